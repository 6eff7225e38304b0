"""Llama 3.1-style RoPE scaling: how far meshfit's logits are from transformers' at positions 0-4096, with the
scaling ignored (as meshfit read Hugging Face configs before it modelled `rope_scaling`) and now.

    python benchmarks/correctness/hf_parity.py [--seq 4096] [--original 8192,2048] [--noise 0.1]

A tiny random Llama (dim 256, 4 heads of 64, 2 layers, 8192 positions, rope_theta 500000; N(0, noise²) added
to every weight, so that attention prefers some positions as a trained model's does) is made with transformers with rope_scaling {rope_type llama3, factor 8, low_freq_factor 1, high_freq_factor 4,
original_max_position_embeddings ORIGINAL} and saved; meshfit reads the folder (its config.json is the
model) and runs the same tokens in fp32. Printed per range of positions: the largest |Δ logit| against
transformers, with the scaling dropped ("ignored") and as meshfit models it now ("now"), and the smallest
cosine similarity of a position's logits with transformers'. ORIGINAL 8192 is Llama 3.1's own value.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

import torch
import transformers

from meshfit.config import load_config
from meshfit.models import build_model
from meshfit.models.hf_read import load_hf

BUCKETS = (0, 64, 512, 1024, 2048, 4096)


def _transformers_model(folder: Path, original: int, noise: float) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                                   rope_theta=500000.0,
                                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0,
                                                 "original_max_position_embeddings": original})
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # larger weights: attention that prefers some positions, as a trained model's does
        for param in model.parameters():
            param.add_(torch.randn_like(param) * noise)
    model.save_pretrained(folder)
    return model


def _meshfit_logits(folder: Path, tokens: torch.Tensor, ignore_scaling: bool) -> torch.Tensor:
    cfg = load_config(None, [f"model.init_from={folder}"]).model.resolve()
    if ignore_scaling:
        cfg = dataclasses.replace(cfg, rope_scaling="none", rope_factor=None, rope_low_freq_factor=None,
                                  rope_high_freq_factor=None, rope_original_max_seq_len=None)
    model = build_model(cfg, "cpu")
    model.load_state_dict(load_hf(folder, cfg))
    with torch.no_grad():
        return model.eval()(tokens)


def _rows(theirs: torch.Tensor, ours: torch.Tensor, seq: int) -> list[tuple[float, float]]:
    """(max |Δ|, min cosine) per bucket of positions."""
    out = []
    for lo, hi in zip(BUCKETS, BUCKETS[1:], strict=False):
        if lo >= seq:
            break
        a, b = theirs[0, lo:min(hi, seq)], ours[0, lo:min(hi, seq)]
        out.append(((a - b).abs().max().item(), torch.nn.functional.cosine_similarity(a, b, dim=-1).min().item()))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--original", default="8192,2048", help="original_max_position_embeddings values")
    parser.add_argument("--noise", type=float, default=0.1,
                        help="std of the noise added to every weight (0: transformers' initialisation, std 0.02)")
    args = parser.parse_args()
    tokens = torch.randint(0, 512, (1, args.seq), generator=torch.Generator().manual_seed(1))
    for original in (int(x) for x in args.original.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            hf = _transformers_model(folder, original, args.noise)
            with torch.no_grad():
                theirs = hf(tokens).logits
            ignored = _rows(theirs, _meshfit_logits(folder, tokens, ignore_scaling=True), args.seq)
            now = _rows(theirs, _meshfit_logits(folder, tokens, ignore_scaling=False), args.seq)
        print(f"\nllama3 RoPE scaling, factor 8, original_max_position_embeddings {original}, noise {args.noise}; "
              f"logits up to |{theirs.abs().max().item():.2f}|")
        print(f"{'positions':>12} | {'ignored max|Δ|':>15} {'min cos':>8} | {'now max|Δ|':>11} {'min cos':>8}")
        for (lo, hi), (d0, c0), (d1, c1) in zip(zip(BUCKETS, BUCKETS[1:], strict=False), ignored, now,
                                                  strict=False):
            print(f"{lo:>5}-{min(hi, args.seq) - 1:<6} | {d0:>15.3e} {c0:>8.5f} | {d1:>11.3e} {c1:>8.5f}")


if __name__ == "__main__":
    main()
