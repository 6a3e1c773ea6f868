"""The public fused ops, side by side: the compositions of the pure ops that get traced, and the
entry points that validate, trace once per signature and run the program on a backend.

=================================  ==========================================================
:func:`split_qkv_rmsnorm_rope`     packed ``qkv [T, (Hq + 2*Hkv)*D]`` -> new ``q, k, v``: split,
                                   RMS-normalise q and k, rotate them (vLLM's packed form;
                                   traced: :func:`attention_prologue`)
:func:`qk_rmsnorm_rope`            separate ``q [T, Hq*D]``, ``k [T, Hkv*D]`` -> new ``q, k``:
                                   the same without the split (Hugging Face's separate
                                   projections; traced: :func:`qk_norm_rope_prologue`)
=================================  ==========================================================

Both check their arguments first (:mod:`fqr.validate`, one set of checks: a bad argument is
named before any kernel runs), then hand the traced program to a backend (:mod:`fqr.backends`:
``auto`` runs the generated kernel on CUDA / NPU tensors, the reference rules on CPU).
Follow one call: :func:`split_qkv_rmsnorm_rope` -> :func:`attention_prologue` traced by
:func:`fqr.core.trace` -> :class:`fqr.core.Program` -> ``Backend.launch`` ->
:func:`fqr.lowering.lower` -> generated source -> launch (``ARCHITECTURE.md``, "The pipeline").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch

from . import ops
from .backends import resolve_backend
from .core import Aval, Program, trace
from .validate import check_norm_stats, check_prologue_args, check_qk_args


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


# --------------------------------------------------------------- the traced compositions


def _norm_then_rope(
    q,
    k,
    positions,
    cos_sin_cache,
    weights,
    biases,
    *,
    groups,
    sums=(None, None),
    counts=(None, None),
    head_dim,
    eps,
    is_neox,
    weight_offset,
    numerics,
):
    """RMSNorm of q and of k over groups of ``groups[i]`` features (no norm when ``groups`` is
    None), then RoPE of both; ``numerics="unfused"`` rounds to q's dtype after the norm and in
    every RoPE step."""
    round_to = q.dtype if numerics == "unfused" else None
    if groups is not None:
        q, k = (
            ops.rms_norm(
                x,
                w,
                eps=eps,
                group_size=g,
                bias=b,
                weight_offset=weight_offset,
                sum_sq=ss,
                count=n,
            )
            for x, w, b, g, ss, n in zip((q, k), weights, biases, groups, sums, counts)
        )
        if round_to is not None:
            q, k = ops.reduce_precision(q, round_to), ops.reduce_precision(k, round_to)
    rope = dict(head_dim=head_dim, is_neox=is_neox, round_to=round_to)
    q = ops.rope(q, positions, cos_sin_cache, **rope)
    k = ops.rope(k, positions, cos_sin_cache, **rope)
    return q, k


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
    """Split the packed row, then norm + RoPE q and k (traced into one program)."""
    q, k, v = ops.split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    groups = {
        "none": None,
        "head": (head_dim, head_dim),
        "full": (num_heads * head_dim, num_kv_heads * head_dim),
    }[norm]
    q, k = _norm_then_rope(
        q,
        k,
        positions,
        cos_sin_cache,
        (q_weight, k_weight),
        (q_bias, k_bias),
        groups=groups,
        sums=(q_sum_sq, k_sum_sq),
        counts=(q_count, k_count),
        head_dim=head_dim,
        eps=eps,
        is_neox=is_neox,
        weight_offset=weight_offset,
        numerics=numerics,
    )
    return q, k, v


def qk_norm_rope_prologue(
    q,
    k,
    positions,
    cos_sin_cache,
    q_weight,
    k_weight,
    q_bias,
    k_bias,
    *,
    head_dim,
    eps,
    is_neox,
    weight_offset,
    numerics,
):
    """Per-head norm + RoPE of separate q and k (traced into one program)."""
    return _norm_then_rope(
        q,
        k,
        positions,
        cos_sin_cache,
        (q_weight, k_weight),
        (q_bias, k_bias),
        groups=(head_dim, head_dim),
        head_dim=head_dim,
        eps=eps,
        is_neox=is_neox,
        weight_offset=weight_offset,
        numerics=numerics,
    )


# ------------------------------------------------------------------------------ programs


@lru_cache(maxsize=512)
def _traced(fn, signature: tuple) -> Program:
    avals, static = signature
    return trace(fn, *avals, **dict(static))


def prologue_program(signature: tuple) -> Program:
    """:func:`attention_prologue` traced for one signature (:func:`program_signature`)."""
    return _traced(attention_prologue, signature)


def qk_program(signature: tuple) -> Program:
    """:func:`qk_norm_rope_prologue` traced for one ``(avals, static)`` signature."""
    return _traced(qk_norm_rope_prologue, signature)


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


# ---------------------------------------------------------------- the shared call path


@dataclass(frozen=True, eq=False)
class FusedOp:
    """A public fused op as the one shared call path (:func:`call_fused`) sees it.

    ``composition``: the function of :mod:`fqr.ops` traced into the op's program (called with
    the tensors positionally, None for an absent optional one, and the static arguments by
    keyword). ``check``: ``check(*tensors, backend=..., **static)`` raises a ``ValueError`` /
    ``TypeError`` naming the bad argument. ``dims``: per tensor, the names of its leading
    dimensions in the program (``("T",)`` for a per-token tensor, ``("P",)`` for a table,
    ``()`` for a weight): those are symbolic, every other dimension is part of the signature.
    A new public op is its composition, one ``FusedOp`` and an entry point that gathers its
    tensors and static arguments and returns ``call_fused(...)``.
    """

    name: str
    composition: Callable[..., Any]
    check: Callable[..., None]
    dims: tuple[tuple[str, ...], ...]
    programs: dict = field(default_factory=dict, repr=False)  # cheap key -> traced Program

    def signature(self, tensors: Sequence[torch.Tensor | None], static: dict) -> tuple:
        """``(avals, static items)``: what the traced program depends on."""
        avals = tuple(Aval.of(t, *d) for t, d in zip(tensors, self.dims))
        return avals, tuple(sorted(static.items()))

    def program(self, signature: tuple) -> Program:
        """The composition traced for one :meth:`signature` (memoised)."""
        return _traced(self.composition, signature)


def call_fused(
    op: FusedOp, tensors: tuple, static: dict, backend: str, rows: torch.Tensor | None = None
) -> tuple:
    """The path of every public fused op: check the arguments (named errors before any kernel),
    look the program up by a cheap key (each tensor's dtype and non-symbolic dims, the static
    arguments) and trace it on a miss, then run it on ``backend`` (:func:`_launch`). ``rows``:
    the tensor whose device and token count the call follows (default the first)."""
    op.check(*tensors, backend=backend, **static)
    key = (
        tuple(
            None if t is None else (t.dtype, t.shape[len(d) :]) for t, d in zip(tensors, op.dims)
        ),
        tuple(static.items()),
    )
    program = op.programs.get(key)
    if program is None:
        program = op.program(op.signature(tensors, static))
        op.programs[key] = program
    rows = tensors[0] if rows is None else rows
    return _launch(program, [t for t in tensors if t is not None], backend, rows)


def _check_split(
    qkv, positions, cache, qw, kw, qb, kb, q_sum_sq, k_sum_sq, *, backend, **static
) -> None:
    counts = static.pop("q_count", None), static.pop("k_count", None)
    stats = None if q_sum_sq is None else NormStats(q_sum_sq, k_sum_sq, *counts)
    check_prologue_args(qkv, positions, cache, qw, kw, qb, kb, stats, backend=backend, **static)


_ROWS, _TABLE, _VECTOR = ("T",), ("P",), ()

SPLIT_QKV_RMSNORM_ROPE = FusedOp(
    "split_qkv_rmsnorm_rope",
    attention_prologue,
    _check_split,
    (_ROWS, _ROWS, _TABLE) + (_VECTOR,) * 4 + (_ROWS, _ROWS),
)
QK_RMSNORM_ROPE = FusedOp(
    "qk_rmsnorm_rope",
    qk_norm_rope_prologue,
    check_qk_args,
    (_ROWS, _ROWS, _ROWS, _TABLE) + (_VECTOR,) * 4,
)


# ------------------------------------------------------------------------------ the ops


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
    then RoPE on the first R features; the reference it matches is
    :func:`fqr.reference.prologue`. ``numerics="fused"`` computes in fp32 and rounds once at the
    store; ``"unfused"`` rounds after the norm and rounds every RoPE multiply/add, as vLLM's and
    Hugging Face's unfused code does. ``norm_stats`` carries the all-reduced statistic of a
    full-width norm sharded over TP ranks (see :class:`NormStats`).
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
    stats: tuple = (None, None)
    if norm_stats is not None:
        check_norm_stats(norm_stats)
        stats = (norm_stats.q_sum_sq, norm_stats.k_sum_sq)
        static.update(q_count=norm_stats.q_count, k_count=norm_stats.k_count)
    tensors = (qkv, positions, cos_sin_cache, q_weight, k_weight, q_bias, k_bias, *stats)
    return call_fused(SPLIT_QKV_RMSNORM_ROPE, tensors, static, backend)


def qk_rmsnorm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    *,
    head_dim: int,
    eps: float = 1e-6,
    is_neox: bool = True,
    q_bias: torch.Tensor | None = None,
    k_bias: torch.Tensor | None = None,
    weight_offset: float = 0.0,
    numerics: str = "fused",
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMS-normalise each head of ``q [T, Hq*D]`` and ``k [T, Hkv*D]``, then rotate them.

    Same math, arguments and numerics modes as :func:`split_qkv_rmsnorm_rope` with
    ``norm="head"``, minus the split (reference: :func:`fqr.reference.qk_prologue`). Returns
    new contiguous ``q`` and ``k`` in q's dtype.
    """
    static = dict(
        head_dim=head_dim,
        eps=eps,
        is_neox=is_neox,
        weight_offset=weight_offset,
        numerics=numerics,
    )
    tensors = (q, k, positions, cos_sin_cache, q_weight, k_weight, q_bias, k_bias)
    return call_fused(QK_RMSNORM_ROPE, tensors, static, backend)


def _launch(program: Program, args: list, backend: str, rows: torch.Tensor) -> tuple:
    """Run ``program`` on ``backend`` for the device of ``rows`` (its first input); no tokens:
    empty outputs, nothing launched (a bad ``backend`` is refused at any T)."""
    runner = resolve_backend(backend, rows.device)
    if rows.shape[0] == 0:
        return tuple(
            torch.empty(0, v.aval.shape[1], dtype=v.aval.dtype, device=rows.device)
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
    spec, wdt = preset.spec, weight_dtype or dtype
    q_len, k_len = spec.norm_widths or (0, 0)
    has_norm = spec.norm != "none"
    stats = sharded_full_norm and spec.norm == "full"

    def vec(n: int, present: bool) -> Aval | None:
        return Aval((n,), wdt) if present else None

    avals = (
        Aval(("T", spec.qkv_width), dtype),
        Aval(("T",), positions_dtype),
        Aval(("P", spec.rotary_dim), cache_dtype),
        vec(q_len, has_norm),
        vec(k_len, has_norm),
        vec(q_len, has_norm and bias),
        vec(k_len, has_norm and bias),
        Aval(("T",), torch.float32) if stats else None,
        Aval(("T",), torch.float32) if stats else None,
    )
    static = spec.kwargs(
        eps=float(spec.eps), weight_offset=float(spec.weight_offset), numerics=numerics
    )
    if stats:
        d = spec.head_dim
        static.update(q_count=preset.total_heads * d, k_count=preset.total_kv_heads * d)
    return prologue_program((avals, tuple(sorted(static.items()))))
