"""Cross-field checks of a config against the world size, done once before any rank starts.

`resolve_run` turns a Config plus a world size into the concrete shape of the run (degrees, local and
micro batch, accumulation steps) or raises ConfigError naming the field and the values that would work.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from meshfit.config import Config, ConfigError
from meshfit.data import DataError, check_files
from meshfit.layout.model_fit import expert_parallel_error, moe_layout_error, pipeline_model_error, seq_len_error
from meshfit.layout.rules import default_zero_stage, layout_error
from meshfit.layout.schedules import default_virtual_stages, least_microbatches
from meshfit.models import ModelConfig
from meshfit.models.config import pad_vocab_for_tp
from meshfit.models.hf_weights import check_hf
from meshfit.parallel.compile import toolchain_error
from meshfit.parallel.context_parallel import cp_degree_error
from meshfit.parallel.dims import ParallelDims, divisors
from meshfit.parallel.pipeline_parallel import StagePlan, plan_stages
from meshfit.parallel.tensor_parallel import tp_degree_error
from meshfit.train.data_mix import check_mixture
from meshfit.train.documents import document_eos
from meshfit.train.held_out import check_held_out


@dataclass(frozen=True)
class RunShape:
    dims: ParallelDims
    local_batch: int  # sequences per data-parallel rank per optimizer step
    micro_batch: int  # sequences per forward pass
    accum_steps: int  # micro-batches per optimizer step
    zero_stage: int  # resolved: 0 DDP, 1 optimizer states, 2 + gradients, 3 + parameters
    mixed_precision: bool  # bf16 compute with fp32 master weights (parallel.mixed_precision or train.precision)
    model: ModelConfig  # the model as built: with its vocabulary padded for tensor parallelism
    stages: StagePlan | None = None  # pipeline stages (pp > 1)
    microbatches: int = 1  # pipeline micro-batches per optimizer step
    eos_id: int | None = None  # data.document_mask: the EOS id that closes each document; None: no mask


def _pipeline(cfg: Config, dims: ParallelDims, model: ModelConfig, local_batch: int) -> tuple[StagePlan, int]:
    pipe = cfg.pipeline
    virtual = pipe.virtual_stages or default_virtual_stages(pipe.schedule)
    if error := pipeline_model_error(model, dims.pp, virtual):
        raise ConfigError(error)
    if cfg.train.micro_batch is not None:
        raise ConfigError("train.micro_batch does not apply with parallel.pp > 1: set pipeline.microbatches "
                          "(micro-batches per step on each pipeline) instead")
    n_stages = dims.pp * virtual
    counts = pipe.layers_per_stage
    if counts is not None and (len(counts) != n_stages or sum(counts) != model.n_layers or min(counts) < 1):
        raise ConfigError(f"pipeline.layers_per_stage={counts}: give {n_stages} positive counts "
                          f"(one per stage) that add up to {model.n_layers} layers")
    micro = pipe.microbatches or local_batch
    # The values offered must pass every check below: divisors of the batch, and ≥ pp unless GPipe.
    least = least_microbatches(pipe.schedule, dims.pp)
    valid = [d for d in divisors(local_batch) if d >= least]
    if local_batch % micro or micro < least:
        why = (f"does not divide the per-pipeline batch {local_batch} (train.global_batch / data-parallel degree)"
               if local_batch % micro else
               f"is fewer than pp={dims.pp}: schedule {pipe.schedule} needs at least pp={dims.pp} micro-batches "
               "to fill the pipeline")
        fix = (f"valid values: {', '.join(map(str, valid))}" if valid else
               f"no value works with a per-pipeline batch of {local_batch}: raise train.global_batch to a "
               f"multiple of {dims.pp * dims.dp} (pp × data-parallel degree) or use pipeline.schedule=gpipe")
        given = f"={micro}" if pipe.microbatches else f" (unset: the per-pipeline batch, {micro})"
        raise ConfigError(f"pipeline.microbatches{given} {why}; {fix}")
    plan = plan_stages(model, cfg.train.seq_len, dims.pp, virtual, pipe.schedule, counts)
    return plan, micro


def _layout(cfg: Config, dims: ParallelDims) -> int:
    """The resolved ZeRO stage, after the layout rules every entry point shares (layout/rules.py)."""
    par, pipe = cfg.parallel, cfg.pipeline
    stage = par.zero_stage if par.zero_stage is not None else default_zero_stage(dims.dp_shard, dims.cp)
    error = layout_error(dp_shard=dims.dp_shard, dp_replicate=dims.dp_replicate, tp=dims.tp, pp=dims.pp,
                         zero_stage=stage, offload=par.offload,
                         sp=par.sp, loss_parallel=par.loss_parallel, schedule=pipe.schedule,
                         virtual_stages=pipe.virtual_stages or default_virtual_stages(pipe.schedule),
                         cp=dims.cp, ep=dims.ep, mixed_precision=par.mixed_precision or cfg.train.precision == "bf16",
                         activation_checkpointing=par.activation_checkpointing, config_names=True)
    if error:
        raise ConfigError(error)
    return stage


def _batch_shape(cfg: Config, dims: ParallelDims, micro_batch: int | None) -> tuple[int, int, int]:
    gb, dp = cfg.train.global_batch, dims.dp
    if gb % dp:
        multiples = ", ".join(str(dp * k) for k in range(1, 5))
        raise ConfigError(
            f"train.global_batch={gb} is not divisible by the data-parallel degree {dp} "
            f"(dp_replicate × dp_shard); valid global_batch values are multiples of {dp}: {multiples}, …"
        )
    local = gb // dp
    micro = micro_batch or local
    if local % micro:
        raise ConfigError(
            f"train.micro_batch={micro} does not divide the per-rank batch {local} (global_batch {gb} / "
            f"data-parallel degree {dp}); valid micro_batch values: {', '.join(map(str, divisors(local)))}"
        )
    return local, micro, local // micro


def _check_data(cfg: Config, vocab_size: int) -> None:
    data = cfg.data
    if data.source == "synthetic" and data.shuffle:
        raise ConfigError("data.shuffle does not apply to data.source=synthetic: its sequences are drawn from the "
                          "seeded chain one by one, in no file order; leave data.shuffle unset")
    if data.sources is not None:
        check_mixture(cfg)
    elif data.source in ("text", "tokens"):
        what = ("a UTF-8 .txt file or a folder of them" if data.source == "text"
                else "a .npy or .bin token file, or a folder `meshfit prepare` wrote")
        if not data.path:
            raise ConfigError(f"data.path is required when data.source={data.source!r}: give {what}")
        if not Path(data.path).exists():
            raise ConfigError(f"data.path={data.path!r} does not exist; give {what}")
    if data.source == "text" and data.tokenizer == "byte" and vocab_size < 256:
        raise ConfigError(
            f"data.tokenizer=byte needs model.vocab_size ≥ 256 (got {vocab_size}); raise model.vocab_size "
            "or use data.tokenizer=bpe"
        )
    if data.tokenizer not in ("byte", "bpe") and data.source != "synthetic":
        _check_tokenizer(data, vocab_size)
    if data.source != "synthetic" and data.sources is None:
        # The files' shape (dtype, size, length) is checked here, once, rather than on every rank.
        try:
            check_files(data.source, data.path, cfg.train.seq_len, data.tokenizer, data.token_dtype, vocab_size)
        except DataError as exc:
            raise ConfigError(f"data.path: {exc}") from None


def _check_tokenizer(data: Any, vocab_size: int) -> None:
    """A tokenizer folder is readable, fits the model's vocabulary, and is the one prepared shards were
    made with."""
    from meshfit.data.shards import is_prepared, read_metadata
    from meshfit.data.tokenizer import check_vocabulary, load_tokenizer

    try:
        tokenizer = load_tokenizer(data.tokenizer)
        check_vocabulary(tokenizer, vocab_size)
        if data.source == "tokens" and data.path and is_prepared(data.path):
            prepared = read_metadata(data.path)["tokenizer"]
            if prepared["sha256"] != tokenizer.digest:
                raise DataError(f"data.tokenizer={data.tokenizer} is not the tokenizer data.path={data.path} was "
                                f"prepared with ({prepared['path']}, sha256 {prepared['sha256'][:12]}…, now "
                                f"{tokenizer.digest[:12]}…); prepare the data again, or use that tokenizer")
    except DataError as exc:
        raise ConfigError(str(exc)) from None


def _check_init_from(cfg: Config, model: Any) -> None:
    """The starting weights' files, headers, names and shapes, before any rank reads them."""
    if cfg.model.init_from:
        try:
            check_hf(cfg.model.init_from, model)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


def _on_cpu(device: str) -> bool:
    """Whether train.device puts the run on CPU ranks."""
    from meshfit.train.dist import wants_cuda

    return not wants_cuda(device)


def _check_memory(cfg: Config) -> None:
    train = cfg.train
    if train.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda, but no CUDA device is visible to torch on this machine; use "
                          "train.device=cpu or auto")
    on_cpu = _on_cpu(train.device)
    if train.memory_tracking == "off" and train.memory_budget is not None and on_cpu:
        raise ConfigError("train.memory_tracking=off cannot enforce train.memory_budget on CPU (the memory tracker "
                          "is what enforces it there); use train.memory_tracking=auto or full, or drop the budget")


def _check_compile(cfg: Config) -> None:
    """train.compile: some step must run compiled, and this machine must be able to build the kernels."""
    train = cfg.train
    if not train.compile:
        return
    on_cpu = _on_cpu(train.device)
    # The memory tracker is a TorchDispatchMode, under which torch.compile does not run: tracked steps run
    # the blocks eagerly. With every step tracked no step would run compiled.
    if train.memory_tracking == "full" or (train.memory_budget is not None and on_cpu):
        why = ("train.memory_tracking=full tracks every step" if train.memory_tracking == "full" else
               "train.memory_budget on CPU is enforced by tracking every step")
        raise ConfigError(f"train.compile=true: {why}, and tracked steps run the blocks eagerly (torch.compile "
                          "cannot run under the per-operator memory tracker), so no step would run compiled; use "
                          "train.memory_tracking=auto or off" + (" and drop the budget" if train.memory_budget
                                                                  is not None and on_cpu else ""))
    if error := toolchain_error("cpu" if on_cpu else "cuda"):
        raise ConfigError(error)


def _padded(cfg: Config, model: ModelConfig, tp: int) -> ModelConfig:
    """The vocabulary padded to a multiple of tp, unless model.pad_vocab_to was set (then tp must divide the
    padded size: a fixed padding keeps checkpoints loadable under every layout that divides it)."""
    if cfg.model.pad_vocab_to is None:
        return pad_vocab_for_tp(model, tp)
    if model.padded_vocab % tp:
        fits = [m for m in (tp, 2 * tp, 64, 128, 256) if m % tp == 0]
        raise ConfigError(f"model.pad_vocab_to={model.pad_vocab_to} pads the vocabulary to {model.padded_vocab} "
                          f"rows, which parallel.tp={tp} does not divide; use a multiple of {tp} "
                          f"(e.g. {', '.join(map(str, fits))}) or leave it unset to pad to a multiple of tp")
    return model


def resolve_run(cfg: Config, world_size: int) -> RunShape:
    """Validate `cfg` for `world_size` ranks; raises ConfigError with the field and valid choices."""
    p = cfg.parallel
    try:
        dims = ParallelDims.resolve(p.dp_replicate, p.dp_shard, p.tp, p.pp, world_size, p.zero_stage, p.cp, p.ep)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    model = cfg.model.resolve()
    if error := seq_len_error(cfg.train.seq_len, model, "train.seq_len", "model.max_seq_len=…"):
        raise ConfigError(error)
    if error := moe_layout_error(model, dims.tp, dims.pp, dims.cp):
        raise ConfigError(error)
    _check_data(cfg, model.vocab_size)
    check_held_out(cfg)
    _check_memory(cfg)
    _check_compile(cfg)
    stage = _layout(cfg, dims)
    if error := expert_parallel_error(model, dims.ep, dims.dp_shard * dims.cp, p.offload):
        raise ConfigError(error)
    if dims.cp > 1 and (error := cp_degree_error(dims.cp, cfg.train.seq_len)):
        raise ConfigError(error)
    # Under context parallelism sequence parallelism splits each rank's part of the sequence.
    seq_field = "train.seq_len" if dims.cp == 1 else "train.seq_len/parallel.cp"
    if dims.tp > 1 and (error := tp_degree_error(model, dims.tp, cfg.train.seq_len // dims.cp, p.sp, seq_field)):
        raise ConfigError(error)
    model = _padded(cfg, model, dims.tp)
    _check_init_from(cfg, model)
    stages, microbatches = None, 1
    if dims.pp > 1:
        local = _batch_shape(cfg, dims, None)[0]
        stages, microbatches = _pipeline(cfg, dims, model, local)
        micro, accum = local, 1
    else:
        local, micro, accum = _batch_shape(cfg, dims, cfg.train.micro_batch)
    mixed = cfg.parallel.mixed_precision or cfg.train.precision == "bf16"
    return RunShape(dims=dims, local_batch=local, micro_batch=micro, accum_steps=accum, zero_stage=stage,
                    mixed_precision=mixed, model=model, stages=stages, microbatches=microbatches,
                    eos_id=_eos(cfg, model.vocab_size))


def _eos(cfg: Config, vocab_size: int) -> int | None:
    eos = document_eos(cfg)
    if eos is not None and eos >= vocab_size:
        field = "data.eos_id" if cfg.data.eos_id is not None else "the data's EOS id"
        raise ConfigError(f"{field} {eos} is not a token of the model's vocabulary (model.vocab_size={vocab_size}); "
                          "give the id the data's documents end with")
    return eos
