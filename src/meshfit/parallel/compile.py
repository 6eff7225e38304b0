"""`train.compile`: torch.compile per transformer block, and what it cost.

Each block (after tensor parallelism and recompute wrapping, before FSDP) is compiled in place with
``nn.Module.compile(fullgraph=True)``, as torchtitan does: the blocks repeat, so dynamo traces one and
reuses the code for the others, and compiling in place keeps every parameter name (checkpoints and
initialization see the plain names). The embedding, final norm, head and loss stay eager. A
Mixture-of-Experts block is compiled without fullgraph: its routed part (router, dispatch, experts, combine)
runs eagerly between two graphs (models/moe.py says why), attention, norms and shared experts compiled. Compilation
happens lazily, in the first forward and backward that run each graph; `compile_seconds` reads torch's own
cumulative compile-time counter so the trainer can report it and keep those steps out of step-time figures.

On CPU inductor generates C++ and needs a working C++ compiler (``g++`` or ``$CXX``); `toolchain_error`
names what is missing before any rank starts.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from meshfit.models.moe import MoE
from meshfit.parallel.fsdp_units import sub_units


def apply_compile(model: nn.Module, max_unit_params: int | None = None) -> int:
    """Compile every block of ``model.layers`` in place; returns how many modules were compiled.

    A block that FSDP shards as smaller units (parallel/fsdp_units.py) is compiled unit by unit instead: dynamo
    cannot trace into an FSDP unit nested inside a compiled module. Units that are one of torch's own
    modules (a lone projection: one matmul, nothing to fuse) and the code between the units (norms,
    residual adds) stay eager."""
    compiled = 0
    for block in model.layers.values():
        units = sub_units(block, max_unit_params)
        for module in [u for u in units if not type(u).__module__.startswith("torch.")] if units else [block]:
            # fullgraph: a graph break inside would split it silently into eager pieces; fail instead. A
            # Mixture-of-Experts block breaks on purpose around its routed part (models/moe.py), which runs
            # eagerly, so it cannot ask for one whole graph.
            module.compile(fullgraph=not any(isinstance(m, MoE) for m in module.modules()))
            compiled += 1
    if getattr(model, "tok_embeddings", None) is not None:
        # Registered after tensor parallelism's own output hook, so it sees what the first block gets.
        model.tok_embeddings.register_forward_hook(_own_storage)
    return compiled


def _own_storage(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel embedding hands the first block a view of its DTensor's local shard (to_local).
    A compiled block given such a view as input returns its gradient to the embedding's redistribution
    as a plain tensor, which fails in backward (torch 2.13, gloo, tp=2); a copy of its own avoids that."""
    return output.clone() if isinstance(output, torch.Tensor) and output._is_view() else output


def compile_seconds() -> float:
    """Seconds this process has spent compiling (forward and backward graphs), by torch's own counter."""
    from torch._dynamo.utils import calculate_time_spent

    return float(calculate_time_spent().get("total_wall_time", 0.0))


def toolchain_error(device_type: str) -> str | None:
    """Why torch.compile cannot build kernels for ``device_type`` here, or None when it can."""
    if device_type != "cpu":
        return None
    from torch._inductor import config, exc
    from torch._inductor.cpp_builder import cpp_compiler_search

    search = tuple(config.cpp.cxx) if isinstance(config.cpp.cxx, (list, tuple)) else (config.cpp.cxx,)
    try:
        cpp_compiler_search(search)
    except exc.InvalidCxxCompiler:
        tried = ", ".join(c for c in search if c) or "g++"
        return (f"train.compile=true on CPU needs a C++ compiler for torch's inductor backend, and none works "
                f"here (tried {tried}); install one (e.g. `apt-get install g++`) or point $CXX at one, or set "
                "train.compile=false")
    return None


def compiled_blocks(model: nn.Module) -> int:
    """How many modules of ``model`` (or of a pipeline's stage list) run through torch.compile."""
    return sum(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())


def eager_blocks(eager: bool) -> contextlib.AbstractContextManager:
    """Run compiled blocks eagerly inside this context when ``eager`` (torch.compile refuses to trace
    under a TorchDispatchMode such as the memory tracker)."""
    return torch.compiler.set_stance("force_eager") if eager else contextlib.nullcontext()
