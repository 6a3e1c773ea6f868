"""The unfused attention prologue exactly as model code writes it (the graphs the pass matches).

These functions are copies, op for op, of the eager code that the fusion patterns rewrite;
the patterns in :mod:`fqr.fusion.patterns` are traced from them, and the small models of
:mod:`fqr.fusion.models` are built on them.

vLLM (``vllm/model_executor/layers/layernorm.py``, ``rotary_embedding/base.py`` and
``common.py``; ``models/qwen3.py``)::

    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = rms_norm(q.view(T, Hq, D), q_weight, eps).view(q.shape)     # RMSNorm.forward_native
    k = rms_norm(k.view(T, Hkv, D), k_weight, eps).view(k.shape)    # (GemmaRMSNorm: (1 + w))
    q, k = rotary_embedding(positions, q, k, D, cos_sin_cache, is_neox)  # forward_native

Hugging Face (``models/qwen3/modeling_qwen3.py``)::

    q = q_norm(q_proj(h).view(B, S, -1, D)).transpose(1, 2)          # Qwen3RMSNorm
    k = k_norm(k_proj(h).view(B, S, -1, D)).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)                       # rotate_half (NeoX)
"""

from __future__ import annotations

import torch

# ----------------------------------------------------------------------------------- vLLM


def vllm_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """vLLM ``RMSNorm.forward_static``: fp32 statistic, round to x's dtype, then ``* weight``
    (``+ bias`` for a norm that has one) in that dtype."""
    orig_dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(dim=-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    x = x.to(orig_dtype)
    x = x * weight
    if bias is not None:
        x = x + bias
    return x


def vllm_gemma_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """vLLM ``GemmaRMSNorm.forward_static``: ``(x * rsqrt(mean(x^2) + eps)) * (1 + w)`` in fp32,
    rounded once at the end (``+ bias`` after it, in x's dtype, for a norm that has one)."""
    orig_dtype = x.dtype
    x = x.float()
    variance = x.pow(2).mean(dim=-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    x = x * (1.0 + weight.float())
    x = x.to(orig_dtype)
    if bias is not None:
        x = x + bias
    return x


def vllm_apply_rotary_emb(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox_style: bool
) -> torch.Tensor:
    """vLLM ``apply_rotary_emb_torch``: x ``[T, H, R]``, cos/sin ``[T, R/2]``."""
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    if is_neox_style:
        x1, x2 = torch.chunk(x, 2, dim=-1)
    else:
        x1 = x[..., ::2]
        x2 = x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox_style:
        return torch.cat((o1, o2), dim=-1)
    return torch.stack((o1, o2), dim=-1).flatten(-2)


def _vllm_rotate_heads(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_tokens: int,
    head_size: int,
    rotary_dim: int,
    is_neox_style: bool,
) -> torch.Tensor:
    """The lines vLLM's rotary embeddings run on query, then on key: ``x`` viewed as
    ``num_tokens`` rows of ``head_size``-wide heads, the first ``rotary_dim`` features of each
    head rotated by :func:`vllm_apply_rotary_emb`, the rest as they are, in ``x``'s shape."""
    shape = x.shape
    x = x.view(num_tokens, -1, head_size)
    x_rot = vllm_apply_rotary_emb(x[..., :rotary_dim], cos, sin, is_neox_style)
    return torch.cat((x_rot, x[..., rotary_dim:]), dim=-1).reshape(shape)


def vllm_rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox_style: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM ``RotaryEmbedding.forward_static`` (rotary_dim = the cache width)."""
    rotary_dim = cos_sin_cache.shape[-1]
    positions = positions.flatten()
    num_tokens = positions.shape[0]
    cos_sin = cos_sin_cache.index_select(0, positions)
    cos, sin = cos_sin.chunk(2, dim=-1)
    return (
        _vllm_rotate_heads(query, cos, sin, num_tokens, head_size, rotary_dim, is_neox_style),
        _vllm_rotate_heads(key, cos, sin, num_tokens, head_size, rotary_dim, is_neox_style),
    )


def vllm_apply_interleaved_rope(x: torch.Tensor, mrope_section) -> torch.Tensor:
    """vLLM ``apply_interleaved_rope``: ``x [3, T, R/2]`` (one plane per row) to ``[T, R/2]``,
    channel ``i`` from h when ``i % 3 == 1 and i < 3*h``, from w when ``i % 3 == 2 and i <
    3*w``, from t otherwise."""
    channels = torch.arange(x.shape[-1], device=x.device)
    is_height = (channels % 3 == 1) & (channels < mrope_section[1] * 3)
    is_width = (channels % 3 == 2) & (channels < mrope_section[2] * 3)
    result = torch.where(is_height, x[1], x[0])
    return torch.where(is_width, x[2], result)


def vllm_mrotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox_style: bool,
    mrope_section,
    mrope_interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM ``MRotaryEmbedding.forward_native`` (rotary_dim = the cache width, the cache in
    its dtype): ``cos_sin_cache[positions]`` per plane (``positions [3, T]``; ``[T]``: plain
    RoPE), the sections joined (``torch.cat`` of each plane's part, or
    :func:`vllm_apply_interleaved_rope`), then ``apply_rotary_emb`` on the first R features."""
    rotary_dim = cos_sin_cache.shape[-1]
    num_tokens = positions.shape[-1]
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    if positions.ndim == 2:
        if mrope_interleaved:
            cos = vllm_apply_interleaved_rope(cos, mrope_section)
            sin = vllm_apply_interleaved_rope(sin, mrope_section)
        else:
            sections = list(mrope_section)
            cos = torch.cat([m[i] for i, m in enumerate(cos.split(sections, dim=-1))], dim=-1)
            sin = torch.cat([m[i] for i, m in enumerate(sin.split(sections, dim=-1))], dim=-1)

    return (
        _vllm_rotate_heads(query, cos, sin, num_tokens, head_size, rotary_dim, is_neox_style),
        _vllm_rotate_heads(key, cos, sin, num_tokens, head_size, rotary_dim, is_neox_style),
    )


def vllm_qk_norm_rope(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    *,
    q_size: int,
    kv_size: int,
    eps: float,
    is_neox: bool,
    gemma: bool = False,
    q_bias: torch.Tensor | None = None,
    k_bias: torch.Tensor | None = None,
):
    """The prologue of vLLM's ``Qwen3Attention.forward`` (Gemma 3's with ``gemma=True``)."""
    norm = vllm_gemma_rms_norm if gemma else vllm_rms_norm
    head_dim = q_weight.shape[0]
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q_by_head = q.view(*q.shape[:-1], q.shape[-1] // head_dim, head_dim)
    q = norm(q_by_head, q_weight, eps, q_bias).view(q.shape)
    k_by_head = k.view(*k.shape[:-1], k.shape[-1] // head_dim, head_dim)
    k = norm(k_by_head, k_weight, eps, k_bias).view(k.shape)
    q, k = vllm_rotary_embedding(positions, q, k, head_dim, cos_sin_cache, is_neox)
    return q, k, v


# ---------------------------------------------------------------------------- Hugging Face


def hf_rms_norm(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face ``Qwen3RMSNorm.forward``."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + eps)
    return weight * hidden_states.to(input_dtype)


def hf_rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def hf_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim: int = 1):
    """Hugging Face ``apply_rotary_pos_emb``: ``cos``/``sin`` ``[B, S, D]`` (halves repeated)."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (hf_rotate_half(q) * sin)
    k_embed = (k * cos) + (hf_rotate_half(k) * sin)
    return q_embed, k_embed


def hf_qk_norm_rope(
    q_proj_out: torch.Tensor,
    k_proj_out: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    *,
    eps: float,
):
    """The q/k part of Hugging Face ``Qwen3Attention.forward``: projections ``[B, S, H*D]`` in,
    rotated ``[B, H, S, D]`` out."""
    head_dim = q_weight.shape[0]
    hidden_shape = (*q_proj_out.shape[:-1], -1, head_dim)
    q = hf_rms_norm(q_proj_out.view(hidden_shape), q_weight, eps).transpose(1, 2)
    k = hf_rms_norm(k_proj_out.view(hidden_shape), k_weight, eps).transpose(1, 2)
    return hf_apply_rotary_pos_emb(q, k, cos, sin)
