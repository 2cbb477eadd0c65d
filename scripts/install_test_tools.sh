#!/usr/bin/env bash
# Debian packages the process-mode tests use besides CRIU itself (scripts/build_criu.sh):
# capsh (libcap2-bin) and unshare (util-linux) for the privilege and PID-namespace tests,
# gcc + libseccomp-dev for the seccomp filter helper (scripts/seccomp/seccomp_exec.c).
# Idempotent; installs only what is missing; needs root (skipped with a note otherwise).
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
PACKAGES=(libcap2-bin util-linux gcc libc6-dev libseccomp-dev)

if [[ "$(id -u)" -ne 0 ]]; then
    echo "install_test_tools: not root: ${PACKAGES[*]} not installed; those tests will skip"
    exit 0
fi
command -v apt-get >/dev/null || { echo "install_test_tools: no apt-get; install ${PACKAGES[*]} by hand"; exit 0; }
missing=()
for pkg in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
    echo "install_test_tools: installing ${missing[*]}"
    apt-get -o DPkg::Lock::Timeout=600 update -qq </dev/null
    apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${missing[@]}" </dev/null >/dev/null
else
    echo "install_test_tools: ${PACKAGES[*]} already installed"
fi
