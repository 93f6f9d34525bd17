#!/usr/bin/env bash
# Install Debian's valgrind (with its headers) and gcc, for the tests of
# make bench-instructions (benchmarks/tests/test_instructions.py), which run
# cachegrind and callgrind and build benchmarks/section.c.
#
# Idempotent: apt is only called if /usr/bin/valgrind or /usr/bin/gcc is missing.
#
# Usage: tools/install-valgrind.sh   (as root, or with sudo available)
set -euo pipefail

bash "$(dirname "$0")/apt-install.sh" /usr/bin/valgrind /usr/bin/gcc -- valgrind gcc

/usr/bin/valgrind --version
test -f /usr/include/valgrind/callgrind.h
