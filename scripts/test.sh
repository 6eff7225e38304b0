#!/usr/bin/env bash
# Install meshfit with its test tools, then run the whole test suite (about 12 minutes on 2 cores) and
# print its slowest tests. The fast tier alone: python3 -m pytest -m "not multiproc" (about 2-3 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
exec "${PYTHON:-python3}" -m pytest -q --durations=15 "$@"
