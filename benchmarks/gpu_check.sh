#!/usr/bin/env bash
# One GPU: calibrate it, then compare planned vs measured peak memory (max_memory_allocated) and step time
# for 4 single-GPU layouts of Llama-3.2 1B (seq 2048). Output under ${OUT:-gpu_check}/. About 5 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_check}"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
export PYTHONPATH="$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
python benchmarks/gpu_check.py --out "$out" --preset llama3-1b --seq-len 2048 --steps 6 2>&1 | tee "$out.log"
