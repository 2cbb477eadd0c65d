#!/usr/bin/env bash
# Debian packages the process-mode tests use besides CRIU itself (scripts/build_criu.sh):
# capsh (libcap2-bin) and unshare (util-linux) for the privilege and PID-namespace tests,
# gcc + libseccomp-dev for the seccomp filter helper (scripts/seccomp/seccomp_exec.c).
# Idempotent; installs only what is missing; needs root (skipped with a note otherwise).
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
# shellcheck source=lib/debian_packages.sh
source "$(dirname "$0")/lib/debian_packages.sh"
install_debian_packages install_test_tools "those tests will skip" start libcap2-bin util-linux gcc libc6-dev libseccomp-dev
