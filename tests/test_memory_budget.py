"""The budget error: its overshoot shows whatever the rounding of the sizes, and offloaded bytes are named."""

from torch.distributed._tools.mem_tracker import _TOTAL_KEY

from meshfit.memory.tracker import MemoryBudgetExceeded, fold_snapshot, over_budget_text

MIB = 2**20


def _breakdown(**extra):
    return {"params": 10 * MIB, "grads": 0, "optim": 20 * MIB, "activations": 50 * MIB, "other": 0, **extra}


def test_overshoot_shows_when_sizes_round_alike():
    # 80.0 MiB needed against an 80.0 MiB budget: 1,768 bytes over (the demo's zero1 run).
    exc = MemoryBudgetExceeded(1, "forward", 80 * MIB + 1768, 80 * MIB, _breakdown())
    assert "needed 80.0 MiB (83887848 bytes) but the budget is 80.0 MiB (83886080 bytes), 1.7 KiB over;" \
        in str(exc)
    assert over_budget_text(80 * MIB + 1, 80 * MIB) == "1 B over"
    assert over_budget_text(81 * MIB + MIB // 2, 80 * MIB) == "1.5 MiB over"
    assert "offloaded" not in str(exc)


def test_offloaded_bytes_are_named_in_the_error():
    exc = MemoryBudgetExceeded(0, "backward", 81 * MIB, 80 * MIB, _breakdown(offloaded=30 * MIB))
    assert str(exc).endswith("other 0 B; 30.0 MiB of them offloaded (on CPU ranks host memory is the rank's own, "
                             "so parallel.offload saves none of the budget)")


def test_offloaded_types_stay_in_the_tally():
    # A CPU rank's snapshot under offload: the host-resident types are the rank's own memory.
    snap = {"Sharded Param": 100, "Unsharded Param": 50, "OptState": 200, "Activation": 70, _TOTAL_KEY: 420}
    folded = fold_snapshot(snap, ("Sharded Param", "Sharded Grad", "OptState"))
    assert folded["params"] == 150 and folded["optim"] == 200 and folded["offloaded"] == 300
    assert folded["peak"] == 420
    assert "offloaded" not in fold_snapshot(snap)


def test_a_dry_run_stands_in_for_a_gpu():
    # `meshfit verify` runs on CPU for a GPU rank: what offload keeps on the host is off the device there.
    snap = {"Sharded Param": 100, "Unsharded Param": 50, "OptState": 200, "Activation": 70, _TOTAL_KEY: 420}
    folded = fold_snapshot(snap, ("Sharded Param", "Sharded Grad", "OptState"), apart=True)
    assert folded["params"] == 50 and folded["optim"] == 0 and folded["peak"] == 120
    assert folded["offloaded"] == 300


def test_verify_leaves_offloaded_shards_out():
    from meshfit.dryrun.verify import verify_layout
    from meshfit.layout.layout import Layout, Workload

    layout = Layout(dp_shard=2, zero_stage=3, offload=True, micro_batch=4)
    measured = verify_layout("tiny", layout, Workload(seq_len=32, global_batch=8, precision="fp32")).measured
    # The AdamW states and weight shards live on the host; the gathered weights are on the device.
    assert measured["optim"] == 0 and measured["params"] > 0
    assert measured["total"] == sum(measured[k] for k in ("params", "grads", "optim", "activations", "buffers"))
