"""RoPE's rotation frequencies, with the scalings that stretch a model's context (Llama 3.1/3.2's "llama3",
"linear").

Written after Hugging Face transformers' ``_compute_default_rope_parameters``,
``_compute_linear_scaling_rope_parameters`` and ``_compute_llama3_parameters``
(``modeling_rope_utils.py``), so that a model read from a Hugging Face ``config.json`` rotates its queries
and keys by the same angles: ``benchmarks/correctness/hf_parity.py`` shows how far logits drift when the
scaling is left out.
"""

from __future__ import annotations

import math

import torch

from meshfit.models.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig, device: torch.device | str = "cpu") -> torch.Tensor:
    """The ``head_size / 2`` angles per position (radians) of ``cfg``'s RoPE, in fp32."""
    dim = cfg.head_size
    half = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float()
    inv_freq = 1.0 / (cfg.rope_theta ** (half / dim))
    if cfg.rope_scaling == "linear":
        # Positions divided by the factor: the same as dividing every frequency by it.
        return inv_freq / cfg.rope_factor
    if cfg.rope_scaling == "llama3":
        return _llama3(inv_freq, cfg)
    return inv_freq


def _llama3(inv_freq: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Llama 3.1's scaling: wavelengths longer than original / low_freq_factor are divided by the factor,
    those shorter than original / high_freq_factor kept, and the band between blended linearly in
    original / wavelength."""
    factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    original = cfg.rope_original_max_seq_len
    low_freq_wavelen, high_freq_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)
