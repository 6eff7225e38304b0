"""Packed documents (data.document_mask): block-causal attention, positions per document, the loss mask."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from dist_jobs import parity_config, train_job, train_layouts_job

from meshfit.data.boundaries import IGNORE, pack
from meshfit.models import build_model, get_preset, init_weights
from meshfit.models.masks import block_causal
from meshfit.util.ranks import run_ranks

EOS = 3


def _model(preset: str, **changes):
    cfg = dataclasses.replace(get_preset(preset), **changes)
    model = build_model(cfg, "cpu")
    init_weights(model, 0, cfg)
    return model.eval(), cfg


def _doc(cfg, n: int, seed: int) -> torch.Tensor:
    """n tokens of one document: ids other than EOS, closed by EOS."""
    ids = torch.randint(EOS + 1, cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))
    ids[0, -1] = EOS
    return ids


def test_pack_reads_documents_positions_and_the_target_mask_from_eos():
    inputs = torch.tensor([[5, 6, EOS, 7, 8, 9, EOS, 4]])
    targets = torch.tensor([[6, EOS, 7, 8, 9, EOS, 4, 5]])
    packed = pack(inputs, targets, EOS)
    assert packed.documents.tolist() == [[0, 0, 0, 1, 1, 1, 1, 2]]  # the EOS belongs to its document
    assert packed.positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    assert packed.targets.tolist() == [[6, EOS, IGNORE, 8, 9, EOS, IGNORE, 5]]
    assert pack(inputs, targets, None).documents is None


def test_block_causal_mask_stays_inside_each_document():
    mask = block_causal(torch.tensor([[0, 0, 1, 1, 1]]))[0, 0]
    expected = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]])
    assert torch.equal(mask, expected.bool())


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt"])
@pytest.mark.parametrize("kernel", ["flash", "eager"])
def test_second_document_of_a_packed_window_sees_only_itself(preset, kernel):
    model, cfg = _model(preset, attention=kernel)
    a, b = _doc(cfg, 11, 1), _doc(cfg, 13, 2)
    packed = pack(torch.cat([a, b], dim=1), torch.zeros(1, 24, dtype=torch.long), EOS)
    with torch.no_grad():
        together = model(packed.inputs, documents=packed.documents, positions=packed.positions)
        alone = model(b)
        plain = model(packed.inputs)  # without the mask B attends to A
    delta = (together[:, 11:] - alone).abs().max().item()
    assert delta <= 1e-6, delta
    assert (together[:, :11] - model(a)).abs().max().item() <= 1e-6
    assert (plain[:, 11:] - alone).abs().max().item() > 1e-3


def write_documents(path, count: int = 400, seed: int = 0):
    """A token file of `count` documents of 3 to 39 tokens, each closed by EOS."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(count):
        doc = rng.integers(EOS + 1, 256, int(rng.integers(3, 40)))
        doc[-1] = EOS
        docs.append(doc)
    np.save(path, np.concatenate(docs).astype(np.uint16))
    return path


FAMILIES = {"llama": ["model.preset=tiny"], "gpt": ["model.preset=tiny-gpt", "model.tie_embeddings=false"]}
# Two ranks each; data-parallel ranks with two micro-batches each see different numbers of counted targets
# (the EOS inputs' targets are left out), so only the global count gives one process's loss.
LAYOUTS = {
    "llama": {"dp2-accum": ["train.micro_batch=2"], "cp2": ["parallel.cp=2"], "pp2": ["parallel.pp=2"],
              "tp2-sp-loss-parallel": ["parallel.tp=2", "parallel.sp=true", "parallel.loss_parallel=true"]},
    "gpt": {"cp2": ["parallel.cp=2"], "pp2": ["parallel.pp=2"]},
}


@pytest.fixture(scope="module")
def documents_file(tmp_path_factory):
    return write_documents(tmp_path_factory.mktemp("documents") / "docs.npy")


def _masked(path, *overrides):
    return parity_config(f"data.path={path}", "data.source=tokens", "data.document_mask=true", f"data.eos_id={EOS}",
                         "data.val_fraction=0.25", "train.eval_every=5", "train.eval_batches=2", *overrides)


def _delta(a, b):
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_masked_loss_and_gradients_equal_one_process_under_dp_accumulation_cp_pp_tp(documents_file):
    for family, layouts in LAYOUTS.items():
        reference = run_ranks(train_job, 1, _masked(documents_file, *FAMILIES[family]))[0]
        runs = run_ranks(train_layouts_job, 2, {name: _masked(documents_file, *FAMILIES[family], *overrides)
                                                for name, overrides in layouts.items()})
        for name in layouts:
            for rank in runs:
                run = rank[name]
                assert _delta(run["losses"], reference["losses"]) <= 1e-5, (family, name)
                assert _delta(run["grad_norms"], reference["grad_norms"]) <= 1e-5, (family, name)
                val = [v["val_loss"] for v in run["val_losses"]]
                assert _delta(val, [v["val_loss"] for v in reference["val_losses"]]) <= 1e-5, (family, name)
