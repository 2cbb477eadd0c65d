#!/usr/bin/env bash
# Debian's headless Chromium and its WebDriver, for the Airflow UI test of the cairn snapshots
# page (providers/cairn_airflow/tests/test_ui_browser.py). Browser downloads (selenium-manager,
# Chrome for Testing) are not possible here, so the test uses these packages only.
# Idempotent; installs only what is missing; needs root (skipped with a note otherwise).
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
PACKAGES=(chromium chromium-driver)

if [[ "$(id -u)" -ne 0 ]]; then
    echo "install_chromium: not root: ${PACKAGES[*]} not installed; the browser test will skip"
    exit 0
fi
command -v apt-get >/dev/null || { echo "install_chromium: no apt-get; install ${PACKAGES[*]} by hand"; exit 0; }
missing=()
for pkg in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
    echo "install_chromium: installing ${missing[*]}"
    apt-get -o DPkg::Lock::Timeout=600 update -qq </dev/null
    apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${missing[@]}" </dev/null >/dev/null
else
    echo "install_chromium: ${PACKAGES[*]} already installed"
fi
