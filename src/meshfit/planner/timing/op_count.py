"""Operators a training step dispatches, counted on meshfit's own model code.

Eager PyTorch pays a fixed host-side cost per operator (Python, the dispatcher, autograd's bookkeeping and,
on a GPU, the kernel launch) whatever the tensor sizes, so a small micro-batch runs far below the per-FLOP
rate of a large one. The time model charges ``operators × seconds per operator`` (`meshfit calibrate
--model` measures the latter) on top of the per-token work. The counts come from running the real blocks
once, forward + loss + backward, on CPU tensors of a shrunken copy of the model (same family, heads,
key/value heads, tying and dropout; small sizes) under a TorchDispatchMode that counts every aten call:
views and autograd's detaches included, as they pay the same dispatch. Activation recompute is applied
with meshfit's own wrappers, so a checkpointed block's re-run forward is in its count.

A compiled block (train.compile) runs inductor's fused kernels instead: its count is its heavy operators
(matmuls, attention) × the launches per heavy operator that `meshfit calibrate --model` counts in the code
inductor generates for one block, forward + backward, per recompute policy (calibrate_compile.py; `small`:
34 launches for 23 heavy operators without recompute, 45 for 30 with full recompute). Without such a
profile it is COMPILED_PER_HEAVY × its heavy operators (an extern kernel and one fused element-wise kernel
per heavy operator: assumed).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from meshfit.layout.recompute import COUNTED_POLICIES, rerun_blocks

if TYPE_CHECKING:
    from meshfit.models.config import ModelConfig

# Launches per heavy operator (matmul, attention) of a compiled block when the profile has no measured count:
# the extern kernel and the fused element-wise kernel that follows it (assumed).
COMPILED_PER_HEAVY = 2.0
_SEQ = 16  # tokens per sequence of the counting run (counts do not depend on sizes)


@dataclasses.dataclass(frozen=True)
class OpCounts:
    """Operators of one forward + backward of one sequence batch (any size)."""

    block: float  # one block (its re-run forward under the policy included)
    block_heavy: float  # of which matmuls and attention kernels
    rest: float  # embeddings, final norm, head and loss

    def block_ops(self, compiled: bool, per_heavy: float = COMPILED_PER_HEAVY) -> float:
        return self.block_heavy * per_heavy if compiled else self.block


def _heavy(name: str) -> bool:
    return any(k in name for k in ("mm.", "addmm", "bmm", "scaled_dot_product", "_flash_attention",
                                   "_efficient_attention"))


class _Counter:
    """Counts aten calls (total, heavy) while active; a thin wrapper so torch is imported lazily."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                counter.total += 1
                counter.heavy += _heavy(str(func))
                return func(*args, **(kwargs or {}))

        self.total = 0
        self.heavy = 0
        self.mode = Mode()

    def __enter__(self) -> _Counter:
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.mode.__exit__(*exc)


def count_ops(fn: Any) -> tuple[int, int]:
    """(operators, heavy operators) that calling ``fn()`` dispatches."""
    with _Counter() as c:
        fn()
    return c.total, c.heavy


def shrunk(model: ModelConfig, n_layers: int) -> ModelConfig:
    """``model``'s structure at small sizes (head dim 8, FFN 16, vocabulary 64)."""
    return dataclasses.replace(model, n_layers=n_layers, dim=8 * model.n_heads, ffn_hidden=16, vocab_size=64,
                               max_seq_len=_SEQ, head_dim=None if model.head_dim is None else 8,
                               sliding_window=None if model.sliding_window is None else _SEQ)


def counting_step(model: ModelConfig, n_layers: int, policy: str, device: str = "cpu"
                  ) -> tuple[Any, Callable[[], None]]:
    """meshfit's model of ``model``'s structure at counting sizes (``shrunk``), under the recompute policy,
    and one training step of it (forward, loss, backward on one sequence): what operators and compiled
    launches are counted on."""
    import torch

    from meshfit.models import build_model, init_weights
    from meshfit.models.loss import lm_loss
    from meshfit.parallel.activation_checkpoint import apply_activation_checkpointing

    cfg = shrunk(model, n_layers)
    net = build_model(cfg, "meta")
    net.to_empty(device=device)
    init_weights(net, 0, cfg, None)
    if policy != "none":
        apply_activation_checkpointing(net, policy, 1)
    x = torch.randint(0, cfg.vocab_size, (1, _SEQ), device=device)
    return net, lambda: lm_loss(net(x), x, cfg.vocab_size).backward()


def _step_ops(model: ModelConfig, n_layers: int, policy: str) -> tuple[int, int]:
    return count_ops(counting_step(model, n_layers, policy)[1])


def op_counts(model: ModelConfig, policy: str) -> OpCounts:
    """Operators per block and outside the blocks for ``policy`` (one of COUNTED_POLICIES): the difference
    between the model with two blocks and with one."""
    if policy not in COUNTED_POLICIES:
        raise ValueError(f"policy {policy!r}: counted are {', '.join(COUNTED_POLICIES)}")
    return _counted(shrunk(model, 1), policy)  # one count per structure, whatever the sizes


@functools.lru_cache(maxsize=64)
def _counted(model: ModelConfig, policy: str) -> OpCounts:
    one, one_heavy = _step_ops(model, 1, policy)
    two, two_heavy = _step_ops(model, 2, policy)
    return OpCounts(block=float(two - one), block_heavy=float(two_heavy - one_heavy), rest=float(2 * one - two))


def rank_ops(model: ModelConfig, policy: str, blocks: int, has_rest: bool, compiled: bool,
             per_heavy: Mapping[str, float] | None = None, rerun: int | None = None) -> float:
    """Operators of one micro-batch's forward + backward on a rank holding ``blocks`` blocks (and the
    embeddings/head when ``has_rest``). meshfit's "selective" checkpoints ``rerun`` of them in full (by
    default as one stage: every second block). ``per_heavy``: a compiled block's measured launches per heavy
    operator by policy (a policy not in it takes "none"'s; without any, COMPILED_PER_HEAVY)."""
    ratios = per_heavy or {}

    def block(p: str) -> float:
        return op_counts(model, p).block_ops(compiled, ratios.get(p, ratios.get("none", COMPILED_PER_HEAVY)))

    if policy == "selective":
        full = rerun_blocks((blocks,), policy) if rerun is None else rerun
        ops = full * block("full") + (blocks - full) * block("none")
    else:
        ops = blocks * block(policy)
    return ops + (op_counts(model, "none" if policy == "selective" else policy).rest if has_rest else 0.0)
