"""FSDP2's reduce-scatters on CPU ranks (parallel/host_reduce.py): an all-to-all and a sum, in the background.

The same micro-batches through the same layout, with the collectives asynchronous, blocking, and through
gloo's own reduce-scatter, must give bit-identical gradients on 2 ranks; the asynchronous run must really
have had a collective in flight when each reducing backward returned.
"""

import pytest
from dist_jobs import parity_config

from meshfit.util.ranks import run_ranks

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]


def grads_job(cfg_dict, mode):
    """One step's gradients through the trainer's own micro-steps, and how many collectives were still in
    flight as each micro-batch's backward returned. `mode`: "background" (the layout's default), "blocking"
    (every call blocks) or "gloo" (FSDP2's own call of gloo's reduce-scatter). None: not installed."""
    from meshfit.config import config_from_dict
    from meshfit.train import run as run_module
    from meshfit.train import trainer
    from meshfit.train.dist import init_distributed

    if mode == "blocking":
        run_module.reduces_in_background = lambda *args: False
    elif mode == "gloo":
        run_module.host_reduce_scatter = lambda *args: None
    run = run_module.build_run(config_from_dict(cfg_dict), init_distributed("cpu"), None)
    if mode != "gloo" and run.host_reduce is None:
        return None
    in_flight = []
    if run.host_reduce is not None:
        finish = run.host_reduce.finish

        def counted_finish():
            in_flight.append(len(run.host_reduce.pending))
            finish()
            assert not run.host_reduce.pending and not run.host_reduce.aside

        run.host_reduce.finish = counted_finish
    inputs, targets = run.batches.next_batch()
    micro, n = run.shape.micro_batch, run.shape.accum_steps
    for i, part in enumerate(run.local_batch(inputs, targets).split(micro)):
        trainer._micro_step(run, part, sync=i == n - 1, scale=None)
    # Returned by value (tensors would travel as shared memory of a process that has exited).
    grads = {name: p.grad.to_local().flatten().tolist() for name, p in run.model.named_parameters()}
    return grads, in_flight


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_background_reduce_scatter_gives_the_blocking_gradients(stage):
    # Four micro-batches per rank: stages 2 and 3 add three reduced shards into earlier ones.
    cfg = parity_config("parallel.dp_shard=2", f"parallel.zero_stage={stage}", "train.micro_batch=1")
    background = run_ranks(grads_job, 2, cfg, "background")
    blocking = run_ranks(grads_job, 2, cfg, "blocking")
    native = run_ranks(grads_job, 2, cfg, "gloo")
    for (bg, in_flight), (bl, none_in_flight), (gl, _) in zip(background, blocking, native, strict=True):
        assert bg.keys() == bl.keys() == gl.keys()
        for name in bg:
            assert bg[name] == bl[name] == gl[name], name
        # Stage 1 reduces once, after the last micro-batch; stages 2 and 3 after every one. The last unit's
        # collective (the root's) is still running when backward returns.
        assert in_flight == ([0, 0, 0, 1] if stage == 1 else [1, 1, 1, 1])
        assert none_in_flight == [0, 0, 0, 0]


def test_zero2_mixed_precision_stash_micro_batches_block():
    # The bf16 stash reads each shard as FSDP2 sets it: the micro-batches it takes reduce blocking, the last
    # one in the background; the gradients match the blocking run's to the bit.
    cfg = parity_config("parallel.dp_shard=2", "parallel.zero_stage=2", "train.micro_batch=1",
                        "parallel.mixed_precision=true")
    background = run_ranks(grads_job, 2, cfg, "background")
    native = run_ranks(grads_job, 2, cfg, "gloo")
    for (bg, in_flight), (gl, _) in zip(background, native, strict=True):
        assert bg == gl
        assert in_flight == [0, 0, 0, 1]


def test_not_installed_for_ddp():
    assert run_ranks(grads_job, 2, parity_config("parallel.dp_replicate=2", "parallel.dp_shard=1"),
                     "background") == [None, None]


def test_zero1_mixed_precision_blocks_and_matches_gloo():
    # FSDP2 casts the bf16 reduced shard to fp32 right after the call: it never runs in the background.
    cfg = parity_config("parallel.dp_shard=2", "parallel.zero_stage=1", "train.micro_batch=1",
                        "parallel.mixed_precision=true")
    ours = run_ranks(grads_job, 2, cfg, "background")
    native = run_ranks(grads_job, 2, cfg, "gloo")
    for (grads, in_flight), (gl, _) in zip(ours, native, strict=True):
        assert grads == gl
        assert in_flight == [0, 0, 0, 0]


def collective_job(dtype_name, op_name, numel):
    """reduce_scatter against gloo's reduce_scatter_tensor on rank-dependent data, blocking and async."""
    import warnings

    import torch
    import torch.distributed as dist

    from meshfit.parallel.host_reduce import reduce_scatter

    warnings.filterwarnings("ignore", message=".*is deprecated")
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype, op = getattr(torch, dtype_name), getattr(dist.ReduceOp, op_name)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank)).to(dtype)
    expected, blocking, background = (torch.empty(numel // world, dtype=dtype) for _ in range(3))
    dist.reduce_scatter_tensor(expected, x.clone(), op=op)
    assert reduce_scatter(blocking, x, dist.group.WORLD, op) is None
    reduce_scatter(background, x, dist.group.WORLD, op, async_op=True).wait()
    return [t.float().tolist() for t in (expected, blocking, background)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("op", ["SUM", "AVG"])
def test_all_to_all_reduce_scatter_equals_gloos(dtype, op):
    for expected, blocking, background in run_ranks(collective_job, 2, dtype, op, 6000):
        assert blocking == expected and background == expected


@pytest.mark.parametrize("world, dtype, op", [(4, "float32", "AVG"), (3, "bfloat16", "AVG"), (2, "float32", "MAX")])
def test_all_to_all_reduce_scatter_on_more_ranks_and_other_ops(world, dtype, op):
    # More than two summands: gloo and torch.sum may add them in a different order (bf16 is summed in
    # fp32 here and rounded once). MAX goes to gloo's own call.
    import torch

    tol = {"float32": {}, "bfloat16": {"atol": 2e-2, "rtol": 2e-2}}[dtype]
    for expected, blocking, background in run_ranks(collective_job, world, dtype, op, 6000):
        torch.testing.assert_close(torch.tensor(blocking), torch.tensor(expected), **tol)
        assert background == blocking


def mismatch_job():
    import torch
    import torch.distributed as dist

    from meshfit.parallel.host_reduce import reduce_scatter

    try:
        reduce_scatter(torch.empty(3), torch.ones(8), dist.group.WORLD, dist.ReduceOp.SUM)
    except ValueError as exc:
        return str(exc)
    return None


def test_sizes_that_do_not_match_are_refused():
    # torch.sum(out=) would resize the output silently.
    assert all("needs output × ranks" in str(msg) for msg in run_ranks(mismatch_job, 2))
