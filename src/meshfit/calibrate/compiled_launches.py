"""`meshfit calibrate --model`: the kernels one torch.compile'd block launches, forward + backward.

The time model charges a compiled block's launches at the measured cost per operator (planner/timing/op_count.py).
Rather than assume how inductor fuses the block, this compiles one block of the model's structure (the
shrunken copy op_count counts eager operators on; on `small` a full-size block launched the same 34
kernels) as train.compile does (``nn.Module.compile(fullgraph=True)``, after recompute wrapping), runs one
forward + backward, and counts the calls in the code inductor generated for it: every kernel the module
defines (C++ on CPU, Triton on CUDA) and every extern kernel or aten fallback (matmuls, attention) that
the wrapper calls. The generated code is read through torch's own hook for it (``run_and_get_code``),
which also sees graphs loaded from the inductor cache, so a warm cache (TORCHINDUCTOR_CACHE_DIR) counts the
same without compiling again. ``torch._inductor.metrics.generated_kernel_count`` is no launch count: for
`small`'s block it read 29, cold and warm, where the generated code calls 11 generated kernels (and 23
extern ones it does not count).

Every counted recompute policy is compiled (`small` on 2 cores: 30 s with a cold cache, mostly the first
policy, as the kernels repeat across policies; 10 s warm; --quick compiles the first only). Each count is
divided by the block's eager matmul/attention operators, so the ratio carries over to the planned model's
blocks.
"""

from __future__ import annotations

import re
import sys

from meshfit.hardware.profile import CompiledLaunches
from meshfit.layout.recompute import COUNTED_POLICIES
from meshfit.models.config import ModelConfig
from meshfit.planner.timing.op_count import counting_step, op_counts

_KERNEL_DEF = re.compile(r"^(\w+) = async_compile\.\w+\(", re.M)  # a kernel the generated module builds
_CALL = re.compile(r"^\s*(?:\w+ = )?([\w.]+)\(", re.M)  # a statement that calls something
_EXTERN = ("extern_kernels.", "torch.ops.")  # library kernels (mm, addmm, ...) and aten fallbacks (attention)


def count_launches(source: str) -> int:
    """Kernel calls in one inductor-generated module: its own kernels and extern or fallback calls."""
    kernels = set(_KERNEL_DEF.findall(source))
    return sum(name.startswith(_EXTERN) or name.split(".")[0] in kernels for name in _CALL.findall(source))


def _block_launches(model: ModelConfig, policy: str, device: str) -> int:
    from torch._inductor.utils import run_and_get_code

    net, step = counting_step(model, 1, policy, device)
    for block in net.layers.values():
        block.compile(fullgraph=True)
    _, sources = run_and_get_code(step)
    return sum(count_launches(s) for s in sources)


def compiled_launches(model: ModelConfig, device: str = "cpu", quick: bool = False) -> dict[str, CompiledLaunches]:
    """{policy: launches of one compiled block and its eager heavy operators} (``quick``: without recompute
    only, which the planner then uses for every policy); empty (and why, on stderr) when this machine cannot
    compile."""
    import warnings

    from meshfit.parallel.compile import toolchain_error

    why = toolchain_error(device)
    if why is not None:
        print(f"compiled blocks not counted: {why}", file=sys.stderr)
        return {}
    out: dict[str, CompiledLaunches] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # checkpoint-under-compile advice, meant for model authors
        for policy in ("none",) if quick else COUNTED_POLICIES:
            heavy = op_counts(model, policy).block_heavy
            try:
                launches = _block_launches(model, policy, device)
            except Exception as exc:  # noqa: BLE001 (a compiler failure must not lose the measurement before it)
                last = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
                print(f"compiled blocks not counted under {policy} recompute: {last}", file=sys.stderr)
                continue
            if launches > 0:
                out[policy] = CompiledLaunches(launches=launches, heavy=heavy)
            else:  # a generated-code layout this reader does not know: keep the assumption
                print(f"compiled blocks not counted under {policy} recompute: no kernel calls found in the code "
                      "inductor generated", file=sys.stderr)
    if not out:
        return out
    print("compiled block, kernels launched forward + backward per matmul/attention operator (assumed "
          "before: 2): " + ", ".join(f"{p} {e.launches:.0f}/{e.heavy:.0f} = {e.launches / e.heavy:.2f}"
                                     for p, e in out.items()), file=sys.stderr)
    return out
