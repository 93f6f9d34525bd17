#!/usr/bin/env bash
# Install Debian packages, without their recommended packages, unless the
# executables they provide are all there already; then check that they are.
# Shared by tools/install-prometheus.sh, tools/install-chromium.sh and
# tools/install-valgrind.sh.
#
# Usage: tools/apt-install.sh EXECUTABLE... -- PACKAGE...
#        (as root, or with sudo available)
set -euo pipefail

binaries=()
while [[ $# -gt 0 && "$1" != "--" ]]; do
    binaries+=("$1")
    shift
done
if [[ $# -eq 0 || ${#binaries[@]} -eq 0 ]]; then
    echo "usage: $0 EXECUTABLE... -- PACKAGE..." >&2
    exit 2
fi
shift
packages=("$@")
if [[ ${#packages[@]} -eq 0 ]]; then
    echo "usage: $0 EXECUTABLE... -- PACKAGE..." >&2
    exit 2
fi

missing=0
for binary in "${binaries[@]}"; do
    [[ -x "$binary" ]] || missing=1
done
if [[ "$missing" -eq 0 ]]; then
    echo "${packages[*]}: already installed"
    exit 0
fi

if [[ "$(id -u)" -eq 0 ]]; then
    SUDO=()
elif command -v sudo >/dev/null 2>&1; then
    SUDO=(sudo)
else
    echo "error: installing ${packages[*]} needs root (or sudo)" >&2
    exit 1
fi
echo "installing Debian's ${packages[*]}"
"${SUDO[@]}" apt-get update
"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y --no-install-recommends "${packages[@]}"
for binary in "${binaries[@]}"; do
    if [[ ! -x "$binary" ]]; then
        echo "error: $binary is missing after installing ${packages[*]}" >&2
        exit 1
    fi
done
