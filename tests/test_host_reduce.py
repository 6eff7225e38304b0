"""FSDP2's reduce-scatters issued in the background on CPU ranks (parallel/host_reduce.py).

The same micro-batches through the same layout, once with the collectives asynchronous and once blocking,
must give bit-identical gradients; the asynchronous run must really have had a collective in flight when
each reducing backward returned.
"""

import pytest

from dist_jobs import parity_config
from meshfit.testing import run_ranks

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]


def grads_job(cfg_dict, background):
    """One step's gradients through the trainer's own micro-steps, and how many collectives were still in
    flight as each micro-batch's backward returned (None: no background reduce-scatter installed)."""
    from meshfit.config import config_from_dict
    from meshfit.train import trainer
    from meshfit.train.dist import init_distributed

    if not background:  # the blocking call throughout: FSDP2's own reduce-scatter
        trainer.reduces_in_background = lambda *args: False
    run = trainer.build_run(config_from_dict(cfg_dict), init_distributed("cpu"), None)
    if background and run.host_reduce is None:
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
    for i, (x, y) in enumerate(zip(inputs.split(micro), targets.split(micro), strict=True)):
        trainer._micro_step(run, x, y, sync=i == n - 1)
    # Returned by value (tensors would travel as shared memory of a process that has exited).
    grads = {name: p.grad.to_local().flatten().tolist() for name, p in run.model.named_parameters()}
    return grads, in_flight


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_background_reduce_scatter_gives_the_blocking_gradients(stage):
    # Four micro-batches per rank: stages 2 and 3 add three reduced shards into earlier ones.
    cfg = parity_config("parallel.dp_shard=2", f"parallel.zero_stage={stage}", "train.micro_batch=1")
    background = run_ranks(grads_job, 2, cfg, True)
    blocking = run_ranks(grads_job, 2, cfg, False)
    for (bg, in_flight), (bl, none_in_flight) in zip(background, blocking, strict=True):
        assert bg.keys() == bl.keys()
        for name in bg:
            assert bg[name] == bl[name], name
        # Stage 1 reduces once, after the last micro-batch; stages 2 and 3 after every one. The last unit's
        # collective (the root's) is still running when backward returns.
        assert in_flight == ([0, 0, 0, 1] if stage == 1 else [1, 1, 1, 1])
        assert none_in_flight == []


def test_zero2_mixed_precision_stash_micro_batches_block():
    # The bf16 stash reads each shard as FSDP2 sets it: the micro-batches it takes reduce blocking, the last
    # one in the background; the gradients match the blocking run's to the bit.
    cfg = parity_config("parallel.dp_shard=2", "parallel.zero_stage=2", "train.micro_batch=1",
                        "parallel.mixed_precision=true")
    background = run_ranks(grads_job, 2, cfg, True)
    blocking = run_ranks(grads_job, 2, cfg, False)
    for (bg, in_flight), (bl, _) in zip(background, blocking, strict=True):
        assert bg == bl
        assert in_flight == [0, 0, 0, 1]


@pytest.mark.parametrize("overrides", [
    ["parallel.dp_replicate=2", "parallel.dp_shard=1"],  # DDP
    ["parallel.dp_shard=2", "parallel.zero_stage=1", "parallel.mixed_precision=true"],  # bf16 reduce, cast
])
def test_not_installed_where_fsdp_reads_the_shard_at_once(overrides):
    assert run_ranks(grads_job, 2, parity_config(*overrides), True) == [None, None]
