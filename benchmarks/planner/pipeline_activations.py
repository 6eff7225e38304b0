"""A 1F1B first stage's activations, with and without sequence parallelism: plan, Korthikanti et al., dry run.

    python benchmarks/planner/pipeline_activations.py [--microbatches 64] [--dry-run [--dry-microbatches 16]]

GPT-3 175B shapes (hidden 12,288, 96 layers, 96 heads, vocabulary 51,200, untied as pipelines train it),
TP 8 × PP 8, 1F1B, seq 2048, eager attention, dropout 0.1, micro-batch 1, mixed precision. Printed per
layout (GiB):

* Korthikanti: the first stage's count, p micro-batches of L/p layers (planner/memory/formulas.py:
  sbh·(10 + 24/t + 5as/(ht)) per layer without SP, sbh·(34 + 5as/h)/t with it) plus the embedding's
  dropout masks (sbh·p, divided by t under SP as Megatron splits them);
* plan peak: the most activation bytes at any phase of the first stage (`MemoryEstimate.activation_peak`),
  and its ratio to Korthikanti's count;
* plan at total: the activations where the stage's total peaks (`MemoryEstimate.activations`), its phase
  and ratio. Under SP the total peaks at a steady backward's end, the stage's units all gathered (torch's
  PipelineStage defers their re-sharding to the step's last backward) and one micro-batch fewer in flight:
  a block's gathered 16-bit weights (24h²/t bytes) outweigh one micro-batch's activations of it.

With ``--dry-run`` rank 0 runs under `meshfit verify` (dryrun/verify.py, fake tensors, ~1-2 minutes a
layout): its step peak next to the plan's total; there, its activations next to the plan's gradients and
activations (its pipeline tracker counts FSDP's unsharded gradient accumulators and the embedding's
full-vocabulary gradient as activations; its buffers are the stage's gathered 16-bit weights); and its activations when the first backward of the last step begins (p micro-batches in flight, no
gradient yet: what Korthikanti count) next to the plan's peak.
"""

from __future__ import annotations

import argparse

from meshfit.layout.layout import Layout, Workload
from meshfit.models.config import ModelConfig
from meshfit.planner.memory.estimate import MemoryEstimate, estimate_memory
from meshfit.planner.memory.formulas import activation_bytes_per_layer

GIB = 2**30
MODEL = ModelConfig(family="gpt", dim=12288, n_layers=96, n_heads=96, n_kv_heads=96, vocab_size=51200,
                    ffn_hidden=4 * 12288, max_seq_len=2048, tie_embeddings=False)
SEQ, TP, PP = 2048, 8, 8


def layout(sp: bool) -> Layout:
    return Layout(tp=TP, pp=PP, sp=sp, schedule="1f1b", micro_batch=1, loss_parallel=True)


def workload(microbatches: int) -> Workload:
    return Workload(seq_len=SEQ, global_batch=microbatches, attention="eager", dropout=0.1)


def korthikanti_first_stage(sp: bool) -> float:
    """Bytes of the first stage's activations by Korthikanti et al.: p micro-batches of L/p layers each,
    and the embedding's dropout mask per micro-batch."""
    per_layer = activation_bytes_per_layer(s=SEQ, b=1, h=MODEL.dim, a=MODEL.n_heads, t=TP, sp=sp)
    embedding_mask = SEQ * MODEL.dim / (TP if sp else 1)
    return PP * (MODEL.n_layers // PP * per_layer + embedding_mask)


def follow_first_backwards() -> dict[str, float]:
    """From now on, records the tracker's activations as each step's first backward begins (the last
    step's stays) in the dict returned."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from meshfit.memory.tracker import PipelineMemTracker
    from meshfit.parallel.pipeline_memory import LeanStage

    seen: dict[str, float] = {}
    plain = LeanStage.backward_one_chunk

    def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        if bwd_chunk_id == 0:
            tracker = next(m for m in _get_current_dispatch_mode_stack() if isinstance(m, PipelineMemTracker))
            seen["activations"] = tracker.current()["activations"]
        return plain(self, bwd_chunk_id, *args, **kwargs)

    LeanStage.backward_one_chunk = backward_one_chunk
    return seen


def plan_row(sp: bool, est: MemoryEstimate) -> str:
    kor = korthikanti_first_stage(sp)
    return (f"{'TP 8 + SP' if sp else 'TP 8':10s} | Korthikanti {kor / GIB:6.2f} | plan peak "
            f"{est.activation_peak / GIB:6.2f} ({est.activation_peak / kor - 1:+6.1%}) | plan at total "
            f"{est.activations / GIB:6.2f} ({est.activations / kor - 1:+6.1%}, {est.phase}, rank {est.pp_rank})")


def dry_row(sp: bool, microbatches: int, seen: dict[str, float]) -> str:
    from meshfit.dryrun.verify import verify_layout

    est = estimate_memory(MODEL, layout(sp), workload(microbatches))
    result = verify_layout(MODEL, layout(sp), workload(microbatches), rank=0)
    dry = result.measured
    return (f"{'TP 8 + SP' if sp else 'TP 8':10s} | m {microbatches} | total: plan {est.total / GIB:6.2f} dry run "
            f"{dry['total'] / GIB:6.2f} ({est.total / dry['total'] - 1:+5.1%}) | there, gradients and activations: "
            f"plan {(est.grads + est.activations) / GIB:6.2f} dry run {dry['activations'] / GIB:6.2f} | p micro-batches: plan peak {est.activation_peak / GIB:6.2f} "
            f"dry run {seen['activations'] / GIB:6.2f} ({est.activation_peak / seen['activations'] - 1:+5.1%}) "
            f"| {result.wall_s:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--microbatches", type=int, default=64)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--dry-microbatches", type=int, default=16)
    args = parser.parse_args()
    print(f"GPT-3 175B shapes, TP {TP} × PP {PP} 1F1B, seq {SEQ}, eager, dropout 0.1, micro-batch 1, "
          f"{args.microbatches} micro-batches; first stage, GiB")
    for sp in (False, True):
        print(plan_row(sp, estimate_memory(MODEL, layout(sp), workload(args.microbatches))), flush=True)
    if args.dry_run:
        print("against `meshfit verify`, rank 0, GiB")
        seen = follow_first_backwards()
        for sp in (False, True):
            print(dry_row(sp, args.dry_microbatches, seen), flush=True)


if __name__ == "__main__":
    main()
