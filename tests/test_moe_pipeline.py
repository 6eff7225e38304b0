"""Pipeline parallelism trains a Mixture-of-Experts model as one process does (fp32, dropless, the auxiliary
loss and the expert bias on, 10 steps): pp 2 on 2 ranks under every schedule meshfit runs — 1F1B,
interleaved 1F1B (2 stages per rank), GPipe, and the split-backward ZBV, interleaved zero-bubble and DualPipeV
(ZeRO-1) — and ep 2 × pp 2 on 4 ranks (dp_shard 2): the same losses and
gradient norms (≤ 1e-5), the same auxiliary loss (≤ 1e-6) and tokens per expert of every layer in every
step record (a stage holds some blocks: the counts of the others come from the other stages) and the same
expert biases. A run saved after 5 steps under pp 2 resumes on one process with the same losses.

Every run sees micro-batches of 2 sequences (the load-balancing loss is a micro-batch's): one process
accumulates 4 of them; pp 2 runs 4 per step; ep 2 × pp 2 runs 2 per step on each of its 2 data-parallel
pipelines."""

import functools

import pytest
from dist_jobs import moe_layouts_job, parity_config

from meshfit.util.ranks import run_ranks

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(500)]

# Four blocks, the first dense: stages hold one or more Mixture-of-Experts blocks, or none.
BASE = ["model.preset=tiny-moe", "model.n_layers=4", "model.moe_bias_update_rate=0.001",
        "model.moe_aux_loss_coeff=0.01"]
PP2 = ["parallel.pp=2", "pipeline.microbatches=4"]
SCHEDULES = {
    "1f1b": [*PP2, "pipeline.schedule=1f1b"],
    "interleaved-1f1b": [*PP2, "pipeline.schedule=interleaved-1f1b", "pipeline.virtual_stages=2"],
    "gpipe": [*PP2, "pipeline.schedule=gpipe"],
    "zbv": [*PP2, "pipeline.schedule=zbv", "parallel.zero_stage=1"],
    "interleaved-zb": [*PP2, "pipeline.schedule=interleaved-zb", "pipeline.virtual_stages=2", "parallel.zero_stage=1"],
    "dualpipev": [*PP2, "pipeline.schedule=dualpipev", "parallel.zero_stage=1"],
}


@functools.cache
def _reference(resume_folder: str | None = None) -> dict:
    # One process, 4 micro-batches of 2 sequences; with a folder: then the last 5 steps resumed from it.
    cfg = parity_config(*BASE, "train.micro_batch=2")
    resume = (None, cfg, resume_folder) if resume_folder else None
    return run_ranks(moe_layouts_job, 1, {"ref": cfg}, resume, timeout_s=200)[0]


def _close(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _biases(ranks: list[dict], name: str) -> dict[int, list[float]]:
    """Every layer's expert bias, from the ranks that hold it (their data-parallel replicas agree)."""
    found: dict[int, list[float]] = {}
    for out in ranks:
        for layer, bias in out[name]["biases"].items():
            assert found.setdefault(layer, bias) == bias, (name, layer)
    return found


def _same(ranks: list[dict], name: str, ref: dict) -> dict[str, float]:
    run = ranks[0][name]
    diffs = {"loss": _close(run["losses"], ref["losses"]), "grad_norm": _close(run["grad_norms"], ref["grad_norms"]),
             "aux_loss": _close(run["aux_losses"], ref["aux_losses"])}
    assert diffs["loss"] <= 1e-5 and diffs["grad_norm"] <= 1e-5 and diffs["aux_loss"] <= 1e-6, (name, diffs)
    assert min(run["aux_losses"]) > 0
    assert run["moe_layers"] == ref["moe_layers"] == [1, 2, 3]
    assert run["tokens"] == ref["tokens"], name  # every layer's, in rank 0's records
    assert _biases(ranks, name) == ref["biases"], name
    assert any(b != 0 for bias in ref["biases"].values() for b in bias)
    return diffs


def test_pp2_schedules_train_as_one_process_and_resume_on_one_process(tmp_path) -> None:
    folder = str(tmp_path / "resume")
    cfgs = {name: parity_config(*BASE, *extra) for name, extra in SCHEDULES.items()}
    ranks = run_ranks(moe_layouts_job, 2, cfgs, (cfgs["1f1b"], None, folder), timeout_s=420)
    # Both ranks hold blocks; rank 0's first stage holds the dense block.
    assert all(ranks[r]["1f1b"]["biases"] for r in (0, 1)) and 0 not in ranks[0]["1f1b"]["biases"]
    ref = _reference(folder)
    diffs = {name: _same(ranks, name, ref["ref"]) for name in SCHEDULES}
    print("pp 2 vs one process:", diffs)
    resumed = _close(ranks[0]["resumed"] + ref["resumed"], ref["ref"]["losses"])
    print("pp 2 for 5 steps, resumed on one process:", resumed)
    assert resumed <= 1e-5


def test_ep2_pp2_on_four_ranks_trains_as_one_process() -> None:
    cfg = parity_config(*BASE, "parallel.pp=2", "parallel.dp_shard=2", "parallel.ep=2", "pipeline.microbatches=2",
                        "pipeline.schedule=1f1b")
    ranks = run_ranks(moe_layouts_job, 4, {"ep2-pp2": cfg}, timeout_s=420)
    # tiny-moe: 8 experts of width 32 over dim 64; each rank holds 4 of them.
    assert all(shapes == ((8, 32, 64), (4, 32, 64)) for shapes in [ranks[0]["ep2-pp2"]["shapes"]["w1"]])
    ref = _reference(None)
    print("ep 2 × pp 2 vs one process:", _same(ranks, "ep2-pp2", ref["ref"]))
