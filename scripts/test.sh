#!/usr/bin/env bash
# Install meshfit with its test tools, then run the whole test suite (about 15 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
exec "${PYTHON:-python3}" -m pytest -q "$@"
