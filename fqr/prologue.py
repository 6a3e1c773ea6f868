"""The attention prologue: ``split_qkv -> rms_norm(q), rms_norm(k) -> rope(q), rope(k)``.

:func:`attention_prologue` is the composition of the pure ops, the function that gets traced.
:func:`split_qkv_rmsnorm_rope` is the public fused op: it validates its arguments (before any
kernel runs), traces the composition once per signature, and hands the program to a backend
(``fqr.backends``: reference, interpret, triton, ascend, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from . import ops
from .core import Aval, Program, trace
from .validate import check_prologue_args

NUMERICS = ("fused", "unfused")


@dataclass(frozen=True)
class NormStats:
    """All-reduced statistics of a full-width norm whose q/k width is split over TP ranks.

    ``q_sum_sq``/``k_sum_sq``: float32 ``[T]`` sums of squares over the whole (unsharded) q/k
    projection; ``q_count``/``k_count``: the unsharded widths (``total_heads * head_dim``).
    """

    q_sum_sq: torch.Tensor
    k_sum_sq: torch.Tensor
    q_count: int
    k_count: int


def attention_prologue(
    qkv,
    positions,
    cos_sin_cache,
    q_weight,
    k_weight,
    q_bias,
    k_bias,
    q_sum_sq,
    k_sum_sq,
    *,
    num_heads,
    num_kv_heads,
    head_dim,
    eps,
    is_neox,
    weight_offset,
    norm,
    numerics,
    q_count=None,
    k_count=None,
):
    """The prologue as a composition of the pure ops (traced into one program)."""
    q, k, v = ops.split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    if norm != "none":
        q_group = head_dim if norm == "head" else num_heads * head_dim
        k_group = head_dim if norm == "head" else num_kv_heads * head_dim
        q = ops.rms_norm(
            q,
            q_weight,
            eps=eps,
            group_size=q_group,
            bias=q_bias,
            weight_offset=weight_offset,
            sum_sq=q_sum_sq,
            count=q_count,
        )
        k = ops.rms_norm(
            k,
            k_weight,
            eps=eps,
            group_size=k_group,
            bias=k_bias,
            weight_offset=weight_offset,
            sum_sq=k_sum_sq,
            count=k_count,
        )
        if numerics == "unfused":
            q = ops.reduce_precision(q, qkv.dtype)
            k = ops.reduce_precision(k, qkv.dtype)
    round_to = qkv.dtype if numerics == "unfused" else None
    q = ops.rope(q, positions, cos_sin_cache, head_dim=head_dim, is_neox=is_neox, round_to=round_to)
    k = ops.rope(k, positions, cos_sin_cache, head_dim=head_dim, is_neox=is_neox, round_to=round_to)
    return q, k, v


@lru_cache(maxsize=512)
def prologue_program(signature: tuple) -> Program:
    """Trace :func:`attention_prologue` for one signature (see :func:`program_signature`)."""
    avals, static = signature
    return trace(attention_prologue, *avals, **dict(static))


def program_signature(
    qkv,
    positions,
    cos_sin_cache,
    q_weight,
    k_weight,
    q_bias,
    k_bias,
    stats: NormStats | None,
    **static,
) -> tuple:
    """Everything the program depends on: avals with symbolic T (and P for the cache rows)."""
    avals = (
        Aval.of(qkv, "T"),
        Aval.of(positions, "T"),
        Aval.of(cos_sin_cache, "P"),
        Aval.of(q_weight),
        Aval.of(k_weight),
        Aval.of(q_bias),
        Aval.of(k_bias),
        None if stats is None else Aval(("T",), torch.float32),
        None if stats is None else Aval(("T",), torch.float32),
    )
    if stats is not None:
        static = dict(static, q_count=stats.q_count, k_count=stats.k_count)
    return avals, tuple(sorted(static.items()))


_PROGRAMS: dict[tuple, Program] = {}  # per-call fast path: (dtype, last dim) per tensor + statics


def split_qkv_rmsnorm_rope(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float = 1e-6,
    is_neox: bool = True,
    q_bias: torch.Tensor | None = None,
    k_bias: torch.Tensor | None = None,
    weight_offset: float = 0.0,
    norm: str = "head",
    norm_stats: NormStats | None = None,
    numerics: str = "fused",
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split the packed QKV row, RMS-normalise q and k, rotate them; return new q, k, v.

    ``qkv [T, (Hq + 2*Hkv)*D]`` (bf16, fp16 or fp32; row stride may exceed the width),
    ``positions [T]`` int32/int64, ``cos_sin_cache [max_position, R]`` (vLLM layout),
    weights/biases ``[D]`` (``norm="head"``, per-head QK-norm) or ``[Hq*D]``/``[Hkv*D]``
    (``norm="full"``, OLMo2), ``norm="none"`` for split + RoPE only (weights None).
    Returns contiguous ``q [T, Hq*D]``, ``k [T, Hkv*D]``, ``v [T, Hkv*D]`` in qkv's dtype.

    Math per head (see ``fqr.ops``): ``y = x * rsqrt(mean(x^2) + eps) * (weight_offset + w) + b``
    then RoPE on the first R features. ``numerics="fused"`` computes in fp32 and rounds once at
    the store; ``"unfused"`` rounds after the norm and rounds every RoPE multiply/add, as
    vLLM's and Hugging Face's unfused code does. ``norm_stats`` carries the all-reduced statistic
    of a full-width norm sharded over TP ranks (see :class:`NormStats`).
    """
    static = dict(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        eps=eps,
        is_neox=is_neox,
        weight_offset=weight_offset,
        norm=norm,
        numerics=numerics,
    )
    check_prologue_args(
        qkv,
        positions,
        cos_sin_cache,
        q_weight,
        k_weight,
        q_bias,
        k_bias,
        norm_stats,
        backend=backend,
        **static,
    )
    from .backends import resolve_backend  # late: backends import lowering

    static["eps"], static["weight_offset"] = float(eps), float(weight_offset)
    tensors = (qkv, positions, cos_sin_cache, q_weight, k_weight, q_bias, k_bias)
    fast_key = (
        positions.dtype,
        tuple(None if t is None else (t.dtype, t.shape[-1]) for t in tensors if t is not positions),
        None if norm_stats is None else (norm_stats.q_count, norm_stats.k_count),
        tuple(static.values()),
    )
    program = _PROGRAMS.get(fast_key)
    if program is None:
        program = prologue_program(program_signature(*tensors, norm_stats, **static))
        _PROGRAMS[fast_key] = program
    stats = () if norm_stats is None else (norm_stats.q_sum_sq, norm_stats.k_sum_sq)
    args = [t for t in tensors if t is not None] + list(stats)
    runner = resolve_backend(backend, qkv.device)  # a bad backend is refused at any T
    if qkv.shape[0] == 0:
        return tuple(
            torch.empty(0, v.aval.shape[1], dtype=qkv.dtype, device=qkv.device)
            for v in program.outputs
        )
    return tuple(runner.launch(program, args))


def preset_program(
    preset,
    dtype: torch.dtype = torch.bfloat16,
    *,
    numerics: str = "fused",
    bias: bool = False,
    positions_dtype: torch.dtype = torch.int64,
    cache_dtype: torch.dtype = torch.float32,
    weight_dtype: torch.dtype | None = None,
    sharded_full_norm: bool = False,
) -> Program:
    """The traced prologue for a :class:`fqr.presets.Preset` (its TP view included).

    ``sharded_full_norm`` (full-width norm at tp > 1): the program takes the all-reduced
    per-token sums of squares as inputs (see :class:`NormStats`).
    """
    wdt = weight_dtype or dtype
    d = preset.head_dim
    q_len = d if preset.norm == "head" else preset.q_size
    k_len = d if preset.norm == "head" else preset.kv_size
    has_norm = preset.norm != "none"
    vec = lambda n, on: Aval((n,), wdt) if on else None  # noqa: E731
    stats = sharded_full_norm and preset.norm == "full"
    avals = (
        Aval(("T", preset.qkv_width), dtype),
        Aval(("T",), positions_dtype),
        Aval(("P", preset.rotary_dim), cache_dtype),
        vec(q_len, has_norm),
        vec(k_len, has_norm),
        vec(q_len, has_norm and bias),
        vec(k_len, has_norm and bias),
        Aval(("T",), torch.float32) if stats else None,
        Aval(("T",), torch.float32) if stats else None,
    )
    static = dict(
        num_heads=preset.num_heads,
        num_kv_heads=preset.num_kv_heads,
        head_dim=d,
        eps=float(preset.eps),
        is_neox=preset.is_neox,
        weight_offset=float(preset.weight_offset),
        norm=preset.norm,
        numerics=numerics,
    )
    if stats:
        static.update(q_count=preset.total_heads * d, k_count=preset.total_kv_heads * d)
    return prologue_program((avals, tuple(sorted(static.items()))))
