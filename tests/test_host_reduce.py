"""FSDP2's reduce-scatters issued in the background on CPU ranks (parallel/host_reduce.py).

The same micro-batches through the same layout, once with the collectives asynchronous and once blocking,
must give bit-identical gradients; the asynchronous run must really have had a collective in flight when
each reducing backward returned.
"""

import pytest

from dist_jobs import parity_config
from meshfit.testing import run_ranks

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]


def grads_job(cfg_dict, asynchronous):
    from meshfit.config import config_from_dict
    from meshfit.parallel.data_parallel import set_micro_batch
    from meshfit.train.dist import init_distributed
    from meshfit.train.loss import lm_loss
    from meshfit.train.trainer import build_run

    cfg = config_from_dict(cfg_dict)
    run = build_run(cfg, init_distributed("cpu"), None)
    comm = run.host_reduce
    if comm is None:
        return None
    inputs, targets = run.batches.next_batch()
    micro, n = run.shape.micro_batch, run.shape.accum_steps
    in_flight = []
    for i, (x, y) in enumerate(zip(inputs.split(micro), targets.split(micro), strict=True)):
        set_micro_batch(run.model, run.shape.zero_stage, last=i == n - 1)
        comm.begin(enabled=asynchronous)
        (lm_loss(run.model(x), y, run.shape.model.vocab_size) / n).backward()
        in_flight.append(len(comm.pending))
        comm.finish()
        assert not comm.pending and not comm.aside
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
        assert none_in_flight == [0, 0, 0, 0]


@pytest.mark.parametrize("overrides", [
    ["parallel.dp_replicate=2", "parallel.dp_shard=1"],  # DDP
    ["parallel.dp_shard=2", "parallel.zero_stage=1", "parallel.mixed_precision=true"],  # bf16 reduce, cast
])
def test_not_installed_where_fsdp_reads_the_shard_at_once(overrides):
    assert run_ranks(grads_job, 2, parity_config(*overrides), True) == [None, None]
