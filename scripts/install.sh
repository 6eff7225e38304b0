#!/usr/bin/env bash
# Install meshfit into the current Python (>= 3.10). `--test` also installs the test tools and the W&B and
# MLflow extras, which the tests use offline (about 30 s and 150 MB more).
#
# torch: an installed torch >= 2.11 is reused as it is. Otherwise MESHFIT_TORCH is installed, by default
# torch==2.13.0 (on machines that keep a local CPU wheel of it, pip takes that file; elsewhere pick your
# build, e.g. MESHFIT_TORCH="torch --index-url https://download.pytorch.org/whl/cpu").
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
extras=""
[ "${1:-}" = "--test" ] && extras="[test,wandb,mlflow]"

if ! "$PY" - <<'PYCHECK' 2>/dev/null; then
import sys, torch
major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 11) else 1)
PYCHECK
  echo "installing ${MESHFIT_TORCH:-torch==2.13.0}"
  # shellcheck disable=SC2086
  "$PY" -m pip install --quiet --disable-pip-version-check ${MESHFIT_TORCH:-torch==2.13.0}
fi
"$PY" -m pip install --quiet --disable-pip-version-check -e ".${extras}"

# train.compile on CPU: torch's inductor backend builds its kernels with a C++ compiler ($CXX, else g++).
# As root on a Debian-like system it is installed when missing (MESHFIT_NO_SYSTEM_PACKAGES=1 skips that);
# elsewhere a note says so: everything else works without it, and a run that asks for compile is refused.
if ! "${CXX:-g++}" --version >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && [ -z "${MESHFIT_NO_SYSTEM_PACKAGES:-}" ]; then
    echo "installing g++ (train.compile on CPU builds its kernels with it)"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null; } ||
      echo "note: g++ could not be installed: train.compile=true on CPU needs a C++ compiler" >&2
  else
    echo "note: no working C++ compiler (${CXX:-g++}): train.compile=true on CPU needs one; install it" \
         "(e.g. apt-get install g++) or point \$CXX at one" >&2
  fi
fi
