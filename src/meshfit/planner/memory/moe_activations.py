"""What a Mixture-of-Experts MLP (models/moe.py) keeps for backward, per token, in bytes.

Counted tensor by tensor from the block's code (each op keeps what its backward reads) and checked with
torch's memory tracker on real blocks on fake tensors (benchmarks/planner/moe_activations.py): Qwen3-30B-A3B
shapes at 4,096 tokens, bf16, balanced routing: 222,232 bytes per token measured for the MLP, 222,036 counted.

* router: its fp32 copy of the input (the gate's matmul keeps it), the fp32 scores (softmax or sigmoid
  keeps its output) and the sum the top-k gates are normalised by;
* per routed copy, at home: the int64 chosen expert, sort order and source token, the fp32 gate before and
  after dropping (and the keep mask), and two fp32 copies of the expert output (the gate product keeps the
  upcast output, index_add its weighted result);
* per routed copy, where its expert is: the copy itself (compute dtype), SwiGLU's four intermediates of
  moe_hidden (gate and up outputs, SiLU output, their product), the row mask, and under expert parallelism
  the two int64 maps that regroup received copies by expert and send the outputs back;
* shared experts: a SwiGLU of moe_shared_experts · moe_hidden, which keeps its input as well.

The most-loaded rank's routed copies at their experts are ``imbalance`` times the balanced share (under
expert parallelism: a rank whose experts are chosen more receives more copies); the home side is always
the rank's own tokens × top_k.

The all-to-all's send buffer is the sorted copies themselves, and what it receives becomes, regrouped by
expert, the kept copy counted above: the received buffer and the sort's one-hot counts are temporaries of
one block's forward (and their gradients of its backward), never alive at the step's peak in the dry runs
measured (benchmarks/planner/moe_plan_accuracy.py), so no term of their own.
"""

from __future__ import annotations

from meshfit.models.config import ModelConfig

# Bytes per routed copy of the small per-copy tensors at home: int64 choice, order and source (3 × 8), the
# fp32 gate and its kept value (2 × 4), the boolean keep mask (1).
_HOME_INDEX_BYTES = 3 * 8 + 2 * 4 + 1
# A measured worst case, kept here with what it was measured on (`--explain` shows it): the largest max / mean
# tokens per expert (`moe_load` in metrics.jsonl) of a real 30-step CPU run of `small-moe` (one process, fp32,
# 8 × 128 tokens a step, auxiliary-loss coefficient 0.01, `meshfit train --set model.preset=small-moe --set
# train.steps=30`): 3.82 at step 6 (layer 2); its last five steps 1.45-1.70. A per-expert figure: a rank that
# holds that expert alone (ep = E) receives it; a rank of several experts averages over them.
MEASURED_IMBALANCE = 3.82
MEASURED_IMBALANCE_NOTE = ("largest max/mean tokens per expert of a 30-step real CPU run of small-moe, fp32, "
                           "1,024 tokens a step, at step 6; 1.45-1.70 in its last five steps")


def rank_imbalance(model: ModelConfig, ep: int, imbalance: float) -> float:
    """The routed-copy factor of the most-loaded rank: ``imbalance``, at most what its E/ep experts can
    receive (each of the ep ranks' tokens sends it at most min(top_k, E/ep) copies); 1 without ep."""
    if ep == 1:
        return 1.0
    k = model.moe_top_k
    return min(imbalance, ep * min(k, model.moe_experts // ep) / k)


def moe_mlp_bytes_per_token(model: ModelConfig, p: int, ep: int = 1, imbalance: float = 1.0) -> float:
    """Bytes one Mixture-of-Experts MLP keeps for backward per token of the rank's micro-batch, in the
    compute dtype of ``p`` bytes, under expert parallelism ``ep`` and routed-token factor ``imbalance``."""
    d, f, k, e = model.dim, model.moe_hidden, model.moe_top_k, model.moe_experts
    router = 4 * d + 4 * e + 4
    home = k * (_HOME_INDEX_BYTES + 2 * 4 * d)
    at_expert = p * d + 4 * p * f + 1 + (2 * 8 if ep > 1 else 0)
    routed = k * at_expert * rank_imbalance(model, ep, imbalance)
    shared = p * d + 4 * p * model.moe_shared_experts * f if model.moe_shared_experts else 0.0
    return router + home + routed + shared
