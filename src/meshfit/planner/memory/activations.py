"""What meshfit's transformer blocks keep for backward, per rank, in bytes: the planner's activation model.

Two numeric modes: ``fp32``, and ``bf16``: mixed precision, where every layout computes on FSDP2's 16-bit
weight copies (layout/data_parallel_kind.py), so every activation is 16-bit; pure bf16 is the same.

meshfit's blocks keep what Korthikanti et al. 2022 count (planner/memory/formulas.py's per-tensor terms, which also
count the Llama block by their rule), because they are written to (models/layers.py): RMSNorm keeps its
16-bit input alone, dropout a one-byte mask, grouped key/value heads are not repeated for the fused
kernel, and under sequence parallelism the gathered projection inputs are gathered again in backward
(parallel/sp_regather.py). On top of that count: LayerNorm's mean and reciprocal deviation per token.
``benchmarks/planner/block_activations.py`` measures these against torch's memory tracker on real blocks.

Recompute policies (layout/recompute.py): ``attention`` drops the attention core's terms; ``op`` keeps the
block input and the outputs of every matmul, attention kernel and reduction (tensor parallelism's
row-parallel matmuls produce full-size partial sums, kept next to their reduced output); a block
checkpointed whole keeps its input.

Context parallelism (parallel/context_parallel.py, degree cp): every sequence-long tensor is a rank's s/cp
tokens; the attention kernel keeps the whole sequence's gathered keys and values (2·s·kv_width per block)
in place of the local ones, and the fused kernel each chunk's output next to their concatenation; eager
scores (and the causal mask) cover each chunk's prefix of the keys. The "attention" and "op" policies
recompute the gathered keys and values (the gather is re-run in backward) rather than keep them.
``benchmarks/planner/block_activations.py --cp`` measures blocks on fake tensors: the same bytes for both families,
both kernels, t = 1 and 2 + SP, every policy.

Mixture-of-Experts models: the first moe_dense_layers blocks are dense blocks; the others keep the same
attention terms and, in place of the dense MLP's, what planner/memory/moe_activations.py counts (router,
routed copies, expert intermediates, index maps, the combine; measured with torch's tracker). Blocks are
reported as their mean (``layers × mean`` is exact for the whole model).
"""

from __future__ import annotations

from dataclasses import replace

from meshfit.layout.layout import Layout, Workload
from meshfit.layout.recompute import rerun_blocks
from meshfit.models.config import MOE_DEFAULTS, ModelConfig, moe_mlp_params
from meshfit.models.mask_kernel import mask_bytes, mask_kernel
from meshfit.planner.memory.formulas import activation_bytes_per_layer
from meshfit.planner.memory.moe_activations import moe_mlp_bytes_per_token, rank_imbalance

MODES = ("fp32", "bf16")


def value_bytes(mode: str) -> int:
    """Bytes of one activation value in the compute dtype."""
    return 4 if mode == "fp32" else 2


def block_weight_params(model: ModelConfig) -> float:
    """Matmul weights of one block (what tensor parallelism splits). A Mixture-of-Experts model's blocks
    differ (its first moe_dense_layers are dense): the mean block's, so that blocks × layers is exact."""
    d, hd = model.dim, model.head_size
    if model.family == "llama":
        attention = d * hd * (2 * model.n_heads + 2 * model.n_kv_heads)
        if not model.moe:
            return attention + 3 * d * model.ffn_hidden
        dense = model.n_layers - model.moe_layers
        mlp = dense * 3 * d * model.ffn_hidden + model.moe_layers * moe_mlp_params(model)
        return attention + mlp / model.n_layers
    return 4 * d * d + 2 * d * model.ffn_hidden


def mlp_width(model: ModelConfig) -> int:
    """The MLP width one token passes through: ffn_hidden, or a Mixture-of-Experts block's top_k routed and
    its shared experts side by side."""
    if not model.moe:
        return model.ffn_hidden
    return (model.moe_top_k + model.moe_shared_experts) * model.moe_hidden


def dense_model(model: ModelConfig) -> ModelConfig:
    """A Mixture-of-Experts model's dense blocks as a model of their own (the dense MLP of ffn_hidden)."""
    return replace(model, **MOE_DEFAULTS) if model.moe else model


def cp_keys_per_query(seq: int, cp: int) -> float:
    """Keys a local query row scores, on average, under context parallelism: rank i's two chunks (of 2·cp,
    c = seq / (2·cp) tokens each) see prefixes of (i + 1)·c and (2·cp − i)·c keys, (2·cp + 1)·c / 2 per row
    on every rank (the causal load balance)."""
    return (2 * cp + 1) * seq / (4 * cp)


def gathered_kv_bytes(model: ModelConfig, *, mode: str, seq: int, batch: int, tp: int = 1) -> float:
    """The whole sequence's keys and values one context-parallel rank gathers per block and micro-batch of
    ``batch`` ``seq``-long sequences: what the all-gather brings in, and what the kernel keeps for backward."""
    return 2 * seq * batch * model.n_kv_heads * model.head_size * value_bytes(mode) / tp


def block_activation_bytes(model: ModelConfig, *, mode: str, seq: int, batch: int, tp: int = 1,
                           sp: bool = False, attention: str = "flash", dropout: float = 0.0,
                           policy: str = "none", cp: int = 1, ep: int = 1, imbalance: float = 1.0) -> float:
    """Bytes one rank keeps for the backward of one block and one micro-batch of ``batch`` ``seq``-long
    sequences (the whole sequence: under context parallelism ``cp`` the rank holds seq / cp of it), under
    recompute ``policy`` "none", "op" or "attention" (a block checkpointed whole: see
    :func:`checkpointed_block_bytes`). A Mixture-of-Experts model's blocks differ: their mean, under expert
    parallelism ``ep`` with the most-loaded rank's routed-token factor ``imbalance``."""
    kw = dict(mode=mode, seq=seq, batch=batch, tp=tp, sp=sp, attention=attention, dropout=dropout, policy=policy,
              cp=cp)
    if not model.moe:
        return _block_bytes(model, **kw)
    dense = _block_bytes(dense_model(model), **kw)
    p = value_bytes(mode)
    tokens = seq // cp * batch
    # The dense MLP's terms out (its input and SwiGLU's four intermediates), the MoE MLP's in. The MoE block
    # is whole on every tensor-parallel rank, which routes its sequence slice under SP, else every token.
    mlp = tokens * p * (model.dim / (tp if sp else 1) + 4 * model.ffn_hidden / tp)
    tokens = tokens // (tp if sp else 1)
    if policy == "op":
        # Matmul outputs kept, element-wise ones recomputed: SiLU's output and the product of the routed
        # and shared experts' SwiGLU are not kept (not measured yet).
        width = (model.moe_top_k * rank_imbalance(model, ep, imbalance) + model.moe_shared_experts) * model.moe_hidden
        moe = tokens * (moe_mlp_bytes_per_token(model, p, ep, imbalance) - 2 * p * width)
        mlp = tokens * _op_mlp_per_token(dense_model(model), p, tp)
    else:
        moe = tokens * moe_mlp_bytes_per_token(model, p, ep, imbalance)
    dense_blocks = model.moe_dense_layers
    return (dense_blocks * dense + model.moe_layers * (dense - mlp + moe)) / model.n_layers


def _block_bytes(model: ModelConfig, *, mode: str, seq: int, batch: int, tp: int, sp: bool, attention: str,
                 dropout: float, policy: str, cp: int) -> float:
    p = value_bytes(mode)
    local = seq // cp
    tokens = local * batch
    keys = cp_keys_per_query(seq, cp) if cp > 1 else None
    seq_split = tp if sp else 1
    if policy == "op":
        return tokens * _op_kept_per_token(model, p, keys or seq, tp, sp, attention)
    gpt = model.family == "gpt"
    total = activation_bytes_per_layer(
        s=local, b=batch, h=model.dim, a=model.n_heads, t=tp, sp=sp, bytes_per_value=p,
        recompute="selective" if policy == "attention" else "none", dropout=gpt and dropout > 0,
        attention=attention, family=model.family, ffn=mlp_width(model) / model.dim,
        kv=model.n_kv_heads / model.n_heads, keys=keys, q=model.q_width / model.dim, qk_norm=model.qk_norm)
    if gpt:
        total += tokens * 2 * 2 * p / seq_split  # two LayerNorms' mean and reciprocal deviation
    if policy == "none" and attention == "eager":
        # The causal mask masked_fill keeps: one byte per query and key, repeated for the query heads of a
        # key/value group, shared by the micro-batch's sequences.
        total += model.n_heads // model.n_kv_heads * local * (keys or seq)
    if cp > 1 and policy == "none":
        # The kernel keeps the gathered keys and values in place of the local ones; the fused kernel also
        # keeps each chunk's output, next to their concatenation (the output projection's input).
        local_kv = tokens * 2 * model.n_kv_heads * model.head_size * p / tp
        outputs = tokens * model.q_width * p / tp if attention == "flash" else 0.0
        total += gathered_kv_bytes(model, mode=mode, seq=seq, batch=batch, tp=tp) - local_kv + outputs
    return total


def _op_kept_per_token(model: ModelConfig, p: int, keys: float, tp: int, sp: bool, attention: str) -> float:
    h, heads, q = model.dim, model.n_heads, model.q_width
    kv = model.n_kv_heads * model.head_size
    kept = p * h / (tp if sp else 1)  # the block input
    kept += p * (q + 2 * kv) / tp  # q, k, v projections (q/k norms, like every element-wise op, recompute)
    if attention == "eager":
        kept += p * heads * keys / tp + p * q / tp  # QKᵀ scores (a row of keys each) and probabilities × V
    else:
        kept += p * q / tp + 4 * heads / tp  # the fused kernel's output and log-sum-exp
    kept += _op_mlp_per_token(model, p, tp)
    # Output projection and MLP down projection: their matmul outputs (full-size partial sums under
    # TP), and under TP the reduced outputs as well (sequence-split under SP).
    reduced = 0 if tp == 1 else p * h / (tp if sp else 1)
    return kept + 2 * (p * h + reduced)


def _op_mlp_per_token(model: ModelConfig, p: int, tp: int) -> float:
    """The dense MLP's matmul outputs the "op" policy keeps: SwiGLU's gate and up projections (GPT: fc1)."""
    up = 2 if model.family == "llama" else 1
    return p * up * model.ffn_hidden / tp


def checkpointed_block_bytes(model: ModelConfig, *, mode: str, seq: int, batch: int, tp: int = 1,
                             sp: bool = False, cp: int = 1) -> float:
    """A block checkpointed whole keeps only its input: the residual stream (sequence-split under SP, and
    the rank's seq / cp tokens under context parallelism)."""
    return seq // cp * batch * model.dim * value_bytes(mode) / (tp if sp else 1)


def embedding_bytes(model: ModelConfig, *, seq: int, batch: int, dropout: float, cp: int = 1) -> float:
    """What the embedding keeps for the backward of one micro-batch on the first stage: GPT's dropout mask,
    one byte per value of the rank's seq / cp tokens, whatever t and SP (learned positions are added to
    the full token embeddings; the sequence split starts at block 0: parallel/tensor_parallel.py).
    Korthikanti et al. count it on the first stage too (sbh·p/t under SP, where Megatron splits it)."""
    if model.family != "gpt" or dropout <= 0:
        return 0.0
    return seq // cp * batch * model.dim


def head_bytes(model: ModelConfig, layout: Layout, mode: str, tokens: int, held: int = 1,
                transient: bool = True) -> float:
    """The last stage around the loss for ``held`` micro-batches whose forward is done and backward not.

    Each keeps the final norm's saved tensors, its logits (compute dtype) and the log-softmax output
    (fp32); on top comes the largest transient of the loss: the fp32 gradients of the log-probabilities
    and of the logits, which coexist in its backward whatever the logits' dtype.
    """
    vocab = model.padded_vocab / layout.tp if layout.loss_parallel else model.padded_vocab
    p = 4 if mode == "fp32" else 2
    norm = tokens * model.dim * (12 if mode != "bf16" else 8) / (layout.tp if layout.sp else 1)
    saved = norm + tokens * vocab * (p + 4)
    # Measured with torch's tracker (seq 1024, vocabulary 8192): two fp32 logit-sized gradients in the
    # loss's backward, 16-bit logits or not (the forward's fp32 copy of 16-bit logits, 4 bytes, is less).
    # torch's loss-parallel cross-entropy keeps one more fp32 tensor of the local logits' size.
    extra = 4 if layout.loss_parallel else 0
    return held * saved + (tokens * vocab * (8 + extra) if transient else 0.0)


def layout_activations(model: ModelConfig, layout: Layout, workload: Workload, layers: int, mode: str,
                       rerun: int | None = None) -> tuple[float, float]:
    """(saved activations of one micro-batch through ``layers`` blocks, what backward adds on top).
    ``rerun``: how many of them are checkpointed whole (by default as one stage of ``layers`` blocks).

    With checkpointed blocks, backward re-runs one checkpointed block at a time in full; while that block's
    gradients are computed its recomputed activations and the gradient temporaries (together about 1.45
    blocks' activations, as measured with torch's tracker) are alive. The "op" and "attention" policies
    recompute, one block at a time, what they did not keep.
    """
    kw = dict(mode=mode, seq=workload.seq_len, batch=layout.micro_batch, tp=layout.tp, sp=layout.sp, cp=layout.cp)
    ac = layout.activation_checkpointing
    moe = dict(ep=layout.ep, imbalance=workload.moe_imbalance)
    full = block_activation_bytes(model, attention=workload.attention, dropout=workload.dropout, **kw, **moe)
    if ac in ("none", "op", "attention"):
        kept = block_activation_bytes(model, attention=workload.attention, dropout=workload.dropout, policy=ac,
                                      **kw, **moe)
        return layers * kept, full - kept
    kept = checkpointed_block_bytes(model, **kw)
    # "selective" checkpoints every parallel.ac_every-th block of each stage (its default assumed).
    checkpointed = rerun_blocks((layers,), ac) if rerun is None else rerun
    return checkpointed * kept + (layers - checkpointed) * full, full * 1.45 if checkpointed else 0.0


def document_mask_bytes(model: ModelConfig, workload: Workload, layout: Layout, mode: str,
                        backend: str = "nccl") -> float:
    """What data.document_mask keeps for backward per micro-batch on one rank and stage (0 without it): the
    mask (models/mask_kernel.py; "gloo": CPU ranks, which run the dense mask), the document ids and
    positions of the rank's whole batch (int64, made once per step and split into micro-batches) and, for RoPE, the cos and sin of each token's own position (fp32, [b, s/cp,
    head_dim] each) in place of the shared tables' rows."""
    if not workload.document_mask:
        return 0.0
    kernel = document_mask_kernel(workload, layout, backend)
    mask = mask_bytes(kernel, seq=workload.seq_len, batch=layout.micro_batch, cp=layout.cp,
                      value_bytes=value_bytes(mode))
    tokens = layout.micro_batch * workload.seq_len / layout.cp
    batch_tokens = workload.global_batch // layout.dp * workload.seq_len / layout.cp
    return mask + 2 * batch_tokens * 8 + (2 * tokens * model.head_size * 4 if model.family == "llama" else 0.0)


def document_mask_kernel(workload: Workload, layout: Layout, backend: str = "nccl") -> str:
    """The kernel that runs the document mask (models/mask_kernel.py)."""
    return mask_kernel(cuda=backend != "gloo", attention=workload.attention, dropout=workload.dropout, cp=layout.cp)
