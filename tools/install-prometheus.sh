#!/usr/bin/env bash
# Install Debian's Prometheus server and promtool, for the tests that scrape a real
# cluster (distributed/tests/test_fine_metrics_prometheus.py).
#
# Idempotent: apt is only called if /usr/bin/prometheus or /usr/bin/promtool is
# missing. Recommended packages (node-exporter, ...) are left out. The package's
# attempt to start its service is refused inside a container; nothing is left
# running: the tests start their own server on loopback.
#
# Usage: tools/install-prometheus.sh   (as root, or with sudo available)
set -euo pipefail

PROMETHEUS=/usr/bin/prometheus
PROMTOOL=/usr/bin/promtool

bash "$(dirname "$0")/apt-install.sh" "$PROMETHEUS" "$PROMTOOL" -- prometheus

"$PROMETHEUS" --version 2>&1 | head -n 1
"$PROMTOOL" --version 2>&1 | head -n 1
