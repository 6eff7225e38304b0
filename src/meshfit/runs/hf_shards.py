"""A checkpoint written as Hugging Face safetensors shards with an index, a layer at a time.

The shards are planned before anything is read: DCP's metadata gives every tensor's full shape, the
Hugging Face names and shapes follow from them (on the meta device), so the file count is known up front
and the names are transformers' (`model-00001-of-00004.safetensors` + `model.safetensors.index.json`; one
shard is written as `model.safetensors`, as transformers does). Then the checkpoint is read one group at a
time (a block's tensors, or one top-level tensor) and each shard is written once its last tensor is
converted: a process holds at most one shard and one block, never the whole model.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from meshfit.models.config import ModelConfig
from meshfit.models.hf_weights import hf_config, to_hf
from meshfit.models.init import strip_padding
from meshfit.train import checkpoint_reader

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SHARD = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")


def shard_name(k: int, n: int) -> str:
    return SINGLE if n == 1 else f"model-{k:05d}-of-{n:05d}.safetensors"


def _groups(names: list[str]) -> list[list[str]]:
    """Tensors read together: a block's (GPT-2 fuses its q, k and v), each top-level tensor alone."""
    layers: dict[str, list[str]] = {}
    top = []
    for name in names:
        match = re.match(r"^layers\.(\d+)\.", name)
        if match:
            layers.setdefault(match.group(1), []).append(name)
        else:
            top.append(name)
    first = [n for n in top if n.startswith(("tok_", "pos_"))]
    return [[n] for n in first] + [layers[i] for i in sorted(layers, key=int)] + [[n] for n in top if n not in first]


def plan(shapes: dict[str, torch.Size], cfg: ModelConfig, dtype: torch.dtype, max_bytes: int) -> list[dict]:
    """[{"names": meshfit tensors, "hf": {name: bytes}}] per group, each Hugging Face tensor given the shard
    it lands in ("shard": k) by filling shards of at most `max_bytes` in order (a larger tensor alone)."""
    size = torch.empty((), dtype=dtype).element_size()
    groups, shard, used = [], 1, 0
    for names in _groups(list(shapes)):
        meta = strip_padding({n: torch.empty(shapes[n], device="meta") for n in names}, cfg)
        hf = {}
        for hf_name, tensor in to_hf(meta, cfg).items():
            nbytes = tensor.numel() * size
            if used and used + nbytes > max_bytes:
                shard, used = shard + 1, 0
            used += nbytes
            hf[hf_name] = (shard, nbytes)
        groups.append({"names": names, "hf": hf})
    return groups


def _converted(folder: Path, groups: list[dict], cfg: ModelConfig, dtype: torch.dtype,
               dtypes: dict[str, torch.dtype], shapes: dict[str, torch.Size]) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor in `dtype`) in plan order, reading the checkpoint a group at a time."""
    for group in groups:
        state = {f"model.{n}": torch.empty(shapes[n], dtype=dtypes[n]) for n in group["names"]}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process, on purpose
            checkpoint_reader.load(state, folder, no_dist=True)
        weights = strip_padding({k.removeprefix("model."): v for k, v in state.items()}, cfg)
        converted = to_hf(weights, cfg)
        for hf_name in group["hf"]:
            yield hf_name, converted[hf_name].to(dtype).contiguous()


def write_shards(folder: Path, shapes: dict[str, torch.Size], dtypes: dict[str, torch.dtype], cfg: ModelConfig,
                 out_dir: Path, dtype: torch.dtype, max_bytes: int) -> list[Path]:
    """Write the model of checkpoint `folder` into `out_dir` (shards, index, config.json); the files."""
    groups = plan(shapes, cfg, dtype, max_bytes)
    where = {name: entry for group in groups for name, entry in group["hf"].items()}
    count = max((shard for shard, _ in where.values()), default=1)
    last = {shard: name for name, (shard, _) in where.items()}  # dicts keep order: each shard's last tensor
    written, pending = [], {}
    for name, tensor in _converted(folder, groups, cfg, dtype, dtypes, shapes):
        shard = where[name][0]
        pending[name] = tensor
        if last[shard] == name:
            path = out_dir / shard_name(shard, count)
            save_file(pending, str(path), metadata={"format": "pt"})
            written.append(path)
            pending = {}
    if count > 1:
        index = {"metadata": {"total_size": sum(nbytes for _, nbytes in where.values())},
                 "weight_map": {name: shard_name(shard, count) for name, (shard, _) in where.items()}}
        (out_dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        written.append(out_dir / INDEX)
    (out_dir / "config.json").write_text(json.dumps(hf_config(cfg, dtype), indent=2) + "\n")
    return [*written, out_dir / "config.json"]
