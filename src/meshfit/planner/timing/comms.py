"""Communication seconds of a layout's step: ring collectives on the mesh's links, and what stays exposed.

Part of the step-time model (planner/timing/estimate.py), in the same roofline spirit:

* Collectives are rings (Patarasuk & Yuan 2009; NCCL): all-reduce 2(n−1)/n · bytes/bw, all-gather and
  reduce-scatter (n−1)/n · bytes/bw, plus a latency alpha per hop and call ((n−1) hops, twice for an
  all-reduce, which is a reduce-scatter followed by an all-gather). A profile calibrated with a model also
  holds times measured at the message sizes its layouts send; a call's time then comes from those
  (`collective_s`): between two measured sizes log-linear in both bytes and seconds, beyond them along the
  line from the nearest measured point (above the largest its slope, below the smallest its shape
  scaled). On 2 gloo ranks the line through an 8 MiB and a 4 KiB message put all-reduce, all-gather and
  reduce-scatter of 0.5–1.4 MiB at 1.3–1.8× their measured times (calibrate_sizes.py), which is why the
  sizes are measured.
* Tensor parallelism (Megatron, Shoeybi et al. 2019; with sequence parallelism Korthikanti et al. 2022):
  per block two all-reduces of s·b·h activations in forward and two in backward (SP: all-gathers plus
  reduce-scatters of the same bytes), two more with full recomputation; never overlapped.
* Context parallelism (parallel/context_parallel.py; Llama 3's all-gather attention, Dubey et al. 2024):
  per block and micro-batch an all-gather of the whole sequence's keys and values in forward (again when
  the block's forward is re-run under recompute) and a reduce-scatter of their gradients in backward, over
  the cp ranks. Assumed exposed, as the tensor-parallel collectives are: meshfit's attention waits for the
  gather right away (the first chunk needs it) and the projections' backward for the reduce-scatter, so
  no compute is scheduled beside them. With grouped-query attention they are small: 2·s·kv_width values
  per block against the attention's 4·s²·dim/cp FLOPs, so at long sequences the attention dwarfs them.
  Attention FLOPs per rank fall by cp (each rank computes its s/cp queries against their causal prefix;
  the chunk pairing balances the ranks), as every other per-token term does.
* Data parallelism: FSDP gathers and reduce-scatters over dp_shard × cp ranks (context-parallel ranks
  shard the weights too), DDP all-reduces over dp × cp.
* Placement: the mesh is (pp, dp_replicate, dp_shard, cp, tp) outer to inner on consecutive ranks, so a
  group of ``size`` ranks ``stride`` apart stays in one node iff stride · size ≤ gpus_per_node (cp ranks
  are tp apart, dp_shard × cp ranks too, replicas tp·dp_shard·cp). A collective over a group that spans
  nodes runs as NCCL runs it: rings ordered node by node, one ring (channel) per NIC, so the traffic that
  leaves a node is spread over the NICs of the group's k GPUs in that node and the bus bandwidth is
  k × the per-GPU NIC rate, at most the intra-node rate (``node_nics``). A point-to-point send uses its
  GPU's NIC.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from meshfit.layout.data_parallel_kind import data_parallel_kind
from meshfit.layout.layout import Layout

if TYPE_CHECKING:
    from meshfit.hardware.catalog import Cluster
    from meshfit.models.config import ModelConfig

# Latency per ring hop and collective call (NCCL's small-message latency is a few µs per step over
# NVLink, more over InfiniBand/RoCE).
ALPHA_INTRA_S = 5e-6
ALPHA_INTER_S = 10e-6
# Fraction of the link rate a large ring collective or send reaches (NCCL bus bandwidth vs. line rate).
COLLECTIVE_BW_EFFICIENCY = 0.8
# DDP's default gradient bucket (bucket_cap_mb=25): one all-reduce call per bucket.
DDP_BUCKET_BYTES = 25 * 2**20


def node_nics(cluster: Cluster, stride: int, size: int, op: str) -> int:
    """NICs of one node that a collective ``op`` over ``size`` ranks ``stride`` apart (spanning nodes)
    sends through: one per member of the group in the node (a point-to-point send: its GPU's own).

    NCCL orders a ring node by node, so the ring leaves each node once, and runs one ring per NIC of the
    node's members, so the traffic leaving a node splits over their NICs. Measured (nccl-tests all_reduce,
    bus bandwidth): two HGX A100 nodes with four 200 Gb/s HDR NICs each, 91 GB/s (NVIDIA/nccl-tests issue
    #100) and three servers of 8 A100 SXM4 with four HDR NICs, 84.8 GB/s on average and 96 GB/s at the
    largest sizes (issue #119): 0.85–0.96 of the four NICs' 100 GB/s, against 25 GB/s for one NIC."""
    if op == "send_recv":
        return 1
    return max(1, min(size, cluster.gpus_per_node // stride))


def link(cluster: Cluster, stride: int, size: int, op: str) -> tuple[float, float]:
    """(bus bytes/s, latency per hop) of ``op`` over ``size`` ranks ``stride`` apart in rank order: the
    calibrated rates when the device has a profile, else the datasheet link at COLLECTIVE_BW_EFFICIENCY:
    within a node the intra-node rate, across nodes the NICs of the group's GPUs in a node (``node_nics``),
    at most the intra-node rate."""
    gpu = cluster.gpu
    if gpu.profile is not None:
        return gpu.profile.link(size, op)
    if stride * size > cluster.gpus_per_node:
        # The traffic still crosses the node's own links: no more than the intra-node rate (nor less than one NIC).
        nics = node_nics(cluster, stride, size, op)
        rate = min(nics * gpu.inter_node_bytes_per_s, max(gpu.intra_node_bytes_per_s, gpu.inter_node_bytes_per_s))
        return rate * COLLECTIVE_BW_EFFICIENCY, ALPHA_INTER_S
    return gpu.intra_node_bytes_per_s * COLLECTIVE_BW_EFFICIENCY, ALPHA_INTRA_S


def ring_terms(op: str, n: int) -> tuple[float, int]:
    """(bytes each rank moves per byte of the buffer, latency hops) of ``op`` as a ring over ``n`` ranks:
    all-reduce is a reduce-scatter then an all-gather; send/recv is one message (nccl-tests' bus bandwidth
    uses the same factors, so `meshfit calibrate` reads them back from measured times)."""
    if op == "send_recv":
        return 1.0, 1
    phases = 2 if op == "all_reduce" else 1
    return phases * (n - 1) / n, phases * (n - 1)


def along_points(points: Mapping[int, float], nbytes: float, line: Callable[[float], float]) -> float:
    """Seconds for an ``nbytes`` message from ``points`` ({bytes: seconds} measured): between the two nearest
    measured sizes interpolated linearly in (log bytes, log seconds); above the largest the largest's time
    plus what ``line`` (seconds by bytes) adds from there, below the smallest ``line`` scaled to pass through
    the smallest; ``line`` alone without points. Each point is first lowered to the least time measured at
    its size or above."""
    if not points or nbytes <= 0:
        return line(nbytes)
    sizes = sorted(points)
    # A larger message's time bounds a smaller one's (it could be padded): each size takes the least time
    # measured at it or above, so one slow repetition (a busy host) does not make a smaller message dearer.
    points = dict(points)
    for small, large in zip(reversed(sizes[:-1]), reversed(sizes[1:])):
        points[small] = min(points[small], points[large])
    if nbytes >= sizes[-1]:  # the line's slope from the largest point: its bandwidth was measured larger still
        return points[sizes[-1]] + line(nbytes) - line(sizes[-1])
    if nbytes <= sizes[0]:  # the line's shape scaled through the smallest point (latency-bound, stays > 0)
        return points[sizes[0]] * line(nbytes) / line(sizes[0]) if line(sizes[0]) > 0 else points[sizes[0]]
    hi = bisect.bisect_left(sizes, nbytes)
    a, b = sizes[hi - 1], sizes[hi]
    w = math.log(nbytes / a) / math.log(b / a)
    return math.exp((1.0 - w) * math.log(points[a]) + w * math.log(points[b]))


def collective_s(cluster: Cluster, op: str, stride: int, n: int, nbytes: float) -> float:
    """Seconds of one ring collective ``op`` over n ranks ``stride`` apart moving an ``nbytes`` buffer (the
    whole gathered / reduced buffer; send/recv: one message): the profile's times at measured message sizes
    where it has them, else the bandwidth/latency line (module notes). Times measured on another group size
    are scaled by the ratio of the two sizes' lines."""
    if n == 1:
        return 0.0
    bw, alpha = link(cluster, stride, n, op)

    def line(ranks: int) -> Callable[[float], float]:
        moved, hops = ring_terms(op, ranks)
        return lambda b: moved * b / bw + alpha * hops

    prof = cluster.gpu.profile
    if prof is None:
        return line(n)(nbytes)
    measured_n, points = prof.measured_sizes(n, op)
    t = along_points(points, nbytes, line(measured_n))
    base = line(measured_n)(nbytes)
    if measured_n != n and points and base > 0:
        t *= line(n)(nbytes) / base
    return t


def ring(cluster: Cluster, op: str, stride: int, n: int, nbytes: float, calls: float = 1.0) -> float:
    """Seconds of ``calls`` ring collectives ``op`` over n ranks ``stride`` apart moving an ``nbytes`` buffer
    in all (``nbytes / calls`` each)."""
    if n == 1 or calls <= 0:
        return 0.0
    return calls * collective_s(cluster, op, stride, n, nbytes / calls)


def tp_comm(model: ModelConfig, layout: Layout, cluster: Cluster, mb_tokens: int, cbytes: int,
             rank: tuple[int, bool, bool]) -> float:
    """Tensor-parallel collective seconds of one micro-batch on the bottleneck rank."""
    tp = layout.tp
    blocks, has_embed, has_head = rank
    per_block = 6 if layout.activation_checkpointing == "full" else 4  # all-reduce equivalents
    # Embedding (vocab-parallel rows): one reduction in forward (a reduce-scatter with SP, except GPT's,
    # whose learned positions are added to the full sequence). Head (vocab-parallel columns): its input
    # gradient is reduced in backward (with SP the input is gathered in forward and scattered back).
    embed = 0.5 if layout.sp and model.family == "llama" else 1.0
    n_ar = blocks * per_block + embed * has_embed + has_head
    t = n_ar * ring(cluster, "all_reduce", 1, tp, mb_tokens * model.dim * cbytes)
    if has_head and not layout.loss_parallel:  # vocab-sharded logits are gathered for the loss
        t += ring(cluster, "all_gather", 1, tp, mb_tokens * model.padded_vocab * cbytes)
    return t


def exposed(comm_s: float, compute_s: float, overlap: float, of_comm: bool) -> float:
    """Communication seconds left exposed beside ``compute_s``: ``overlap`` is the share of it hidden
    (``of_comm``: calibrated; on CPU ranks a collective's work takes cycles from the compute beside it), or
    the share of the compute during which communication runs hidden (DP_OVERLAP, datasheet devices)."""
    if of_comm:
        return comm_s - overlap * min(comm_s, compute_s)
    return max(0.0, comm_s - overlap * compute_s)


def dp_comm(layout: Layout, cluster: Cluster, rank_params: float, blocks: int, m: int, compute_s: float,
             recompute_s: float, cbytes: int, sbytes: int, overlap: float, of_comm: bool = False
             ) -> tuple[float, int, int]:
    """(exposed data-parallel seconds, parameter gathers per step, gradient reductions per step).

    DDP (stage 0) all-reduces the gradients once, during the last micro-batch's backward (no_sync before).
    FSDP gathers each block's weights in the compute dtype and reduce-scatters its gradients: stage 3
    gathers for every forward and backward and reduces every micro-batch; stage 2 keeps the gathered
    weights for the whole step (one gather) and reduces every micro-batch; stage 1 also reduces once per
    step, in the compute dtype. HSDP all-reduces the reduced shard across replicas; stage-0 replicas (of
    tensor-parallel weights, or under mixed precision) all-reduce once per step, as DDP does. Under a
    pipeline schedule torch's stages skip the gradient sync and the post-backward reshard until the step's end, so gradients are reduced once,
    exposed, and stages 1/2 gather once per step, stage 3 once per warm-up forward (min(p, m)) and once per
    backward.
    """
    tp, shard, replicate = layout.tp, layout.shard, layout.dp_replicate
    kind = data_parallel_kind(layout.zero_stage, layout.dp * layout.cp, tp, cbytes == 2)
    if kind in ("none", "ddp"):
        grads = rank_params * sbytes
        backward_last = ((compute_s - recompute_s) * 2.0 / 3.0 + recompute_s) / m
        t = ring(cluster, "all_reduce", tp, layout.dp * layout.cp, grads, math.ceil(grads / DDP_BUCKET_BYTES))
        return exposed(t, backward_last, overlap, of_comm), 0, 0
    calls = blocks + 1  # one gather/reduction per block plus the root module (embeddings, norm, head)
    gather = ring(cluster, "all_gather", tp, shard, rank_params * cbytes, calls) if kind == "fsdp" else 0.0
    rbytes = cbytes if layout.zero_stage == 1 else sbytes
    reduce = (ring(cluster, "reduce_scatter", tp, shard, rank_params * rbytes, calls)
              + ring(cluster, "all_reduce", tp * shard, replicate, rank_params * rbytes / shard, calls))
    if layout.pp == 1:
        gathers = 2 * m if layout.zero_stage in (0, 3) else 1
        reductions = 1 if layout.zero_stage <= 1 else m
        hidden, fixed = gathers * gather + reductions * reduce, 0.0
    else:
        gathers, reductions = (m + min(layout.pp, m)) if layout.zero_stage in (0, 3) else 1, 1
        hidden, fixed = gathers * gather, reduce
    if kind == "replicas":
        gathers = 0  # the weights are whole: only compute-dtype casts, no communication
    return exposed(hidden, compute_s, overlap, of_comm) + fixed, gathers, reductions


def cp_comm(layout: Layout, cluster: Cluster, kv_bytes: float, blocks: int, rerun: float) -> float:
    """Context-parallel collective seconds of one micro-batch on the bottleneck rank: per block an
    all-gather of the ``kv_bytes`` of gathered keys and values (one call each) in forward, ``rerun`` more
    of them per block where forwards are re-run in backward, and a reduce-scatter of their gradients."""
    if layout.cp == 1:
        return 0.0
    gather = ring(cluster, "all_gather", layout.tp, layout.cp, kv_bytes, calls=2)
    scatter = ring(cluster, "reduce_scatter", layout.tp, layout.cp, kv_bytes, calls=2)
    return blocks * ((1.0 + rerun) * gather + scatter)
