"""model.init_from at scale: each rank reads only the blocks of the stored tensors that it holds, in the
stored dtype, and ends with exactly the values a one-process load gives."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_jobs import init_from_job, parity_config

from meshfit.models import build_model, init_weights
from meshfit.models.hf_read import HFWeights
from meshfit.models.hf_weights import save_hf
from meshfit.models.init import strip_padding
from meshfit.models.presets import get_preset
from meshfit.util.ranks import run_ranks

LAYOUTS = {"fsdp2 x pp2": ["parallel.dp_shard=2", "parallel.pp=2"],
           "fsdp2 x tp2": ["parallel.dp_shard=2", "parallel.tp=2"]}
# tiny-gpt ties its head to the embedding (no pipeline); its q, k and v are column ranges of one stored
# tensor, which tensor parallelism reads in parts.
CASES = [("tiny", "fsdp2 x pp2"), ("tiny", "fsdp2 x tp2"), ("tiny-gpt", "fsdp2 x tp2")]


def _hf_folder(folder: Path, preset: str) -> tuple[Path, dict[str, torch.Tensor]]:
    """A Hugging Face folder of a seeded `preset` model stored in bf16, and its weights read back whole
    by one process (the reference)."""
    cfg = get_preset(preset)
    model = build_model(cfg, "cpu")
    init_weights(model, 3, cfg)
    save_hf(strip_padding(model.state_dict(), cfg), cfg, folder, torch.bfloat16)
    reference = build_model(cfg, "cpu")
    init_weights(reference, 0, cfg, HFWeights(folder, cfg))
    return folder, {name: tensor.detach() for name, tensor in reference.state_dict().items()}


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_four_ranks_read_a_quarter_each_and_load_what_one_process_loads(tmp_path: Path) -> None:
    cases, references, stored = {}, {}, {}
    for preset, layout in CASES:
        if preset not in references:
            folder, references[preset] = _hf_folder(tmp_path / preset, preset)
            stored[preset] = (folder / "model.safetensors").stat().st_size
        cases[f"{preset} {layout}"] = parity_config(f"model.preset={preset}", f"model.init_from={folder}",
                                                    *LAYOUTS[layout])
    ranks = run_ranks(init_from_job, 4, cases)
    for case in cases:
        preset = case.split()[0]
        read = [rank[case]["bytes_read"] for rank in ranks]
        # Every stored byte is read by some rank; no rank reads much more than its quarter (norms, biases
        # and GPT's positions are replicated over tensor-parallel ranks, and stages differ a little).
        assert sum(read) >= 0.98 * stored[preset], (case, read, stored[preset])
        assert max(read) <= 0.3 * stored[preset], (case, read, stored[preset])
        for rank in ranks:
            for name, offsets, values in rank[case]["blocks"]:
                local = torch.from_numpy(values)
                full = references[preset][name]
                block = full[tuple(slice(o, o + s) for o, s in zip(offsets, local.shape))]
                assert torch.equal(local, block), (case, name, offsets)
