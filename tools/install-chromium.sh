#!/usr/bin/env bash
# Install Debian's headless-capable Chromium and its ChromeDriver, for the tests
# that open dashboard pages and performance_report files in a real browser
# (distributed/tests/utils_browser.py, distributed/tests/test_dashboard_browser.py).
#
# Idempotent: apt is only called if /usr/bin/chromium or /usr/bin/chromedriver is
# missing. Recommended packages are left out. Selenium is then given the driver's
# path, so that it never tries to download one (there is no internet here).
#
# Usage: tools/install-chromium.sh   (as root, or with sudo available)
set -euo pipefail

CHROMIUM=/usr/bin/chromium
CHROMEDRIVER=/usr/bin/chromedriver

bash "$(dirname "$0")/apt-install.sh" "$CHROMIUM" "$CHROMEDRIVER" -- \
    chromium chromium-driver

# Both print one line; chromium's D-Bus complaints on stderr are noise
"$CHROMIUM" --version 2>/dev/null | head -n 1
"$CHROMEDRIVER" --version 2>&1 | head -n 1
