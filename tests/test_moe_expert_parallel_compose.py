"""Expert parallelism (parallel.ep) composed with the rest of a layout trains as one process does: fp32,
tiny-moe with the expert bias and the auxiliary loss on, dropless unless said, 10 steps; the same losses
and gradient norms (≤ 1e-5), tokens per expert, auxiliary losses and expert biases.

* ep 4 on 4 ranks, HSDP (dp_replicate 2 × dp_shard 2) with ep 2, and ep 2 over dp_shard 4 with op-level
  recompute (the expert shards' FSDP unit inside the recomputed block): one 4-rank launch.
* ep 2 with activation checkpointing (every block, with a shared expert; op-level; every second block,
  under a capacity factor): the all-to-alls run again in the recomputed forward, and the block's tokens
  per expert, auxiliary loss and bias update are taken once, not again in backward. With bf16 mixed
  precision against one process in bf16 (losses within 1e-3). One 2-rank launch.
* ep 2 with compiled blocks (train.compile), alone, with full and with op-level recompute, and compiled
  blocks without expert parallelism, against one eager process. One 2-rank launch; compiling costs ~20 s
  per graph here, so the inductor cache is the one tests/test_compile.py uses.
"""

import tempfile
from pathlib import Path

import pytest
from dist_jobs import moe_layouts_job, parity_config

from meshfit.util.ranks import run_ranks

pytestmark = pytest.mark.multiproc

BASE = ["model.preset=tiny-moe", "model.moe_bias_update_rate=0.001"]
CAPACITY = ["model.moe_capacity_factor=1.0"]
SHARED = ["model.moe_shared_experts=1"]
EP2 = ["parallel.dp_shard=2", "parallel.ep=2"]


def _close(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _same(run: dict, ref: dict) -> None:
    assert _close(run["losses"], ref["losses"]) <= 1e-5, (run["losses"], ref["losses"])
    assert _close(run["grad_norms"], ref["grad_norms"]) <= 1e-5
    assert run["tokens"] == ref["tokens"]
    assert _close(run["aux_losses"], ref["aux_losses"]) <= 1e-6 and min(ref["aux_losses"]) > 0
    assert run["biases"] == ref["biases"] and any(b != 0 for bias in ref["biases"].values() for b in bias)


def _reference(ranks: int, **variants: list[str]) -> dict:
    # One process, micro-batches as large as one rank's batch (capacity and auxiliary loss are a micro-batch's).
    cfgs = {name: parity_config(*BASE, f"train.micro_batch={8 // ranks}", *extra) for name, extra in variants.items()}
    return run_ranks(moe_layouts_job, 1, cfgs)[0]


@pytest.mark.timeout(300)
def test_ep4_hsdp_and_op_recompute_on_four_ranks_train_as_one_process() -> None:
    ref = _reference(4, plain=[])["plain"]
    cfgs = {"ep4": parity_config(*BASE, "parallel.dp_shard=4", "parallel.ep=4"),
            "hsdp": parity_config(*BASE, "parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.ep=2"),
            "ep2-op": parity_config(*BASE, "parallel.dp_shard=4", "parallel.ep=2", "parallel.activation_checkpointing=op")}
    out = run_ranks(moe_layouts_job, 4, cfgs, timeout_s=240)[0]
    # tiny-moe: 8 experts of width 32 over dim 64; ep4: 2 per rank; HSDP: 4 per rank, replicated; ep 2 over
    # dp_shard 4: 4 per ep rank, FSDP-sharded over its 2 edp ranks (gathered inside the recomputed block).
    assert out["ep4"]["shapes"]["w1"] == ((8, 32, 64), (2, 32, 64))
    assert out["hsdp"]["shapes"]["w1"] == ((8, 32, 64), (4, 32, 64))
    assert out["ep2-op"]["shapes"]["w1"] == ((8, 32, 64), (2, 32, 64))
    for name in cfgs:
        _same(out[name], ref)


@pytest.mark.timeout(300)
def test_ep2_with_recompute_and_with_bf16_trains_as_one_process() -> None:
    # A shared expert runs after the routed ones: the recomputed forward goes on past the counting (without
    # one, recompute stops once the last saved tensor is back, before the block would count again).
    ref = _reference(2, shared=SHARED, capacity=CAPACITY, fp32=[], bf16=["train.precision=bf16"])
    recompute = {"full": ("full", SHARED), "op": ("op", []), "selective": ("selective", CAPACITY)}
    cfgs = {name: parity_config(*BASE, *EP2, *extra, f"parallel.activation_checkpointing={mode}")
            for name, (mode, extra) in recompute.items()}
    cfgs["bf16"] = parity_config(*BASE, *EP2, "train.precision=bf16")
    out = run_ranks(moe_layouts_job, 2, cfgs, timeout_s=240)[0]
    _same(out["full"], ref["shared"])
    _same(out["op"], ref["fp32"])
    _same(out["selective"], ref["capacity"])
    assert out["selective"]["dropped"] > 0
    assert _close(out["bf16"]["losses"], ref["bf16"]["losses"]) <= 1e-3
    assert _close(out["bf16"]["losses"], ref["fp32"]["losses"]) > 0  # bf16 did compute in bf16


@pytest.fixture
def inductor_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """The inductor cache of tests/test_compile.py (ranks inherit the environment)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / "meshfit-tests-inductor"))


@pytest.mark.timeout(600)
def test_compiled_moe_blocks_with_and_without_ep_train_as_one_eager_process(inductor_cache: None) -> None:
    ref = _reference(2, plain=[])["plain"]
    cfgs = {"compiled": parity_config(*BASE, *EP2, "train.compile=true"),
            "compiled-ep1": parity_config(*BASE, "parallel.dp_shard=2", "train.compile=true"),
            "compiled-full": parity_config(*BASE, *EP2, "train.compile=true",
                                           "parallel.activation_checkpointing=full"),
            "compiled-op": parity_config(*BASE, *EP2, "train.compile=true", "parallel.activation_checkpointing=op")}
    out = run_ranks(moe_layouts_job, 2, cfgs, timeout_s=540)[0]
    for name in cfgs:
        assert out[name]["compiled"] == 2  # tiny-moe's two blocks, the MoE one included
        _same(out[name], ref)
