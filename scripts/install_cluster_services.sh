#!/usr/bin/env bash
# Debian's PostgreSQL and Redis servers for the multi-worker Airflow cluster
# (cairn_airflow.local_stack with executor="celery"; providers/cairn_airflow/tests/
# test_celery_cluster.py and `make demo-cluster`). Each cluster starts its own server processes
# on their own ports and data directories; the packages' system services are not used.
# Idempotent; installs only what is missing; needs root (skipped with a note otherwise).
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
PACKAGES=(postgresql redis-server util-linux)

if [[ "$(id -u)" -ne 0 ]]; then
    echo "install_cluster_services: not root: ${PACKAGES[*]} not installed; the cluster tests will skip"
    exit 0
fi
command -v apt-get >/dev/null || { echo "install_cluster_services: no apt-get; install ${PACKAGES[*]} by hand"; exit 0; }
missing=()
for pkg in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
    echo "install_cluster_services: installing ${missing[*]}"
    apt-get update -qq </dev/null
    # policy-rc.d 101: the packages' own services stay stopped (a cluster starts its own).
    had_policy=0; [[ -e /usr/sbin/policy-rc.d ]] && had_policy=1
    ((had_policy)) || { printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; }
    trap '((had_policy)) || rm -f /usr/sbin/policy-rc.d' EXIT
    apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${missing[@]}" </dev/null >/dev/null
else
    echo "install_cluster_services: ${PACKAGES[*]} already installed"
fi
