"""Layout-independent weight initialization.

Each parameter's full value depends only on ``seed`` and the parameter's
canonical name, never on construction order, global RNG state or how the
model is later sharded (FSDP, tensor or pipeline parallel). Every rank
generates the full tensor and keeps its own shard, so no communication is
needed and any parallel layout starts from bit-identical weights.
"""

from __future__ import annotations

import math
import zlib
from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from meshfit.models.config import ModelConfig

# Name components inserted by wrappers (DDP/DataParallel, torch.compile,
# FSDP1, activation checkpointing); stripping them gives the bare model's name.
_WRAPPER_COMPONENTS = frozenset({"module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})

BASE_STD = 0.02


def canonical_name(name: str, cfg: ModelConfig | None = None) -> str:
    """Parameter name with wrapper components removed.

    With tied embeddings ``output.weight`` maps to ``tok_embeddings.weight``,
    so a pipeline stage holding only the output head gets the same values as
    the stage holding the embedding.
    """
    name = ".".join(part for part in name.split(".") if part not in _WRAPPER_COMPONENTS)
    if cfg is not None and cfg.tie_embeddings and name == "output.weight":
        return "tok_embeddings.weight"
    return name


def _generator(seed: int, name: str) -> torch.Generator:
    # The CPU generator keeps only the low 32 bits of its seed, so seed and
    # name are hashed together into 32 bits; crc32 is stable across processes
    # (unlike hash(), which is salted per interpreter).
    return torch.Generator(device="cpu").manual_seed(zlib.crc32(f"{seed}:{name}".encode()))


VOCAB_TABLES = ("tok_embeddings.weight", "output.weight")


def _pad_rows(full: torch.Tensor, name: str, cfg: ModelConfig) -> torch.Tensor:
    """A vocabulary table with the padded rows appended as zeros: the real rows are the same whatever the
    padding, and the padded ones never receive a gradient."""
    if name not in VOCAB_TABLES or cfg.padded_vocab == cfg.vocab_size or full.shape[0] != cfg.vocab_size:
        return full
    return torch.cat([full, full.new_zeros(cfg.padded_vocab - cfg.vocab_size, *full.shape[1:])])


def strip_padding(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Full weights by plain name with the vocabulary tables cut back to the real vocabulary."""
    return {name: value[:cfg.vocab_size] if name in VOCAB_TABLES else value for name, value in weights.items()}


def _real_shape(name: str, shape: torch.Size, cfg: ModelConfig) -> torch.Size:
    if name in VOCAB_TABLES and shape[0] == cfg.padded_vocab:
        return torch.Size((cfg.vocab_size, *shape[1:]))
    return shape


def _full_value(name: str, shape: torch.Size, seed: int, cfg: ModelConfig) -> torch.Tensor:
    """The full fp32 CPU tensor for parameter ``name``."""
    return _pad_rows(_random_value(name, _real_shape(name, shape, cfg), seed, cfg), name, cfg)


def _random_value(name: str, shape: torch.Size, seed: int, cfg: ModelConfig) -> torch.Tensor:
    parts = name.split(".")
    full = torch.empty(shape, dtype=torch.float32)
    if parts[-1] == "bias":
        return nn.init.zeros_(full)
    if len(parts) >= 2 and parts[-2].endswith("norm"):
        return nn.init.ones_(full)
    std = BASE_STD
    if (len(parts) >= 2 and parts[-2] in ("wo", "w2")) or parts[-1] == "w2":
        # Residual-branch output projections (a Mixture-of-Experts block's experts.w2 among them), scaled
        # as in GPT-2 so the residual stream's variance does not grow with depth.
        std = BASE_STD / math.sqrt(2 * cfg.n_layers)
    return nn.init.normal_(full, mean=0.0, std=std, generator=_generator(seed, name))


class WeightSource(Protocol):
    """Starting weights read part by part (models/hf_read.py): ``local(name, param)`` is the block of the
    full tensor ``name`` that ``param`` holds (all of it for a plain tensor, the shard of a DTensor)."""

    def local(self, name: str, param: torch.Tensor) -> torch.Tensor: ...


def local_region(param: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, sizes) of the block of the full tensor that `param` holds on this rank: a DTensor's shard
    (any placements, FSDP's uneven last shard included: DCP's own chunk of it), else the whole tensor."""
    if isinstance(param, DTensor):
        (chunk,) = param.__create_chunk_list__()
        return tuple(chunk.offsets), tuple(chunk.sizes)
    return (0,) * param.dim(), tuple(param.shape)


def _given(weights: dict[str, torch.Tensor], name: str, shape: torch.Size, cfg: ModelConfig) -> torch.Tensor:
    if name not in weights:
        raise ValueError(f"model.init_from: the weights have no tensor for {name!r}")
    full = _pad_rows(weights[name], name, cfg)
    if full.shape != shape:
        raise ValueError(f"model.init_from: {name} has shape {tuple(full.shape)} there, the model needs "
                         f"{tuple(shape)}; set the model section to the weights' dimensions")
    return full


def _copy_into(param: torch.Tensor, full: torch.Tensor, name: str) -> None:
    if isinstance(param, DTensor):
        mesh = param.device_mesh
        # src_data_rank=None: every rank built the same full tensor, so each
        # keeps its own shard without a scatter.
        local = distribute_tensor(
            full.to(mesh.device_type), mesh, param.placements, src_data_rank=None
        ).to_local()
        target = param.to_local()
    else:
        local, target = full, param
    if target.shape != local.shape:
        raise ValueError(f"init_weights: {name} has local shape {tuple(target.shape)}, expected {tuple(local.shape)}")
    target.copy_(local)


def check_weights(model: nn.Module, weights: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    """Every parameter of ``model`` has a tensor of its shape in ``weights`` (meta tensors suffice: only
    names and shapes are compared); ValueError naming the first that does not."""
    for raw_name, param in model.named_parameters():
        _given(weights, canonical_name(raw_name, cfg), param.shape, cfg)


def _copy_local(param: torch.Tensor, local: torch.Tensor, name: str) -> None:
    target = param.to_local() if isinstance(param, DTensor) else param
    if target.shape != local.shape:
        raise ValueError(f"init_weights: {name} has local shape {tuple(target.shape)}, the source gave "
                         f"{tuple(local.shape)}")
    target.copy_(local)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, cfg: ModelConfig, weights: WeightSource | None = None) -> None:
    """Initialize every parameter of ``model`` in place and recompute its buffers.

    Weights ~ N(0, 0.02), with ``wo``/``w2`` scaled by ``1/sqrt(2 * n_layers)``;
    embeddings ~ N(0, 0.02); norm weights 1; biases 0. Parameters may be
    plain tensors on any device and dtype or DTensors of any placement, but
    not on the meta device: call ``model.to_empty(device=...)`` first.
    Each full tensor is generated on CPU in fp32, which costs host memory
    and time proportional to the largest parameter (the embedding table).
    With ``weights`` (``model.init_from``, checked beforehand with ``check_weights``) every parameter
    takes its value from there instead, each rank reading only its own block.
    """
    for raw_name, param in model.named_parameters():
        name = canonical_name(raw_name, cfg)
        if param.is_meta:
            raise ValueError(
                f"init_weights: {raw_name} is on the meta device; call model.to_empty(device=...) first"
            )
        if weights is None:
            _copy_into(param, _full_value(name, param.shape, seed, cfg), raw_name)
        else:
            _copy_local(param, weights.local(name, param), raw_name)
    for module in model.modules():
        init_buffers = getattr(module, "init_buffers", None)
        if callable(init_buffers):
            init_buffers()
