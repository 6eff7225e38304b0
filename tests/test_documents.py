"""Packed documents (data.document_mask): block-causal attention, positions per document, the loss mask."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from dist_jobs import parity_config, train_job, train_layouts_job
from tokenizer_fixture import make_tokenizer

from meshfit.config import ConfigError, load_config
from meshfit.data.boundaries import IGNORE, pack
from meshfit.data.prepare import prepare
from meshfit.dryrun.verify import verify_layout
from meshfit.layout.layout import Layout, Workload
from meshfit.models import build_model, get_preset, init_weights
from meshfit.models.masks import block_causal
from meshfit.planner.memory.estimate import estimate_memory
from meshfit.train.shape import resolve_run
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


# ---- settings ---------------------------------------------------------------------------------------


def _resolve(*overrides: str):
    return resolve_run(load_config(None, ["train.seq_len=64", *overrides]), 1)


def test_the_eos_id_comes_from_the_data_or_data_eos_id_and_is_refused_where_unknown(tmp_path, documents_file):
    text = tmp_path / "a.txt"
    text.write_text("some text " * 20)
    raw = ["data.source=tokens", f"data.path={documents_file}", "data.document_mask=true"]
    assert _resolve(*raw, f"data.eos_id={EOS}").eos_id == EOS
    assert _resolve(f"data.path={documents_file}", "data.source=tokens").eos_id is None
    folder = make_tokenizer(tmp_path / "tok")  # 300 tokens: a model of 320
    assert _resolve("data.source=text", f"data.path={text}", f"data.tokenizer={folder}", "model.vocab_size=320",
                    "data.document_mask=true").eos_id == 1  # </s>
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["the quick brown fox " * 8] * 12))
    prepared = prepare([docs], folder, tmp_path / "prepared")
    shards = ["data.source=tokens", f"data.path={tmp_path / 'prepared'}", "model.vocab_size=320",
              "data.document_mask=true"]
    assert _resolve(*shards).eos_id == 1 and prepared is not None
    refusals = {
        r"data\.eos_id=2, but .*meshfit-data\.json records EOS id 1": [*shards, "data.eos_id=2"],
        r"data\.document_mask=true needs the EOS id .*a\.txt: data\.tokenizer=byte joins documents without an EOS":
            ["data.source=text", f"data.path={text}", "data.document_mask=true"],
        r"docs\.npy: it is a raw token file, which records no EOS id: give it as data\.eos_id": raw,
        r"data\.source=synthetic has none unless data\.eos_id": ["data.document_mask=true"],
        r"data\.eos_id=3 is used only by data\.document_mask=true": [f"data.eos_id={EOS}"],
        r"data\.eos_id 300 is not a token of the model's vocabulary \(model\.vocab_size=256\)":
            [*raw, "data.eos_id=300"],
        r"data\.eos_id applies to token files": ["data.source=text", f"data.path={text}", f"data.tokenizer={folder}",
                                                 "model.vocab_size=320", "data.document_mask=true", "data.eos_id=1"],
    }
    for message, overrides in refusals.items():
        with pytest.raises(ConfigError, match=message):
            _resolve(*overrides)


def test_a_refused_document_mask_is_one_error_line_before_any_rank_starts(tmp_path, documents_file, capsys):
    from meshfit.commands.main import main

    code = main(["train", "--run-dir", str(tmp_path / "run"), "--set", "data.source=tokens", "--set",
                 f"data.path={documents_file}", "--set", "data.document_mask=true"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and not (tmp_path / "run").exists()
    assert err.splitlines() == [err] and err.startswith("error: data.document_mask=true needs the EOS id"), err


def test_planner_counts_the_mask_and_the_dry_run_measures_it():
    model = get_preset("tiny")
    workload = Workload(seq_len=256, global_batch=8, precision="fp32")
    for layout in (Layout(dp_shard=2, zero_stage=3, micro_batch=2), Layout(cp=2, micro_batch=2)):
        planned, measured = [], []
        for mask in (False, True):
            w = dataclasses.replace(workload, document_mask=mask)
            planned.append(estimate_memory(model, layout, w, backend="gloo").total)
            measured.append(verify_layout(model, layout, w).measured["total"])
        # the dense mask: micro-batch × (s / cp) × s fp32 values, with RoPE's per-token angles and the ids
        assert planned[1] - planned[0] >= 2 * 256 * 256 / layout.cp * 4
        assert abs((measured[1] - measured[0]) - (planned[1] - planned[0])) <= 0.01 * (planned[1] - planned[0])


def test_flex_attention_block_mask_attends_as_the_dense_mask():
    """The CUDA path's block mask, run forward on CPU (FlexAttention has no CPU backward)."""
    import torch.nn.functional as F

    from meshfit.models.masks import document_mask, flex_attention

    docs = torch.tensor([[0] * 50 + [1] * 70 + [2] * 8, [0] * 128])
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, 128, 16, generator=gen) for heads in (4, 2, 2))
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(docs, flex=False), enable_gqa=True)
    flex = flex_attention(q, k, v, document_mask(docs, flex=True))
    assert (flex - dense).abs().max().item() <= 1e-6
    causal = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert (flex[0, :, 50:] - causal[0, :, 50:]).abs().max().item() > 1e-3
