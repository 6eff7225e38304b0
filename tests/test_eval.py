"""Validation loss: settings checked before ranks start, held-out data, and parity across layouts."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
from dist_jobs import parity_config, resume_job
from eval_jobs import layouts_job, untouched_job

from meshfit.config import ConfigError, load_config
from meshfit.data import MarkovSource, write_token_file
from meshfit.data.heldout import SYNTHETIC_FIRST, held_out_batches, split_tokens
from meshfit.train.metrics import tensorboard_scalars
from meshfit.train.shape import resolve_run
from meshfit.util.ranks import run_ranks

EVAL = ["model.n_layers=4", "train.steps=6", "train.eval_every=2", "train.eval_batches=2"]


def _resolve(*overrides: str) -> None:
    resolve_run(load_config(None, list(overrides)), 1)


def _tokens(tmp_path: Path, name: str, count: int) -> str:
    return str(write_token_file(tmp_path / name, np.arange(count) % 200, "uint16"))


# ---- settings ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["train.eval_batches=0", "train.eval_batches=-1", "train.eval_every=-2",
                                 "data.val_fraction=1", "data.val_fraction=-0.1"])
def test_bad_values_name_the_field(bad: str) -> None:
    with pytest.raises(ConfigError, match=bad.split("=")[0].replace(".", r"\.")):
        load_config(None, [bad])


def test_defaults_change_nothing() -> None:
    cfg = load_config(None, [])
    assert cfg.train.eval_every == 0 and cfg.data.val_path is None and cfg.data.val_fraction == 0


def test_held_out_settings_checked_before_ranks(tmp_path: Path) -> None:
    data = _tokens(tmp_path, "train.npy", 5000)
    tokens = ["data.source=tokens", f"data.path={data}", "train.seq_len=32"]
    with pytest.raises(ConfigError, match=r"train\.eval_every=2 needs held-out data.*data\.val_path"):
        _resolve(*tokens, "train.eval_every=2")
    with pytest.raises(ConfigError, match=r"data\.val_path: .*missing\.npy: does not exist"):
        _resolve(*tokens, "train.eval_every=2", f"data.val_path={tmp_path / 'missing.npy'}")
    with pytest.raises(ConfigError, match="both set"):
        _resolve(*tokens, f"data.val_path={data}", "data.val_fraction=0.1")
    with pytest.raises(ConfigError, match=r"data\.val_path does not apply to data\.source=synthetic"):
        _resolve(f"data.val_path={data}")
    short = _tokens(tmp_path, "val.npy", 100)  # 3 sequences of 33 tokens; one global batch is 8
    with pytest.raises(ConfigError, match=r"holds 100 tokens, i\.e\. 3 sequences.*2 × 8 = 16 are needed"):
        _resolve(*tokens, "train.eval_every=2", "train.eval_batches=2", f"data.val_path={short}")
    with pytest.raises(ConfigError, match=r"lower train\.eval_batches to ≤ 1"):  # 500 tokens: 15 sequences
        _resolve(*tokens, "train.eval_every=2", "train.eval_batches=2", "data.val_fraction=0.1")
    with pytest.raises(ConfigError, match=r"leaves 20 of data\.path's 5000 tokens for training"):
        _resolve(*tokens, "data.val_fraction=0.996")
    _resolve(*tokens, "train.eval_every=2", "train.eval_batches=1", "data.val_fraction=0.1")
    _resolve(*tokens, "train.eval_every=2", f"data.val_path={data}")


def test_bad_held_out_setting_is_one_error_line(tmp_path: Path, capsys) -> None:
    from meshfit.commands.main import main

    data = _tokens(tmp_path, "train.npy", 5000)
    code = main(["train", "--run-dir", str(tmp_path / "run"), "--set", "data.source=tokens", "--set",
                 f"data.path={data}", "--set", "train.eval_every=5"])
    out, err = capsys.readouterr()
    assert code == 2 and not (tmp_path / "run").exists()
    assert err.strip().splitlines() == [err.strip()] and err.startswith("error: train.eval_every=5"), err


# ---- held-out data ----------------------------------------------------------------------------------


def test_share_is_cut_off_the_training_tokens() -> None:
    tokens = np.arange(1000)
    train, held = split_tokens(tokens, 0.1)
    assert len(held) == 100 and train[-1] + 1 == held[0] and len(train) + len(held) == 1000


def test_synthetic_held_out_stream_is_the_same_language_but_never_trained_on() -> None:
    source = MarkovSource(256, seed=7)
    reader = held_out_batches(source, seq_len=16, global_batch=4, dp_rank=1, dp_size=2, batches=2, name="s")
    first = [(x.clone(), y.clone()) for x, y in reader]
    again = list(reader)
    assert len(first) == 2 and all((a[0] == b[0]).all() for a, b in zip(first, again, strict=True))
    # Rank 1 of 2 reads rows 2-3 of each held-out global batch, numbered from SYNTHETIC_FIRST.
    expected = source.sequences(range(SYNTHETIC_FIRST + 2, SYNTHETIC_FIRST + 4), 17)
    assert (first[0][0] == expected[:, :-1]).all() and (first[0][1] == expected[:, 1:]).all()
    assert not (first[0][0] == source.sequences(range(2, 4), 17)[:, :-1]).all()


def test_val_loss_goes_to_tensorboard() -> None:
    rec = {"loss": 3.0, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 1.0, "step_time_s": 1.0,
           "peak_mem_bytes": 1, "mem": []}
    assert "val/loss" not in tensorboard_scalars(rec)
    assert tensorboard_scalars({**rec, "val_loss": 2.5})["val/loss"] == 2.5


# ---- every layout -----------------------------------------------------------------------------------


@functools.cache
def reference() -> tuple[dict, dict]:
    """One process, with and without evaluation."""
    return tuple(run_ranks(layouts_job, 1, {"eval": parity_config(*EVAL),
                                            "plain": parity_config(*EVAL, "train.eval_every=0")})[0].values())


def _check(name: str, result: dict) -> float:
    ref, plain = reference()
    assert [v["step"] for v in result["val_losses"]] == [2, 4, 6], name
    delta = max(abs(a["val_loss"] - b["val_loss"]) for a, b in zip(result["val_losses"], ref["val_losses"],
                                                                    strict=True))
    assert delta <= 1e-5, (name, result["val_losses"], ref["val_losses"])
    # Evaluating changes nothing in training: the losses are those of the run without evaluation.
    assert max(abs(a - b) for a, b in zip(result["losses"], plain["losses"], strict=True)) <= 1e-5, name
    return delta


LAYOUTS = {
    "ddp": ["parallel.dp_replicate=2"],
    "zero1": ["parallel.dp_shard=2", "parallel.zero_stage=1", "train.micro_batch=2"],
    "zero2": ["parallel.dp_shard=2", "parallel.zero_stage=2", "train.micro_batch=2"],
    "zero3": ["parallel.dp_shard=2"],
    "tp": ["parallel.tp=2", "parallel.sp=true", "parallel.loss_parallel=true"],
    "pp": ["parallel.pp=2", "pipeline.schedule=1f1b", "pipeline.microbatches=4"],
    "pp-interleaved": ["parallel.pp=2", "pipeline.schedule=interleaved-1f1b"],
}


@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_val_loss_equals_one_process_under_every_layout() -> None:
    ref, plain = reference()
    assert ref["losses"] == plain["losses"] and plain["val_losses"] == []
    results = run_ranks(layouts_job, 2, {n: parity_config(*EVAL, *o) for n, o in LAYOUTS.items()}, timeout_s=380)
    deltas = {name: _check(name, result) for name, result in results[0].items()}
    print("max |Δ val_loss| vs one process:", {k: f"{v:.1e}" for k, v in deltas.items()})
    for name in LAYOUTS:  # every rank logs the same value
        assert results[0][name]["val_losses"] == results[1][name]["val_losses"], name


@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_val_loss_under_the_other_pipeline_schedules() -> None:
    # V schedules put the last stage on the first rank; zero-bubble ones split the backward.
    layouts = {s: ["parallel.pp=2", f"pipeline.schedule={s}", "pipeline.microbatches=4"]
               for s in ("gpipe", "interleaved-zb", "zbv", "dualpipev")}
    results = run_ranks(layouts_job, 2, {n: parity_config(*EVAL, *o) for n, o in layouts.items()}, timeout_s=380)
    deltas = {name: _check(name, result) for name, result in results[0].items()}
    print("max |Δ val_loss| vs one process:", {k: f"{v:.1e}" for k, v in deltas.items()})


@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_val_loss_under_composed_layouts_four_ranks() -> None:
    layouts = {"pp-zero3": ["parallel.pp=2", "parallel.dp_shard=2"],
               "tp-zero3": ["parallel.tp=2", "parallel.sp=true", "parallel.loss_parallel=true", "parallel.dp_shard=2"],
               "hsdp-offload": ["parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.offload=true"],
               "pp-tp": ["parallel.pp=2", "parallel.tp=2", "parallel.sp=true", "parallel.loss_parallel=true"]}
    results = run_ranks(layouts_job, 4, {n: parity_config(*EVAL, *o) for n, o in layouts.items()}, timeout_s=380)
    deltas = {name: _check(name, result) for name, result in results[0].items()}
    print("max |Δ val_loss| vs one process:", {k: f"{v:.1e}" for k, v in deltas.items()})


@pytest.mark.multiproc
@pytest.mark.timeout(200)
def test_evaluation_leaves_training_state_and_turns_dropout_off() -> None:
    cfg = parity_config("model.family=gpt", "model.n_kv_heads=4", "model.dropout=0.3", "parallel.dp_shard=2",
                         "parallel.zero_stage=2", "train.eval_every=1")  # ZeRO-2 keeps gathered weights after a forward
    for rank in run_ranks(untouched_job, 2, cfg):
        assert rank["dropouts"] > 0 and rank["first"] == rank["second"]
        assert rank["all_training"] and rank["grads"] == 0 and rank["optimizer_state"] == 0 and rank["sharded"]


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_evaluation_schedule_continues_after_resume(tmp_path: Path) -> None:
    cfg = parity_config("train.eval_every=3", "train.eval_batches=2", "parallel.dp_shard=2")
    result = run_ranks(resume_job, 2, cfg, str(tmp_path), timeout_s=280)[0]
    assert [v["step"] for v in result["full"]["val_losses"]] == [3, 6, 9]
    assert [v["step"] for v in result["first"]["val_losses"]] == [3]
    assert result["full"]["val_losses"] == result["first"]["val_losses"] + result["second"]["val_losses"]


# ---- meshfit show -----------------------------------------------------------------------------------


def _run_dir(path: Path, val: dict[int, object]) -> Path:
    """A run directory as training leaves it, with val_loss on the steps in `val`."""
    path.mkdir()
    (path / "config.yaml").write_text(load_config(None, ["train.steps=4", "train.eval_every=2"]).to_yaml())
    records = [{"step": s, "loss": 5.0 - s / 2, "tokens_per_s": 1000.0, "step_time_s": 1.0, "peak_mem_bytes": 2**20,
                "mem": [{"params": 1, "peak": 2**20}], **({"val_loss": val[s]} if s in val else {})}
               for s in range(1, 5)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_show_has_a_val_loss_column_and_markers(tmp_path: Path, capsys, monkeypatch) -> None:
    from meshfit.commands.main import main
    from meshfit.runs import plots as show_mod  # the plots are saved there

    monkeypatch.chdir(tmp_path)  # short run names: the table keeps each row on one line
    _run_dir(tmp_path / "a", {2: 4.25, 4: 3.5})
    _run_dir(tmp_path / "b", {})
    figures = []
    real_save = show_mod._save
    monkeypatch.setattr(show_mod, "_save", lambda fig, path, **kw: figures.append(fig) or real_save(fig, path, **kw))
    assert main(["show", "a", "b", "--out", "plots"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "layout" in line)
    assert "val loss" in header
    assert "3.5000 @4" in next(line for line in out.splitlines() if line.startswith("│ a "))
    assert "3.5000" not in next(line for line in out.splitlines() if line.startswith("│ b "))
    lines = figures[0].axes[0].get_lines()  # the loss plot: a's curve, a's val markers, b's curve
    assert [line.get_label() for line in lines][1].endswith("(val)")
    assert list(lines[1].get_xdata()) == [2, 4] and list(lines[1].get_ydata()) == [4.25, 3.5]
    assert len(lines) == 3  # no markers for a run that never evaluated


def test_show_names_a_val_loss_that_is_not_a_number(tmp_path: Path, capsys) -> None:
    from meshfit.commands.main import main

    run = _run_dir(tmp_path / "a", {2: "low"})
    assert main(["show", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "line 2" in err[0] and "val_loss" in err[0], err


# ---- what the ranks read ----------------------------------------------------------------------------


def test_a_share_is_never_trained_on_and_evaluating_changes_no_training_data(tmp_path: Path) -> None:
    from meshfit.train.held_out import data_sources

    data = _tokens(tmp_path, "train.npy", 5000)
    base = ["data.source=tokens", f"data.path={data}", "data.val_fraction=0.1"]
    train, held = data_sources(load_config(None, [*base, "train.eval_every=2"]), 256, None)
    assert len(train) == 4500 and len(held) == 500 and held[0] == np.load(data)[4500]
    same, none = data_sources(load_config(None, base), 256, None)
    assert none is None and len(same) == 4500  # training reads the same tokens with evaluation off


def test_bpe_held_out_text_gets_the_training_texts_ids(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    from meshfit.train.held_out import data_sources

    (tmp_path / "train.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    (tmp_path / "val.txt").write_text("a lazy fox, quick as a dog. " * 20)
    cfg = load_config(None, ["data.source=text", "data.tokenizer=bpe", f"data.path={tmp_path / 'train.txt'}",
                             f"data.val_path={tmp_path / 'val.txt'}", "train.eval_every=1"])
    _, held = data_sources(cfg, 280, tmp_path / "cache")
    cached = list((tmp_path / "cache").glob("bpe-280-*/tokenizer.json"))
    assert len(cached) == 1  # one tokenizer, the training text's
    expected = Tokenizer.from_file(str(cached[0])).encode((tmp_path / "val.txt").read_text()).ids
    assert held.tolist() == expected


def test_bpe_held_out_text_with_few_words_is_not_tokenized_on_its_own(tmp_path: Path) -> None:
    """Held-out BPE text is read with the training text's tokenizer: before the ranks start only its bytes
    bound its length (a tokenizer trained on the held-out text itself would count other tokens)."""
    train = tmp_path / "train.txt"
    train.write_text(" ".join(["alpha", "beta", "gamma", "delta"] * 400))
    bpe = ["data.source=text", f"data.path={train}", "data.tokenizer=bpe", "model.vocab_size=270",
           "train.seq_len=32", "train.eval_every=2", "train.eval_batches=1"]
    few_words = tmp_path / "val.txt"
    few_words.write_text("alphabetagammadelta " * 10)  # 10 words, 200 bytes
    _resolve(*bpe, f"data.val_path={few_words}")
    too_short = tmp_path / "short.txt"
    too_short.write_text("alpha beta")
    with pytest.raises(ConfigError, match=r"data\.val_path: .*short\.txt: has 10 bytes"):
        _resolve(*bpe, f"data.val_path={too_short}")
