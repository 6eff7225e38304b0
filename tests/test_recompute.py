"""What each recompute policy runs again in backward, counted operator by operator on one block."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from meshfit.config import load_config
from meshfit.models import build_model, init_weights
from meshfit.models.layers import RMSNorm
from meshfit.models.moe import MoE
from meshfit.parallel.activation_checkpoint import apply_activation_checkpointing
from meshfit.parallel.expert_parallel import AllToAllDispatcher
from meshfit.train.shape import resolve_run

aten = torch.ops.aten
MATMULS = {"aten.mm.default", "aten.addmm.default", "aten.bmm.default"}
ATTENTION = "aten._scaled_dot_product_flash_attention_for_cpu.default"
# Views and detaches cost no kernel; what remains is what a recompute launches.
FREE = ("aten.view", "aten._unsafe_view", "aten.t.", "aten.transpose", "aten.unsqueeze", "aten.slice",
        "aten.split", "aten.detach", "aten.expand", "aten.permute", "aten.squeeze", "aten.alias")


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _block_ops(preset: str, policy: str) -> tuple[Counter[str], Counter[str]]:
    """Operators of one block's forward and of its backward under `policy`."""
    cfg = load_config(None, [f"model.preset={preset}", "train.seq_len=32", "train.global_batch=2"])
    model_cfg = resolve_run(cfg, 1).model
    model = build_model(model_cfg, "meta")
    if policy != "none":
        apply_activation_checkpointing(model, policy, 1)
    model.to_empty(device="cpu")
    init_weights(model, 0, model_cfg)
    block = next(iter(model.layers.values()))
    x = torch.randn(2, 32, model_cfg.dim, requires_grad=True)
    extra = (model.rope.cos, model.rope.sin) if model_cfg.family == "llama" else ()
    forward, backward = _Count(), _Count()
    with forward:
        out = block(x, *extra)
    with backward:
        out.square().sum().backward()
    return forward.ops, backward.ops


def _recomputed(preset: str, policy: str) -> Counter[str]:
    """Operators that `policy` runs in backward beyond what the same block's backward runs without it."""
    return _block_ops(preset, policy)[1] - _block_ops(preset, "none")[1]


def _kernels(ops: Counter[str]) -> Counter[str]:
    return Counter({op: n for op, n in ops.items() if not op.startswith(FREE)})


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt"])
def test_op_level_recompute_runs_no_matmul_or_attention_again(preset: str) -> None:
    again = _kernels(_recomputed(preset, "op"))
    assert not set(again) & MATMULS and ATTENTION not in again, again
    # The MLP's activation and the other element-wise ops run again: SwiGLU's silu and RoPE's rotation
    # (llama), GELU and LayerNorm (gpt). Llama's RMSNorm recomputes itself in backward under every policy.
    assert again, "op-level recompute runs nothing again"
    expected = {"aten.silu.default", "aten.cat.default", "aten.neg.default"} if preset == "tiny" else \
        {"aten.gelu.default", "aten.native_layer_norm.default"}
    assert expected <= set(again), again
    _, backward = _block_ops(preset, "op")
    norm = "aten.rsqrt.default" if preset == "tiny" else "aten.native_layer_norm.default"
    assert backward[norm] == 2, backward  # both norms of the block, once each
    forward, _ = _block_ops(preset, "none")
    full = _kernels(_recomputed(preset, "full"))
    # Full recompute runs the block's forward again, matmuls and attention included, up to the last tensor
    # the backward needs (torch stops the recompute there: the block's last projection is not run again).
    matmuls = sum(forward[m] for m in MATMULS)
    assert sum(full[m] for m in MATMULS) == matmuls - 1 and full[ATTENTION] == 1, (full, forward)
    assert sum(again.values()) < sum(full.values())


def test_norms_inside_a_recomputed_block_are_not_recomputed_a_second_time() -> None:
    """A block recomputed in backward computes each norm twice (forward, recompute), not three times:
    a norm's own recompute (which saves its input alone when the block keeps its graph) is off there."""
    forward, _ = _block_ops("tiny", "none")
    for policy, runs in (("none", 2), ("op", 2), ("full", 2)):
        fwd, bwd = _block_ops("tiny", policy)
        assert (fwd["aten.rsqrt.default"] + bwd["aten.rsqrt.default"]) == runs * forward["aten.rsqrt.default"], policy
    model_cfg = resolve_run(load_config(None, ["model.preset=tiny"]), 1).model
    model = build_model(model_cfg, "meta")
    apply_activation_checkpointing(model, "selective", 2)
    alone = [m.recompute_alone for block in model.layers.values() for m in block.modules() if isinstance(m, RMSNorm)]
    assert alone == [True, True, False, False], alone  # the second of two blocks is checkpointed whole


EXCHANGE = "_c10d_functional.all_to_all_single.default"


def _moe_exchanges(policy: str) -> tuple[int, int]:
    """Token exchanges (all-to-alls) of tiny-moe's MoE block under expert parallelism over one rank, in its
    forward and in its backward under `policy`."""
    model_cfg = resolve_run(load_config(None, ["model.preset=tiny-moe"]), 1).model
    model = build_model(model_cfg, "meta")
    if policy != "none":
        apply_activation_checkpointing(model, policy, 1)
    model.to_empty(device="cpu")
    init_weights(model, 0, model_cfg)
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        moe.dispatcher = AllToAllDispatcher(dist.group.WORLD)
    block = list(model.layers.values())[1]  # the first block is dense
    x = torch.randn(2, 32, model_cfg.dim, requires_grad=True)
    forward, backward = _Count(), _Count()
    with forward:
        out = block(x, model.rope.cos, model.rope.sin)
    with backward:
        out.square().sum().backward()
    return forward.ops[EXCHANGE], backward.ops[EXCHANGE]


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_op_level_recompute_keeps_the_expert_token_exchange(world_of_one) -> None:
    """Full recompute exchanges the tokens again in backward (dispatch and combine); op-level recompute keeps
    what the exchanges brought, as it keeps every collective's output."""
    sent, kept = _moe_exchanges("none")
    assert sent == 2 and kept > 0  # dispatch and combine; their backward is the reverse exchange
    assert _moe_exchanges("full") == (sent, kept + sent)
    assert _moe_exchanges("op") == (sent, kept)
