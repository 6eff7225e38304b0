"""One rank of a large world, in this process: a fake process group, fake tensors, and stand-ins for peers.

`fake_world(world, rank)` initializes torch's fake process group (collectives return at once and move no
data) and yields a `FakeTensorMode` (tensors carry shapes, dtypes and storage sizes, but no data). Real
training code then runs unchanged for that rank, except where torch reads data that another rank would
have sent or that only exists on real tensors; for those few places this module answers the way the real
peers and kernels would (what is replaced and why is documented at each function). None of them allocates
differently from a real run, so memory trackers see a real step's allocations. They rely on torch 2.13's
private pieces (DTensor's sharding propagator and caches, DDP's module helpers, the pipelining stage
protocol).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode


@contextlib.contextmanager
def fake_world(world: int, rank: int) -> Iterator[Any]:
    """Fake process group of `world` ranks as global rank `rank`; yields the FakeTensorMode to use.

    The group is destroyed, every patch undone and DTensor's caches of this world's meshes dropped on exit,
    so the process can run another dry run (of another rank or world size) or a real run.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a dry run needs a process without a process group (one is already initialized)")
    _forget_device_meshes()  # meshes of an earlier (real) world in this process
    # init_process_group wraps sys.excepthook to prefix "[rank<N>]" and nothing unwraps it: restored below,
    # or each dry run would add a prefix of its own to every later uncaught error of this process.
    excepthook = sys.excepthook
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        with (_isolated_sharding_propagation(), _ddp_without_start_up_checks(),
              _lower_right_attention_as_on_a_gpu()):
            yield FakeTensorMode(allow_non_fake_inputs=True)
    finally:
        dist.destroy_process_group()
        sys.excepthook = excepthook
        _forget_device_meshes()


def _forget_device_meshes() -> None:
    """Empty DTensor's process-wide caches, whose entries hold the DeviceMesh objects of the world that
    filled them.

    A DeviceMesh hashes and compares by its shape, dimension names and global ranks only, not by its
    process groups, so a mesh of the next world (same layout, or another rank's mesh of the same shape)
    hits the entries of the previous one. The sharding propagation then returns output specs that carry
    the old mesh: the op's output DTensor lives on it, and its next collective (e.g. a sequence-parallel
    all-gather in PrepareModuleInput) resolves the old mesh's process-group name in the new world, where
    it names no group ("Could not resolve the process group") or, by coincidence of numbering, another
    one. Emptying them also frees the old world (meshes, groups), which these entries would keep alive.
    """
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor._redistribute import _gen_transform_infos, clear_redistribute_planner_cache
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    # Op -> output specs: the dispatcher's C++ fast path, and the Python cache of this (the dry run's) thread.
    _clear_sharding_prop_cache()
    ShardingPropagator._propagate_tensor_meta_cached.cache_clear()  # keyed on op schemas (with meshes)
    _gen_transform_infos.cache_clear()  # redistribute steps; flattened steps carry their own mesh
    clear_redistribute_planner_cache()  # redistribute planners, keyed on (and holding) a mesh
    MeshTopoInfo.build_from_mesh.cache_clear()  # per-mesh communication cost model


def stand_in_for_peers(run: Any) -> None:
    """Adapt a built run (meshfit.train.trainer.Run) to a world whose other ranks are not there."""
    from torch.nn.parallel import DistributedDataParallel

    for module in run.model.modules():  # the model, or each pipeline stage
        if isinstance(module, DistributedDataParallel):
            _fake_ddp_reduction(module)
    if run.pipe is not None:
        _stand_in_for_pipeline_peers(run)
    _route_balanced(run.model)


def _route_balanced(model: Any) -> None:
    """Mixture-of-Experts routers route round-robin (models/moe.py's ``Router.balanced``): fake tensors hold
    no scores to choose by, and expert parallelism's split sizes must be known on the host. Every expert
    then gets the same share of the tokens, as published MoE benchmarks force it (the planner's default,
    ``--moe-imbalance 1``)."""
    from meshfit.models.moe import Router

    for module in model.modules():
        if isinstance(module, Router):
            module.balanced = True


@contextlib.contextmanager
def _isolated_sharding_propagation() -> Iterator[None]:
    """Keep DTensor's output-shape propagation out of the memory tracker, as in a real run.

    DTensor computes an op's global output shape by running it on global-shape fake tensors, under the
    active fake mode when there is one (and uncached while a fake mode is active). In a real run that is a
    private fake mode that the tracker ignores; in a dry run it is the run's own mode, and the tracker would
    count global-size temporaries (seen: a first AdamW step at five times its real size). With no mode
    active the propagation gets a private fake mode again.
    """
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.utils._python_dispatch import _disable_current_modes

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def isolated(self: Any, op_schema: Any) -> Any:
        with _disable_current_modes():
            return original(self, op_schema)

    ShardingPropagator._propagate_tensor_meta_non_cached = isolated
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original


@contextlib.contextmanager
def _ddp_without_start_up_checks() -> Iterator[None]:
    """DDP's constructor compares parameter shapes across ranks and broadcasts rank 0's weights, in C++
    code that reads tensor data (which fake tensors lack). Both only move data between identical replicas
    before training starts (outside any tracked step), so the dry run skips them."""
    import torch.nn.parallel.distributed as ddp_module

    names = ("_verify_param_shape_across_processes", "_sync_module_states")
    saved = {name: getattr(ddp_module, name) for name in names}
    for name in names:
        setattr(ddp_module, name, lambda *args, **kwargs: None)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(ddp_module, name, value)


@contextlib.contextmanager
def _lower_right_attention_as_on_a_gpu() -> Iterator[None]:
    """Context parallelism's query chunks attend to a prefix of the gathered keys under torch's lower-right
    causal bias (models/layers.py). A GPU runs it in 16 bits in a fused kernel without a mask (flash
    attention's causal mode ends the diagonal at the last key; it keeps its output and a log-sum-exp; the
    dry run assumes the same in fp32, where torch picks another kernel), while torch's
    CPU path materializes the mask as an additive queries × keys tensor that the CPU kernel keeps for
    backward. The dry run counts what a GPU rank holds (as it does for offload), so here it runs the fused
    kernel's op, whose meta function sizes the output and log-sum-exp on the fake CPU tensors."""
    from torch.nn.attention.bias import CausalBias, CausalVariant

    original = CausalBias.__dict__["_dispatch"]

    def dispatch(query: Any, key: Any, value: Any, attn_mask: Any, dropout_p: float = 0.0,
                 is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> Any:
        if attn_mask.variant != CausalVariant.LOWER_RIGHT or attn_mask.seq_len_q == attn_mask.seq_len_kv:
            return original.__func__(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal=True,
                                                                  scale=scale)[0]

    CausalBias._dispatch = staticmethod(dispatch)
    try:
        yield
    finally:
        CausalBias._dispatch = original


class _RealIntegerOps(TorchDispatchMode):
    """Runs ops on plain integer tensors for real: DDP's one-time bucket rebuild (step 2) broadcasts the
    new bucket layout as int32 tensors that C++ code then reads. Float tensors (the buckets) stay fake."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
        from torch.utils._pytree import tree_leaves

        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        dtypes = [t.dtype for t in tensors] or [kwargs.get("dtype")]
        real = not any(isinstance(t, FakeTensor) for t in tensors) and all(
            d is not None and not d.is_floating_point and not d.is_complex for d in dtypes)
        if real:
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def _fake_ddp_reduction(model: Any) -> None:
    """DDP's own all-reduce reads the fake group's result, which is empty. The hook below does what the
    built-in one does to the bucket in memory (divide in place, all-reduce in place) and hands the bucket
    back; the bucket rebuild before step 2's forward runs its integer bookkeeping for real."""
    world = dist.get_world_size(model.process_group)

    def all_reduce(state, bucket):  # unannotated: DDP checks the annotations, which would be strings here
        buffer = bucket.buffer().div_(world)
        dist.all_reduce(buffer, group=model.process_group)
        future = torch.futures.Future()
        future.set_result(buffer)
        return future

    model.register_comm_hook(None, all_reduce)
    pre_forward = model._pre_forward

    def pre_forward_with_real_integers(*args: Any, **kwargs: Any) -> Any:
        with _RealIntegerOps():
            return pre_forward(*args, **kwargs)

    model._pre_forward = pre_forward_with_real_integers


def _stand_in_for_pipeline_peers(run: Any) -> None:
    """Answer, in place of the other pipeline ranks, what torch's schedule asks them before step 1.

    On its first step a schedule agrees with its peers on how stage shapes are found (a vote read back
    with `.item()`) and exchanges pickled shape metadata with them. Under a fake process group nothing
    arrives, so this rank's stages get the answers the peers would send: the vote that a run without
    static shapes reaches (DYNAMIC: infer shapes by running one micro-batch, as the real run does), the
    activation that a previous stage sends (a non-last stage's output: taken from a stage of this rank
    once it has run, else the residual stream [micro-batch, sequence / cp (/ tp with sp), dim] in the stage
    compute dtype) and the gradient that a next stage sends back (shaped like this stage's output).
    The schedule itself, its sends/receives (into this rank's own buffers) and all compute run unchanged.
    """
    try:
        from torch.distributed.pipelining._utils import (
            InferenceMode,
            _derive_grad_metas,
            _StageBackwardMeta,
            _StageForwardMeta,
            _TensorMeta,
        )
    except ImportError as exc:
        raise RuntimeError(f"a pipeline dry run needs the pipelining internals of torch 2.13 ({exc}); "
                           f"this is torch {torch.__version__}") from None

    schedule = run.pipe.schedule
    stages = list(getattr(schedule, "_stages", None) or [schedule._stage])

    def vote(voters: list[Any], has_backward: bool, p2p_done: bool) -> None:
        for stage in voters:
            stage._inference_mode = InferenceMode.DYNAMIC

    def activation() -> tuple[Any, ...]:
        for stage in stages:
            if not stage.is_last and stage._stage_meta.outputs is not None:
                return stage._stage_meta.outputs
        shape, dim = run.shape, run.cfg.model.resolve().dim
        # This rank's part of the sequence under context parallelism, sequence-split under SP.
        seq = run.cfg.train.seq_len // shape.dims.cp // (shape.dims.tp if run.cfg.parallel.sp else 1)
        micro = shape.local_batch // shape.microbatches
        dtype = torch.bfloat16 if shape.mixed_precision and shape.zero_stage >= 2 else torch.float32
        return (_TensorMeta(shape=torch.Size((micro, seq, dim)), stride=(seq * dim, dim, 1), dtype=dtype,
                            requires_grad=True),)

    def receiver(stage: Any) -> Callable[[int], Any]:
        def recv_meta(src_stage: int) -> Any:
            if src_stage < stage.stage_index:
                return _StageForwardMeta(forward_metas=activation())
            return _StageBackwardMeta(backward_metas=_derive_grad_metas(stage._stage_meta.outputs))
        return recv_meta

    schedule._warmup_p2p = vote
    for stage in stages:
        stage._recv_meta = receiver(stage)
        stage._send_meta = lambda meta, dst_stage: None  # the peer is not there to read it
