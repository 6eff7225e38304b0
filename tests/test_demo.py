"""`meshfit demo`: the seed scenario runs end to end and reports what it measured, readably."""

import json
import math
import re
import warnings

import pytest
from test_cli import meshfit

from meshfit.commands.main import main
from meshfit.config import ConfigError
from meshfit.data import MarkovSource
from meshfit.demo.categories import category_note
from meshfit.demo.chart import UNBUDGETED, bar_label, bar_note, memory_chart
from meshfit.demo.run import check_demo_args, demo_trials, loss_floor
from meshfit.demo.tables import WIDTH, parity_text
from meshfit.demo.trial import DEMO_BUDGET, Entry, demo_config, failure_line
from meshfit.train.launch import Outcome
from meshfit.util.kept_warnings import KeptWarnings, warning_logs
from meshfit.util.units import parse_bytes

FAILING = ("ddp", "ddp-4x-batch", "zero1", "zero2")
FITTING = ("zero3", "fsdp-ac", "tp", "pp", "3d")


def _check_long_scene(root):
    """Long sequences: ZeRO-3 alone does not fit; split over the ranks (cp) each sequence does."""
    long = json.loads((root / "long_sequences.json").read_text())
    runs = {e["layout"]: e for e in long["layouts"]}
    assert long["seq_len"] == 1024
    assert runs["long-zero3"]["fits"] is False and runs["long-zero3"]["peak_mem_bytes"] > long["budget_bytes"]
    assert runs["long-cp"]["fits"] and runs["long-zero3-ac"]["fits"]
    acts = {name: max(m["activations"] for m in e["mem"]) for name, e in runs.items()}
    assert acts["long-cp"] < 0.6 * acts["long-zero3"]  # half the sequence, plus the gathered keys and values
    losses = [runs[n]["final_loss"] for n in ("long-zero3-ac", "long-cp")]
    assert abs(losses[0] - losses[1]) <= 1e-5
    for name in ("long-zero3", "long-cp"):  # full recompute's plan is 13% high here (see README)
        assert runs[name]["predicted_peak_mem_bytes"] == pytest.approx(runs[name]["peak_mem_bytes"], rel=0.10)
    assert (root / "long_memory.png").read_bytes()[:4] == b"\x89PNG"


def _check_experts_scene(root):
    """Mixture of Experts: ZeRO-3 alone gathers every expert of a block and does not fit; with ep each rank
    gathers only its own experts and fits, with the same losses."""
    scene = json.loads((root / "experts.json").read_text())
    runs = {e["layout"]: e for e in scene["layouts"]}
    assert runs["moe-zero3"]["fits"] is False and runs["moe-zero3"]["peak_mem_bytes"] > scene["budget_bytes"]
    assert runs["moe-ep"]["fits"] and runs["moe-ep"]["peak_mem_bytes"] <= scene["budget_bytes"]
    # The same sharded model states on both: optimizer states per rank equal.
    optim = {name: max(m["optim"] for m in e["mem"]) for name, e in runs.items()}
    assert optim["moe-ep"] == optim["moe-zero3"]
    for name, run in runs.items():  # the plan counts each block's gathered experts: E, or E/ep with ep
        assert run["predicted_peak_mem_bytes"] == pytest.approx(run["peak_mem_bytes"], rel=0.10), name
    assert (root / "experts_memory.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.multiproc
@pytest.mark.timeout(560)
def test_demo_progression(tmp_path):
    res = meshfit("demo", "--run-dir", str(tmp_path), timeout=550)
    assert res.returncode == 0, res.stderr
    summary = {e["layout"]: e for e in json.loads((tmp_path / "summary.json").read_text())}
    budget = parse_bytes(DEMO_BUDGET)
    for name in FAILING:
        entry = summary[name]
        assert entry["fits"] is False and entry["final_loss"] is None, name
        assert entry["peak_mem_bytes"] is not None, entry["error"]
        assert entry["peak_mem_bytes"] > budget  # measured without the budget
        assert "memory budget exceeded" in entry["error"]
    for name in FITTING:
        entry = summary[name]
        assert entry["fits"] is True and entry["final_loss"] is not None, name
        assert entry["peak_mem_bytes"] <= budget
    # A larger local batch needs more memory, not less; every stage needs less than the one before.
    assert summary["ddp-4x-batch"]["peak_mem_bytes"] > summary["ddp"]["peak_mem_bytes"]
    order = [summary[n]["peak_mem_bytes"] for n in ("ddp", "zero1", "zero2", "zero3", "fsdp-ac")]
    assert order == sorted(order, reverse=True)
    ddp = max(summary["ddp"]["mem"], key=lambda m: m["peak"])
    # DDP's model states alone (weights + grads + AdamW moments) exceed the budget.
    assert ddp["params"] + ddp["max"]["grads"] + ddp["max"]["optim"] > budget
    # The breakdown shown is the peak step's: its most-loaded rank is the peak.
    for name, entry in summary.items():
        assert max(m["peak"] for m in entry["mem"]) == entry["peak_mem_bytes"], name
    # The layouts that fit trained the same model on the same data: the same losses.
    losses = [summary[n]["final_loss"] for n in FITTING]
    assert max(losses) - min(losses) <= 1e-5
    assert summary["3d"]["ranks"] == 8 and summary["zero3"]["ranks"] == 2
    assert len(summary["3d"]["mem"]) == 8 and {tuple(m["stages"]) for m in summary["3d"]["mem"]} == {(0,), (1,)}
    # The plan printed first predicted every layout's most-loaded rank within 10% of what was measured.
    for name, entry in summary.items():
        assert entry["predicted_peak_mem_bytes"] == pytest.approx(entry["peak_mem_bytes"], rel=0.10), name
    assert (tmp_path / "memory.png").read_bytes()[:4] == b"\x89PNG"
    _check_long_scene(tmp_path)
    _check_experts_scene(tmp_path)

    out = res.stdout
    lines = out.splitlines()
    assert "the plan" in out and "predicted (planner) vs measured" in out and "measured MiB per rank" in out
    # Everything fits 100 columns, and no table cell wrapped: each layout's row carries its measured peak.
    assert max(len(line) for line in lines) <= WIDTH
    for name, entry in summary.items():
        rows = [line for line in lines if re.match(rf"│ {re.escape(name)} +│ +{entry['ranks']} +│ (yes|no\*)", line)]
        assert len(rows) == 1 and f" {entry['peak_mem_bytes'] / 2**20:.1f} │" in rows[0], (name, rows)
    # Each budget error once, one line per failing layout: the rank, the phase and the bytes.
    over = [line for line in lines if "over budget:" in line]
    assert len(over) == len(FAILING) + 2, over  # and the long and experts scenes' ZeRO-3
    for line in over:
        assert re.search(r"rank \d+ needed [\d.]+ MiB during (forward|backward|optimizer step), [\d.]+ (B|KiB|MiB) "
                         r"over the (80|140|300).0 MiB budget", line), line
    assert "memory budget exceeded" not in out + res.stderr  # the ranks' own long reports stay off the console
    # Why the fitting layouts agree, with the measured spread; the data's loss floor, from its generator.
    assert f"ends at the same loss, {min(losses):.4f} (largest difference between them: " \
           f"{max(losses) - min(losses):.1e})" in re.sub(r"\s+", " ", out)
    assert "float rounding" in out
    # Rows whose categories the tracker files apart from the plan's are named, with why (ddp and 3d here).
    entries = [Entry(e["layout"], e["fits"], e["peak_mem_bytes"], e["final_loss"], e["why"], e["ranks"],
                     mem=e["mem"], predicted=e["predicted_mem"], predicted_phase=e["predicted_phase"])
               for e in summary.values()]
    note = category_note(demo_trials(2), entries)
    assert note is not None and re.sub(r"\s+", " ", note) in re.sub(r"\s+", " ", out)
    assert f"{loss_floor(demo_config())['floor']:.2f} nats/token" in out
    # Warnings stay off the console.
    assert not re.search(r"\w+Warning\b", out), out
    assert not re.search(r"\w+Warning:", res.stderr), res.stderr


def _entry(name, fits, peak, loss=None, ranks=2):
    mem = [{"params": peak // 4, "grads": peak // 4, "optim": peak // 4, "activations": peak // 4, "other": 0,
            "peak": peak}]
    return Entry(name, fits, peak, loss, "why", ranks, 1.0, mem, None if fits else "memory budget exceeded")


def test_chart_labels_ranks_and_unbudgeted_bars(tmp_path):
    entries = [_entry("ddp", False, 100 * 2**20).to_json(), _entry("3d", True, 30 * 2**20, 7.6, ranks=8).to_json()]
    assert bar_label(entries[1]) == "3d\n(8 ranks)" and bar_label(entries[0]) == "ddp\n(2 ranks)"
    assert UNBUDGETED == "measured without budget" and UNBUDGETED in bar_note(entries[0])
    assert bar_note(entries[1]) == "fits"
    memory_chart(entries, 80 * 2**20, tmp_path / "memory.png")
    assert (tmp_path / "memory.png").read_bytes()[:4] == b"\x89PNG"


def test_failure_line_names_rank_phase_and_overshoot():
    record = {"rank": 1, "message": "memory budget exceeded on rank 1 ...",
              "budget": {"rank": 1, "phase": "backward", "needed": 84483316, "budget": 83886080}}
    line = failure_line(Outcome(ok=False, failure=record, failed_ranks=(0, 1)))
    assert line == "rank 1 needed 80.6 MiB during backward, 583.2 KiB over the 80.0 MiB budget"
    # Measured: zero1 needed 1,768 bytes more than the budget, and both round to 80.0 MiB.
    record["budget"].update(needed=83887848, phase="forward")
    line = failure_line(Outcome(ok=False, failure=record, failed_ranks=(0, 1)))
    assert line == "rank 1 needed 80.0 MiB during forward, 1.7 KiB over the 80.0 MiB budget"
    assert "\n" not in failure_line(Outcome(ok=False, exit_codes={0: -9}))


def _measured(peak, params, grads, optim, activations, other, phase):
    return [{"params": params, "grads": grads, "optim": optim, "activations": activations, "other": other,
             "peak": peak, "phase": phase}]


def _planned(params, grads, optim, activations, buffers):
    return {"params": params, "grads": grads, "optim": optim, "activations": activations, "buffers": buffers,
            "total": params + grads + optim + activations + buffers}


def test_category_note_names_rows_filed_apart():
    """Planned and measured breakdowns (bytes) of a 2-rank demo run: ddp and 3d agree on the peak, not per
    category; zero3 agrees on both."""
    trials = {t.name: t for t in demo_trials(2)}
    rows = [
        Entry("ddp", False, 109651180, None, "", 2,
              mem=_measured(109651180, 21902336, 21902336, 43804900, 21910536, 131072, "forward"),
              predicted=_planned(21902336, 43804672, 43804672, 0, 131072), predicted_phase="bucket rebuild"),
        Entry("zero3", True, 77956348, 7.6, "", 2,
              mem=_measured(77956348, 21048832, 12426752, 21902564, 22447128, 131072, "backward"),
              predicted=_planned(21048832, 12426752, 21902336, 23228416, 131072), predicted_phase="reduce in flight"),
        Entry("3d", True, 27479152, 7.6, "", 8,
              mem=_measured(27479152, 2739200, 0, 5478512, 16343040, 2918400, "pipeline forward/backward"),
              predicted=_planned(9694208, 5478400, 5478400, 7352320, 393216), predicted_phase="backward"),
    ]
    note = category_note([trials[e.layout] for e in rows], rows)
    assert note.startswith("Why some rows' categories differ from the plan's while their peaks agree: ddp: ")
    assert "DDP's gradient buckets, rebuilt in step 2's forward, as activations (the plan: grads)" in note
    assert "3d: inside pipeline stages the tracker counts FSDP's gathered weights" in note
    assert "zero3" not in note
    # A row filed apart for no known reason says where the peaks came instead.
    zero1 = Entry("zero1", True, 100, 7.6, "", 2, mem=_measured(100, 60, 0, 0, 40, 0, "backward"),
                  predicted=_planned(20, 0, 0, 80, 0), predicted_phase="loss")
    assert category_note([trials["zero1"]], [zero1]) == ("Why some rows' categories differ from the plan's while "
                                                         "their peaks agree: zero1: the peak came in another phase "
                                                         "than planned (planned: loss; measured: backward).")
    assert category_note([trials["zero3"]], rows[1:2]) is None


def test_demo_refuses_one_rank_before_anything_runs(tmp_path, capsys):
    assert main(["demo", "--nproc", "1", "--run-dir", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --nproc 1: the demo runs on 2 or 4 ranks.") and "\n" not in err
    assert "on 1 rank ZeRO shards nothing" in err
    assert not (tmp_path / "d").exists()
    assert main(["demo", "--nproc", "3", "--run-dir", str(tmp_path / "d")]) == 2
    assert "the rank count must divide its batch (8) and key-value heads (4)" in capsys.readouterr().err


def test_demo_refuses_a_training_runs_folder(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints" / "step-3").mkdir(parents=True)
    (run / "config.yaml").write_text("train: {}\n")
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (run / "result.json").write_text('{"status": "finished"}')
    before = sorted(p.relative_to(run).as_posix() for p in run.rglob("*"))
    for extra in ([], ["--overwrite"]):  # --overwrite replaces an earlier demo's output, never a training run
        assert main(["demo", "--run-dir", str(run), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: --run-dir {run} holds a training run (metrics.jsonl (2 steps); "
                              "result.json (finished)") and "choose another --run-dir for the demo" in err
    assert sorted(p.relative_to(run).as_posix() for p in run.rglob("*")) == before


def test_demo_reruns_into_its_own_folder_with_overwrite(tmp_path):
    demo = tmp_path / "demo"
    (demo / "zero3").mkdir(parents=True)  # a layout's run folder holds a run's files: that is the demo's own
    for name in ("config.yaml", "metrics.jsonl", "result.json"):
        (demo / "zero3" / name).write_text("{}")
    (demo / "summary.json").write_text("[]")
    with pytest.raises(ConfigError, match=r"holds an earlier demo's output \(summary.json, zero3\): replace it "
                                          r"with --overwrite"):
        check_demo_args(demo, 2, overwrite=False)
    check_demo_args(demo, 2, overwrite=True)
    check_demo_args(tmp_path / "new", 4, overwrite=False)


def test_parity_and_loss_floor_explained():
    cfg = demo_config()
    floor = loss_floor(cfg)
    vocab = cfg.model.resolve().vocab_size
    # The floor is the generator's entropy rate, below a uniform guess over the vocabulary.
    assert floor["floor"] == MarkovSource(vocab, cfg.train.seed).entropy_floor()
    assert 0 < floor["floor"] < floor["uniform"] == pytest.approx(math.log(vocab))
    text = parity_text([_entry("zero3", True, 1, 7.6), _entry("tp", True, 1, 7.6 + 5e-7),
                        _entry("ddp", False, 1)])
    assert "same loss, 7.6000 (largest difference between them: 5.0e-07)" in text and "same seed" in text
    assert parity_text([_entry("zero3", True, 1, 7.6)]) is None


def test_demo_warnings_go_to_the_log(tmp_path, capsys):
    with KeptWarnings(tmp_path / "warnings.log") as kept:
        warnings.warn("a DTensor-style warning", UserWarning)
    assert kept.count == 1 and "UserWarning: a DTensor-style warning" in (tmp_path / "warnings.log").read_text()
    captured = capsys.readouterr()
    assert "DTensor" not in captured.out + captured.err
    (tmp_path / "tp").mkdir()
    (tmp_path / "tp" / "warnings.log").write_text("[rank 1] x.py:1: UserWarning: w\n")
    assert [(p.relative_to(tmp_path).as_posix(), n) for p, n in warning_logs(tmp_path)] == \
        [("tp/warnings.log", 1), ("warnings.log", 1)]


def test_a_signal_ends_the_whole_demo(tmp_path, monkeypatch, capsys):
    """Ctrl-C (or SIGTERM) reaches the launcher of one layout's ranks; the demo ends there rather than going
    on with the next layout."""
    import meshfit.demo.run as demo
    import meshfit.demo.trial as trial

    started = []

    def stopped_launch(cfg, run_dir, nproc):
        started.append(run_dir.name)
        return Outcome(ok=False, signal="SIGINT")

    monkeypatch.setattr(trial, "launch", stopped_launch)
    assert demo.run_demo(tmp_path / "d", nproc=2) == 130
    assert started == ["ddp"]  # neither the run without the budget nor the next layout started
    assert "stopped by SIGINT during ddp; no summary was written" in capsys.readouterr().out
    assert not (tmp_path / "d" / "summary.json").exists()
