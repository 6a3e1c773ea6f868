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

from dataclasses import dataclass
from functools import lru_cache

import torch

from . import ops
from .backends import resolve_backend
from .core import Aval, Program, Section, trace
from .validate import (
    call_metadata,
    check_cache_args,
    check_distinct_caches,
    check_finite_scalar,
    check_index_prologue_args,
    check_mrope_args,
    check_out_buffers,
    check_positions_in_range,
    check_prologue_args,
    check_qk_args,
    check_slots_in_range,
    remember_checked_key,
)


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
    full_norm=False,
):
    """RMSNorm of q and of k over groups of ``groups[i]`` features (no norm when ``groups`` is
    None), then RoPE of both; ``numerics="unfused"`` rounds to q's dtype where the model code
    does, in the norm and in every RoPE step (``fqr.ops.norm``, ``fqr.ops.rope``)."""
    round_to = q.dtype if numerics.startswith("unfused") else None
    # HF's OLMo2 (full-width norms): the weight multiplies in fp32 (one rounding), and RoPE runs
    # in fp32 with fp32 cos/sin, rounded once (fqr.numerics, "unfused-hf")
    hf_full_norm = numerics == "unfused-hf" and full_norm
    values = [q, k]  # k None: q alone (vLLM's rotary_emb(positions, q, None))
    if groups is not None:
        values = [
            None
            if x is None
            else ops.rms_norm(
                x,
                w,
                eps=eps,
                group_size=g,
                bias=b,
                weight_offset=weight_offset,
                sum_sq=ss,
                count=n,
                round_to=round_to,
                round_before_weight=False if hf_full_norm else None,
            )
            for x, w, b, g, ss, n in zip(values, weights, biases, groups, sums, counts)
        ]
    if cos_sin_cache is not None:  # else a layer without RoPE (NoPE): the norm alone
        rope = dict(head_dim=head_dim, is_neox=is_neox, round_to=None if hf_full_norm else round_to)
        values = [
            None if x is None else ops.rope(x, positions, cos_sin_cache, **rope) for x in values
        ]
    return values[0], values[1]


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
    num_v_heads=None,
    v_head_dim=None,
    head_stride=None,
    with_v=True,
):
    """Split the packed row, then norm + RoPE q and k (traced into one program); without a
    ``cos_sin_cache`` no RoPE; ``with_v=False`` returns ``(q, k)`` only (the in-place form,
    where v stays where it is in the packed row)."""
    q, k, v = ops.split_qkv(
        qkv,
        num_heads,
        num_kv_heads,
        head_dim,
        num_v_heads=num_v_heads,
        v_head_dim=v_head_dim,
        head_stride=head_stride,
    )
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
        full_norm=norm == "full",
    )
    return (q, k, v) if with_v else (q, k)


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
    """Per-head norm + RoPE of separate q and k (traced into one program); ``k`` None: q
    alone, the output ``(q,)``."""
    q, k = _norm_then_rope(
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
    return (q,) if k is None else (q, k)


def mrope_attention_prologue(
    qkv,
    positions_t,
    positions_h,
    positions_w,
    cos_sin_cache,
    q_weight,
    k_weight,
    q_bias,
    k_bias,
    *,
    num_heads,
    num_kv_heads,
    head_dim,
    mrope_section,
    mrope_interleaved,
    eps,
    is_neox,
    weight_offset,
    output_gate,
    numerics,
):
    """Qwen3-VL / Qwen3.5 (traced into one program): split the row (with ``output_gate``,
    each q head followed by its gate head, ``[q_0 g_0 q_1 g_1 ... | k | v]``), per-head
    RMSNorm of q and k, multimodal RoPE of both from the three position planes; returns
    ``(q, k, v)`` or ``(q, k, v, gate)``, v and the gate copies of the row."""
    d = head_dim
    q_end = (2 if output_gate else 1) * num_heads * d
    sections = [
        Section(num_heads, d, 0, 2 * d if output_gate else d),
        Section(num_kv_heads, d, q_end),
        Section(num_kv_heads, d, q_end + num_kv_heads * d),
    ]
    if output_gate:
        sections.append(Section(num_heads, d, d, 2 * d))
    q, k, v, *gate = ops.split_heads(qkv, sections)
    round_to = qkv.dtype if numerics.startswith("unfused") else None
    planes = (positions_t, positions_h, positions_w)
    q, k = (
        ops.mrope(
            ops.rms_norm(
                x, w, eps=eps, group_size=d, bias=b, weight_offset=weight_offset, round_to=round_to
            ),
            *planes,
            cos_sin_cache,
            head_dim=d,
            mrope_section=mrope_section,
            mrope_interleaved=mrope_interleaved,
            is_neox=is_neox,
            round_to=round_to,
        )
        for x, w, b in ((q, q_weight, q_bias), (k, k_weight, k_bias))
    )
    return (q, k, v, *gate)


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


def mrope_program(signature: tuple) -> Program:
    """:func:`mrope_attention_prologue` traced for one ``(avals, static)`` signature."""
    return _traced(mrope_attention_prologue, signature)


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


# ------------------------------------------------------------------------------ the ops


def split_qkv_rmsnorm_rope(
    qkv: torch.Tensor,
    positions: torch.Tensor | None,
    cos_sin_cache: torch.Tensor | None,
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
    num_v_heads: int | None = None,
    v_head_dim: int | None = None,
    head_stride: int | None = None,
    inplace: bool = False,
    numerics: str = "fused",
    backend: str = "auto",
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
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
    store; ``"unfused"`` rounds where vLLM's native code and Hugging Face's Qwen3 / Gemma 3
    modules round, bit for bit; ``"unfused-hf"`` as Hugging Face's code where it rounds
    otherwise than vLLM's (OLMo2's full-width norm; :mod:`fqr.numerics`). ``norm_stats``
    carries the all-reduced statistic of a full-width norm sharded over TP ranks (see
    :class:`NormStats`).

    The layouts and forms peers' ops take:

    * ``cos_sin_cache=None``: a layer without RoPE, the norm alone (``positions`` may then be
      None; given, it is checked and not needed);
    * ``num_v_heads`` / ``v_head_dim``: v's own head count and head width (default k's), the
      row being ``[q | k | v]`` with ``Hv*Dv`` columns of v;
    * ``head_stride``: every head of the row starts ``head_stride >= head_dim`` columns after
      the previous one (a padded ``[T, heads, head_stride]`` layout flattened; the padding is
      neither read nor written); the outputs are contiguous;
    * ``inplace=True`` (opt-in; new tensors are the default): q and k are written back into
      ``qkv`` where they were read (vLLM's / vllm-ascend's in-place ops), nothing else in
      ``qkv`` is written; returns views ``(q, k, v)`` of ``qkv``. Needs heads back to back
      (``head_stride`` None) and no input that requires grad.
    * ``out=(q, k, v)``: caller buffers written instead of new tensors (as vLLM's kernels take
      their output buffers), returned as given: ``[T, Hq*D]``, ``[T, Hkv*D]``, ``[T, Hv*Dv]``
      in qkv's dtype on its device, unit stride in the last dim (rows may be strided, e.g.
      views into one wider buffer), overlapping neither ``qkv`` nor each other, no input
      that requires grad (:func:`fqr.validate.check_out_buffers`, every call).
    """
    statics = (num_heads, num_kv_heads, head_dim, eps, is_neox, weight_offset, norm, numerics)
    statics += (num_v_heads, v_head_dim, head_stride, inplace, backend)
    if cos_sin_cache is None:
        positions = None  # no rotation: the program has no positions input
    tensors = (qkv, positions, cos_sin_cache, q_weight, k_weight, q_bias, k_bias)
    rows = (qkv,) if positions is None else (qkv, positions)
    stats = None
    if norm_stats is None:
        key = call_metadata(rows, tensors[2:], statics)
    elif type(norm_stats) is NormStats:
        stats = (norm_stats.q_sum_sq, norm_stats.k_sum_sq)
        counts = (norm_stats.q_count, norm_stats.k_count)
        key = call_metadata((*rows, *stats), tensors[2:], statics + counts)
    else:
        key = None  # the checks name what is wrong with it
    call = _CALLS.get(key) if key is not None else None
    if call is None:
        static = dict(zip(_PROLOGUE_STATICS, statics[:11]))
        check_prologue_args(*tensors, norm_stats, backend=backend, inplace=inplace, **static)
        static["eps"], static["weight_offset"] = float(eps), float(weight_offset)
        if inplace:
            static["with_v"] = False
        program = prologue_program(program_signature(*tensors, norm_stats, **static))
        call = _checked_call(key, program, backend, qkv.device)
    elif call.host_positions and positions is not None:
        check_positions_in_range(positions, cos_sin_cache.shape[0])
    args = [t for t in tensors if t is not None]
    if stats is not None:
        args += stats
    if out is not None:
        if inplace:
            raise ValueError("out= and inplace=True both say where q and k go: give one")
        v_width = (num_v_heads or num_kv_heads) * (v_head_dim or head_dim)
        widths = (num_heads * head_dim, num_kv_heads * head_dim, v_width)
        check_out_buffers(out, qkv, widths, tensors)
        return call.run(args, out=list(out))
    if not inplace:
        return call.run(args)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    views = (
        qkv[:, :q_size],
        qkv[:, q_size : q_size + kv_size],
        qkv[:, q_size + kv_size :],
    )
    call.run(args, out=list(views[:2]))
    return views


_PROLOGUE_STATICS = (
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "eps",
    "is_neox",
    "weight_offset",
    "norm",
    "numerics",
    "num_v_heads",
    "v_head_dim",
    "head_stride",
)


def qk_rmsnorm_rope(
    q: torch.Tensor,
    k: torch.Tensor | None,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor | None,
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

    ``k=None`` (with ``k_weight``/``k_bias`` None): q alone, returned as ``(q, None)`` -- vLLM's
    ``rotary_emb(positions, q, None)`` after ``q_norm``, as Gemma 4's KV-shared and MTP draft
    layers run it (their keys come from another layer's cache).
    """
    tensors = (q, k, positions, cos_sin_cache, q_weight, k_weight, q_bias, k_bias)
    statics = (head_dim, eps, is_neox, weight_offset, numerics, backend, k is None)
    rows = (q, positions) if k is None else (q, k, positions)
    key = call_metadata(rows, tensors[3:], statics)
    call = _CALLS.get(key) if key is not None else None
    if call is None:
        check_qk_args(
            *tensors,
            head_dim=head_dim,
            eps=eps,
            is_neox=is_neox,
            weight_offset=weight_offset,
            numerics=numerics,
            backend=backend,
        )
        static = dict(
            head_dim=head_dim,
            eps=float(eps),
            is_neox=is_neox,
            weight_offset=float(weight_offset),
            numerics=numerics,
        )
        avals = tuple(Aval.of(t, "T") for t in tensors[:3]) + (Aval.of(cos_sin_cache, "P"),)
        avals += tuple(Aval.of(t) for t in tensors[4:])
        program = qk_program((avals, tuple(sorted(static.items()))))
        call = _checked_call(key, program, backend, q.device)
    elif call.host_positions:
        check_positions_in_range(positions, cos_sin_cache.shape[0])
    outs = call.run([t for t in tensors if t is not None])
    return (outs[0], None) if k is None else outs


def split_qkv_rmsnorm_mrope(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    mrope_section: tuple[int, int, int] | list[int],
    mrope_interleaved: bool = False,
    eps: float = 1e-6,
    is_neox: bool = True,
    q_bias: torch.Tensor | None = None,
    k_bias: torch.Tensor | None = None,
    weight_offset: float = 0.0,
    output_gate: bool = False,
    numerics: str = "fused",
    backend: str = "auto",
) -> tuple[torch.Tensor, ...]:
    """Split the packed row, RMS-normalise q and k per head, rotate them by multimodal RoPE;
    return new ``q, k, v`` (and ``gate`` with ``output_gate``). vllm-ascend's
    ``split_qkv_rmsnorm_mrope`` (Qwen3-VL, Qwen3.5), with fqr's argument names and numerics.

    ``qkv [T, (Hq + 2*Hkv)*D]``, or with ``output_gate=True`` Qwen3.5's gated attention row
    ``[T, (2*Hq + 2*Hkv)*D]`` where each q head is followed by its gate head
    (``[q_0 g_0 q_1 g_1 ... | k | v]``, vLLM's ``Qwen3NextAttention``); ``positions [3, T]``
    (temporal, height, width planes; ``[T]`` for text: the same position on every plane, which
    is plain RoPE bit for bit), int32/int64; ``cos_sin_cache [max_position, R]`` (vLLM layout);
    ``mrope_section (t, h, w)`` summing to ``R/2``, contiguous or ``mrope_interleaved``
    (Qwen3-VL, Qwen3.5; :mod:`fqr.ops.mrope` states which plane each frequency reads);
    weights (and optional biases) ``[D]``, scaled by ``weight_offset + w`` (1.0: Qwen3.5's
    ``(1 + w)`` norms). Returns contiguous ``q [T, Hq*D]``, ``k``, ``v [T, Hkv*D]`` and
    ``gate [T, Hq*D]`` in qkv's dtype, v and the gate copied bit for bit.

    Math per head: ``y = x * rsqrt(mean(x^2) + eps) * (weight_offset + w) + b``, then the
    rotation of the first R features by each frequency's plane angle; the reference it matches
    is :func:`fqr.reference.mrope_prologue`. ``numerics`` as :func:`split_qkv_rmsnorm_rope`
    (``"unfused"`` rounds where vLLM's ``RMSNorm`` / ``GemmaRMSNorm`` and
    ``MRotaryEmbedding.forward_native`` round).
    """
    section = tuple(mrope_section) if isinstance(mrope_section, (tuple, list)) else mrope_section
    statics = (num_heads, num_kv_heads, head_dim, section, mrope_interleaved, eps, is_neox)
    statics += (weight_offset, output_gate, numerics, backend)
    tensors = (cos_sin_cache, q_weight, k_weight, q_bias, k_bias)
    # positions [3, T] is keyed as its [T, 3] view (T first, as every token tensor)
    planar = isinstance(positions, torch.Tensor) and positions.dim() == 2
    rows = (qkv, positions.mT if planar else positions)
    keyed = isinstance(section, tuple) and all(type(s) is int for s in section)
    key = call_metadata(rows, tensors, statics) if keyed else None
    call = _CALLS.get(key) if key is not None else None
    if call is None:
        static = dict(zip(_MROPE_STATICS, statics[:-1]))
        check_mrope_args(qkv, positions, *tensors[:3], q_bias, k_bias, backend=backend, **static)
        static.update(eps=float(eps), weight_offset=float(weight_offset), mrope_section=section)
        plane = Aval.of(positions[0] if planar else positions, "T")
        avals = (Aval.of(qkv, "T"), plane, plane, plane, Aval.of(cos_sin_cache, "P"))
        avals += tuple(Aval.of(t) for t in tensors[1:])
        program = mrope_program((avals, tuple(sorted(static.items()))))
        call = _checked_call(key, program, backend, qkv.device)
    elif call.host_positions:
        check_positions_in_range(positions, cos_sin_cache.shape[0])
    planes = positions.unbind(0) if planar else (positions, positions, positions)
    return call.run([qkv, *planes, *(t for t in tensors if t is not None)])


_MROPE_STATICS = (
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "mrope_section",
    "mrope_interleaved",
    "eps",
    "is_neox",
    "weight_offset",
    "output_gate",
    "numerics",
)


# ------------------------------------------------------------------- the per-call path


class CheckedCall:
    """What a call whose arguments passed the checks once needs on every later call with the
    same metadata (:func:`fqr.validate.call_metadata`): its traced program, the launch of its
    backend (:meth:`fqr.backends.Backend.bind`), whether the positions' range must be checked
    on the host (CPU tensors), and -- for generated kernels -- the generated host function of
    this metadata (:mod:`fqr.lowering.host`; one for ``out=None``, one for ``out``), made after
    the first call and remade when a new kernel variant is bound."""

    __slots__ = ("program", "launch", "host_positions", "backend", "host", "_host_builds")

    MAX_HOST_BUILDS = 8  # regenerations per checked call (each bound variant makes one)

    def __init__(self, program: Program, launch, host_positions: bool, backend=None):
        self.program = program
        self.launch = launch
        self.host_positions = host_positions
        self.backend = backend if backend is not None and backend.has_kernels else None
        self.host: list = [None, None]  # HostFunction for out=None, for out
        self._host_builds = 0

    def run(self, args: list, out: list[torch.Tensor] | None = None) -> tuple:
        """Run on ``args`` (first: the token rows), into ``out`` when given (``[T, width]``
        tensors whose rows may be strided, e.g. views into the packed input); no tokens: empty
        outputs, no launch. The generated host function runs the call where it covers it,
        else the general path does (and a newly bound kernel variant regenerates it)."""
        host = self.host[out is not None]
        if host is not None:
            outs = host.fn(args) if out is None else host.fn(args, out)
            if outs is not None:
                return outs
        rows = args[0]
        if rows.shape[0] == 0:
            if out is not None:
                return tuple(out)
            return tuple(
                torch.empty(0, v.aval.shape[1], dtype=v.aval.dtype, device=rows.device)
                for v in self.program.outputs
            )
        outs = tuple(self.launch(args) if out is None else self.launch(args, out))
        if self.backend is not None and self._host_builds < self.MAX_HOST_BUILDS:
            bound = self.backend.bound_kernels(self.program)
            if host is None or host.bound != bound:
                self._host_builds += 1
                self.host[out is not None] = self.backend.host_function(self.program, args, out)
        return outs


_CALLS: dict[tuple, CheckedCall] = {}
MAX_CHECKED_CALLS = 4096  # distinct argument metadata kept (a full table stops adding)


def _checked_call(key, program: Program, backend: str, device: torch.device) -> CheckedCall:
    """Resolve the backend (a bad or unavailable one is refused at any T) and keep the call
    for its metadata key."""
    resolved = resolve_backend(backend, device)
    kept = key is not None and len(_CALLS) < MAX_CHECKED_CALLS
    # a call that is not kept runs once: no host function for it
    call = CheckedCall(
        program, resolved.bind(program), device.type == "cpu", resolved if kept else None
    )
    if kept:
        _CALLS[key] = call
        remember_checked_key(key)
    return call


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


def mrope_preset_program(
    preset,
    dtype: torch.dtype = torch.bfloat16,
    *,
    numerics: str = "fused",
    bias: bool = False,
    positions_dtype: torch.dtype = torch.int64,
    cache_dtype: torch.dtype = torch.float32,
    weight_dtype: torch.dtype | None = None,
    output_gate: bool = False,
) -> Program:
    """The traced :func:`split_qkv_rmsnorm_mrope` program of a preset of an mRoPE variant
    (its TP view; the variant fields ``mrope_section``, ``mrope_interleaved``), with or without
    the gate, as a call with those dtypes traces it."""
    spec, wdt, fields = preset.spec, weight_dtype or dtype, preset.params
    gate = bool(output_gate)
    width = ((2 if gate else 1) * spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    plane = Aval(("T",), positions_dtype)
    vec = Aval((spec.head_dim,), wdt)
    avals = (
        Aval(("T", width), dtype),
        plane,
        plane,
        plane,
        Aval(("P", spec.rotary_dim), cache_dtype),
    )
    avals += (vec, vec, vec if bias else None, vec if bias else None)
    static = dict(
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        mrope_section=tuple(fields["mrope_section"]),
        mrope_interleaved=bool(fields["mrope_interleaved"]),
        eps=float(spec.eps),
        is_neox=spec.is_neox,
        weight_offset=float(spec.weight_offset),
        output_gate=gate,
        numerics=numerics,
    )
    return mrope_program((avals, tuple(sorted(static.items()))))


# --------------------------------------------------- variants: Gemma 4 v norm, Llama 4 L2 norm


def vnorm_prologue(
    qkv,
    positions,
    cos_sin_cache,
    q_weight,
    k_weight,
    *,
    num_heads,
    num_kv_heads,
    head_dim,
    eps,
    is_neox,
    weight_offset,
    numerics,
):
    """Gemma 4: split, norm + RoPE of q and k (:func:`attention_prologue`'s per-head form),
    and v normalised per head without weight (traced into one program)."""
    q, k, v = ops.split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    q, k = _norm_then_rope(
        q,
        k,
        positions,
        cos_sin_cache,
        (q_weight, k_weight),
        (None, None),
        groups=(head_dim, head_dim),
        head_dim=head_dim,
        eps=eps,
        is_neox=is_neox,
        weight_offset=weight_offset,
        numerics=numerics,
    )
    round_to = qkv.dtype if numerics.startswith("unfused") else None
    v = ops.rms_norm(v, None, eps=eps, group_size=head_dim, round_to=round_to)
    return q, k, v


def rope_l2norm_prologue(
    qkv,
    positions,
    cos_sin_cache,
    *,
    num_heads,
    num_kv_heads,
    head_dim,
    eps,
    is_neox,
    numerics,
    floor_scale=None,
    attn_scale=0.1,
):
    """Llama 4: split; on RoPE layers (a ``cos_sin_cache``) rotate q and k, then L2-normalise
    each head without weight; on NoPE layers (None) neither, and with ``floor_scale`` q scaled
    by the attention temperature (traced into one program). Unfused, vLLM rounds after the
    rotation (``rope``'s ``round_to``) and once after the norm (fp32 ``qk_norm(q.float())``);
    Hugging Face rotates in fp32 and rounds once (``unfused-hf``: the rotation exact, then one
    ``reduce_precision``)."""
    q, k, v = ops.split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    round_to = qkv.dtype if numerics.startswith("unfused") else None
    if cos_sin_cache is not None:
        hf = numerics == "unfused-hf"
        rotated = [
            ops.rope(
                x,
                positions,
                cos_sin_cache,
                head_dim=head_dim,
                is_neox=is_neox,
                round_to=None if hf else round_to,
            )
            for x in (q, k)
        ]
        if hf:
            rotated = [ops.reduce_precision(x, qkv.dtype) for x in rotated]
        q, k = (
            ops.rms_norm(x, None, eps=eps, group_size=head_dim, round_to=round_to) for x in rotated
        )
    if floor_scale is not None:
        q = ops.attn_temperature(q, positions, floor_scale=floor_scale, attn_scale=attn_scale)
    return q, k, v


def vnorm_program(signature: tuple) -> Program:
    """:func:`vnorm_prologue` traced for one ``(avals, static)`` signature."""
    return _traced(vnorm_prologue, signature)


def rope_l2norm_program(signature: tuple) -> Program:
    """:func:`rope_l2norm_prologue` traced for one ``(avals, static)`` signature."""
    return _traced(rope_l2norm_prologue, signature)


def split_qkv_rmsnorm_rope_vnorm(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float = 1e-6,
    is_neox: bool = True,
    weight_offset: float = 0.0,
    numerics: str = "fused",
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gemma 4's prologue: split the packed row, RMS-normalise and rotate q and k, and
    RMS-normalise v per head without weight; return new q, k, v.

    Arguments as :func:`split_qkv_rmsnorm_rope` with ``norm="head"`` (weights ``[D]``). Per head
    (``fqr.ops``): ``q, k = rope(x * rsqrt(mean(x^2) + eps) * (weight_offset + w))`` and
    ``v = v * rsqrt(mean(v^2) + eps)``, the same ``eps`` (the model's ``rms_norm_eps``). This is
    vLLM's ``Gemma4Attention.forward`` (``q_norm``, ``k_norm``, ``rotary_emb``, ``v_norm =
    RMSNorm(head_dim, has_weight=False)``) and vllm-ascend's ``split_qkv_rmsnorm_rope_vnorm``;
    the reference it matches is :func:`fqr.reference.vnorm_prologue`. Gemma 4's full-attention
    layers (head_dim 512) take their proportional RoPE table as a full-width ``cos_sin_cache``
    (:mod:`fqr.rope_cache`); their ``attention_k_eq_v`` checkpoints load k's weights into v's
    slot, so the row keeps its ``[q | k | v]`` layout. ``numerics="unfused"`` rounds where vLLM's
    native modules do (the v norm once, fp32 inside).
    """
    statics = (num_heads, num_kv_heads, head_dim, eps, is_neox, weight_offset, numerics)
    statics += (backend, "vnorm")
    tensors = (qkv, positions, cos_sin_cache, q_weight, k_weight)
    key = call_metadata((qkv, positions), tensors[2:], statics)
    call = _CALLS.get(key) if key is not None else None
    if call is None:
        static = dict(
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            eps=eps,
            is_neox=is_neox,
            weight_offset=weight_offset,
            numerics=numerics,
        )
        if cos_sin_cache is None:
            raise ValueError("cos_sin_cache is required (Gemma 4 rotates every layer)")
        if numerics == "unfused-hf":
            raise ValueError(
                "numerics 'unfused-hf' is not defined for the v-norm prologue: 'unfused' rounds "
                "as vLLM's Gemma4Attention does"
            )
        check_prologue_args(*tensors, None, None, None, norm="head", backend=backend, **static)
        static["eps"], static["weight_offset"] = float(eps), float(weight_offset)
        avals = (Aval.of(qkv, "T"), Aval.of(positions, "T"), Aval.of(cos_sin_cache, "P"))
        avals += (Aval.of(q_weight), Aval.of(k_weight))
        program = vnorm_program((avals, tuple(sorted(static.items()))))
        call = _checked_call(key, program, backend, qkv.device)
    elif call.host_positions:
        check_positions_in_range(positions, cos_sin_cache.shape[0])
    return call.run(list(tensors))


MAX_TEMPERATURE_POSITION = 1 << 24  # positions are exact as fp32 numbers below this


def split_qkv_rope_l2norm(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor | None,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float = 1e-5,
    is_neox: bool = False,
    floor_scale: float | None = None,
    attn_scale: float = 0.1,
    numerics: str = "fused",
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Llama 4's prologue: split the packed row; rotate q and k, then L2-normalise each head
    without weight; return new q, k, v (v a copy).

    ``qkv [T, (Hq + 2*Hkv)*D]``, ``positions [T]``, ``cos_sin_cache [max_position, R]`` (vLLM
    layout). Per head: ``y = rope(x) * rsqrt(mean(rope(x)^2) + eps)`` -- HF
    ``Llama4TextL2Norm`` (``eps = rms_norm_eps``) after ``apply_rotary_emb``, vLLM's ``qk_norm
    = RMSNorm(head_dim, has_weight=False)`` after ``rotary_emb``. ``is_neox=False`` (default):
    Hugging Face's layout, whose rotation is a complex multiplication of interleaved pairs
    ``(2i, 2i+1)``; vLLM permutes the checkpoint's q/k rows at load
    (``permute_qk_weight_for_rotary``) and rotates NeoX halves, ``is_neox=True``.

    ``cos_sin_cache=None`` is a NoPE layer (every fourth layer of Llama 4): no rotation and no
    norm (vLLM: ``use_qk_norm and not nope``); ``floor_scale`` (the config's, 8192) then scales q
    by the attention temperature ``log(floor((p + 1) / floor_scale) + 1) * attn_scale + 1``
    (vLLM ``Llama4Attention._get_attn_scale``, on with ``attn_temperature_tuning``;
    :mod:`fqr.ops.temperature`), positions below 2^24. The reference it matches is
    :func:`fqr.reference.rope_l2norm_prologue`. ``numerics="unfused"`` rounds as vLLM's code
    (the rotation in the model dtype, the norm once), ``"unfused-hf"`` as Hugging Face's (the
    rotation in fp32, rounded once, then the norm once).
    """
    statics = (num_heads, num_kv_heads, head_dim, eps, is_neox, floor_scale, attn_scale)
    statics += (numerics, backend, "rope-l2norm")
    reads_positions = cos_sin_cache is not None or floor_scale is not None
    rows = (qkv, positions) if reads_positions else (qkv,)
    key = call_metadata(rows, (cos_sin_cache,), statics)
    call = _CALLS.get(key) if key is not None else None
    if call is None:
        if floor_scale is not None:
            check_finite_scalar("floor_scale", floor_scale, positive=True)
            check_finite_scalar("attn_scale", attn_scale)
            if positions is None:
                raise ValueError("positions is required with floor_scale (the temperature)")
        check_prologue_args(
            qkv,
            positions,
            cos_sin_cache,
            None,
            None,
            None,
            None,
            None,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            eps=eps,
            is_neox=is_neox,
            weight_offset=0.0,
            norm="none",
            numerics=numerics,
            backend=backend,
        )
        static = dict(
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            eps=float(eps),
            is_neox=is_neox,
            numerics=numerics,
        )
        if floor_scale is not None:
            static.update(floor_scale=float(floor_scale), attn_scale=float(attn_scale))
        avals = (
            Aval.of(qkv, "T"),
            Aval.of(positions, "T") if reads_positions else None,
            Aval.of(cos_sin_cache, "P"),
        )
        program = rope_l2norm_program((avals, tuple(sorted(static.items()))))
        call = _checked_call(key, program, backend, qkv.device)
    if call.host_positions and reads_positions:
        limit = MAX_TEMPERATURE_POSITION if cos_sin_cache is None else cos_sin_cache.shape[0]
        check_positions_in_range(positions, limit)
    args = [*rows] if cos_sin_cache is None else [*rows, cos_sin_cache]
    return call.run(args)


# ------------------------------------------- MiniMax-M3: indexer heads, KV-cache insert


def index_heads_prologue(
    qkv,
    positions,
    cos_sin_cache,
    q_weight,
    k_weight,
    index_q_weight,
    index_k_weight,
    *,
    num_heads,
    num_kv_heads,
    head_dim,
    num_index_heads,
    index_head_dim,
    eps,
    is_neox,
    weight_offset,
    attn_fp8,
    index_fp8,
    numerics,
):
    """MiniMax-M3's sparse-attention prologue (traced into one program): the row ``[q | k | v
    | index_q | index_k]`` split in five, q and k normalised per ``head_dim`` head, index_q
    and the one index_k head per ``index_head_dim`` head, all four rotated by the same table;
    ``attn_fp8`` / ``index_fp8`` saturate q, k, v / index_q, index_k to +-448 and store them
    as E4M3."""
    iq_at = (num_heads + 2 * num_kv_heads) * head_dim
    q, k, v, iq, ik = ops.split_heads(
        qkv,
        (
            ops.Section(num_heads, head_dim, 0),
            ops.Section(num_kv_heads, head_dim, num_heads * head_dim),
            ops.Section(num_kv_heads, head_dim, (num_heads + num_kv_heads) * head_dim),
            ops.Section(num_index_heads, index_head_dim, iq_at),
            ops.Section(1, index_head_dim, iq_at + num_index_heads * index_head_dim),
        ),
    )
    common = dict(
        eps=eps, is_neox=is_neox, weight_offset=weight_offset, numerics=numerics, biases=(None,) * 2
    )
    q, k = _norm_then_rope(
        q,
        k,
        positions,
        cos_sin_cache,
        (q_weight, k_weight),
        groups=(head_dim, head_dim),
        head_dim=head_dim,
        **common,
    )
    iq, ik = _norm_then_rope(
        iq,
        ik,
        positions,
        cos_sin_cache,
        (index_q_weight, index_k_weight),
        groups=(index_head_dim, index_head_dim),
        head_dim=index_head_dim,
        **common,
    )
    attn, index = [q, k, v], [iq, ik]
    if attn_fp8:
        attn = [ops.quantize_fp8(x) for x in attn]
    if index_fp8:
        index = [ops.quantize_fp8(x) for x in index]
    return (*attn, *index)


def cache_prologue(
    qkv,
    positions,
    cos_sin_cache,
    q_weight,
    k_weight,
    key_cache,
    value_cache,
    slot_mapping,
    k_scale,
    v_scale,
    *,
    num_heads,
    num_kv_heads,
    head_dim,
    eps,
    is_neox,
    weight_offset,
    numerics,
):
    """Norm + RoPE of q and k, then k and v written into the paged caches by slot (traced into
    one program): returns ``(q, new key_cache, new value_cache)``, the caches functional
    updates (:func:`fqr.ops.cache_insert`) that the kernel stores in place when donated."""
    q, k, v = ops.split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    q, k = _norm_then_rope(
        q,
        k,
        positions,
        cos_sin_cache,
        (q_weight, k_weight),
        (None, None),
        groups=(head_dim, head_dim),
        head_dim=head_dim,
        eps=eps,
        is_neox=is_neox,
        weight_offset=weight_offset,
        numerics=numerics,
    )
    key_cache = ops.cache_insert(key_cache, k, slot_mapping, k_scale)
    value_cache = ops.cache_insert(value_cache, v, slot_mapping, v_scale)
    return q, key_cache, value_cache


def index_heads_program(signature: tuple) -> Program:
    """:func:`index_heads_prologue` traced for one ``(avals, static)`` signature."""
    return _traced(index_heads_prologue, signature)


def cache_program(signature: tuple) -> Program:
    """:func:`cache_prologue` traced for one ``(avals, static)`` signature."""
    return _traced(cache_prologue, signature)


def split_qkv_index_rmsnorm_rope(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    index_q_weight: torch.Tensor,
    index_k_weight: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_index_heads: int,
    index_head_dim: int,
    eps: float = 1e-6,
    is_neox: bool = True,
    weight_offset: float = 1.0,
    attn_fp8: bool = False,
    index_fp8: bool = False,
    numerics: str = "fused",
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """MiniMax-M3's sparse-attention prologue with its lightning-indexer heads, fused: vllm-
    ascend's ``split_qkv_index_rmsnorm_rope``. Returns new ``(q, k, v, index_q, index_k)``.

    ``qkv [T, (Hq + 2*Hkv)*D + (Hi + 1)*Di]`` is the packed row ``[q | k | v | index_q |
    index_k]``: ``Hi = num_index_heads`` indexer q heads and ONE indexer k head shared by
    them, both of ``Di = index_head_dim``. Per head of q and k (width D) and of index_q and
    index_k (width Di), with its own weight (``[D]``, ``[D]``, ``[Di]``, ``[Di]``)::

        y = x * rsqrt(mean(x^2) + eps) * (weight_offset + w)      # Gemma (1 + w) by default

    then NeoX (or GPT-J) RoPE of the first R features of every head of all four, R the
    ``cos_sin_cache`` width (R <= min(D, Di)), from the same rows ``cos_sin_cache[positions]``
    (MiniMax-M3's one ``rotary_emb`` for both); v is copied. ``attn_fp8``: q, k and v are
    returned as ``float8_e4m3fn``, ``clamp(y, -448, 448)`` rounded to nearest-even E4M3;
    ``index_fp8`` the same for index_q and index_k. The scale is 1, as vllm-ascend's kernel
    writes it (``clamp(y, -448, 448).to(float8_e4m3fn)``, no scale argument). Otherwise the
    outputs are in qkv's dtype: q ``[T, Hq*D]``, k and v ``[T, Hkv*D]``, index_q ``[T,
    Hi*Di]``, index_k ``[T, Di]``.

    The reference it matches is :func:`fqr.reference.index_prologue` (then
    :func:`fqr.reference.saturate_fp8` for FP8 outputs). ``numerics`` as for
    :func:`split_qkv_rmsnorm_rope` (``unfused``: vLLM's ``GemmaRMSNorm`` then
    ``RotaryEmbedding.forward_native`` in the model dtype, then clamp and cast for FP8).
    """
    tensors = (qkv, positions, cos_sin_cache, q_weight, k_weight, index_q_weight, index_k_weight)
    statics = (num_heads, num_kv_heads, head_dim, num_index_heads, index_head_dim, eps, is_neox)
    statics += (weight_offset, attn_fp8, index_fp8, numerics, backend)
    key = call_metadata((qkv, positions), tensors[2:], statics)
    call = _CALLS.get(key) if key is not None else None
    if call is None:
        weights = (
            ("q_weight", q_weight, head_dim),
            ("k_weight", k_weight, head_dim),
            ("index_q_weight", index_q_weight, index_head_dim),
            ("index_k_weight", index_k_weight, index_head_dim),
        )
        static = dict(zip(_INDEX_STATICS, statics[:11]))
        check_index_prologue_args(qkv, positions, cos_sin_cache, weights, backend=backend, **static)
        static["eps"], static["weight_offset"] = float(eps), float(weight_offset)
        avals = (Aval.of(qkv, "T"), Aval.of(positions, "T"), Aval.of(cos_sin_cache, "P"))
        avals += tuple(Aval.of(t) for t in tensors[3:])
        program = index_heads_program((avals, tuple(sorted(static.items()))))
        call = _checked_call(key, program, backend, qkv.device)
    elif call.host_positions:
        check_positions_in_range(positions, cos_sin_cache.shape[0])
    return call.run(list(tensors))


_INDEX_STATICS = (
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "num_index_heads",
    "index_head_dim",
    "eps",
    "is_neox",
    "weight_offset",
    "attn_fp8",
    "index_fp8",
    "numerics",
)


def split_qkv_rmsnorm_rope_cache(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float = 1e-6,
    is_neox: bool = True,
    weight_offset: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    numerics: str = "fused",
    backend: str = "auto",
) -> torch.Tensor:
    """Split the packed QKV row, RMS-normalise and rotate q and k, and write k and v into the
    paged KV cache (vllm-ascend's ``minimax_qknorm_rope_cache`` for the main heads, vLLM's
    ``reshape_and_cache_flash`` fused in); returns the new ``q [T, Hq*D]`` only.

    q and k: the math of :func:`split_qkv_rmsnorm_rope` (per-head norm, ``(weight_offset +
    w)``, RoPE of the first R features). Then for every token ``t`` with ``s =
    slot_mapping[t] >= 0``, block ``s // block_size``, row ``s % block_size``::

        key_cache[s // bs, s % bs, h, :]   = store(k[t, h])
        value_cache[s // bs, s % bs, h, :] = store(v[t, h])

    ``key_cache`` / ``value_cache``: ``[num_blocks, block_size, Hkv, D]`` (vLLM's flash
    layout, any strides with a contiguous last dim), in qkv's dtype (``store`` rounds to it)
    or ``float8_e4m3fn`` (``store(x) = e4m3(clamp(x / scale, -448, 448))`` with the float32
    ``[1]`` ``k_scale`` / ``v_scale``, default 1: vLLM's FP8 KV-cache convention). A negative
    slot (padding) writes nothing; rows no slot names are left as they are; two tokens naming
    one slot is the caller's error (vLLM's scheduler never does it) and leaves either row.

    **The caches are updated in place**, as vLLM's cache ops update the caller's cache: the
    composition is functional (:func:`fqr.ops.cache_insert` returns the new cache) and the
    public op donates the caller's buffers, so the kernel stores straight into them (the
    reference backend copies the functional result back). The reference it matches is
    :func:`fqr.reference.prologue` for q and :func:`fqr.reference.cache_insert` for the
    caches. ``numerics="unfused"`` rounds k to qkv's dtype before the cache store, as the
    model's ``k_norm`` / ``rotary_emb`` / ``reshape_and_cache`` chain does.
    """
    tensors = (qkv, positions, cos_sin_cache, q_weight, k_weight, key_cache, value_cache)
    tensors += (slot_mapping, k_scale, v_scale)
    statics = (num_heads, num_kv_heads, head_dim, eps, is_neox, weight_offset, numerics, backend)
    key = call_metadata((qkv, positions, slot_mapping), tensors[2:7] + tensors[8:], statics)
    call = _CALLS.get(key) if key is not None else None
    if call is None:
        static = dict(
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            eps=eps,
            is_neox=is_neox,
            weight_offset=weight_offset,
            numerics=numerics,
        )
        check_prologue_args(*tensors[:5], None, None, None, norm="head", backend=backend, **static)
        check_cache_args(
            qkv,
            key_cache,
            value_cache,
            slot_mapping,
            k_scale,
            v_scale,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
        )
        static["eps"], static["weight_offset"] = float(eps), float(weight_offset)
        avals = (Aval.of(qkv, "T"), Aval.of(positions, "T"), Aval.of(cos_sin_cache, "P"))
        avals += (Aval.of(q_weight), Aval.of(k_weight))
        avals += (Aval.of(key_cache, "B"), Aval.of(value_cache, "B"), Aval.of(slot_mapping, "T"))
        avals += (Aval.of(k_scale), Aval.of(v_scale))
        program = cache_program((avals, tuple(sorted(static.items()))))
        call = _checked_call(key, program, backend, qkv.device)
    else:
        check_distinct_caches(key_cache, value_cache)
        if call.host_positions:
            check_positions_in_range(positions, cos_sin_cache.shape[0])
            check_slots_in_range(slot_mapping, key_cache)
    return call.run([t for t in tensors if t is not None])[0]
