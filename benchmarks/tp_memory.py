"""Per-rank memory under tensor parallelism t = 1, 2, 4, with and without sequence parallelism.

    python benchmarks/tp_memory.py

Measured on CPU ranks (preset `small`: dim 256, 4 layers, 8 heads, 4 key/value heads; batch 8 × 128).
Prints parameter bytes per rank and the activation peak, next to the ratios that Korthikanti et al. (2022)
predict per transformer layer: no SP (10 + 24/t + 5as/(ht)) / (34 + 5as/h), SP (34/t + 5as/(ht)) / (34 + 5as/h).
Those formulas assume GPT layers with 16-bit activations and dropout masks; this model is an fp32
Llama-style decoder without dropout, so the ratios, not the bytes, are what to compare.
"""

from __future__ import annotations

from meshfit.config import load_config
from meshfit.testing import run_ranks
from meshfit.train.dist import init_distributed
from meshfit.train.trainer import train
from meshfit.units import fmt_bytes

BASE = ["model.preset=small", "train.seq_len=128", "train.global_batch=8", "train.steps=2", "train.log_every=100"]


def job(overrides: list[str]) -> dict:
    return train(load_config(None, overrides), init_distributed("cpu"), None)


def predicted(t: int, sp: bool, s: int = 128, h: int = 256, a: int = 8) -> float:
    attn = 5 * a * s / h
    return ((34 / t + attn / t) if sp else (10 + 24 / t + attn / t)) / (34 + attn)


def main() -> None:
    rows = [(1, False), (2, False), (2, True), (4, False), (4, True)]
    base = None
    print(f"{'t':>2} {'SP':>3} {'params/rank':>12} {'activations':>12} {'measured':>9} {'predicted':>9}")
    for t, sp in rows:
        overrides = BASE + ([f"parallel.tp={t}"] if t > 1 else []) + (["parallel.sp=true"] if sp else [])
        mem = run_ranks(job, t, overrides)[0]["mem"][0]
        act = mem["max_by_type"]["Activation"]
        base = base or act
        print(f"{t:>2} {'yes' if sp else 'no':>3} {fmt_bytes(mem['rest']['params']):>12} {fmt_bytes(act):>12} "
              f"{act / base:>9.2f} {predicted(t, sp):>9.2f}", flush=True)


if __name__ == "__main__":
    main()
