"""A plain training loop over Hugging Face's LlamaForCausalLM on one device: the eager baseline that
meshfit's single-GPU figures are compared with.

    python benchmarks/peers/hf_baseline.py --preset llama3-1b --seq-len 2048 --micro-batch 4 --accum 2 [--device cuda]

Same shapes as the meshfit preset, bf16 autocast over fp32 weights (meshfit's mixed precision keeps fp32
master weights too), SDPA attention, fused AdamW (betas 0.9/0.95, weight decay 0.1) on CUDA, clipping at
1.0, random tokens. Prints one JSON line: median step time and tokens/s of the steps after the first two,
peak allocated bytes (CUDA) and the losses. Needs `transformers` (a test extra of meshfit).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from meshfit.models.presets import get_preset


def _hf_model(preset: str, seq: int, device: torch.device) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = get_preset(preset)
    if shape.family != "llama":
        raise SystemExit(f"--preset {preset}: the baseline builds Llama-family models only")
    config = LlamaConfig(hidden_size=shape.dim, intermediate_size=shape.ffn_hidden, num_hidden_layers=shape.n_layers,
                         num_attention_heads=shape.n_heads, num_key_value_heads=shape.n_kv_heads,
                         vocab_size=shape.vocab_size, tie_word_embeddings=shape.tie_embeddings,
                         rope_theta=shape.rope_theta, max_position_embeddings=seq, rms_norm_eps=shape.norm_eps,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    with device:  # initialised where it trains: a host initialisation of a billion parameters is slow
        return LlamaForCausalLM(config).train()


def run_baseline(preset: str, seq: int, micro_batch: int, accum: int, steps: int, device: str = "cuda",
                 compile: bool = False) -> dict[str, Any]:
    """Train `steps` optimizer steps; the figures of steps 3 and later."""
    dev = torch.device(device)
    model = _hf_model(preset, seq, dev)
    forward = torch.compile(model) if compile else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                  fused=dev.type == "cuda")
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")
    times, losses = [], []
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    for _ in range(steps):
        batches = [torch.randint(vocab, (micro_batch, seq + 1), generator=generator).to(dev) for _ in range(accum)]
        start = time.perf_counter()
        total = 0.0
        for tokens in batches:
            with autocast:
                loss = forward(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss
            (loss / accum).backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(total) / accum)  # reads the device: the step's time includes finishing it
        times.append(time.perf_counter() - start)
    steady = times[2:] or times
    step_s = statistics.median(steady)
    return {"step_time_s": step_s, "tokens_per_s": micro_batch * accum * seq / step_s,
            "peak_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
            "losses": losses, "compiled": compile}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama3-1b")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    print(json.dumps(run_baseline(args.preset, args.seq_len, args.micro_batch, args.accum, args.steps, args.device,
                                  args.compile)))


if __name__ == "__main__":
    main()
