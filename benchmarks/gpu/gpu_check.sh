#!/usr/bin/env bash
# One GPU: calibration, then planned vs measured step time and peak memory of single-GPU layouts of
# Llama-3.2 1B (seq 2048, 16K tokens per step: plain, op and full recompute, ZeRO-3 + CPU offload, compiled,
# compiled with op recompute, and the plain layout tracked every step), next to a Hugging Face eager loop on
# the same shapes. One table at the end; output under ${OUT:-gpu_check}/; no checkpoints are written.
# Sized for at most 8 minutes on one H200.
set -euo pipefail
cd "$(dirname "$0")/../.."  # the project root
out="${OUT:-gpu_check}"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(), torch.__version__)"
export PYTHONPATH="$PWD/src:$PWD/benchmarks/peers${PYTHONPATH:+:$PYTHONPATH}"
# One inductor cache for every compiled layout of the run.
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$out/inductor-cache}"
python benchmarks/gpu/gpu_check.py --out "$out" --preset llama3-1b --seq-len 2048 --steps 8 2>&1 | tee "$out.log"
