"""`meshfit show` (summary table, plots, bad input) and TensorBoard events from `metrics.tensorboard`."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest
import yaml

from meshfit.commands.main import main
from meshfit.config import load_config
from meshfit.runs import plots as show_mod  # the plots' figures are saved there
from meshfit.train.metrics import MetricsLog
from meshfit.util.units import fmt_bytes

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _rank_mem(peak: int, measured: str = "tracker") -> dict:
    """One rank's `mem` entry, shaped as the trainer writes it (see a real metrics.jsonl)."""
    parts = {"params": peak // 10, "grads": 0, "optim": peak // 20, "other": 32768}
    parts["activations"] = peak - sum(parts.values())
    return {**parts, "activations_other": parts["activations"] + parts["other"], "peak": peak,
            "phase": "backward", "max": dict(parts), "max_by_type": {"Sharded Param": parts["params"]},
            "rest": {**parts, "activations": 0, "peak": parts["params"] + parts["optim"]},
            "measured": measured, "rss_peak": 300 * 2**20}


def _record(step: int, loss: float, tps: float, peaks: list[int]) -> dict:
    mem = [_rank_mem(p, "tracker" if step <= 3 else "carried") for p in peaks]
    return {"step": step, "time": 1.7e9 + step, "loss": loss, "grad_norm": 0.5, "lr": 1e-3,
            "tokens_per_s": tps, "step_time_s": 1024 / tps, "mfu": tps / 1e6, "peak_mem_bytes": max(peaks),
            "mem": mem}


def _make_run(path: Path, steps: int = 4, planned: int = 10, dp_shard: int = 2, zero_stage: int | None = None,
              result: dict | None = None, tps: tuple = (1000, 2000, 3000, 5000)) -> list[dict]:
    """A run directory as `meshfit train` leaves it: config.yaml, metrics.jsonl and (optionally) result.json."""
    path.mkdir(parents=True)
    cfg = load_config(None, [f"train.steps={planned}", f"parallel.dp_shard={dp_shard}",
                             *([f"parallel.zero_stage={zero_stage}"] if zero_stage is not None else [])])
    (path / "config.yaml").write_text(cfg.to_yaml())
    # rank 1 is the most-loaded one, and its peak grows in the last step
    records = [_record(s, 5.0 - 0.5 * s, tps[s - 1], [8 * 2**20, (9 if s < steps else 12) * 2**20])
               for s in range(1, steps + 1)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if result is not None:
        (path / "result.json").write_text(json.dumps(result))
    return records


def _show(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["show", *args])
    out, err = capsys.readouterr()
    return code, out, err


def _row(out: str, name: str) -> list[str]:
    line = next(line for line in out.splitlines() if line.startswith("│ " + name + " "))
    return [cell.strip() for cell in line.strip("│").split("│")]


def test_table_has_one_row_per_run_with_the_figures(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    records = _make_run(tmp_path / "a", result={"layout": "dp_shard=2", "zero_stage": 3, "world_size": 2})
    code, out, err = _show(capsys, "a")
    assert code == 0, err
    header = [c.strip() for c in next(line for line in out.splitlines() if "layout" in line).strip("┃").split("┃")]
    row = dict(zip(header, _row(out, "a")))
    steady = records[1:]  # medians leave out step 1 (warm-up)
    assert row["layout"] == "dp_shard=2 ZeRO-3"
    assert row["ranks"] == "2"
    assert row["steps"] == "4 / 10"
    assert row["status"] == "finished"  # result.json without a `status` field (older runs)
    assert row["final loss"] == "3.0000"
    assert row["tokens/s"] == "3,000"  # median of 2000, 3000, 5000; not 2500 (with step 1)
    assert row["step time"] == f"{statistics.median(r['step_time_s'] for r in steady) * 1e3:.1f} ms"
    assert row["MFU"] == "0.3%"
    assert row["peak mem"] == f"{fmt_bytes(12 * 2**20)} (rank 1)"


def test_status_and_layout_without_result(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _make_run(tmp_path / "running", zero_stage=1)  # no result.json: still running or killed
    _make_run(tmp_path / "failed")
    (tmp_path / "failed" / "failures").mkdir()
    (tmp_path / "failed" / "failures" / "rank1.json").write_text("{}")
    _make_run(tmp_path / "new", result={"status": "diverged", "world_size": 2})
    _make_run(tmp_path / "stopped", result={"stopped": "SIGTERM after step 4", "world_size": 2})
    code, out, err = _show(capsys, "running", "failed", "new", "stopped")
    assert code == 0, err
    assert _row(out, "running")[1:5] == ["dp_shard=2 ZeRO-1", "2", "4 / 10", "incomplete"]
    assert _row(out, "failed")[1] == "dp_shard=2 ZeRO-3"  # the config's default stage for dp_shard > 1
    assert _row(out, "failed")[4] == "failed"
    assert _row(out, "new")[4] == "diverged"  # a result's own status wins
    assert _row(out, "stopped")[4] == "stopped"


def test_plots_are_written_and_never_overwritten(tmp_path, capsys):
    run = tmp_path / "a"
    _make_run(run)
    code, out, _ = _show(capsys, str(run))
    assert code == 0
    names = ("show-loss.png", "show-throughput.png", "show-memory.png")
    for name in names:  # one run: the plots go into its own directory
        data = (run / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000
        assert f"wrote {run / name}" in out
    before = (run / "show-loss.png").read_bytes()
    code, out, _ = _show(capsys, str(run))
    assert code == 0
    assert (run / "show-loss.png").read_bytes() == before
    assert (run / "show-loss-2.png").read_bytes().startswith(PNG_MAGIC)
    assert f"wrote {run / 'show-loss-2.png'} (show-loss.png was already there: kept)" in out


def test_two_runs_are_overlaid_on_the_same_axes(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _make_run(tmp_path / "z3")
    _make_run(tmp_path / "z1", zero_stage=1, steps=3)
    figures = []
    real_save = show_mod._save
    monkeypatch.setattr(show_mod, "_save", lambda fig, path, **kw: figures.append(fig) or real_save(fig, path, **kw))
    code, out, err = _show(capsys, "z3", "z1")
    assert code == 0, err
    folders = [p for p in tmp_path.iterdir() if p.name.startswith("show-")]
    assert len(folders) == 1  # several runs: ./show-<time>
    assert sorted(p.name for p in folders[0].iterdir()) == ["show-loss.png", "show-memory.png", "show-throughput.png"]
    loss, throughput, memory = figures
    for fig in (loss, throughput):
        labels = [line.get_label() for line in fig.axes[0].get_lines() if not line.get_label().startswith("_")]
        assert labels == ["z3 (dp_shard=2 ZeRO-3)", "z1 (dp_shard=2 ZeRO-1)"]
    lines = loss.axes[0].get_lines()
    assert list(lines[0].get_ydata()) == [4.5, 4.0, 3.5, 3.0] and list(lines[1].get_xdata()) == [1, 2, 3]
    titles = [ax.get_title() for ax in memory.axes]
    assert titles == ["params", "grads", "optim", "activations", "other", "total at the peak"]
    assert [t.get_text() for t in memory.legends[0].get_texts()] == [
        "z3 (dp_shard=2 ZeRO-3), 2 ranks", "z1 (dp_shard=2 ZeRO-1), 2 ranks"]
    peak_panel = memory.axes[-1]
    assert len(peak_panel.get_lines()) == 4  # 2 runs × 2 ranks
    assert max(peak_panel.get_lines()[1].get_ydata()) == 12  # rank 1 of z3, in MiB


def _assert_usage_error(capsys, args: list[str], *expected: str) -> str:
    code, out, err = _show(capsys, *args)
    assert code == 2
    assert "Traceback" not in out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for text in expected:
        assert text in lines[0]
    return lines[0]


def test_bad_input_is_one_clear_line(tmp_path, capsys):
    good = tmp_path / "good"
    _make_run(good)
    missing = tmp_path / "nope"
    _assert_usage_error(capsys, [str(good), str(missing)], f"{missing} does not exist", "run directory")
    empty = tmp_path / "empty"
    empty.mkdir()
    _assert_usage_error(capsys, [str(empty)], f"{empty} has no metrics.jsonl")
    demo = tmp_path / "demo"
    _make_run(demo / "zero3")
    _assert_usage_error(capsys, [str(demo)], "it holds run directories: zero3")
    _assert_usage_error(capsys, [str(good / "metrics.jsonl")], f"{good / 'metrics.jsonl'} is a file",
                        f"(here: {good})")

    truncated = tmp_path / "truncated"
    _make_run(truncated)
    text = (truncated / "metrics.jsonl").read_text()
    (truncated / "metrics.jsonl").write_text(text[: len(text) - 40])  # a rank killed mid-write: left out
    assert main(["show", str(truncated), "--out", str(tmp_path / "plots-truncated")]) == 0
    said = capsys.readouterr()
    assert f"{truncated / 'metrics.jsonl'} line 4 is cut short" in said.err and "Traceback" not in said.err
    (truncated / "metrics.jsonl").write_text(text[: len(text) - 40] + "\n")  # a whole line that is no record
    _assert_usage_error(capsys, [str(truncated)], f"{truncated / 'metrics.jsonl'} line 4 is not valid JSON")
    corrupt = tmp_path / "corrupt"
    _make_run(corrupt)
    lines = (corrupt / "metrics.jsonl").read_text().splitlines()
    lines[1] = "\x00\x00garbage"
    (corrupt / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    _assert_usage_error(capsys, [str(corrupt)], "line 2 is not valid JSON")
    (corrupt / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    _assert_usage_error(capsys, [str(corrupt)], "line 1 is not a step record", "missing tokens_per_s")
    (corrupt / "metrics.jsonl").write_text("[1, 2]\n")
    _assert_usage_error(capsys, [str(corrupt)], "line 1 is not a step record (a JSON list)")
    bad_value = {**_record(1, 2.0, 100, [2**20]), "loss": "nan?"}
    (corrupt / "metrics.jsonl").write_text(json.dumps(bad_value) + "\n")
    _assert_usage_error(capsys, [str(corrupt)], "line 1 is not a step record (loss: expected a number, got 'nan?')")
    (corrupt / "metrics.jsonl").write_text(json.dumps({**bad_value, "loss": 2.0, "mem": [3]}) + "\n")
    _assert_usage_error(capsys, [str(corrupt)], "mem: expected a list of one object per rank, got 3 for rank 0")

    broken_result = tmp_path / "broken_result"
    _make_run(broken_result, result={})
    (broken_result / "result.json").write_text('{"layout": ')
    _assert_usage_error(capsys, [str(broken_result)], f"{broken_result / 'result.json'}: not a JSON result file")
    out_file = tmp_path / "out.txt"
    out_file.write_text("x")
    _assert_usage_error(capsys, [str(good), "--out", str(out_file)], f"--out {out_file} is a file")
    assert not list(good.glob("*.png"))  # every failure above came before any plot was written


def _set_rank_value(run: Path, line: int, rank: int, key: str, value) -> None:
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    records[line - 1]["mem"][rank][key] = value
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.mark.parametrize("breaks, expected", [
    # A rank's breakdown at its peak: the table reads `peak`, the memory plot every category.
    (lambda run: _set_rank_value(run, 2, 0, "peak", "big"),
     "metrics.jsonl line 2 is not a step record (mem[0].peak: expected a number of bytes ≥ 0, got 'big')"),
    (lambda run: _set_rank_value(run, 4, 1, "grads", "zero"),
     "metrics.jsonl line 4 is not a step record (mem[1].grads: expected a number of bytes ≥ 0, got 'zero')"),
    (lambda run: _set_rank_value(run, 1, 1, "activations", None),
     "metrics.jsonl line 1 is not a step record (mem[1].activations: expected a number of bytes ≥ 0, got null)"),
    (lambda run: (run / "result.json").write_text(json.dumps({"world_size": "two"})),
     "result.json: world_size: expected a whole number of ranks ≥ 1, got 'two'"),
    (lambda run: (run / "result.json").write_text(json.dumps({"zero_stage": 7})),
     "result.json: zero_stage: expected a ZeRO stage 0, 1, 2 or 3, got 7"),
    (lambda run: (run / "config.yaml").write_text("model:\n  preset: tiny\ntrain:\n  - 1\n  - 2\n"),
     "config.yaml: train: expected a section of key: value entries, got a list"),
    (lambda run: (run / "config.yaml").write_text("parallel:\n  dp_shard: two\n"),
     "config.yaml: parallel.dp_shard: expected a whole degree ≥ 1, or -1 (the rest of the ranks), got 'two'"),
    (lambda run: (run / "config.yaml").write_text("train:\n  steps: 1.5\n"),
     "config.yaml: train.steps: expected a whole number of steps ≥ 1, got 1.5"),
    (lambda run: (run / "config.yaml").write_text("pipeline:\n  schedule: 3\n"),
     "config.yaml: pipeline.schedule: expected a string, got 3"),
    (lambda run: (run / "config.yaml").write_text("- a list\n"),
     "config.yaml: expected the run's resolved config (sections model, parallel, train …), got a list"),
    (lambda run: (run / "result.json").mkdir(), "result.json is a directory, not a result file"),
], ids=["peak-string", "category-string", "category-null", "world-size-string", "zero-stage-range",
        "train-is-a-list", "degree-string", "steps-fraction", "schedule-number", "config-a-list", "result-a-dir"])
def test_wrong_values_in_run_files_are_one_line_before_any_plot(tmp_path, capsys, breaks, expected):
    run = tmp_path / "run"
    _make_run(run)
    breaks(run)
    line = _assert_usage_error(capsys, [str(run)], expected)
    assert str(run) in line
    assert not list(run.glob("*.png"))  # checked before the table and every plot


def test_step_ticks_are_whole_numbers_and_flat_memory_starts_at_zero(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    _make_run(run, steps=3)  # 3 steps: matplotlib's own ticks would be 1.00, 1.25, … 3.00
    figures = []
    real_save = show_mod._save
    monkeypatch.setattr(show_mod, "_save", lambda fig, path, **kw: figures.append(fig) or real_save(fig, path, **kw))
    code, _, err = _show(capsys, str(run))
    assert code == 0, err
    for fig in figures:
        for ax in fig.axes:
            ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
            assert ticks and all(float(t).is_integer() for t in ticks), (ax.get_title(), ticks)
    panels = {ax.get_title(): ax for ax in figures[2].axes}
    assert panels["grads"].get_ylim() == (0, 1)  # all-zero gradients: a flat line at the bottom, not ±0.04
    params = 8 * 2**20 // 10 / 2**20  # rank 0's and rank 1's params differ: not constant, autoscaled
    assert panels["params"].get_ylim()[0] < params
    constant = tmp_path / "constant"
    _make_run(constant, steps=3)
    for line in (1, 2, 3):
        for rank in (0, 1):
            _set_rank_value(constant, line, rank, "params", 4 * 2**20)
    figures.clear()
    assert _show(capsys, str(constant))[0] == 0
    panels = {ax.get_title(): ax for ax in figures[2].axes}
    assert panels["params"].get_ylim() == (0, 5)  # 4 MiB on every rank and step: 0 … 4 MiB + a quarter


def test_paths_are_not_markup(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _make_run(tmp_path / "[red]x")
    code, out, err = _show(capsys, "[red]x")
    assert code == 0, err
    assert "│ [red]x " in out and "wrote [red]x/show-loss.png" in out


def test_run_without_steps_yet(tmp_path, capsys):
    run = tmp_path / "starting"
    _make_run(run, steps=0)
    code, out, err = _show(capsys, str(run))
    assert code == 0, err
    assert "0 / 10" in out and "incomplete" in out and "no plots written" in out
    assert not list(run.glob("*.png"))


# ---- TensorBoard ----------------------------------------------------------------------------------------


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_metrics_log_writes_tensorboard_scalars(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl", 2, tensorboard=True)
    recs = [_record(1, 4.0, 1000, [2**20, 2**21]), {**_record(2, 3.5, 2000, [2**20, 2**21]), "mfu": None}]
    for rec in recs:
        log.record(rec)
    log.close()
    scalars = _scalars(tmp_path / "tensorboard")
    assert [step for step, _ in scalars["train/loss"]] == [1, 2]
    assert [v for _, v in scalars["train/loss"]] == pytest.approx([4.0, 3.5])
    assert [v for _, v in scalars["perf/tokens_per_s"]] == pytest.approx([1000, 2000])
    assert [v for _, v in scalars["memory/peak_mem_bytes"]] == pytest.approx([2**21, 2**21])
    assert scalars["perf/mfu"] == [(1, pytest.approx(0.001))]  # no point where the MFU is unknown
    for tag in ("train/grad_norm", "train/lr", "perf/step_time_s", "memory/activations_bytes"):
        assert len(scalars[tag]) == 2


def test_tensorboard_hides_the_steps_a_resumed_run_repeats(tmp_path):
    """An attempt logs steps 1-3 and dies; the restart resumes from the step-1 checkpoint and logs 2-3
    again: TensorBoard shows each step once, from the attempt that counts (as metrics.jsonl keeps)."""
    first = MetricsLog(tmp_path / "metrics.jsonl", 3, tensorboard=True)
    for step in (1, 2, 3):
        first.record(_record(step, 10.0 + step, 1000, [2**20]))
    first.close()
    resumed = MetricsLog(tmp_path / "metrics.jsonl", 3, tensorboard=True, start_step=1)
    for step in (2, 3):
        resumed.record(_record(step, 20.0 + step, 1000, [2**20]))
    resumed.close()
    assert len(list((tmp_path / "tensorboard").iterdir())) == 2
    assert _scalars(tmp_path / "tensorboard")["train/loss"] == [(1, 11.0), (2, 22.0), (3, 23.0)]
    kept = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert kept == [11.0, 22.0, 23.0]


def test_missing_tensorboard_is_named(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    with pytest.raises(RuntimeError, match=r"metrics\.tensorboard.*pip install tensorboard"):
        MetricsLog(tmp_path / "metrics.jsonl", 2, tensorboard=True)
    MetricsLog(tmp_path / "metrics.jsonl", 2).close()  # off by default: tensorboard is never imported


def test_config_metrics_section():
    assert load_config().metrics.tensorboard is False
    assert load_config(None, ["metrics.tensorboard=true"]).metrics.tensorboard is True
    assert "metrics" in yaml.safe_load(load_config().to_yaml())


@pytest.mark.timeout(240)
def test_training_writes_tensorboard_events_and_show_reads_the_run(tmp_path, capsys):
    run = tmp_path / "tb"
    assert main(["train", "--set", "model.preset=tiny", "--set", "train.steps=3", "--set", "train.seq_len=32",
                 "--set", "metrics.tensorboard=true", "--run-dir", str(run)]) == 0
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    loss = _scalars(run / "tensorboard")["train/loss"]
    assert [s for s, _ in loss] == [1, 2, 3]
    assert [v for _, v in loss] == pytest.approx([r["loss"] for r in records], rel=1e-6)
    capsys.readouterr()
    code, out, err = _show(capsys, str(run))
    assert code == 0, err
    assert "single rank" in out and "3 / 3" in out and "finished" in out and f"{records[-1]['loss']:.4f}" in out
