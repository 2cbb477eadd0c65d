#!/usr/bin/env bash
# Debian's SLURM (slurm-wlm: slurmctld, slurmd, the client commands) and MUNGE for the SLURM
# tests (tests/integration/integrations/slurm/). Only the binaries: the session fixture writes
# its own slurm.conf, munge key and state directories under a temporary folder and starts the
# daemons itself, so no service is enabled or started here (policy-rc.d keeps the packages'
# maintainer scripts from starting munge or slurmd).
# Idempotent; installs only what is missing; needs root (skipped with a note otherwise).
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
# shellcheck source=lib/debian_packages.sh
source "$(dirname "$0")/lib/debian_packages.sh"
install_debian_packages install_slurm "the SLURM tests will skip" no-services slurm-wlm munge
