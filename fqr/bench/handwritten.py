"""A hand-written one-kernel Triton fusion of the Qwen3-style prologue: the bar the generator is
measured against (issue 12), and the "bare Triton launch" of the dispatch table.

Scope, as a hand-written kernel for one model family would have it: NeoX rotation of the whole
head (``rotary_dim == head_dim``), per-head RMSNorm with weight (and ``weight_offset``, Gemma's
``1 + w``), power-of-two head counts, contiguous outputs. One program per token: it loads the
cos/sin row once, then q's heads as one ``[Hq, D/2]`` pair of tiles, k's likewise, and copies v.
Math (per head, fp32, rounded once at the store): ``y = x * rsqrt(mean(x^2) + eps) * (offset +
w)``, then ``(y1 cos - y2 sin, y2 cos + y1 sin)`` on the two halves: what
:func:`fqr.reference.prologue` computes for these presets.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_rope_heads(src, dst, w, cos, sin, eps, offset, H: tl.constexpr, HALF: tl.constexpr):
    heads = tl.arange(0, H)[:, None] * (2 * HALF)
    half = tl.arange(0, HALF)[None, :]
    x1 = tl.load(src + heads + half).to(tl.float32)
    x2 = tl.load(src + heads + HALF + half).to(tl.float32)
    r = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
    y1 = x1 * r * (offset + tl.load(w + half).to(tl.float32))
    y2 = x2 * r * (offset + tl.load(w + HALF + half).to(tl.float32))
    tl.store(dst + heads + half, (y1 * cos - y2 * sin).to(dst.dtype.element_ty))
    tl.store(dst + heads + HALF + half, (y2 * cos + y1 * sin).to(dst.dtype.element_ty))


@triton.jit(do_not_specialize=["eps", "offset"])
def _qwen3_prologue_kernel(
    qkv, positions, cos_sin, q_w, k_w, q_out, k_out, v_out, eps, offset,
    HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    row = qkv + t * ((HQ + 2 * HKV) * 2 * HALF)
    half = tl.arange(0, HALF)[None, :]
    table = cos_sin + tl.load(positions + t) * (2 * HALF)
    cos = tl.load(table + half)
    sin = tl.load(table + HALF + half)
    q_dst = q_out + t * (HQ * 2 * HALF)
    _norm_rope_heads(row, q_dst, q_w, cos, sin, eps, offset, HQ, HALF)
    k_dst = k_out + t * (HKV * 2 * HALF)
    _norm_rope_heads(row + HQ * 2 * HALF, k_dst, k_w, cos, sin, eps, offset, HKV, HALF)
    cols = tl.arange(0, HKV * 2 * HALF)
    v = tl.load(row + (HQ + HKV) * 2 * HALF + cols)
    tl.store(v_out + t * (HKV * 2 * HALF) + cols, v)


def supports(spec) -> bool:
    """Whether the hand-written kernel covers ``spec`` (a :class:`fqr.presets.PrologueSpec`)."""

    def pow2(n: int) -> bool:
        return n > 0 and n & (n - 1) == 0

    return (
        spec.norm == "head"
        and spec.is_neox
        and spec.rotary_dim == spec.head_dim
        and pow2(spec.num_heads)
        and pow2(spec.num_kv_heads)
        and pow2(spec.head_dim)
    )


def qwen3_prologue(
    qkv, positions, cos_sin_cache, q_weight, k_weight, *, spec, num_warps: int = 4, out=None
):
    """Run the hand-written kernel on contiguous inputs; returns ``q, k, v``."""
    tokens, d = qkv.shape[0], spec.head_dim
    q, k, v = out or (
        torch.empty(tokens, spec.num_heads * d, dtype=qkv.dtype, device=qkv.device),
        torch.empty(tokens, spec.num_kv_heads * d, dtype=qkv.dtype, device=qkv.device),
        torch.empty(tokens, spec.num_kv_heads * d, dtype=qkv.dtype, device=qkv.device),
    )
    _qwen3_prologue_kernel[(tokens,)](
        qkv, positions, cos_sin_cache, q_weight, k_weight, q, k, v,
        float(spec.eps), float(spec.weight_offset),
        HQ=spec.num_heads, HKV=spec.num_kv_heads, HALF=d // 2, num_warps=num_warps,
    )  # fmt: skip
    return q, k, v
