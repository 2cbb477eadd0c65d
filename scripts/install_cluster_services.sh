#!/usr/bin/env bash
# Debian's PostgreSQL and Redis servers for the multi-worker Airflow cluster
# (cairn_airflow.local_stack with executor="celery"; providers/cairn_airflow/tests/
# test_celery_cluster.py and `make demo-cluster`). Each cluster starts its own server processes
# on their own ports and data directories; the packages' system services are not used.
# Idempotent; installs only what is missing; needs root (skipped with a note otherwise).
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
# shellcheck source=lib/debian_packages.sh
source "$(dirname "$0")/lib/debian_packages.sh"
install_debian_packages install_cluster_services "the cluster tests will skip" no-services postgresql redis-server util-linux
