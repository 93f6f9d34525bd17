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

if [[ -x "$PROMETHEUS" && -x "$PROMTOOL" ]]; then
    echo "prometheus and promtool are already installed"
else
    if [[ "$(id -u)" -eq 0 ]]; then
        SUDO=()
    elif command -v sudo >/dev/null 2>&1; then
        SUDO=(sudo)
    else
        echo "error: installing prometheus needs root (or sudo)" >&2
        exit 1
    fi
    echo "installing Debian's prometheus"
    "${SUDO[@]}" apt-get update
    "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y --no-install-recommends prometheus
    for binary in "$PROMETHEUS" "$PROMTOOL"; do
        if [[ ! -x "$binary" ]]; then
            echo "error: $binary is missing after installing prometheus" >&2
            exit 1
        fi
    done
fi

"$PROMETHEUS" --version 2>&1 | head -n 1
"$PROMTOOL" --version 2>&1 | head -n 1
