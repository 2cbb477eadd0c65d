#!/usr/bin/env bash
# Debian's SLURM (slurm-wlm: slurmctld, slurmd, the client commands) and MUNGE for the SLURM
# tests (tests/integration/integrations/slurm/). Only the binaries: the session fixture writes
# its own slurm.conf, munge key and state directories under a temporary folder and starts the
# daemons itself, so no service is enabled or started here (policy-rc.d keeps the packages'
# maintainer scripts from starting munge or slurmd).
# Idempotent; installs only what is missing; needs root (skipped with a note otherwise).
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
PACKAGES=(slurm-wlm munge)

if [[ "$(id -u)" -ne 0 ]]; then
    echo "install_slurm: not root: ${PACKAGES[*]} not installed; the SLURM tests will skip"
    exit 0
fi
command -v apt-get >/dev/null || { echo "install_slurm: no apt-get; install ${PACKAGES[*]} by hand"; exit 0; }
missing=()
for pkg in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
    echo "install_slurm: installing ${missing[*]}"
    # Keep invoke-rc.d from starting the packaged services (no systemd here; the tests run their
    # own daemons). Only a policy file this script created is removed again.
    policy=/usr/sbin/policy-rc.d
    created_policy=0
    if [[ ! -e "$policy" ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && created_policy=1
    fi
    trap '[[ $created_policy -eq 1 ]] && rm -f "$policy"' EXIT
    apt-get -o DPkg::Lock::Timeout=600 update -qq </dev/null
    apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${missing[@]}" </dev/null >/dev/null
else
    echo "install_slurm: ${PACKAGES[*]} already installed"
fi
