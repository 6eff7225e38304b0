"""Packed documents (data.document_mask): block-causal attention, positions per document, the loss mask."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from meshfit.data.boundaries import IGNORE, pack
from meshfit.models import build_model, get_preset, init_weights
from meshfit.models.masks import block_causal

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
