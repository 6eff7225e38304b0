"""meshfit against transformers on tiny random models of each Hugging Face family: max |Δ logits|,
|Δ loss| and max |Δ grad| on one process and on 2 gloo ranks under the layouts of
tests/test_hf_models.py (TP 2 for every family; ZeRO-3, SP, recompute and CP 2 for the variants).

    PYTHONPATH=src:tests python benchmarks/correctness/hf_layout_parity.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from hf_families import SEQ, layouts_job, reference, save_random_model, tokens
from test_hf_models import CASES, FAMILIES, LAYOUTS, _folder_model, _logits_and_loss, _meshfit

from meshfit.config import load_config
from meshfit.models.hf_read import load_hf
from meshfit.parallel.context_parallel import shard_sequence
from meshfit.util.ranks import run_ranks



def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    toks = tokens()
    refs = {family: reference(save_random_model(family, tmp / family), toks) for family in FAMILIES}
    print("| family | layout | max abs Δ logits | abs Δ loss | max abs Δ grad |")
    print("|---|---|---|---|---|")
    for family in FAMILIES:
        cfg = _folder_model(tmp / family)
        logits, loss = _logits_and_loss(_meshfit(cfg, load_hf(tmp / family, cfg)), cfg, toks)
        print(f"| {family} | 1 process | {(logits - refs[family]['logits']).abs().max().item():.1e} | "
              f"{abs(loss - refs[family]['loss']):.1e} | — |")
    cases = [(f"{family}/{layout}", load_config(None, [f"model.init_from={tmp / family}", f"train.seq_len={SEQ}",
                                                       "train.global_batch=2", "train.device=cpu",
                                                       *LAYOUTS[layout]]).model_dump())
             for family, layout in CASES]
    for name, got in run_ranks(layouts_job, 2, cases, toks, timeout_s=600)[0].items():
        family, layout = name.split("/")
        ref = refs[family]
        want = shard_sequence(ref["logits"], 2, 0) if layout == "cp2" else ref["logits"]
        grad = max((torch.from_numpy(got["grads"][k]) - g).abs().max().item() for k, g in ref["grads"].items())
        print(f"| {family} | {layout} (2 ranks) | {(torch.from_numpy(got['logits']) - want).abs().max().item():.1e} | "
              f"{abs(got['loss'] - ref['loss']):.1e} | {grad:.1e} |")


if __name__ == "__main__":
    main()
