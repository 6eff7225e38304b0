#!/usr/bin/env bash
# Install meshfit with its test tools, then run the whole test suite (about 12 minutes on 2 cores) and
# print its slowest tests. The fast tier alone: python3 -m pytest -m "not multiproc" (about 4 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
# Two pytest workers: a multi-process test spends much of its time starting processes and waiting on its
# ranks' rendezvous, so two at a time use the 2 cores better (multi-process tests: 775 s one at a time,
# 510 s two at a time, measured on 2 cores; the rest of the suite gains nothing and loses nothing).
exec "${PYTHON:-python3}" -m pytest -q -n 2 --durations=15 "$@"
