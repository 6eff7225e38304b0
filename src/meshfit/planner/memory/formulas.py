"""Analytic per-rank memory: model states (ZeRO), activations per transformer layer, pipeline in-flight counts.

Functions of plain numbers, so that published figures can be reproduced exactly and a planner can reason
about models far too large to build. They give the idealised quantities of the papers they cite; how
meshfit's torch building blocks deviate (fp32 master weights as FSDP2's shards, FSDP2 gathering one block
at a time) is left to the code that maps a layout onto these functions.
"""

from __future__ import annotations

import functools
from fractions import Fraction

from meshfit.layout.precision import OPTIMIZERS, PRECISIONS, paper_state_bytes
from meshfit.layout.schedules import SCHEDULE_NAMES
from meshfit.models.config import ATTENTIONS

# Per-parameter bytes: layout/precision.py (here in the ZeRO paper's accounting, paper_state_bytes).


def _check_int(name: str, value: int, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer ≥ {minimum}")


def model_state_bytes(
    n_params: int, *, precision: str, optimizer: str, zero_stage: int, dp_shard: int
) -> dict[str, float]:
    """Bytes of weights, gradients and optimizer states one rank keeps for ``n_params`` parameters.

    ZeRO semantics (Rajbhandari et al. 2020, §5): stage 1 divides the optimizer term K (including the
    fp32 master weights of mixed precision) by ``dp_shard``, stage 2 also the gradients, stage 3 also the
    weights; stage 0 (DDP) replicates everything whatever ``dp_shard`` is. Returns ``params``, ``grads``
    and ``optim``. With Ψ = 7.5e9, N_d = 64 and mixed-precision Adam this gives the paper's Figure 1:
    120, 31.4, 16.6 and 1.9 GB for stages 0 to 3.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}; valid precisions: {', '.join(PRECISIONS)}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r}; valid optimizers: {', '.join(OPTIMIZERS)}")
    _check_int("n_params", n_params, 0)
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage!r} must be 0, 1, 2 or 3")
    _check_int("dp_shard", dp_shard, 1)
    weight, grad, optim = paper_state_bytes(precision, optimizer)
    n = dp_shard if zero_stage > 0 else 1

    def share(stage: int) -> int:
        # the term is sharded from this ZeRO stage on
        return n if zero_stage >= stage else 1

    return {
        "params": n_params * weight / share(3),
        "grads": n_params * grad / share(2),
        "optim": n_params * optim / share(1),
    }


# --- Activations -------------------------------------------------------------------------------------

RECOMPUTE = ("none", "selective", "full")

# How a saved tensor is divided across the t tensor-parallel ranks.
_SEQ = "seq"  # replicated under plain TP; sequence parallelism splits it along the sequence (÷t)
_TP = "tp"  # inside a column/row-parallel region: split across heads or the MLP width (÷t)
_CORE = "core"  # attention core (scores, softmax, its dropout): split by heads; selective recompute drops it


def _saved_tensors(s: int, b: int, h: int, a: int, p: Fraction, dropout: bool, attention: str,
                   family: str = "gpt", ffn: Fraction = Fraction(4), kv: Fraction = Fraction(1),
                   keys: Fraction | None = None, q: Fraction = Fraction(1),
                   qk_norm: bool = False) -> dict[str, tuple[Fraction, str]]:
    """Bytes each tensor saved for backward takes in one layer before any splitting, and how it splits.

    Korthikanti et al. 2022, §4.1 (GPT), with p = bytes per value (their 2) and 1-byte dropout masks.
    The Llama block is counted by the same rule (each op keeps the inputs its backward needs, shared
    inputs once): RMSNorms keep their inputs, K and V are ``kv`` = kv_heads / heads wide, and SwiGLU keeps
    the gate and up projections' outputs, the SiLU output and their product (4 tensors ``ffn`` = f/h
    wide, where GPT's GeLU MLP keeps 2 of width 4h); no dropout. ``q``: the query width over h (heads ×
    head_dim / h, 1 unless the head width is set apart from h / heads, as Qwen3 32B's); ``qk_norm``: the
    per-head query and key norms (Qwen3) keep their inputs, the q and k projections' outputs.
    """
    sbh = Fraction(s * b * h)
    gpt = family == "gpt"
    saved: dict[str, tuple[Fraction, str]] = {
        # Attention block, 11sbh + 5as²b for GPT at p = 2 (with its dropout mask and the core below).
        "ln1.input": (p * sbh, _SEQ),  # the norm keeps its input
        "attn.qkv_input": (p * sbh, _SEQ),  # Q, K and V projections share one input
        "attn.q": (p * sbh * q, _TP),  # QKᵀ needs both operands
        "attn.k": (p * sbh * q * kv, _TP),
        "attn.v": (p * sbh * q * kv, _TP),  # the probabilities × V matmul needs V
        "attn.proj_input": (p * sbh * q, _TP),  # output projection input (the attention context)
        # MLP block, 19sbh for GPT at p = 2 (with its dropout mask).
        "ln2.input": (p * sbh, _SEQ),
        "mlp.fc1_input": (p * sbh, _SEQ),
    }
    if qk_norm:
        saved["attn.q_norm_input"] = (p * sbh * q, _TP)
        saved["attn.k_norm_input"] = (p * sbh * q * kv, _TP)
    if gpt:
        saved["mlp.gelu_input"] = (ffn * p * sbh, _TP)  # 4h-wide first-linear output
        saved["mlp.fc2_input"] = (ffn * p * sbh, _TP)  # GeLU output
    else:
        for name in ("gate_output", "silu_output", "up_output", "fc2_input"):
            saved[f"mlp.{name}"] = (ffn * p * sbh, _TP)
    if dropout:
        # Dropout after the attention output projection and after the MLP keeps a one-byte mask each.
        saved["attn.dropout_mask"] = (sbh, _SEQ)
        saved["mlp.dropout_mask"] = (sbh, _SEQ)
    if attention == "eager":
        # One value per head, query and key: s keys per query row, or under context parallelism the
        # ``keys`` of the gathered sequence each local query chunk scores on average.
        scores = a * s * b * (Fraction(s) if keys is None else keys)
        # The QKᵀ scores themselves are not kept: softmax's backward needs only its output.
        saved["attn.softmax_output"] = (p * scores, _CORE)
        if dropout:
            saved["attn.softmax_dropout_mask"] = (scores, _CORE)
            saved["attn.softmax_dropout_output"] = (p * scores, _CORE)  # input of probabilities × V
        # Without dropout, the probabilities × V matmul reuses the softmax output already counted.
    else:
        # Flash attention recomputes scores and probabilities in its backward and regenerates its dropout
        # mask from the RNG state; it keeps one fp32 log-sum-exp per head and query row.
        saved["attn.logsumexp"] = (Fraction(4 * a * s * b), _CORE)
    return saved


def _validated_terms(s: int, b: int, h: int, a: int, t: int, sp: bool, recompute: str,
                     bytes_per_value: float, dropout: bool, attention: str, family: str = "gpt",
                     ffn: float = 4, kv: float = 1, keys: float | None = None, q: float = 1,
                     qk_norm: bool = False) -> dict[str, Fraction]:
    for name, value in (("s", s), ("b", b), ("h", h), ("a", a), ("t", t)):
        _check_int(name, value, 1)
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r}; valid: {', '.join(RECOMPUTE)}")
    if attention not in ATTENTIONS:
        raise ValueError(f"attention={attention!r}; valid: {', '.join(ATTENTIONS)}")
    if family not in ("gpt", "llama"):
        raise ValueError(f"family={family!r}; valid: gpt, llama")
    if family == "llama" and dropout:
        raise ValueError("dropout=True: the Llama block has no dropout")
    if isinstance(bytes_per_value, bool) or not bytes_per_value > 0:
        raise ValueError(f"bytes_per_value={bytes_per_value!r} must be > 0")
    # Exact rational arithmetic, so that the sum equals the papers' closed forms exactly.
    p = Fraction(bytes_per_value)
    if recompute == "full":
        # Only the layer input survives the forward; with SP it is the sequence-sharded residual stream.
        return {"layer_input": p * s * b * h / (t if sp else 1)}
    out = {}
    saved = _saved_tensors(s, b, h, a, p, dropout, attention, family, Fraction(ffn), Fraction(kv),
                           None if keys is None else Fraction(keys), Fraction(q), qk_norm)
    for name, (size, split) in saved.items():
        if split == _CORE and recompute == "selective":
            continue
        out[name] = size if split == _SEQ and not sp else size / t
    return out


def activation_terms_per_layer(
    *, s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False, recompute: str = "none",
    bytes_per_value: float = 2, dropout: bool = True, attention: str = "eager", family: str = "gpt",
    ffn: float = 4, kv: float = 1, keys: float | None = None, q: float = 1, qk_norm: bool = False,
) -> dict[str, float]:
    """Per-rank bytes of each tensor one GPT transformer layer keeps for its backward (one micro-batch).

    s: sequence length, b: micro-batch size, h: hidden size, a: attention heads, t: tensor-parallel
    degree, sp: sequence parallelism. ``recompute``: "none"; "selective" recomputes the attention core
    (Korthikanti et al.'s selective recomputation), so its terms are not kept; "full" keeps only the
    layer's input. The values add up to :func:`activation_bytes_per_layer`.
    """
    terms = _validated_terms(s, b, h, a, t, sp, recompute, bytes_per_value, dropout, attention, family, ffn,
                             kv, keys, q, qk_norm)
    return {name: float(value) for name, value in terms.items()}


# A plan search asks for the same few layer shapes tens of thousands of times (exact fractions are slow).
@functools.lru_cache(maxsize=4096, typed=True)  # typed: True and 1, 8.0 and 8 are validated apart
def activation_bytes_per_layer(
    *, s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False, recompute: str = "none",
    bytes_per_value: float = 2, dropout: bool = True, attention: str = "eager", family: str = "gpt",
    ffn: float = 4, kv: float = 1, keys: float | None = None, q: float = 1, qk_norm: bool = False,
) -> float:
    """Per-rank activation bytes one GPT-style transformer layer keeps for backward (one micro-batch).

    Summed from per-tensor terms (:func:`activation_terms_per_layer`). With the defaults (16-bit values,
    dropout, eager attention) it equals Korthikanti et al. 2022, Table 2, per layer:

    * no parallelism: sbh·(34 + 5as/h)
    * tensor parallel t: sbh·(10 + 24/t + 5as/(ht))
    * tensor + sequence parallel: sbh·(34/t + 5as/(ht))
    * selective recompute: sbh·(10 + 24/t), with SP sbh·34/t
    * full recompute: 2sbh (the layer input), with SP 2sbh/t (the paper's table lists 2sbh, without SP)

    ``bytes_per_value`` scales every stored value (masks stay one byte), ``dropout=False`` removes the
    masks and the dropout outputs, ``attention="flash"`` replaces the 5as²b attention core by a
    4asb-byte fp32 log-sum-exp. Embeddings, the final norm, the head and the loss are not included.
    ``family="llama"`` counts the Llama block by the same rule (see ``_saved_tensors``), with ``ffn`` =
    ffn_hidden / h and ``kv`` = kv_heads / heads (``q`` and ``qk_norm``: see ``_saved_tensors``). ``keys``: the keys each query row scores (eager
    attention), on average, when they are not the ``s`` queries themselves (context parallelism: ``s`` is a
    rank's part of the sequence, ``keys`` the prefix of the gathered one its chunks see).
    """
    terms = _validated_terms(s, b, h, a, t, sp, recompute, bytes_per_value, dropout, attention, family, ffn,
                             kv, keys, q, qk_norm)
    return float(sum(terms.values(), Fraction(0)))


# --- Pipeline schedules ------------------------------------------------------------------------------

SCHEDULES = SCHEDULE_NAMES


def pipeline_in_flight_microbatches(schedule: str, pp: int, stage: int, microbatches: int,
                                    virtual: int = 1) -> int:
    """Most micro-batches whose activations pipeline rank ``stage`` holds at once during a step.

    The unit is one micro-batch through one stage. With one stage per rank (gpipe, 1f1b) that is a
    micro-batch of the rank's layers; with ``virtual`` stages per rank (interleaved and V schedules) it is a
    micro-batch through one of the rank's stages, i.e. layers / (pp · virtual) layers, so the rank's peak
    activations ≈ result × (activations of one micro-batch through one of its stages).

    Literature:

    * gpipe: every forward runs before any backward: ``microbatches`` on every rank (Huang et al. 2019).
    * 1f1b: stage r runs pp - r warm-up forwards, then alternates backward and forward (Narayanan et al.
      2021, PipeDream-Flush): ``min(pp - stage, microbatches)``; the first stage holds pp, the last 1.
    * interleaved-1f1b (Narayanan et al. 2021, §2.2): the first stage holds
      (1 + (pp - 1)/(pp · virtual)) · pp micro-batches of a rank's layers, i.e. pp · virtual + pp - 1 in
      the unit above. The count below reproduces that for rank 0 when microbatches is a
      multiple of pp and at least 2 · pp (with fewer, the rank holds all M · virtual).
    * zbv (Qi et al. 2024): the same peak as 1F1B's first stage, pp micro-batches of a rank's layers
      = 2 · pp stages, on every rank once microbatches ≥ 2 · pp - 1.

    The exact counts below are an assumption where the papers give no figure (fewer micro-batches than
    the steady state needs, interleaved-zb, dualpipev): they are read off the operation order that torch
    2.13's schedules generate (``Schedule1F1B`` warm-up, ``_calculate_single_rank_operations`` of the
    multi-stage schedules), counting a forward's activations as alive until its full backward or, where
    the backward is split, until its weight-gradient step (torch keeps the autograd graph between the
    input- and weight-gradient steps). An overlapped forward+backward (dualpipev) counts the forward
    before the backward frees. With M micro-batches, rank r, v = virtual and
    ``rounds = max(1, M // pp)``, ``per_round = M // rounds``:

    * interleaved-1f1b: ``w = min((v - 1) · per_round + 2 · (pp - 1 - r), M · v)`` warm-up forwards, plus
      the steady state's forward that precedes the first backward when ``w < M · v``.
    * interleaved-zb: ``min(M · v, (v - 1) · per_round + pp)`` on every rank.
    * zbv: ``min(M + 1 + r, 2 · pp, 2 · M)``.
    * dualpipev: ``2 · pp + 1`` on every rank (it needs M ≥ 2 · pp).

    ``virtual`` must match what the schedule runs: 1 for gpipe and 1f1b, ≥ 2 for the interleaved
    schedules, 2 for zbv and dualpipev.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}; valid schedules: {', '.join(SCHEDULES)}")
    _check_int("pp", pp, 1)
    _check_int("microbatches", microbatches, 1)
    _check_int("virtual", virtual, 1)
    if not isinstance(stage, int) or isinstance(stage, bool) or not 0 <= stage < pp:
        raise ValueError(f"stage={stage!r} must be a pipeline rank in 0..{pp - 1}")
    m, r, v = microbatches, stage, virtual
    if schedule in ("gpipe", "1f1b"):
        if v != 1:
            raise ValueError(f"virtual={v}: {schedule} runs one stage per rank (virtual=1)")
        return m if schedule == "gpipe" else min(pp - r, m)
    if schedule in ("zbv", "dualpipev"):
        if v != 2:
            raise ValueError(f"virtual={v}: {schedule} runs exactly 2 stages per rank (virtual=2)")
        if schedule == "zbv":
            return min(m + 1 + r, 2 * pp, 2 * m)
        if m < 2 * pp:
            raise ValueError(f"microbatches={m}: dualpipev needs at least 2 · pp = {2 * pp} micro-batches")
        return 2 * pp + 1
    if v < 2:
        raise ValueError(f"virtual={v}: {schedule} needs ≥ 2 stages per rank")
    rounds = max(1, m // pp)
    if m % rounds:
        # torch refuses these: the micro-batches must split into equal rounds of about pp each
        raise ValueError(f"microbatches={m}: {schedule} needs a multiple of {rounds} (rounds of ~pp={pp})")
    per_round = m // rounds
    if schedule == "interleaved-zb":
        return min(m * v, (v - 1) * per_round + pp)
    warmup = _interleaved_warmup(pp, r, m, v)
    return warmup + (1 if warmup < m * v else 0)


def _interleaved_warmup(pp: int, rank: int, m: int, v: int, per_round: int | None = None) -> int:
    per_round = m // max(1, m // pp) if per_round is None else per_round
    return min((v - 1) * per_round + 2 * (pp - 1 - rank), m * v)


def rank_actions(pp: int, rank: int, microbatches: int, virtual: int, warmup: int | None = None,
                 rounds: int | None = None) -> tuple[tuple[str, int], ...]:
    """The order in which pipeline rank ``rank`` runs its micro-batches' forwards ("F") and full
    backwards ("B"), each on one of its ``virtual`` stages (0 = its first).

    With one stage (``virtual`` 1) it is the 1F1B shape: ``warmup`` forwards, then a backward and a
    forward in turn, then the remaining backwards (GPipe: warmup = every micro-batch). With several it is
    the interleaved 1F1B order torch 2.13's ``ScheduleInterleaved1F1B`` generates (warm-up forwards as in
    :func:`pipeline_in_flight_microbatches`, then a forward and a backward in turn; forwards take each
    stage for a round of micro-batches in order, backwards in reverse stage order), which
    `tests/test_planner_memory.py` checks against torch's op lists. ``rounds``, when given, runs only that
    many of the step's rounds of micro-batches (each of the step's size; interleaved only).
    """
    m, v = microbatches, virtual
    per_round = m // max(1, m // pp)
    if v == 1:
        w = min(m, m if warmup is None else warmup)
        return (("F", 0),) * w + (("B", 0), ("F", 0)) * (m - w) + (("B", 0),) * w
    if rounds is not None:
        m = per_round * min(rounds, m // per_round)
    w = _interleaved_warmup(pp, rank, m, v, per_round)
    forwards = [("F", (i // per_round) % v) for i in range(m * v)]
    backwards = [("B", v - 1 - (i // per_round) % v) for i in range(m * v)]
    steady = [op for pair in zip(forwards[w:], backwards, strict=False) for op in pair]
    return tuple(forwards[:w] + steady + backwards[m * v - w:])


def split_backward_states(pp: int, stage: int, microbatches: int, schedule: str = "zbv",
                          virtual: int = 2) -> tuple[tuple[int, int], ...]:
    """A split-backward schedule's states that bound pipeline rank ``stage``'s activations: pairs (forwards
    whose backward has not begun, input-gradient steps whose weight-gradient step has not run), in units of
    one micro-batch through one of the rank's stages.

    With n the rank's in-flight count: interleaved-zb (n = v·pp when pp divides m) splits as many as its
    rank, (n − r, r) and (n − r − 1, r + 1); dualpipev (n = 2·pp + 1) runs its steady state as whole
    backwards and splits only its last micro-batches: (n, 0), (2·pp − 1, 1) but on its last rank, and
    (pp − j, j) for j up to r + 1.
    Both are the states of torch 2.13's ``ScheduleInterleavedZeroBubble`` and ``ScheduleDualPipeV`` orders
    (`tests/test_planner_memory.py`: pp 2–5, v 2–4, m from pp and 2·pp).

    Between its input- and weight-gradient steps torch keeps a micro-batch's autograd graph (every saved
    tensor, recomputed ones included) and the gradients of the weights' outputs, so such a micro-batch
    weighs more than one only waiting for its backward; the rank's peak is the heaviest state. zbv: read
    off the operation order torch 2.13's ``ScheduleZBVZeroBubble`` generates (`tests/test_planner_memory.py`
    checks this closed form against it for pp 1-8 and 1 to 3·pp micro-batches), keeping the states that
    can be the heaviest when a split micro-batch weighs at least a waiting one: with n =
    min(M + 1 + r, 2·pp, 2·M) micro-batches in flight, (n, 0) and (n − 1, 1); and, where the rank ever
    holds two or more split micro-batches, the state with the most of them. Its waiting and split counts
    sum to S = max(2·M' − 3·pp + r + 2, M' − pp + 1) with M' = min(M, 2·pp − 1), of which
    k = max(0, M' − pp − r) are waiting (for M ≥ 2·pp: (pp − r − 1, 2·r + 1)).
    """
    _check_int("pp", pp, 1)
    _check_int("microbatches", microbatches, 1)
    if not 0 <= stage < pp:
        raise ValueError(f"stage={stage!r} must be a pipeline rank in 0..{pp - 1}")
    m, r = microbatches, stage
    if schedule not in ("zbv", "interleaved-zb", "dualpipev"):
        raise ValueError(f"schedule={schedule!r} does not split its backward; valid: zbv, interleaved-zb, dualpipev")
    if schedule != "zbv":
        n = pipeline_in_flight_microbatches(schedule, pp, r, m, virtual)
        if schedule == "interleaved-zb":
            j = min(r, n - 1)  # fewer micro-batches than ranks (not a layout meshfit runs) split fewer
            return ((n - j, j), (n - j - 1, j + 1))
        last = r == pp - 1
        return ((n, 0),) + (() if last else ((2 * pp - 1, 1),)) + tuple((pp - j, j) for j in range(1 if last else 2,
                                                                                                   r + 2))
    n = min(m + 1 + r, 2 * pp, 2 * m)
    states = [(n, 0), (n - 1, 1)]
    steady = min(m, 2 * pp - 1)
    total = max(2 * steady - 3 * pp + r + 2, steady - pp + 1)
    waiting = max(0, steady - pp - r)
    if total - waiting >= 2:
        states.append((waiting, total - waiting))
    return tuple(states)
