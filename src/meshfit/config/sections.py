"""The run configuration's sections (model, parallel, pipeline, train, data, checkpoint, metrics): each key
typed, with its default and its bounds."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from meshfit.config.files import ConfigError
from meshfit.data.blend import DEFAULT_BLOCK
from meshfit.layout.data_parallel_kind import DEFAULT_MAX_UNIT_PARAMS
from meshfit.layout.recompute import AC_EVERY, AC_MODES
from meshfit.layout.schedules import SCHEDULES
from meshfit.util.units import parse_bytes

# A count of steps beyond this is a typo (the longest published pre-training runs take about 10^6 steps);
# any other integer beyond 2^53 could not even be held exactly by the float arithmetic the planner does.
MAX_STEPS = 10**9
MAX_INT = 2**53
STEP_COUNTS = ("steps", "stop_after", "warmup_steps", "log_every", "eval_every", "interval")


def _takes(annotation: Any, kind: type) -> bool:
    """Whether a field's annotation admits values of `kind` (bool, or a Literal / Optional around it)."""
    return annotation is kind or any(_takes(arg, kind) for arg in typing.get_args(annotation))


class _Section(BaseModel):
    # extra="forbid" turns a typo such as `train.stpes` into an error naming the unknown key;
    # allow_inf_nan=False refuses ±inf and NaN in every float key (none of them means anything infinite).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_as_number(cls, value: Any, info: ValidationInfo) -> Any:
        # Python's bool is an int: `steps: true` in YAML would otherwise train 1 step.
        if isinstance(value, bool) and not _takes(cls.model_fields[info.field_name].annotation, bool):
            raise ValueError(f"must be a number, not the boolean {str(value).lower()}")
        return value

    @field_validator("*")
    @classmethod
    def _sane_count(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            limit = MAX_STEPS if info.field_name in STEP_COUNTS else MAX_INT
            if abs(value) > limit:
                raise ValueError(f"{value} is beyond any real run (at most {limit:,})")
        return value


class ModelSection(_Section):
    """A named preset, or the model of an init_from folder's config.json, optionally with any of its
    dimensions overridden (for an init_from model, only where they agree with its config.json)."""

    # Unset: the model of init_from's config.json when init_from names a folder, else "tiny".
    preset: str | None = None
    family: Literal["llama", "gpt"] | None = None
    dim: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    vocab_size: int | None = None
    ffn_hidden: int | None = None
    max_seq_len: int | None = None
    tie_embeddings: bool | None = None
    dropout: float | None = None
    norm_eps: float | None = None
    rope_theta: float | None = None
    # Pad the vocabulary to a multiple of this (tensor parallelism splits it by rows). Unset: padded to a
    # multiple of parallel.tp only when tp does not divide it.
    pad_vocab_to: int | None = None
    # Attention kernel: flash (torch's fused scaled_dot_product_attention) or eager (scores materialised).
    attention: str | None = None  # checked by ModelConfig.validate
    # Llama-family variants (models/config.py): explicit head width, q/k/v biases, q/k norms, RoPE scaling
    # ("none", "linear", "llama3") with its parameters, and the original model's attention window.
    head_dim: int | None = None
    qkv_bias: bool | None = None
    qk_norm: bool | None = None
    rope_scaling: str | None = None
    rope_factor: float | None = None
    rope_low_freq_factor: float | None = None
    rope_high_freq_factor: float | None = None
    rope_original_max_seq_len: int | None = None
    sliding_window: int | None = None
    qk_norm_scope: str | None = None  # "head" (Qwen3) or "projection" (OLMoE)
    # Mixture of Experts (models/config.py, models/moe.py): set moe_experts to make every block after the
    # first moe_dense_layers a Mixture-of-Experts block; checked by ModelConfig.validate.
    moe_experts: int | None = None
    moe_top_k: int | None = None
    moe_ffn_hidden: int | None = None
    moe_shared_experts: int | None = None
    moe_dense_layers: int | None = None
    moe_score: str | None = None
    moe_norm_topk: bool | None = None
    moe_route_scale: float | None = None
    moe_capacity_factor: float | None = None
    moe_aux_loss_coeff: float | None = None
    moe_bias_update_rate: float | None = None
    # Start from these weights instead of random ones: a Hugging Face model folder (config.json +
    # safetensors, as `meshfit export` writes), whose config.json is then the model; or one safetensors
    # file of the model above.
    init_from: str | None = None

    def resolve(self):  # -> meshfit.models.ModelConfig (import kept local: models import torch)
        """The model: the preset's (or init_from's config.json's) ModelConfig with this section's overrides
        applied and validated."""
        from meshfit.config.model_source import resolve_model

        return resolve_model(self)


def _degree(value: int | None) -> int | None:
    if value is not None and (value == 0 or value < -1):
        raise ValueError("must be a positive degree, or -1 for 'the rest of the world size'")
    return value


def _one_of(value: str, valid: tuple[str, ...]) -> str:
    if value not in valid:
        raise ValueError(f"must be one of {', '.join(repr(v) for v in valid)}")
    return value


class ParallelSection(_Section):
    """The layout: degrees of each parallel dimension (product = world size) and how state is kept."""

    dp_replicate: int = 1
    # None (unset): data parallelism takes the ranks the other degrees leave (layout/rules.py's
    # data_parallel_rest): dp_shard, or dp_replicate when zero_stage=0 asks for DDP replicas.
    dp_shard: int | None = None
    tp: int = 1
    pp: int = 1
    # Context parallelism: each sequence split over cp ranks (parallel/context_parallel.py); they hold the
    # same weights, sharded with dp_shard when zero_stage ≥ 1.
    cp: int = 1
    # Expert parallelism: each Mixture-of-Experts block's routed experts split over ep of the dp_shard × cp
    # ranks (parallel/expert_parallel.py); it takes no ranks of its own, so ep divides dp_shard × cp.
    ep: int = 1
    # 0 = DDP, 1 = optimizer states sharded, 2 = + gradients, 3 = + parameters (FSDP). None: 3 when
    # dp_shard > 1, else 0. Sharding happens across dp_shard; dp_replicate replicates (HSDP).
    zero_stage: int | None = None
    offload: bool = False  # sharded parameters, gradients and optimizer states live in host memory
    mixed_precision: bool = False  # bf16 compute, fp32 master weights and reductions
    activation_checkpointing: str = "none"  # one of layout/recompute.py's AC_MODES
    ac_every: int = AC_EVERY  # selective: checkpoint every ac_every-th transformer block of each stage
    sp: bool = False  # sequence parallelism for norms, dropout and the residual stream (needs tp > 1)
    # Mixed precision, ZeRO-2/3: gradients reduce-scattered in fp32, or in the compute dtype (bf16) as
    # DeepSpeed does. Stage 1 always reduces in bf16.
    reduce_dtype: Literal["fp32", "compute"] = "fp32"
    # A block with more parameters is sharded as smaller FSDP units (parallel/fsdp_units.py); null: one per block.
    max_unit_params: int | None = Field(DEFAULT_MAX_UNIT_PARAMS, ge=1)
    loss_parallel: bool = False  # cross-entropy on vocabulary-sharded logits (needs tp > 1)

    _check = field_validator("dp_replicate", "dp_shard", "tp", "pp", "cp")(_degree)

    @field_validator("ep")
    @classmethod
    def _ep(cls, value: int) -> int:
        if value < 1:
            raise ValueError("must be ≥ 1 (1: every expert on every data-parallel rank)")
        return value

    @field_validator("zero_stage")
    @classmethod
    def _stage(cls, value: int | None) -> int | None:
        if value is not None and value not in (0, 1, 2, 3):
            raise ValueError("must be 0 (DDP), 1 (optimizer states), 2 (+ gradients) or 3 (+ parameters, FSDP)")
        return value

    @field_validator("activation_checkpointing")
    @classmethod
    def _ac(cls, value: str) -> str:
        return _one_of(value, AC_MODES)

    @field_validator("ac_every")
    @classmethod
    def _every(cls, value: int) -> int:
        if value < 1:
            raise ValueError("must be ≥ 1 (1 checkpoints every block)")
        return value


class PipelineSection(_Section):
    """Pipeline parallelism (used when parallel.pp > 1)."""

    schedule: str = "1f1b"  # one of layout/schedules.py's SCHEDULES
    microbatches: int | None = None  # per optimizer step on each pipeline; None = one sequence each
    virtual_stages: int | None = None  # stages per rank; None = 1, or 2 for interleaved and V schedules
    layers_per_stage: list[int] | None = None  # override of the balanced split, one entry per stage

    @field_validator("schedule")
    @classmethod
    def _schedule(cls, value: str) -> str:
        return _one_of(value, SCHEDULES)

    @field_validator("microbatches", "virtual_stages")
    @classmethod
    def _positive_opt(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError("must be a positive integer")
        return value

    @field_validator("layers_per_stage", mode="before")
    @classmethod
    def _layers(cls, value: Any) -> Any:
        if isinstance(value, str):  # --set pipeline.layers_per_stage=3,2,2,1
            try:
                return [int(x) for x in value.replace("[", "").replace("]", "").split(",") if x.strip()]
            except ValueError:
                raise ValueError("write the layers of each stage as integers, e.g. 3,2,2,1") from None
        return value


class TrainSection(_Section):
    steps: int = 20
    seed: int = Field(0, ge=0)
    global_batch: int = 8
    micro_batch: int | None = None  # sequences per rank per forward; None = the whole local batch
    seq_len: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = Field(0.1, ge=0, le=1)  # the final lr as a fraction of lr
    warmup_steps: int = Field(2, ge=0)
    weight_decay: float = Field(0.1, ge=0)
    grad_clip: float = Field(1.0, ge=0)  # 0 = no clipping
    precision: Literal["fp32", "bf16"] = "fp32"
    memory_budget: int | None = None  # bytes of tracked tensor memory per rank
    # How step memory is measured (memory/meter.py): auto = from the allocator's counters on every step on
    # CUDA, else as ops; ops = the per-operator tracker on the first memory_tracked_steps steps of a launch,
    # and every step when a CPU budget is enforced; full = the per-operator tracker every step; off = never.
    memory_tracking: Literal["auto", "ops", "full", "off"] = "auto"
    memory_tracked_steps: int = 3
    device: Literal["auto", "cpu", "cuda"] = "auto"
    peak_flops: float | None = Field(None, gt=0)  # per device, for MFU; None = measured (CPU) or catalog (GPU)
    log_every: int = 1
    stop_after: int | None = None  # end this launch after this many steps (the LR schedule still spans `steps`)
    on_nonfinite: Literal["stop", "skip"] = "stop"  # a NaN/Inf loss or gradient on any rank: stop, or skip the step
    # A rank that makes no progress for this long (a step, a collective, a save) is hung: every rank
    # reports it and exits non-zero.
    timeout_s: float = 600.0
    # Validation loss on held-out data (data.val_path / data.val_fraction; synthetic data has its own
    # held-out stream) after every eval_every-th step; 0 = never. Each evaluation averages eval_batches
    # global batches, the same ones every time, so the values form one comparable curve.
    eval_every: int = Field(0, ge=0)
    eval_batches: int = 4
    # torch.compile each transformer block (parallel/compile.py); the first steps, which compile, are
    # reported once (`compile_s`) and left out of step-time figures.
    compile: bool = False

    @field_validator("memory_budget", mode="before")
    @classmethod
    def _budget(cls, value: Any) -> int | None:
        if value is None or (isinstance(value, str) and value.lower() in ("", "none", "null")):
            return None
        size = parse_bytes(value)
        if size <= 0:
            raise ValueError("must be a positive size such as 300MiB or 2GB")
        return size

    @field_validator("timeout_s")
    @classmethod
    def _timeout(cls, value: float) -> float:
        if value <= 0:
            raise ValueError("must be a positive number of seconds")
        return value

    @field_validator("steps", "global_batch", "seq_len", "log_every", "memory_tracked_steps", "eval_batches")
    @classmethod
    def _positive(cls, value: int) -> int:
        if value <= 0:
            raise ValueError("must be a positive integer")
        return value

    @field_validator("micro_batch", "stop_after")
    @classmethod
    def _micro(cls, value: int | None) -> int | None:
        if value is not None and value <= 0:
            raise ValueError("must be a positive integer, or null for none")
        return value

    @field_validator("lr")
    @classmethod
    def _lr(cls, value: float) -> float:
        # lr=0 would train nothing while looking like a run; the schedule's floor is min_lr_ratio instead.
        if not value > 0:
            raise ValueError("must be > 0, e.g. 3e-3 (the peak learning rate; the schedule ends at min_lr_ratio · lr)")
        return value


class SourceEntry(_Section):
    """One source of a weighted mixture (data.sources)."""

    path: str  # what data.path accepts, read with the data section's source, tokenizer and token_dtype
    weight: float = Field(gt=0)  # relative: a mixture's weights need not sum to 1
    val_fraction: float = Field(0.0, ge=0, lt=1)  # its last share of tokens held out (then not trained on)


class DataSection(_Section):
    source: Literal["synthetic", "text", "tokens"] = "synthetic"
    path: str | None = None
    # Instead of `path`: a weighted mixture, [{path, weight, val_fraction}, …] (data/blend.py); on the
    # command line as YAML, e.g. --set 'data.sources=[{path: a.npy, weight: 3}, {path: b.npy, weight: 1}]'.
    sources: list[SourceEntry] | None = None
    # Sequences per block of the blend: in each, every source gets its share of them, rounded. At most
    # 10^7: each rank holds a table of 16 bytes per sequence of the block it reads.
    mix_block: int = Field(DEFAULT_BLOCK, ge=1, le=10**7)
    # Read the windows of each epoch in a seeded order (data/windows.py); unset: on for a prepared data
    # folder (one holding meshfit-data.json), off for anything else (file order).
    shuffle: bool | None = None
    # byte, bpe (trained on data.path's text), a Hugging Face tokenizer folder (tokenizer.json), or `model`:
    # the tokenizer in model.init_from's folder. Folders are checked before the ranks start.
    tokenizer: str = "byte"
    token_dtype: Literal["uint16", "uint32", "int32", "int64"] | None = None
    # Held-out data for train.eval_every: a file (or folder) like `path`, read with the same source,
    # tokenizer and token_dtype; or the last val_fraction of `path`'s tokens, then not trained on.
    val_path: str | None = None
    val_fraction: float = Field(0.0, ge=0, lt=1)
    # Packed documents kept apart (data/boundaries.py): attention stays inside each document, positions
    # restart at each, and the prediction across a boundary is not counted. Needs the data's EOS id: a
    # prepared folder's or a tokenizer folder's, or `eos_id` for a raw token file.
    document_mask: bool = False
    eos_id: int | None = Field(None, ge=0)

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must be byte, bpe, model (model.init_from's tokenizer) or a tokenizer folder")
        return value

    @field_validator("sources", mode="before")
    @classmethod
    def _sources(cls, value: Any) -> Any:
        if isinstance(value, str):  # --set data.sources=[{path: a.npy, weight: 1}, …]
            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError as exc:
                raise ValueError(f"write the sources as a YAML list, e.g. [{{path: a.npy, weight: 3}}, "
                                 f"{{path: b.npy, weight: 1}}] ({exc.__class__.__name__})") from None
        if value is not None and not value:
            raise ValueError("lists no source; give at least one {path, weight}, or leave data.sources unset "
                             "and give data.path")
        return value


class CheckpointSection(_Section):
    """Distributed checkpoints: model, optimizer, LR schedule, data position, RNG states and step."""

    interval: int = 0  # save every `interval` steps; 0 = only at the end
    at_end: bool = True  # save after the last step
    keep_latest: int = 2  # complete checkpoints kept (older ones are deleted); ≥ 2 so one can fall back
    async_save: bool = False  # write in the background while training goes on
    dir: str | None = None  # default: RUN_DIR/checkpoints
    resume: bool = False  # continue from the latest complete checkpoint in `dir` (if there is one)
    resume_from: str | None = None  # continue from exactly this checkpoint folder (no fallback)
    # A resume continues only on the data its checkpoint was saved on (path, size, contents, tokenizer),
    # unless this is set (--new-data): then the first resumed step's metrics record what changed.
    new_data: bool = False

    @field_validator("interval")
    @classmethod
    def _interval(cls, value: int) -> int:
        if value < 0:
            raise ValueError("must be ≥ 0 steps (0 saves only at the end)")
        return value

    @field_validator("keep_latest")
    @classmethod
    def _keep(cls, value: int) -> int:
        if value < 2:
            raise ValueError("must be ≥ 2: the previous checkpoint is the fallback when the latest is damaged")
        return value


class MetricsSection(_Section):
    """Where rank 0 reports each step besides metrics.jsonl."""

    # The packages are checked when training starts, not here, so a run's config.yaml still loads on a
    # machine without them. Unset names fall back to the tracker's own environment variable, then to the
    # default named beside them (as Hugging Face's Trainer reads WANDB_PROJECT and MLFLOW_TRACKING_URI).
    tensorboard: bool = False  # also write TensorBoard event files to RUN_DIR/tensorboard
    wandb: bool = False  # also log to a Weights & Biases run (pip install 'meshfit[wandb]')
    wandb_project: str | None = Field(None, min_length=1)  # $WANDB_PROJECT, else "meshfit"
    wandb_entity: str | None = Field(None, min_length=1)  # $WANDB_ENTITY, else the account's default
    mlflow: bool = False  # also log to an MLflow run (pip install 'meshfit[mlflow]')
    mlflow_tracking_uri: str | None = Field(None, min_length=1)  # $MLFLOW_TRACKING_URI, else RUN_DIR/mlruns
    mlflow_experiment: str | None = Field(None, min_length=1)  # $MLFLOW_EXPERIMENT_NAME, else "meshfit"
    run_name: str | None = Field(None, min_length=1)  # the W&B and MLflow run's name; default RUN_DIR's name


class Config(_Section):
    model: ModelSection = ModelSection()
    parallel: ParallelSection = ParallelSection()
    pipeline: PipelineSection = PipelineSection()
    train: TrainSection = TrainSection()
    data: DataSection = DataSection()
    checkpoint: CheckpointSection = CheckpointSection()
    metrics: MetricsSection = MetricsSection()

    @model_validator(mode="after")
    def _tokenizer_of_the_model(self) -> Config:
        """data.tokenizer=model names the folder model.init_from reads the weights from."""
        if self.data.tokenizer == "model":
            if not self.model.init_from:
                raise ValueError("data.tokenizer=model takes the tokenizer of model.init_from's folder, but "
                                 "model.init_from is not set; give a tokenizer folder, or byte / bpe")
            self.data.tokenizer = self.model.init_from
        return self

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


SECTIONS = tuple(Config.model_fields)
