"""Analytic step time of a layout: compute, exposed communication, pipeline bubble, offload and optimizer.

A roofline-style estimate for ranking thousands of layouts, not a simulator: every term is plain float
arithmetic on per-model quantities cached once, so a call costs microseconds. The model follows the
literature it cites and the way meshfit's torch building blocks communicate:

* Matmuls and attention on datasheet figures: kernel by kernel (planner/timing/kernels.py), each GEMM of a
  block and of the head at the part's published maximum achievable matmul rate with tile and wave
  quantization and a memory roofline for skinny shapes, the attention core at FlashAttention-2's published
  rate (flash) or as the memory traffic of its materialised scores (eager). On a calibrated device: the
  training FLOPs per token (``flops_per_token``: 6 · matmul params + attention, Kaplan/PaLM) at the measured
  rates; with an explicit ``efficiency`` (a what-if): at that fraction of the datasheet peak (bf16 tensor
  cores for mixed/bf16, plain fp32 for fp32), eager attention EAGER_ATTENTION_SLOWDOWN times slower.
  Activation recomputation (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models"): a checkpointed block re-runs its forward (+1/3 of its fwd+bwd FLOPs); "full"
  checkpoints every block, meshfit's "selective" every second one of each pipeline stage.
* Element-wise kernels (norms, RoPE, activations, residual adds, casts, the loss's softmax) are memory-bound:
  the bytes they read and write per token (``models.traffic``, counted from meshfit's model code) at the
  memory bandwidth: the calibrated element-wise rate, else HBM_EFFICIENCY × the datasheet HBM rate.
* Compiled blocks (``Workload.compiled``, train.compile): inductor fuses each chain of element-wise ops into
  one kernel that reads its inputs and writes its outputs once, so a block moves COMPILED_ELEMENTWISE of
  its eager element-wise bytes, and op-level recompute's re-run element-wise forward the same fraction
  (it is fused into the backward's kernels). Matmul, attention and communication terms are unchanged, and
  so is memory (the planner assumes a compiled block keeps what an eager one keeps).
* Communication (collectives as rings, tensor, context and data parallelism, placement on the mesh):
  planner/timing/comms.py; expert parallelism's all-to-alls and expert GEMMs: planner/timing/experts.py.
* Pipeline bubble (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
  Using Megatron-LM"): (p−1)/m of the ideal time for gpipe and 1f1b, (p−1)/(m·v) interleaved.

* Per-operator cost: eager PyTorch pays a fixed host-side cost per dispatched operator whatever the sizes,
  which dominates small micro-batches. With a profile that measured it (``calibrate --model``: ``op_s``),
  each micro-batch adds the rank's operators (counted on meshfit's block code per recompute policy; for
  compiled blocks the kernel launches calibrate --model counted, else assumed; planner/timing/op_count.py) ×
  ``op_s``. A measured tensor-parallel rate holds its own fixed cost per block instead. Datasheet devices
  and older profiles charge nothing for it.

Not modelled: stragglers, clocks held below the boost clock over a long run, and communication kernels
slowing the kernels they share the GPU with (beyond DP_OVERLAP). A rate calibrated on the model itself
(``calibrate --model``) holds all of a step's per-token compute: element-wise work is not added to it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshfit.layout.layout import Layout, Workload
from meshfit.layout.precision import COMPUTE_BYTES, OPTIMIZER_STATES, STORAGE_BYTES
from meshfit.layout.recompute import rerun_blocks
from meshfit.layout.schedules import SPLIT_BACKWARD, v_shaped
from meshfit.layout.stage_split import balanced_split, head_flops, layer_flops
from meshfit.models.config import pad_vocab_for_tp
from meshfit.models.traffic import Traffic, elementwise_traffic
from meshfit.planner.memory.activations import gathered_kv_bytes
from meshfit.planner.timing.comms import collective_s, cp_comm, dp_comm, exposed, ring, tp_comm
from meshfit.planner.timing.experts import ep_comm, fsdp_saved_params
from meshfit.planner.timing.kernels import kernel_times
from meshfit.planner.timing.op_count import rank_ops

if TYPE_CHECKING:
    from meshfit.hardware.catalog import Cluster
    from meshfit.hardware.profile import HardwareProfile
    from meshfit.models.config import ModelConfig

# Eager attention (materialised scores, memory-bound softmax) versus a fused kernel, where attention runs at
# one rate (a calibrated device's fused-kernel rate, or an explicit efficiency): FlashAttention (Dao et al.
# 2022) reports 2–4× faster attention than the PyTorch baseline; we take the low end and apply it to the
# attention-core FLOPs only. The datasheet model counts the scores' traffic instead (kernels.py).
EAGER_ATTENTION_SLOWDOWN = 2.0
# Fraction of the compute during which data-parallel communication and offload copies run hidden
# (FSDP prefetching, DDP bucket hooks): the first gather and the last reduction of a pass stay exposed,
# and communication kernels slow the compute they share the GPU with.
DP_OVERLAP = 0.8
# Zero-bubble schedules fill the 1F1B bubble with the split-off weight-gradient (W) passes: with equal
# F, B and W times ZB-H1's bubble is (p−1)·(T_F + T_B − T_W) ≈ 1/3 of 1F1B's (Qi et al. 2024, "Zero
# Bubble Pipeline Parallelism"); ZB-V and DualPipeV (DeepSeek-V3 report) do better once m ≥ 2p, so 1/3
# of the interleaved bubble is a conservative figure for all three.
ZERO_BUBBLE_FACTOR = 1.0 / 3.0
# Under the split-backward schedules a recomputed block's forward runs again in the input-gradient step
# and, in torch's weight-gradient step, once more per group of weights it reduces: forward re-runs per
# recomputed block and micro-batch (1 under the other schedules), counted on the dry run of torch 2.13's
# schedules (`small` and `small-gpt`, PP 2, 4 micro-batches). A real 2-rank run of `small` at seq 512: zbv
# with full recompute 2.2× 1F1B's step time with it, against 1.3× without recompute.
_ZERO_BUBBLE_RERUNS = {"llama": 5.56, "gpt": 5.06}
SPLIT_RERUNS = {"zbv": _ZERO_BUBBLE_RERUNS, "interleaved-zb": _ZERO_BUBBLE_RERUNS,
                "dualpipev": {"llama": 2.19, "gpt": 2.06}}
# Effective host<->device copy rate per GPU: PCIe Gen4/Gen5 x16 links shared by GPU pairs and NICs on
# common 8-GPU servers, pinned memory.
PCIE_BYTES_PER_S = 25e9
# Host memory bandwidth per GPU for the CPU optimizer step: a dual-socket server's ~400 GB/s over 8 GPUs.
HOST_MEM_BYTES_PER_S = 50e9
# Fraction of the HBM peak an element-wise (foreach/fused) optimizer step reaches.
HBM_EFFICIENCY = 0.8
# Share of a block's eager element-wise bytes (models/traffic.py) a compiled block still moves. Assumed, from
# counting the forward of meshfit's Llama block with each fused chain reading its inputs and writing its
# outputs once (RoPE's seven ops become one kernel, silu·mul one, each residual add joins the next norm):
# 0.50 in fp32 at the `small` shapes, 0.53 in fp32 and 0.35 in bf16 at Llama-3 8B's; the planner takes 0.5
# for every precision and for backward. Not measured on a GPU; on CPU the measured compiled/eager step time
# of the `small` model is in README (benchmarks/training/compile_speed.py).
COMPILED_ELEMENTWISE = 0.5


@dataclass(frozen=True)
class StepTime:
    """Seconds one optimizer step spends in each part, on the most-loaded rank; ``total_s`` is their sum."""

    compute_s: float  # forward+backward(+recompute) time of the most-loaded rank's kernels, all micro-batches
    recompute_s: float  # part of compute_s spent re-running forwards (activation checkpointing)
    elementwise_s: float  # part of compute_s in memory-bound element-wise kernels (within a measured rate: op's re-run)
    tp_comm_s: float  # exposed tensor-parallel collective time
    cp_comm_s: float  # exposed context-parallel collective time (keys and values gathered, gradients scattered)
    dp_comm_s: float  # exposed data-parallel (all-reduce / reduce-scatter / all-gather) time
    pp_comm_s: float  # point-to-point activation sends between stages
    bubble_s: float  # pipeline idle time
    offload_s: float  # exposed host<->device transfer time (offload), plus the CPU optimizer step
    optimizer_s: float  # optimizer step (memory-bound over the rank's optimizer states)
    total_s: float  # step time
    tokens_per_s: float  # global tokens per second (workload.tokens / total_s)
    mfu: float  # model FLOPs utilisation: tokens_per_s * model_flops_per_token / (world_size * peak)
    operators_s: float = 0.0  # part of compute_s in the per-operator cost (measured profiles only)
    ep_comm_s: float = 0.0  # expert parallelism's all-to-alls, not overlapped (planner/timing/experts.py)


@functools.lru_cache(maxsize=1024)
def _model_terms(model: ModelConfig, seq_len: int) -> tuple[float, float, float, float, float]:
    """(training FLOPs/token, block forward FLOPs/token, head forward FLOPs/token, attention-core forward
    FLOPs/token per block, parameter count), computed once per model and sequence length."""
    # Imported here: whoever passes a ModelConfig has loaded this module already.
    from meshfit.models.config import flops_per_token, num_params

    return (flops_per_token(model, seq_len), layer_flops(model, seq_len), head_flops(model),
            4.0 * model.q_width * seq_len, float(num_params(model)))


def bottleneck_rank(n_layers: int, pp: int, virtual: int, v_shape: bool, layer_cost: float,
                    head_cost: float, loads: tuple[float, float, float] | None = None) -> tuple[int, bool, bool]:
    """(blocks, holds the embedding, holds the head) of the most loaded pipeline rank (bottleneck_stages)."""
    stages, embedding, head = bottleneck_stages(n_layers, pp, virtual, v_shape, layer_cost, head_cost, loads)
    return sum(stages), embedding, head


@functools.lru_cache(maxsize=4096)
def bottleneck_stages(n_layers: int, pp: int, virtual: int, v_shape: bool, layer_cost: float, head_cost: float,
                      loads: tuple[float, float, float] | None = None) -> tuple[tuple[int, ...], bool, bool]:
    """(blocks of each of its stages, holds the embedding, holds the head) of the most loaded pipeline rank:
    by ``loads`` (per block, head and embeddings) when given, else by forward FLOPs.

    Stages split as ``plan_stages`` splits them; ranks hold stages round-robin (r, r+p, …) or V-shaped
    (r and 2p−1−r), as ``StagePlan.stages_of_rank`` places them.
    """
    n_stages = pp * virtual
    if n_stages == 1:
        return (n_layers,), True, True
    if n_stages > n_layers:
        raise ValueError(f"pp × virtual_stages = {pp} × {virtual} = {n_stages} stages, but the model has "
                         f"{n_layers} layers; every stage needs at least one layer")
    counts = balanced_split(n_layers, n_stages, layer_cost, head_cost)
    last = n_stages - 1
    owned = [(r, 2 * pp - 1 - r) if v_shape else tuple(range(r, n_stages, pp)) for r in range(pp)]

    # The split follows the FLOP costs (as plan_stages splits); the most loaded rank is judged by ``loads``
    # (per block, head and embeddings, e.g. seconds with element-wise work) when given.
    block_load, head_load, embed_load = loads if loads is not None else (layer_cost, head_cost, 0.0)

    def load(stages: tuple[int, ...]) -> float:
        return (sum(counts[s] for s in stages) * block_load + (head_load if last in stages else 0.0)
                + (embed_load if 0 in stages else 0.0))

    worst = max(owned, key=load)
    return tuple(counts[s] for s in worst), 0 in worst, last in worst


@functools.lru_cache(maxsize=256)
def _traffic(model: ModelConfig, cbytes: int) -> Traffic:
    return elementwise_traffic(model, cbytes)


def _elementwise_bytes(model: ModelConfig, layout: Layout, cbytes: int) -> tuple[float, float, float, float]:
    """Element-wise bytes per token on one rank (``elementwise_traffic``): (a block's forward + backward,
    its forward, the embeddings, the final norm and loss). Tensor parallelism splits the head- and
    FFN-wide tensors, sequence parallelism also the dim-wide ones of the blocks and the final norm, loss
    parallelism the vocabulary."""
    t, tp = _traffic(model, cbytes), layout.tp
    wide = tp if layout.sp else 1
    forward = t.split_fwd / tp + t.wide_fwd / wide
    block = forward + t.split_bwd / tp + t.wide_bwd / wide + t.gathered_bwd
    return block, forward, t.embed, t.final_norm / wide + t.vocab / (tp if layout.loss_parallel else 1)


def _elementwise_s(ew: tuple[float, float, float, float], rank: tuple[int, bool, bool], re_run: float,
                   tokens: int, bandwidth: float) -> tuple[float, float]:
    """(seconds, of which re-run in backward) of the rank's element-wise kernels in one step; ``re_run``:
    block forwards re-run per block (the "op" policy re-runs every block's element-wise forward)."""
    block, forward, embed, head = ew
    blocks, has_embed, has_head = rank
    redo = blocks * forward * re_run
    moved = blocks * block + redo + (embed if has_embed else 0.0) + (head if has_head else 0.0)
    return tokens * moved / bandwidth, tokens * redo / bandwidth


def _loss_parallel_delta_s(model: ModelConfig, layout: Layout, cluster: Cluster, mb_tokens: int, cbytes: int,
                           bandwidth: float) -> float:
    """Seconds per micro-batch that the layout's loss parallelism adds to (off) or saves from (on) the
    head of a tensor-parallel rate measured the other way: the vocabulary-sharded logits gathered for the
    loss, and the loss's element-wise work over the whole vocabulary instead of 1/tp of it."""
    tp = layout.tp
    gather = ring(cluster, "all_gather", 1, tp, mb_tokens * model.padded_vocab * cbytes)
    whole_vocab = mb_tokens * _traffic(model, cbytes).vocab * (1.0 - 1.0 / tp) / bandwidth
    return (gather + whole_vocab) * (-1.0 if layout.loss_parallel else 1.0)


def _operators_s(model: ModelConfig, layout: Layout, workload: Workload, prof: HardwareProfile | None,
                 stage_blocks: tuple[int, ...], has_head: bool, m: int, tp_measured: bool) -> tuple[float, float]:
    """(seconds, of which re-run in backward) of the per-operator cost of the rank's ``m`` micro-batches:
    0 without a measured cost per operator, and under a measured tensor-parallel rate (its fixed cost per
    block holds it)."""
    t_op = prof.op_seconds(workload.precision) if prof is not None and not tp_measured else None
    if not t_op:
        return 0.0, 0.0
    blocks, ac = sum(stage_blocks), layout.activation_checkpointing
    launches = prof.launches_per_heavy() if prof is not None else None  # compiled blocks' measured launches
    ops = rank_ops(model, ac, blocks, has_head, workload.compiled, launches, rerun_blocks(stage_blocks, ac))
    plain = rank_ops(model, "none", blocks, has_head, workload.compiled, launches)
    redo = max(0.0, ops - plain) * _reruns(layout, model, ac)
    return m * (plain + redo) * t_op, m * redo * t_op


def _reruns(layout: Layout, model: ModelConfig, ac: str) -> float:
    """Forward runs per recomputed block and micro-batch in backward (SPLIT_RERUNS; 1 elsewhere)."""
    if ac not in ("full", "selective") or layout.pp == 1 or layout.schedule not in SPLIT_BACKWARD:
        return 1.0
    return SPLIT_RERUNS[layout.schedule][model.family]


def _check(layout: Layout, workload: Workload, cluster: Cluster, efficiency: float,
           dp_overlap: float) -> tuple[int, int]:
    """(sequences per data-parallel rank, micro-batches per step), or ValueError naming the mismatch."""
    if layout.world_size != cluster.world_size:
        raise ValueError(
            f"layout world size {layout.world_size} ({layout.describe()}: dp_replicate × dp_shard × cp × tp × pp) "
            f"differs from the cluster's world size {cluster.world_size} ({cluster.nodes} nodes × "
            f"{cluster.gpus_per_node} {cluster.gpu.name})")
    if workload.precision not in COMPUTE_BYTES or workload.optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"workload precision={workload.precision!r} / optimizer={workload.optimizer!r}; "
                         f"valid: {', '.join(COMPUTE_BYTES)} / {', '.join(OPTIMIZER_STATES)}")
    if not (0.0 < efficiency <= 1.0 and 0.0 <= dp_overlap <= 1.0):
        raise ValueError(f"efficiency={efficiency} must be in (0, 1] and dp_overlap={dp_overlap} in [0, 1]")
    local, rest = divmod(workload.global_batch, layout.dp)
    if rest or local == 0:
        raise ValueError(f"global_batch={workload.global_batch} is not a multiple of the data-parallel degree "
                         f"{layout.dp}")
    if local % layout.micro_batch:
        raise ValueError(f"micro_batch={layout.micro_batch} does not divide the per-rank batch {local} "
                         f"(global_batch {workload.global_batch} / dp {layout.dp})")
    return local, local // layout.micro_batch


def step_time(model: ModelConfig, layout: Layout, workload: Workload, cluster: Cluster, *,
              efficiency: float | None = None, dp_overlap: float | None = None) -> StepTime:
    """Predicted time of one optimizer step of ``workload`` under ``layout`` on ``cluster``.

    ``efficiency``: a what-if that runs every matmul and the attention at this fraction of the peak (of the
    measured rates on a calibrated device); by default datasheet devices run each kernel at its published
    rate (planner/timing/kernels.py) and calibrated ones at their measured rates. ``dp_overlap``: fraction
    of the compute that hides data-parallel communication and offload copies (0 exposes all of it; default
    DP_OVERLAP). A calibrated device's
    measured overlap is instead the share of the communication hidden (see `comm_time.exposed`).
    The layout and workload are assumed to pass their own ``check()``; raises ValueError when the layout's
    world size differs from the cluster's, when the batch does not split into the layout's micro-batches,
    or when the pipeline has more stages than the model has layers.
    """
    prof = cluster.gpu.profile
    per_kernel = prof is None and efficiency is None  # datasheet figures, no what-if: kernels.py's rates
    if efficiency is None:
        efficiency = 1.0
    of_comm = dp_overlap is None and prof is not None
    if dp_overlap is None:
        dp_overlap = prof.overlap if prof is not None else DP_OVERLAP
    local, m = _check(layout, workload, cluster, efficiency, dp_overlap)
    model = pad_vocab_for_tp(model, layout.tp)  # as training builds it
    precision, s, tp, pp = workload.precision, workload.seq_len, layout.tp, layout.pp
    fpt, layer, head, core, n_params = _model_terms(model, s)
    gpu = cluster.gpu
    peak = gpu.fp32_flops if precision == "fp32" else gpu.bf16_flops
    cbytes, sbytes = COMPUTE_BYTES[precision], STORAGE_BYTES[precision]
    virtual = layout.virtual_stages if pp > 1 else 1
    # A tensor-parallel rate measured on the model itself (calibrate --model) holds what the split costs
    # beyond the split matmuls, its collectives included: they are not added again below. It was measured
    # with sequence and loss parallelism both on or both off; a layout with one of them on uses the
    # measurement of its sequence parallelism (the blocks' work) and the difference loss parallelism makes
    # to the head (_loss_parallel_delta_s).
    tp_rate = prof.tp_rate(precision, tp, layout.sp) if prof is not None and tp > 1 else None
    rate = (tp_rate[0] if tp_rate is not None else peak) * efficiency
    # Memory-bound element-wise work, unless a rate measured on the model itself holds it already.
    in_rate = prof is not None and (prof.model_flops is not None or tp_rate is not None)
    ew = _elementwise_bytes(model, layout, cbytes)
    if in_rate:  # only the "op" policy's re-run element-wise forward is not in the measured rate
        ew = (0.0, ew[1] if layout.activation_checkpointing == "op" else 0.0, 0.0, 0.0)
    if workload.compiled:  # the blocks' element-wise chains fuse; embeddings, head and loss stay eager
        ew = (ew[0] * COMPILED_ELEMENTWISE, ew[1] * COMPILED_ELEMENTWISE, ew[2], ew[3])
    bandwidth = prof.elementwise_bytes_per_s if prof is not None else gpu.hbm_bytes_per_s * HBM_EFFICIENCY
    mb_tokens = layout.micro_batch * s // layout.cp
    kernels = (kernel_times(model, gpu, precision, workload.attention, mb_tokens, s, tp, layout.cp, bandwidth,
                            layout.ep, workload.moe_imbalance) if per_kernel else None)
    # Stages split by FLOPs, as the pipeline splits them; the most loaded rank by time per token, element-wise
    # work included (a large vocabulary's loss can outweigh several blocks).
    block_t, head_t = (3 * layer / tp / rate, 3 * head / tp / rate) if kernels is None else (kernels.block,
                                                                                             kernels.head)
    loads = (block_t + ew[0] / bandwidth, head_t + ew[3] / bandwidth, ew[2] / bandwidth)
    stage_blocks, has_embedding, has_head = bottleneck_stages(model.n_layers, pp, virtual, v_shaped(layout.schedule),
                                                              layer, head, loads)
    blocks = sum(stage_blocks)
    rank = blocks, has_embedding, has_head

    # Compute: the bottleneck rank's share of the model FLOPs, 1/tp of it per tensor-parallel rank.
    share = (blocks * layer + head * has_head) / (model.n_layers * layer + head)
    core_r = blocks * core / tp  # attention-core forward FLOPs per token on this rank
    ac = layout.activation_checkpointing
    # Forward FLOPs re-run in backward. meshfit's "selective" checkpoints every second block of each stage in
    # full (parallel.ac_every = 2); "attention" re-runs the attention core; "op" re-runs element-wise ops
    # only (their bytes, below).
    rerun = rerun_blocks(stage_blocks, ac) / max(1, blocks) * _reruns(layout, model, ac)
    redo = rerun * blocks * layer / tp + (core_r if ac == "attention" else 0.0)
    redo_core = (1.0 if ac == "attention" else rerun) * core_r
    slow = EAGER_ATTENTION_SLOWDOWN - 1.0 if workload.attention == "eager" else 0.0
    # A calibrated device has its own (fused) attention rate; a what-if efficiency runs attention at the
    # matmul rate; a measured tensor-parallel rate holds both.
    attn_rate = prof.flops(precision, attention=True) * efficiency if prof is not None else rate
    tp_fixed_s = tp_redo_s = 0.0
    if tp_rate is not None:
        attn_rate = rate
        # Per block and micro-batch; a re-run forward adds its share as it does of the FLOPs (a third).
        tp_fixed_s = tp_rate[1] * blocks * m
        tp_redo_s = tp_fixed_s * rerun / 3.0
    tokens = local * s // layout.cp  # tokens of this rank's sequences per step (its part of each under cp)

    def seconds(flops: float, core: float) -> float:  # matmul FLOPs (attention core included) per token
        return tokens * ((flops - core) / rate + core * (1.0 + slow) / attn_rate)

    ew_s, ew_redo_s = _elementwise_s(ew, rank, 1.0 if ac == "op" else rerun, tokens, bandwidth)
    ops_s, ops_redo_s = _operators_s(model, layout, workload, prof, stage_blocks, has_head, m, tp_rate is not None)
    if tp_rate is not None and has_head and layout.loss_parallel != layout.sp:
        tp_fixed_s += _loss_parallel_delta_s(model, layout, cluster, layout.micro_batch * s, cbytes, bandwidth) * m
    if kernels is None:
        matmul_s, matmul_redo_s = seconds(fpt * share / tp + redo, 3.0 * core_r + redo_core), seconds(redo, redo_core)
    else:
        cores = (1.0 if ac == "attention" else rerun) * blocks  # attention cores re-run, as redo_core counts
        matmul_s, matmul_redo_s = kernels.step_s(tokens, blocks, has_head, rerun * blocks, cores)
    compute_s = matmul_s + tp_fixed_s + tp_redo_s + ew_s + ops_s
    recompute_s = matmul_redo_s + tp_redo_s + ew_redo_s + ops_redo_s

    tp_comm_s = 0.0
    if tp > 1 and tp_rate is None:
        tp_comm_s = m * tp_comm(model, layout, cluster, mb_tokens, cbytes, rank)
    # The cp group re-gathers keys and values wherever a block's forward is re-run, and under the "op" and
    # "attention" policies, which recompute the gathered keys and values rather than keep them.
    regather = 1.0 if ac in ("op", "attention") else rerun
    kv_bytes = gathered_kv_bytes(model, mode="fp32" if cbytes == 4 else "bf16", seq=s, batch=layout.micro_batch,
                                 tp=tp)
    cp_comm_s = m * cp_comm(layout, cluster, kv_bytes, blocks, regather)
    moe_blocks = blocks * model.moe_layers / model.n_layers
    ep_comm_s = m * ep_comm(model, layout, cluster, mb_tokens, cbytes, moe_blocks, rerun * moe_blocks,
                            workload.moe_imbalance)
    rank_params = n_params / (tp * pp)
    # Also with one data-parallel rank: FSDP (stages 2/3) still gathers and, with offload, copies; a rank's
    # E/ep experts over their edp ranks (planner/timing/experts.py).
    moved = rank_params - fsdp_saved_params(model, layout) / (tp * pp)
    dp_comm_s, gathers, reductions = dp_comm(layout, cluster, moved, blocks, m, compute_s, recompute_s,
                                             cbytes, sbytes, dp_overlap, of_comm)

    bubble_s = pp_comm_s = 0.0
    if pp > 1:
        factor = (pp - 1) / (m * virtual)  # gpipe and 1f1b run one stage per rank (virtual = 1)
        if layout.schedule in SPLIT_BACKWARD:
            factor *= ZERO_BUBBLE_FACTOR
        bubble_s = factor * (compute_s + tp_comm_s)
        # Each micro-batch's activation goes forward and its gradient back across each of the rank's
        # stages; with SP the residual stream between blocks is sequence-sharded.
        send = mb_tokens * model.dim * cbytes / (tp if layout.sp else 1)
        pp_comm_s = 2 * m * virtual * collective_s(cluster, "send_recv", tp * layout.cp * layout.dp, pp, send)

    # Optimizer step over the rank's share (ZeRO ≥ 1 updates 1/(dp_shard × cp)), memory-bound; with offload it
    # runs on the host and the sharded weights/gradients cross PCIe once per gather/reduction.
    owned = rank_params / (layout.shard if layout.zero_stage >= 1 else 1)
    step_bytes = 2.0 * owned * sbytes * (2 + OPTIMIZER_STATES[workload.optimizer])  # weights, grads, states
    offload_s = 0.0
    if layout.offload:
        # FSDP copies the shard to the device in its kept dtype and casts there.
        copies = (gathers + reductions) * owned * sbytes / PCIE_BYTES_PER_S
        offload_s = exposed(copies, compute_s, dp_overlap, of_comm) + step_bytes / HOST_MEM_BYTES_PER_S
        optimizer_s = 0.0
    else:
        bandwidth = prof.elementwise_bytes_per_s if prof is not None else gpu.hbm_bytes_per_s * HBM_EFFICIENCY
        optimizer_s = step_bytes / bandwidth

    total = compute_s + tp_comm_s + cp_comm_s + ep_comm_s + dp_comm_s + pp_comm_s + bubble_s + offload_s + optimizer_s
    tokens_per_s = workload.tokens / total
    return StepTime(compute_s=compute_s, recompute_s=recompute_s, elementwise_s=ew_s, tp_comm_s=tp_comm_s,
                    cp_comm_s=cp_comm_s, dp_comm_s=dp_comm_s, pp_comm_s=pp_comm_s, bubble_s=bubble_s,
                    offload_s=offload_s, optimizer_s=optimizer_s, total_s=total, tokens_per_s=tokens_per_s,
                    mfu=tokens_per_s * fpt / (layout.world_size * peak), operators_s=ops_s, ep_comm_s=ep_comm_s)
