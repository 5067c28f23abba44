"""RoPE inverse frequencies with HF's scalings (linear, Llama 3.1, YaRN): the angles the decoder rotates by.

Why apart: pure functions of the config, used by the decoder (`pgdiag.model.transformer`) and the loader.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from pgdiag.model.config import RopeConfig


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> tuple[Tensor, float]:
    """Inverse frequencies (head_dim/2,) fp32 on the CPU and the cos/sin scale for a RoPE config (HF semantics).
    On the CPU also inside the meta-device model build: meta arithmetic runs PyTorch's Python references, whose
    first call imports torch._dynamo (1.2 s of a start on a GPU machine)."""
    with torch.device("cpu"):
        return _inv_freq(rope, head_dim)


def _inv_freq(rope: RopeConfig, head_dim: int) -> tuple[Tensor, float]:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)  # (D/2,)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope), 1.0
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, head_dim)
    return inv_freq, 1.0


def _llama3_inv_freq(inv_freq: Tensor, rope: RopeConfig) -> Tensor:
    """Llama 3.1 scaling: long wavelengths divided by `factor`, short kept, a linear blend in between."""
    old_len = rope.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn_inv_freq(rope: RopeConfig, head_dim: int) -> tuple[Tensor, float]:
    """YaRN (arXiv 2309.00071): interpolate low frequencies, keep high ones, ramp between; scale cos/sin."""

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope.attention_factor is not None:
        attention_factor = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = mscale(rope.factor, rope.mscale) / mscale(rope.factor, rope.mscale_all_dim)
    else:
        attention_factor = mscale(rope.factor)

    def correction_dim(rotations: float) -> float:
        ctx = rope.original_max_position_embeddings
        return head_dim * math.log(ctx / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # (D/2,)
    pos_freqs = rope.theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor
