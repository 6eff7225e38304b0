"""model.init_from read at scale: every rank reads only the parts of each tensor that it holds.

A Hugging Face folder's safetensors files are memory-mapped; for each parameter of the rank's model (its
pipeline stage, its tensor- and data-parallel shard) the rank asks safetensors for the slice it keeps, in
the stored dtype, and copies it into the parameter, one tensor at a time. Host memory during loading stays
within the rank's share plus one slice; an 8B model no longer costs every rank 32 GB of fp32 tensors.

Names and layouts are hf_weights.py's: Llama-family tensors are renamed; GPT-2's Conv1D weights are stored
[in, out] (read transposed) and its q, k and v are column ranges of one fused c_attn. Vocabulary rows that
padding for tensor parallelism adds are zeros, not read. A Mixture-of-Experts block's 3-D expert tensor is
read from the per-expert tensors of the experts the rank's block of it covers, each sliced alike.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from safetensors import safe_open

from meshfit.models.config import ModelConfig
from meshfit.models.hf_weights import expert_source, hf_source, safetensors_files
from meshfit.models.init import VOCAB_TABLES, local_region

class HFWeights:
    """The weights of a Hugging Face folder (or one .safetensors file), read slice by slice.

    ``local(name, param)`` is the part of meshfit tensor ``name`` that ``param`` (a plain tensor or a
    DTensor shard) holds. ``bytes_read`` counts the stored bytes read so far, ``seconds`` the time spent.
    """

    def __init__(self, path: str | Path, cfg: ModelConfig) -> None:
        self.path, self.cfg = Path(path), cfg
        self.files: dict[str, Path] = {}  # Hugging Face tensor name -> the file holding it
        for file in safetensors_files(self.path):
            try:
                with safe_open(str(file), framework="pt") as handle:  # reads the header only
                    self.files.update({key: file for key in handle.keys()})
            except Exception as exc:  # safetensors raises its own error types for damaged headers
                raise ValueError(f"model.init_from: {file} cannot be read as safetensors: {exc}") from None
        self.bytes_read = 0
        self.seconds = 0.0

    def read(self, name: str, offsets: tuple[int, ...], sizes: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The block of meshfit tensor `name` at `offsets` of `sizes`, read from the files, as `dtype`."""
        began = time.perf_counter()
        rows = sizes[0]
        if name in VOCAB_TABLES:  # rows past the real vocabulary are padding: zeros, not stored
            rows = max(0, min(offsets[0] + sizes[0], self.cfg.vocab_size) - offsets[0])
        block = self._stored(name, offsets, (rows, *sizes[1:])).to(dtype)
        if rows < sizes[0]:
            block = torch.cat([block, block.new_zeros(sizes[0] - rows, *sizes[1:])])
        self.seconds += time.perf_counter() - began
        return block.contiguous()

    def _stored(self, name: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        template = expert_source(name, self.cfg)
        if template is not None:  # experts offsets[0] onwards, each one's block of rows and columns
            parts = [self._tensor(template.format(j=j), name, offsets[1:], sizes[1:], False, 0)
                     for j in range(offsets[0], offsets[0] + sizes[0])]
            return torch.stack(parts) if parts else torch.empty(sizes)
        source = hf_source(name, self.cfg)
        if source is None:
            raise ValueError(f"model.init_from: no Hugging Face tensor holds meshfit's {name!r}")
        stored, transposed, shift = source
        return self._tensor(stored, name, offsets, sizes, transposed, shift)

    def _tensor(self, stored: str, name: str, offsets: tuple[int, ...], sizes: tuple[int, ...], transposed: bool,
                shift: int) -> torch.Tensor:
        """The block of stored tensor `stored` (meshfit's `name`) at `offsets` of `sizes`."""
        if stored not in self.files:
            raise ValueError(f"model.init_from: the weights have no tensor {stored!r} (for meshfit's {name!r})")
        if any(size == 0 for size in sizes):
            return torch.empty(sizes)
        spans = [slice(start, start + size) for start, size in zip(offsets, sizes)]
        spans[0] = slice(spans[0].start + shift, spans[0].stop + shift)  # a fused tensor's rows (or columns)
        with safe_open(str(self.files[stored]), framework="pt") as handle:
            part = handle.get_slice(stored)
            block = part[spans[1], spans[0]].t() if transposed else part[tuple(spans)]
        self.bytes_read += block.numel() * block.element_size()
        return block

    def local(self, name: str, param: torch.Tensor) -> torch.Tensor:
        offsets, sizes = local_region(param)
        return self.read(name, offsets, sizes, param.dtype)

    def full(self, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.read(name, (0,) * len(shape), tuple(shape), dtype)


def load_hf(path: str | Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Every tensor of the model whole, in fp32, by plain name (one process: tests, conversions); a rank
    reads its own part with ``HFWeights.local`` instead."""
    from meshfit.models.build import build_model
    from meshfit.models.hf_weights import check_hf
    from meshfit.models.init import canonical_name

    check_hf(path, cfg)
    weights = HFWeights(path, cfg)
    return {name: weights.full(canonical_name(name, cfg), tuple(param.shape))
            for name, param in build_model(cfg, "meta").named_parameters(remove_duplicate=False)}
