"""The planner's per-rank peak within 5% of `meshfit verify` (the real code, fake tensors) per layout kind.

Real multi-process CPU runs are compared in tests/test_demo.py (every demo layout within 10%) and in
benchmarks/planner/plan_accuracy.py (the table in docs/planner.md).
"""

import dataclasses

import pytest

from meshfit.dryrun.verify import verify_layout
from meshfit.layout.layout import Layout, Workload
from meshfit.models.presets import get_preset
from meshfit.planner.memory.estimate import estimate_memory

# The `small` preset with a larger vocabulary, so that the logits weigh as they do in real models.
MODEL = dataclasses.replace(get_preset("small"), vocab_size=8192, max_seq_len=1024)
FP32 = Workload(seq_len=128, global_batch=8, precision="fp32")
MIXED = Workload(seq_len=128, global_batch=8, precision="mixed")
GPT = dataclasses.replace(get_preset("small-gpt"), vocab_size=8192, max_seq_len=1024)
# Half the batch where a layout's micro-batches add nothing new past the second (fewer steps to dry-run).
FP32_4 = dataclasses.replace(FP32, global_batch=4)
MIXED_4 = dataclasses.replace(MIXED, global_batch=4)
EAGER = Workload(seq_len=128, global_batch=4, precision="mixed", attention="eager", dropout=0.1)
# Long sequences, where activations and the logits outweigh the model states (a dry run costs the same:
# fake tensors hold no data). Recompute policies are checked here, where what they drop decides the peak.
LONG = dataclasses.replace(MIXED, seq_len=1024)
EAGER_LONG = dataclasses.replace(EAGER, seq_len=1024)

KINDS = {
    "ddp": (Layout(dp_replicate=4), FP32),
    "zero1": (Layout(dp_shard=4, zero_stage=1), MIXED),
    "zero1-tp": (Layout(dp_shard=2, tp=2, zero_stage=1, sp=True), MIXED_4),
    "zero2": (Layout(dp_shard=4, zero_stage=2), MIXED),
    "zero3": (Layout(dp_shard=8, zero_stage=3), MIXED),
    "zero3-ac": (Layout(dp_shard=8, zero_stage=3, activation_checkpointing="full"), FP32),
    "hsdp": (Layout(dp_replicate=2, dp_shard=4, zero_stage=3), FP32),
    "tp-sp": (Layout(tp=2, sp=True, loss_parallel=True, micro_batch=2), FP32_4),
    "fsdp-tp": (Layout(dp_shard=4, tp=2, zero_stage=3, sp=True, loss_parallel=True), MIXED),
    "pp-1f1b": (Layout(pp=2, schedule="1f1b"), FP32_4),
    "pp-fsdp": (Layout(pp=2, dp_shard=2, zero_stage=3, schedule="1f1b"), MIXED_4),
    # Pipelines at m = p, 4p and 16p micro-batches (their peak no longer grows with m past the warm-up).
    "pp-1f1b-p": (Layout(pp=2, schedule="1f1b", micro_batch=2), FP32_4),
    "pp-interleaved-4p": (Layout(pp=2, schedule="interleaved-1f1b", virtual_stages=2), FP32),
    "pp-1f1b-16p": (Layout(pp=2, schedule="1f1b"), dataclasses.replace(FP32, global_batch=32)),
    # Mixed precision without sharding (one rank: tests/test_verify.py): 16-bit activations too.
    "ddp-mixed": (Layout(dp_replicate=4), MIXED),
    "tp-mixed": (Layout(tp=2, micro_batch=2), MIXED_4),
    "zero2-op-long": (Layout(dp_shard=4, zero_stage=2, activation_checkpointing="op", micro_batch=2), LONG),
    "fsdp-tp-long": (Layout(dp_shard=4, tp=2, zero_stage=3, sp=True, loss_parallel=True, micro_batch=2), LONG),
    # Pipelined ZeRO-3 under TP (its two peaks, the first stage's fp32 embedding gradient); full recompute
    # at a long sequence in mixed precision (the logits held through backward, the blocks' temporaries);
    # zbv's split backward.
    "pp-fsdp-tp": (Layout(pp=2, dp_shard=2, tp=2, zero_stage=3, sp=True), MIXED),
    # ... in fp32: the all-gathers' outputs next to the weights at a backward's start, and the embedding's
    # kept gradient copy.
    "pp-fsdp-tp-fp32": (Layout(pp=2, dp_shard=2, tp=2, zero_stage=3, sp=True, loss_parallel=True), FP32),
    "zero3-ac-long": (Layout(dp_shard=2, zero_stage=3, activation_checkpointing="full", micro_batch=1), LONG),
    "pp-zbv": (Layout(pp=2, schedule="zbv", virtual_stages=2, micro_batch=1), FP32),
    # zbv's weight-gradient step under full recompute, where the peak is (`small` at seq 2048).
    "pp-zbv-ac-long": (Layout(pp=2, schedule="zbv", virtual_stages=2, micro_batch=1, activation_checkpointing="full"),
                       Workload(seq_len=2048, global_batch=2, precision="fp32"),
                       dataclasses.replace(get_preset("small"), max_seq_len=2048)),
    # ... with every other block recomputed (two blocks per stage), 4 micro-batches: kept and recomputed
    # blocks of split micro-batches side by side.
    "pp-zbv-selective-long": (Layout(pp=2, schedule="zbv", virtual_stages=2, micro_batch=1,
                                     activation_checkpointing="selective"),
                              Workload(seq_len=2048, global_batch=4, precision="fp32"),
                              dataclasses.replace(get_preset("small"), max_seq_len=2048, n_layers=8)),
    # The other split-backward schedules under recompute: their own orders of split micro-batches, the same
    # weight-gradient steps.
    "pp-interleaved-zb-ac": (Layout(pp=2, schedule="interleaved-zb", virtual_stages=2, micro_batch=1,
                                    activation_checkpointing="full"),
                             Workload(seq_len=512, global_batch=4, precision="fp32"),
                             dataclasses.replace(get_preset("small"), n_layers=8)),
    "pp-dualpipev-ac": (Layout(pp=2, schedule="dualpipev", virtual_stages=2, micro_batch=1,
                               activation_checkpointing="full"),
                        Workload(seq_len=512, global_batch=4, precision="fp32"),
                        dataclasses.replace(get_preset("small"), n_layers=8)),
    # An interleaved rank's stages accumulate and reduce their gradients at different times (m = p).
    "pp-interleaved-fsdp": (Layout(pp=2, dp_shard=2, zero_stage=3, schedule="interleaved-1f1b", virtual_stages=2,
                                   micro_batch=1), MIXED_4),
    "gpt-eager": (Layout(tp=2, sp=True, loss_parallel=True, micro_batch=2), EAGER, GPT),
    # Pipelined replicas of 16-bit weight copies under TP: the first stage's embedding gradient held
    # full-vocabulary in fp32, its dropout masks per micro-batch in flight.
    "pp-tp-gpt-mixed": (Layout(pp=2, tp=2, sp=True, loss_parallel=True, micro_batch=1), EAGER,
                        dataclasses.replace(GPT, tie_embeddings=False)),
    "gpt-eager-attention-long": (Layout(tp=2, sp=True, loss_parallel=True, micro_batch=2,
                                        activation_checkpointing="attention"), EAGER_LONG, GPT),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", list(KINDS))
def test_prediction_within_5_percent_of_verify(kind):
    layout, workload, model = (*KINDS[kind], MODEL)[:3]
    predicted = estimate_memory(model, layout, workload).as_dict()["total"]
    measured = verify_layout(model, layout, workload).measured["total"]
    assert predicted == pytest.approx(measured, rel=0.05), (kind, predicted, measured)
