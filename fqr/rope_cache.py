"""Real RoPE angle tables in vLLM's ``cos_sin_cache`` layout.

``cache[p] = [cos(p * f_0) .. cos(p * f_{R/2-1}), sin(p * f_0) .. sin(p * f_{R/2-1})]`` with
``f_i = 1 / theta^(2i / R)`` (R = rotary_dim), as vLLM's ``RotaryEmbedding._compute_cos_sin_cache``
builds it. The angles are computed in float64 and rounded once to ``dtype``, so the table is the
correctly rounded real table, not an fp32 approximation of it. ``scaling={"rope_type": "llama3",
...}`` applies Llama 3.1's frequency scaling (vLLM ``Llama3RotaryEmbedding``; Llama 4 Scout's
``low_freq_factor == high_freq_factor`` has no smooth band, as vLLM's ``smooth = 0``).
``scaling={"rope_type": "proportional", "partial_rotary_factor": f}`` is Gemma 4's full-attention
RoPE (vLLM ``Gemma4RotaryEmbedding``, HF ``_compute_proportional_rope_parameters``): the table
spans the whole head (``rotary_dim = head_dim``), its first ``int(head_dim * f) // 2``
frequencies are ``1 / theta^(2i / head_dim)`` and the rest are 0 (cos 1, sin 0: those pairs pass
through unrotated).
``{"rope_type": "linear", "factor": f}`` divides every position by ``f`` (vLLM
``LinearScalingRotaryEmbedding``).
"""

from __future__ import annotations

import math

import torch


def inverse_frequencies(rotary_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    if scaling and scaling.get("rope_type") == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low) if high != low else 0.0 * wavelen
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(is_mid, mid, scaled)
    elif scaling and scaling.get("rope_type") == "linear":
        # positions divided by the factor (vLLM LinearScalingRotaryEmbedding; Gemma 3 27B)
        inv_freq = inv_freq / scaling["factor"]
    elif scaling and scaling.get("rope_type") == "proportional":
        rotated = int(rotary_dim * scaling["partial_rotary_factor"]) // 2
        inv_freq[rotated:] = 0.0
    elif scaling:
        raise ValueError(f"unsupported rope scaling {scaling!r}")
    return inv_freq


def rope_angles(
    positions: torch.Tensor, rotary_dim: int, theta: float, scaling: dict | None = None
) -> torch.Tensor:
    """float64 angles ``[len(positions), rotary_dim/2]``."""
    inv_freq = inverse_frequencies(rotary_dim, theta, scaling)
    return positions.to(torch.float64)[:, None] * inv_freq[None, :]


def rope_cos_sin_cache(
    rotary_dim: int,
    max_position: int,
    theta: float,
    scaling: dict | None = None,
    dtype=torch.float32,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``[max_position, rotary_dim]`` table (or only ``rows`` of it, when given)."""
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    positions = torch.arange(max_position) if rows is None else rows
    angles = rope_angles(positions, rotary_dim, theta, scaling)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype)
