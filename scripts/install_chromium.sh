#!/usr/bin/env bash
# Debian's headless Chromium and its WebDriver, for the Airflow UI test of the cairn snapshots
# page (providers/cairn_airflow/tests/test_ui_browser.py). Browser downloads (selenium-manager,
# Chrome for Testing) are not possible here, so the test uses these packages only.
# Idempotent; installs only what is missing; needs root (skipped with a note otherwise).
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
# shellcheck source=lib/debian_packages.sh
source "$(dirname "$0")/lib/debian_packages.sh"
install_debian_packages install_chromium "the browser test will skip" start chromium chromium-driver
