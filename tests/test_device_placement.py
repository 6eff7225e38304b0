"""Where a layout puts its tensors on a CUDA rank, checked on this CPU-only build with fake CUDA tensors
(tests/fake_cuda.py): host-offloaded shards next to device-resident buffers and activations, as ZeRO-3 +
CPU offload runs on a GPU."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
from fake_cuda import devices, fake_cuda

from meshfit.config import load_config
from meshfit.dryrun.fake_world import fake_world

CUDA = torch.device("cuda", 0)
BASE = ["model.preset=tiny", "train.seq_len=32", "train.global_batch=2", "train.micro_batch=2",
        "train.device=cpu", "train.peak_flops=1e12"]


@contextlib.contextmanager
def _cuda_world():
    """A fake world of one CUDA rank; yields its FakeTensorMode. FSDP2 allocates its (empty) buffers on
    the mesh's device when it wraps a module, which only a fake mode can do here."""
    import meshfit.parallel.data_parallel as data_parallel

    with fake_cuda(), fake_world(1, 0) as fake:
        wrap = data_parallel.fully_shard

        def fully_shard(*args, **kwargs):
            with fake:
                return wrap(*args, **kwargs)

        with mock.patch.object(data_parallel, "fully_shard", fully_shard):
            yield fake


def _placed(*overrides: str) -> tuple[dict[str, str], dict[str, str]]:
    """Parameter and buffer device types of the layout, built for a CUDA rank; each block's rotation of
    device-resident activations by the model's RoPE tables runs too (a host/device mix raises here as on
    a GPU)."""
    import meshfit.models.init as init
    from meshfit.models import build_model
    from meshfit.parallel.parallelize import parallelize
    from meshfit.train.shape import resolve_run

    cfg = load_config(None, [*BASE, *overrides])
    shape = resolve_run(cfg, 1)
    with _cuda_world() as fake, mock.patch.object(init, "_copy_into", lambda *args: None):
        # Weights stay uninitialised (fake CUDA tensors take no random values); buffers are computed.
        meshes = shape.dims.build_mesh("cuda")
        model = parallelize(build_model(shape.model, "meta"), shape.dims, meshes, shape.model,
                            parallel=cfg.parallel, zero_stage=shape.zero_stage,
                            mixed_precision=shape.mixed_precision, device=CUDA, seed=0, materialize=lambda: fake)
        with fake:  # apply_rope's products (its slicing of the tables needs CUDA's device guard)
            x = torch.empty(model.rope.cos.shape, device=CUDA)
            assert (x * model.rope.cos + x * model.rope.sin).device == CUDA
        return devices(model.named_parameters()), devices(model.named_buffers())


@pytest.mark.parametrize("overrides", [
    ["parallel.zero_stage=3", "parallel.offload=true"],
    ["parallel.zero_stage=3", "parallel.offload=true", "parallel.mixed_precision=true"],
    ["parallel.zero_stage=3", "parallel.offload=true", "parallel.activation_checkpointing=full"],
    ["parallel.zero_stage=2", "parallel.offload=true", "parallel.activation_checkpointing=op"],
], ids=["zero3-offload", "zero3-offload-bf16", "zero3-offload-full-ac", "zero2-offload-op-ac"])
def test_offload_keeps_shards_on_the_host_and_buffers_on_the_device(overrides):
    params, buffers = _placed(*overrides)
    assert params and set(params.values()) == {"cpu"}, params
    # The RoPE tables meet the activations in every block's forward: on the host they failed the first
    # step on a GPU ("found at least two devices, cuda:0 and cpu").
    assert buffers and set(buffers.values()) == {"cuda"}, buffers


# Sharded layouts without offload are not built here: FSDP2 re-shards CUDA parameters in C++ code that
# takes the device guard (fake_cuda.py).
@pytest.mark.parametrize("overrides", [[], ["parallel.activation_checkpointing=op"]], ids=["plain", "op-ac"])
def test_layouts_without_offload_keep_everything_on_the_device(overrides):
    params, buffers = _placed(*overrides)
    assert set(params.values()) == {"cuda"} and set(buffers.values()) == {"cuda"}, (params, buffers)


def test_the_step_after_backward_mixes_no_devices_with_offloaded_states():
    """Loss and vote on the device; parameters, gradients and AdamW states on the host: the gradient
    norm, the vote, clipping and the optimizer step of the trainer, as one offloaded ZeRO-3 step runs them
    after its backward."""
    import meshfit.models.init as init
    from meshfit.train.dist import RankEnv
    from meshfit.train.run import build_run
    from meshfit.train.trainer import _optimizer_step

    cfg = load_config(None, [*BASE, "parallel.zero_stage=3", "parallel.offload=true", "train.grad_clip=1.0"])
    env = RankEnv(rank=0, world_size=1, local_rank=0, device=CUDA)
    with _cuda_world() as fake, mock.patch.object(init, "_copy_into", lambda *args: None):
        run = build_run(cfg, env, None, materialize=lambda: fake)
        with fake:
            params = list(run.model.parameters())
            for p in params:  # FSDP2 leaves each reduced gradient shard beside its parameter shard
                p.grad = torch.empty_like(p)
            losses = [torch.empty((), device=CUDA)]
            grad_norm, vote = _optimizer_step(run, losses, None, tracking=False, read=False)
            states = [t for state in run.optimizer.state.values() for t in state.values() if t.dim()]
        assert vote.values.device == CUDA and grad_norm.device == CUDA
        assert devices((str(i), t) for i, t in enumerate(states)).values() and \
            set(devices((str(i), t) for i, t in enumerate(states)).values()) == {"cpu"}
