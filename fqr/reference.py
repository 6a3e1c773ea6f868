"""The independent float64 formulation of the attention prologue.

Every check in fqr (goldens, ``fqr bench``, the runtime's verification, ``fqr fuse``, the tests)
compares an implementation with these functions. They share no code with ``fqr.ops`` (whose
``impl`` rules are one of the implementations checked) and work on the already-rounded inputs, in
float64, on any device:

* :func:`rms_norm` -- per group of ``n`` features (a head, or a whole projection)::

      y = x / sqrt(sum(x^2) / n + eps) * (weight_offset + w) + b

  with no ``w`` (a weightless norm: Llama 4's L2 norm, Gemma 4's v norm) the scale is 1; a
  tensor-parallel shard of a full-width norm takes ``sum(x^2)`` and ``n`` from the all-reduced
  statistic instead;
* :func:`rotate` -- RoPE as complex multiplication: the first R features of each head form R/2
  complex numbers ``z_i = x1_i + i x2_i`` (NeoX pairs ``(i, i + R/2)``, GPT-J ``(2i, 2i+1)``),
  each multiplied by ``cos_i + i sin_i`` from the token's angle row (vLLM layout: cos in columns
  ``[0, R/2)``, sin in ``[R/2, R)``), in complex128; :func:`rope` takes that row from
  ``cos_sin_cache[positions[t]]``;
* :func:`split_row` -- a packed row cut into :class:`fqr.core.Section` s (q, k, v, ... each
  with its own head count, head_dim, offset and head stride), by index arithmetic;
* :func:`prologue` -- the op of :func:`fqr.split_qkv_rmsnorm_rope`: split, norm q and k, rotate
  them, copy v bit for bit; :func:`qk_prologue` -- the no-split op of
  :func:`fqr.qk_rmsnorm_rope`;
* :func:`vnorm_prologue` (Gemma 4: v normalised without weight) and
  :func:`rope_l2norm_prologue` (Llama 4: rotate, then the weightless norm; NoPE layers' q times
  :func:`attn_temperature`).

A variant of the prologue is a new composition of these pieces (its own sections, the norm
before or after the rotation, another source of angle rows such as mRoPE's three planes).
The expectation does not depend on ``numerics``: ``fused`` and ``unfused`` differ only in the
tolerance they are held to (:func:`fqr.numerics.compare`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .core import KV_CACHE_FP8_DTYPES, Section, qkv_sections  # layouts and names (no math)

F64 = torch.float64
Tensor = torch.Tensor


def _f64(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.detach().to(F64)


def split_row(row: torch.Tensor, sections: Sequence[Section]) -> list[torch.Tensor]:
    """Each section's heads gathered from the packed ``row [T, W]`` by index arithmetic (head
    ``h`` of a section: columns ``[offset + h*head_stride, ... + head_dim)``), as new
    ``[T, heads*head_dim]`` tensors in the row's dtype, in order."""
    parts = []
    for s in sections:
        last = s.offset + (s.heads - 1) * s.head_stride + s.head_dim
        if last > row.shape[-1]:
            raise ValueError(f"section {s} reaches column {last} of a {row.shape[-1]}-wide row")
        starts = s.offset + s.head_stride * torch.arange(s.heads, device=row.device)
        columns = (starts[:, None] + torch.arange(s.head_dim, device=row.device)).flatten()
        parts.append(row.index_select(1, columns))
    return parts


def split_qkv_layout(qkv: Tensor, layout: str, num_heads: int, head_dim: int) -> list[Tensor]:
    """``[q, k, v]`` of a packed row a checkpoint stores (no load-time permutation), by the
    model's own reshapes, in the row's dtype: ``"per-head"`` (GPT-NeoX, Persimmon: ``row.view(T,
    H, 3, D)``, q, k, v the three slices), ``"codegen-mpN"`` (CodeGen: ``row.view(T, N, 3,
    H*D/N)``, q, v, k the three slices, in that order)."""
    t, h, d = qkv.shape[0], num_heads, head_dim
    row = qkv[:, : 3 * h * d]
    if layout == "per-head":
        parts = row.reshape(t, h, 3, d)
        return [parts[:, :, i].reshape(t, h * d).contiguous() for i in range(3)]
    if not layout.startswith("codegen-mp"):
        raise ValueError(f"unknown qkv layout {layout!r}")
    shards = int(layout.removeprefix("codegen-mp"))
    parts = row.reshape(t, shards, 3, h * d // shards)
    q, v, k = (parts[:, :, i].reshape(t, h * d).contiguous() for i in range(3))
    return [q, k, v]


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    *,
    eps: float,
    group_size: int,
    bias: torch.Tensor | None = None,
    weight_offset: float = 0.0,
    sum_sq: torch.Tensor | None = None,
    count: int | None = None,
) -> torch.Tensor:
    """float64 ``y = x / sqrt(sum(x^2)/n + eps) * (weight_offset + w) + b`` per group of
    ``group_size`` features of ``x [T, width]`` (``n = group_size``; no ``weight``: scale 1).
    ``sum_sq [T]`` and ``count`` replace the group's own sum of squares and ``n`` (a TP shard of
    a full-width norm, the statistic all-reduced over the ranks)."""
    t, width = x.shape
    groups = _f64(x).reshape(t, width // group_size, group_size)
    if sum_sq is None:
        mean_sq = (groups * groups).sum(dim=-1, keepdim=True) / group_size
    else:
        if count is None:
            raise ValueError("count is required with sum_sq")
        mean_sq = _f64(sum_sq).reshape(t, 1, 1) / count
    y = groups / torch.sqrt(mean_sq + eps)
    if weight is not None:
        y = y * (weight_offset + _f64(weight))
    if bias is not None:
        y = y + _f64(bias)
    return y.reshape(t, width)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    eps: float,
    group_size: int,
) -> torch.Tensor:
    """float64 LayerNorm of each group of ``group_size`` features of ``x [T, width]``: ``y = (x
    - mean) / sqrt(mean((x - mean)^2) + eps) * w + b``; ``weight`` / ``bias`` ``[group_size]``
    (every group alike) or ``[width]`` (each group its own, Chameleon's per-head weights)."""
    t, width = x.shape
    n = group_size
    groups = _f64(x).reshape(t, width // n, n)
    centred = groups - groups.sum(dim=-1, keepdim=True) / n
    y = centred / torch.sqrt((centred * centred).sum(dim=-1, keepdim=True) / n + eps)
    for v, combine in ((weight, torch.mul), (bias, torch.add)):
        if v is not None:
            y = combine(y, _f64(v).reshape(-1, n))  # [1, n] or [heads, n]: broadcasts
    return y.reshape(t, width)


def project(x: Tensor, w_qkv: Tensor, qkv_bias: Tensor | None = None) -> Tensor:
    """float64 QKV projection ``x [T, K] @ w_qkv[N, K].T (+ qkv_bias [N])``: the packed row a
    projected prologue (:mod:`fqr.prologue.projected`) feeds its prologue, never rounded to
    the activation dtype (the float64 composition the fused projected form is held to)."""
    y = _f64(x) @ _f64(w_qkv).T
    return y if qkv_bias is None else y + _f64(qkv_bias)


def cos_sin_rows(cos_sin_cache: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """float64 angle rows ``[T, R]`` of the tokens: ``cos_sin_cache[positions]``."""
    return _f64(cos_sin_cache.index_select(0, positions.long()))


def rotate(x: torch.Tensor, rows: torch.Tensor, *, head_dim: int, is_neox: bool = True):
    """float64 RoPE of ``x [T, H*head_dim]`` by per-token angle rows ``[T, R]`` (cos | sin):
    the first R features of each head as R/2 complex numbers times ``cos + i sin``; the
    features past R are unchanged."""
    t, width = x.shape
    heads = _f64(x).reshape(t, width // head_dim, head_dim)
    rows = _f64(rows)
    r = rows.shape[1]
    rotation = torch.complex(rows[:, : r // 2], rows[:, r // 2 :])[:, None, :]
    part = heads[..., :r]
    if is_neox:
        z = torch.complex(part[..., : r // 2].contiguous(), part[..., r // 2 :].contiguous())
    else:
        z = torch.view_as_complex(part.reshape(t, width // head_dim, r // 2, 2).contiguous())
    w = z * rotation
    rotated = torch.cat([w.real, w.imag], dim=-1) if is_neox else torch.view_as_real(w).flatten(-2)
    return torch.cat([rotated, heads[..., r:]], dim=-1).reshape(t, width)


def group_rows(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The angle rows a head group ``head_dim`` wide rotates by under rows ``[T, R]`` (cos |
    sin): its first ``r = min(R, head_dim)`` features turn by the first ``r/2`` frequencies,
    ``cos = row[:r/2]``, ``sin = row[R/2 : R/2 + r/2]`` (vllm-ascend's MiniMax indexer);
    ``[T, r]``."""
    half = rows.shape[1] // 2
    h = min(rows.shape[1], head_dim) // 2
    return torch.cat([rows[:, :h], rows[:, half : half + h]], dim=1)


def rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    head_dim: int,
    is_neox: bool = True,
) -> torch.Tensor:
    """float64 RoPE of ``x [T, H*head_dim]`` at ``positions`` of a vLLM ``cos_sin_cache``."""
    return rotate(x, cos_sin_rows(cos_sin_cache, positions), head_dim=head_dim, is_neox=is_neox)


def head_norm_rotate(
    x: Tensor, weight: Tensor | None, rows: Tensor, *, head_dim: int, eps: float,
    is_neox: bool = True, bias: Tensor | None = None, weight_offset: float = 0.0,
) -> Tensor:  # fmt: skip
    """float64 :func:`rms_norm` of each head of ``x``, then :func:`rotate` by the angle rows."""
    normed = rms_norm(
        x, weight, eps=eps, group_size=head_dim, bias=bias, weight_offset=weight_offset
    )
    return rotate(normed, rows, head_dim=head_dim, is_neox=is_neox)


def prologue(
    qkv: Tensor, positions: Tensor | None, cos_sin_cache: Tensor | None, q_weight: Tensor | None,
    k_weight: Tensor | None, *, num_heads: int, num_kv_heads: int, head_dim: int,
    eps: float = 1e-6, is_neox: bool = True, q_bias: Tensor | None = None,
    k_bias: Tensor | None = None, weight_offset: float = 0.0, norm: str = "head", norm_stats=None,
    num_v_heads: int | None = None, v_head_dim: int | None = None, head_stride: int | None = None,
    qkv_layout: str = "qkv",
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """The prologue of :func:`fqr.split_qkv_rmsnorm_rope` by its formulas (module docstring).

    Same arguments (any float dtypes, any device; ``norm_stats`` anything with ``q_sum_sq``,
    ``k_sum_sq``, ``q_count``, ``k_count``, e.g. :class:`fqr.NormStats`; ``cos_sin_cache``
    None: no rotation; ``qkv_layout`` other than ``"qkv"``: :func:`split_qkv_layout`); returns
    float64 ``q [T, Hq*D]``, ``k [T, Hkv*D]`` and ``v`` copied in qkv's dtype.
    """
    if qkv_layout != "qkv":
        q, k, v = split_qkv_layout(qkv, qkv_layout, num_heads, head_dim)
    else:
        layout = dict(num_v_heads=num_v_heads, v_head_dim=v_head_dim, head_stride=head_stride)
        q, k, v = split_row(qkv, qkv_sections(num_heads, num_kv_heads, head_dim, **layout))
    q, k = _f64(q), _f64(k)
    if norm != "none":
        stats = {"q": (None, None), "k": (None, None)}
        if norm_stats is not None:
            stats = {
                "q": (norm_stats.q_sum_sq, norm_stats.q_count),
                "k": (norm_stats.k_sum_sq, norm_stats.k_count),
            }
        normed = []
        for name, x, w, b in (("q", q, q_weight, q_bias), ("k", k, k_weight, k_bias)):
            sum_sq, count = stats[name]
            group = head_dim if norm == "head" else x.shape[1]
            normed.append(
                rms_norm(
                    x,
                    w,
                    eps=eps,
                    group_size=group,
                    bias=b,
                    weight_offset=weight_offset,
                    sum_sq=sum_sq,
                    count=count,
                )
            )
        q, k = normed
    if cos_sin_cache is None:
        return q, k, v
    rows = cos_sin_rows(cos_sin_cache, positions)
    q = rotate(q, rows, head_dim=head_dim, is_neox=is_neox)
    k = rotate(k, rows, head_dim=head_dim, is_neox=is_neox)
    return q, k, v


def layernorm_prologue(
    qkv: Tensor, positions: Tensor, cos_sin_cache: Tensor, q_weight: Tensor, k_weight: Tensor,
    q_bias: Tensor | None = None, k_bias: Tensor | None = None, *, num_heads: int,
    num_kv_heads: int, head_dim: int, eps: float = 1e-5, is_neox: bool = True,
    qkv_layout: str = "qkv",
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Persimmon's / Chameleon's prologue (:func:`fqr.split_qkv_layernorm_rope`), float64: the
    row split (``qkv_layout``: :func:`split_qkv_layout`), each head of q and of k through
    :func:`layer_norm` (weights ``[D]``, or ``[H*D]``: each head its own), then
    rotated; v copied in qkv's dtype."""
    if qkv_layout == "qkv":
        q, k, v = split_row(qkv, qkv_sections(num_heads, num_kv_heads, head_dim))
    else:
        q, k, v = split_qkv_layout(qkv, qkv_layout, num_heads, head_dim)
    rows = cos_sin_rows(cos_sin_cache, positions)
    out = []
    for x, w, b in ((q, q_weight, q_bias), (k, k_weight, k_bias)):
        normed = layer_norm(x, w, b, eps=eps, group_size=head_dim)
        out.append(rotate(normed, rows, head_dim=head_dim, is_neox=is_neox))
    return out[0], out[1], v


def qk_prologue(
    q: Tensor, k: Tensor | None, positions: Tensor, cos_sin_cache: Tensor, q_weight: Tensor,
    k_weight: Tensor, *, head_dim: int, eps: float = 1e-6, is_neox: bool = True,
    q_bias: Tensor | None = None, k_bias: Tensor | None = None, weight_offset: float = 0.0,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """The no-split prologue of :func:`fqr.qk_rmsnorm_rope`: float64 ``(q, k)``, each head
    normalised, then rotated (``k`` None: ``(q, None)``)."""
    rows = cos_sin_rows(cos_sin_cache, positions)
    per_head = dict(head_dim=head_dim, eps=eps, is_neox=is_neox, weight_offset=weight_offset)
    q = head_norm_rotate(q, q_weight, rows, bias=q_bias, **per_head)
    return q, None if k is None else head_norm_rotate(k, k_weight, rows, bias=k_bias, **per_head)


# ----------------------------------------------------------------- FP8 and the paged cache

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn: 1.75 * 2^8
E4M3_MANTISSA_BITS = 3
E4M3_MIN_NORMAL_EXPONENT = -6  # below 2^-6 the spacing stays 2^-9 (subnormals)


E5M2_MAX = 57344.0  # the largest finite float8_e5m2: 1.75 * 2^15
FP8_MAX = {torch.float8_e4m3fn: E4M3_MAX, torch.float8_e5m2: E5M2_MAX}


def saturate_fp8(
    x: torch.Tensor, scale: torch.Tensor | None = None, dtype: torch.dtype = torch.float8_e4m3fn
) -> torch.Tensor:
    """float64 ``clamp(x / scale, -max, max)``: the value an FP8 store of ``dtype`` rounds
    (E4M3: 448, E5M2: 57344, the stores saturate; NaN stays NaN; ``scale`` a per-tensor ``[1]``
    or 0-dim scale, default 1)."""
    y = _f64(x)
    if scale is not None:
        y = y / _f64(scale).reshape(())
    top = FP8_MAX[dtype]
    return torch.where(torch.isnan(y), y, y.clamp(-top, top))


def e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float64, within +-448) rounded to the nearest float8_e4m3fn value, ties to even,
    as float64: by its binade, ``q = 2^(max(floor(log2|x|), -6) - 3)`` and ``round(x / q) * q``
    (exact in float64: ``q`` is a power of two, ``torch.round`` ties to even)."""
    x = _f64(x)
    if bool((x.abs() > E4M3_MAX).any()):
        raise ValueError("e4m3_round takes values within +-448 (saturate_fp8 first)")
    mag = x.abs()
    exponent = torch.floor(torch.log2(torch.where(mag > 0, mag, torch.ones_like(mag))))
    # log2 of a value just below a power of two can round up to it: take the binade exactly.
    exponent = torch.where(torch.exp2(exponent) > mag, exponent - 1, exponent)
    exponent = exponent.clamp_min(E4M3_MIN_NORMAL_EXPONENT)
    quantum = torch.exp2(exponent - E4M3_MANTISSA_BITS)
    return torch.round(x / quantum) * quantum


def cache_insert(
    cache: torch.Tensor,
    x: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The paged-cache write of :func:`fqr.ops.cache_insert` by index arithmetic, float64.

    Returns ``(expected, written)``: ``expected`` is ``cache`` as float64 with each token's
    heads (``x [T, H*D]``) at slot ``s = slot_mapping[t] >= 0`` (block ``s // block_size``,
    row ``s % block_size``), unrounded (saturated to +-448 by ``x / scale`` for an FP8
    cache); ``written`` is a bool ``[blocks, block_size]`` of the rows written. Rows not
    written hold the cache's own values (compare them bit for bit). ``slot_mapping`` may be
    ``[N]`` with N <= T: tokens ``t >= N`` are not written. Computed on ``cache``'s device."""
    if slot_mapping.shape[0] > x.shape[0]:
        raise ValueError(f"{slot_mapping.shape[0]} slots for {x.shape[0]} tokens")
    blocks, block_size, heads, head_dim = cache.shape
    # one float64 copy (a cache can be GiBs), rows contiguous for the indexed store below
    expected = cache.detach().to(F64, copy=True, memory_format=torch.contiguous_format)
    values = _f64(x).reshape(x.shape[0], heads, head_dim)
    if cache.dtype in FP8_MAX:
        values = saturate_fp8(values, scale, cache.dtype)
    # Where the data is (no copy to the host): each slot's last token (the order of a loop over
    # the tokens, a slot named twice keeping the later token's row), then one indexed store.
    slots = slot_mapping.to(device=cache.device, dtype=torch.int64)
    tokens = torch.arange(slots.shape[0], device=cache.device)
    keep = slots >= 0
    last = torch.full((blocks * block_size,), -1, dtype=torch.int64, device=cache.device)
    last.scatter_reduce_(0, slots[keep], tokens[keep], "amax")
    written = (last >= 0).reshape(blocks, block_size)
    rows = written.reshape(-1).nonzero().squeeze(1)
    expected.view(blocks * block_size, heads, head_dim)[rows] = values[last[rows]]
    return expected, written


def store_kv(
    key_cache: Tensor, value_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor,
    k_scale: Tensor | None, v_scale: Tensor | None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The expected ``(key_cache, value_cache)`` once ``k`` and ``v [T, H*D]`` of the tokens
    are written at their slots (:func:`cache_insert`, each cache with its own scale)."""
    key, _ = cache_insert(key_cache, k, slot_mapping, scale=k_scale)
    value, _ = cache_insert(value_cache, v, slot_mapping, scale=v_scale)
    return key, value


def kv_cache_insert(
    key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor,
    *, kv_cache_dtype: str = "auto", k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The stand-alone paged KV insert (vLLM's ``reshape_and_cache_flash``), float64: ``key``
    and ``value [T, H, D]`` of the first ``N = len(slot_mapping)`` tokens at their slots by
    :func:`cache_insert` (an FP8 cache given as vLLM's uint8 bytes read as the float8 dtype
    ``kv_cache_dtype`` names, :data:`fqr.core.KV_CACHE_FP8_DTYPES`). Returns the expected
    ``(key_cache, value_cache)``."""

    def typed(cache: Tensor) -> Tensor:
        # uint8: E4M3 bytes unless kv_cache_dtype names another FP8 ("auto" is never uint8)
        fp8 = KV_CACHE_FP8_DTYPES.get(kv_cache_dtype, torch.float8_e4m3fn)
        return cache.view(fp8) if cache.dtype == torch.uint8 else cache

    tokens, heads, head_dim = key.shape
    key_rows = key.reshape(tokens, heads * head_dim)
    value_rows = value.reshape(tokens, heads * head_dim)
    return store_kv(
        typed(key_cache), typed(value_cache), key_rows, value_rows, slot_mapping, k_scale, v_scale
    )


def index_prologue(
    qkv: Tensor, positions: Tensor, cos_sin_cache: Tensor, q_weight: Tensor, k_weight: Tensor,
    index_q_weight: Tensor, index_k_weight: Tensor, *, num_heads: int, num_kv_heads: int,
    head_dim: int, num_index_heads: int, index_head_dim: int, eps: float,
    weight_offset: float = 1.0, is_neox: bool = True, attn_fp8: bool = False,
    index_fp8: bool = False, q_bias: Tensor | None = None, k_bias: Tensor | None = None,
    quantize_dtype: torch.dtype | None = None,
) -> tuple[Tensor, ...]:  # fmt: skip
    """MiniMax-M3's prologue with indexer heads, float64: the packed row ``[q | k | v |
    index_q | index_k]`` (one shared index_k head of ``index_head_dim``), q, k, index_q and
    index_k each RMS-normalised per head with its own weight (``(1 + w)`` Gemma norms; q and k
    plus ``q_bias``/``k_bias`` when given, added after the weight as vllm-ascend's kernel adds
    them; the index heads take none) and rotated by the same angle rows, each group over its
    first ``min(R, its head_dim)`` features (:func:`group_rows`; R the table width), v copied.
    Returns ``(q, k, v, index_q, index_k)``: float64 but v (the row's dtype); ``attn_fp8`` /
    ``index_fp8``: q, k, v / index_q, index_k saturated to the range of ``quantize_dtype``
    (:func:`saturate_fp8`: what the FP8 store rounds; None or float8_e4m3fn +-448,
    float8_e5m2 +-57344)."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    iq_at = q_size + 2 * kv_size
    sections = qkv_sections(num_heads, num_kv_heads, head_dim) + (
        Section(num_index_heads, index_head_dim, iq_at),
        Section(1, index_head_dim, iq_at + num_index_heads * index_head_dim),
    )
    q, k, v, iq, ik = split_row(qkv, sections)
    rows = cos_sin_rows(cos_sin_cache, positions)
    out = []
    weights = (q_weight, k_weight, index_q_weight, index_k_weight)
    biases = (q_bias, k_bias, None, None)
    dims = (head_dim, head_dim, index_head_dim, index_head_dim)
    for x, w, b, d in zip((q, k, iq, ik), weights, biases, dims):
        per_head = dict(head_dim=d, eps=eps, is_neox=is_neox, weight_offset=weight_offset)
        out.append(head_norm_rotate(x, w, group_rows(rows, d), bias=b, **per_head))
    attn = [out[0], out[1], v]
    index = [out[2], out[3]]
    fp8 = quantize_dtype or torch.float8_e4m3fn
    if attn_fp8:
        attn = [saturate_fp8(x, None, fp8) for x in attn]
    if index_fp8:
        index = [saturate_fp8(x, None, fp8) for x in index]
    return (*attn, *index)


def cache_prologue(
    qkv: Tensor, positions: Tensor, cos_sin_cache: Tensor, q_weight: Tensor, k_weight: Tensor,
    key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor, *, num_heads: int,
    num_kv_heads: int, head_dim: int, eps: float = 1e-6, is_neox: bool = True,
    weight_offset: float = 0.0, k_scale: Tensor | None = None, v_scale: Tensor | None = None,
    return_k: bool = False,
) -> tuple[Tensor, ...]:  # fmt: skip
    """The KV-cache prologue, float64: q and k of :func:`prologue` (per-head norm, RoPE) for
    all T tokens, k and v of the first N (``slot_mapping [N]``, N <= T) written into the paged
    caches by :func:`cache_insert`. Returns ``(q, expected key_cache, expected value_cache)``,
    with ``return_k`` ``(q, k, ...)``."""
    q, k, v = prologue(
        qkv, positions, cos_sin_cache, q_weight, k_weight, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, eps=eps, is_neox=is_neox,
        weight_offset=weight_offset,
    )  # fmt: skip
    key, value = store_kv(key_cache, value_cache, k, v, slot_mapping, k_scale, v_scale)
    return (q, *((k,) if return_k else ()), key, value)


def index_cache_prologue(
    qkv: Tensor, positions: Tensor, cos_sin_cache: Tensor, q_weight: Tensor, k_weight: Tensor,
    index_q_weight: Tensor, index_k_weight: Tensor, key_cache: Tensor, value_cache: Tensor,
    index_cache: Tensor, slot_mapping: Tensor, index_slot_mapping: Tensor, *, num_heads: int,
    num_kv_heads: int, head_dim: int, num_index_heads: int, index_head_dim: int, eps: float,
    is_neox: bool = True, weight_offset: float = 1.0, index_qkv: Tensor | None = None,
    k_scale: Tensor | None = None, v_scale: Tensor | None = None,
) -> tuple[Tensor, ...]:  # fmt: skip
    """MiniMax-M3's prologue with its caches, float64: q, k, v, index_q, index_k of
    :func:`index_prologue` (the row ``[q | k | v | index_q | index_k]``, or ``qkv`` then
    ``index_qkv`` side by side), k and v written into the 4-D caches by ``slot_mapping``,
    index_k into the 3-D ``index_cache [blocks, block_size, Di]`` by ``index_slot_mapping``
    (:func:`cache_insert`; an FP8 index cache saturates, no scale). Returns ``(q, index_q,
    expected key_cache, expected value_cache, expected index_cache)``; index_q saturated to
    the index cache's FP8 range when it is FP8 (E4M3 +-448, E5M2 +-57344: it is returned in
    that dtype)."""
    row = qkv if index_qkv is None else torch.cat([_f64(qkv), _f64(index_qkv)], dim=1)
    q, k, v, iq, ik = index_prologue(
        row, positions, cos_sin_cache, q_weight, k_weight, index_q_weight, index_k_weight,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        num_index_heads=num_index_heads, index_head_dim=index_head_dim, eps=eps,
        weight_offset=weight_offset, is_neox=is_neox,
    )  # fmt: skip
    key, value = store_kv(key_cache, value_cache, k, v, slot_mapping, k_scale, v_scale)
    index, _ = cache_insert(index_cache.unsqueeze(2), ik, index_slot_mapping)
    if index_cache.dtype in FP8_MAX:
        iq = saturate_fp8(iq, None, index_cache.dtype)
    return q, iq, key, value, index.squeeze(2)


def mrope_cos_sin_rows(
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    mrope_section: Sequence[int],
    *,
    interleaved: bool,
) -> torch.Tensor:
    """float64 angle rows ``[T, R]`` of multimodal RoPE: ``positions [3, T]`` (temporal,
    height, width; ``[T]``: the same position on all three planes), each plane's row
    ``cos_sin_cache[positions[p]]``, and each frequency's cos and sin taken from one plane as
    vLLM's ``MRotaryEmbedding`` writes it: contiguous sections ``torch.cat`` of the plane-``p``
    part of section ``p``; interleaved (Qwen3-VL's ``apply_interleaved_mrope``) the t rows with
    frequencies ``1::3`` below ``3*s_h`` from h and ``2::3`` below ``3*s_w`` from w."""
    if positions.dim() == 1:
        positions = positions.expand(3, -1)
    planes = [cos_sin_rows(cos_sin_cache, positions[p]) for p in range(3)]
    r = planes[0].shape[1]
    halves = [(rows[:, : r // 2], rows[:, r // 2 :]) for rows in planes]
    out = []
    for part in range(2):  # cos, then sin
        t, h, w = (halves[p][part] for p in range(3))
        if interleaved:
            chosen = t.clone()
            s_h, s_w = mrope_section[1], mrope_section[2]
            chosen[:, 1 : 3 * s_h : 3] = h[:, 1 : 3 * s_h : 3]
            chosen[:, 2 : 3 * s_w : 3] = w[:, 2 : 3 * s_w : 3]
        else:
            pieces = [m.split(list(mrope_section), dim=-1)[i] for i, m in enumerate((t, h, w))]
            chosen = torch.cat(pieces, dim=-1)
        out.append(chosen)
    return torch.cat(out, dim=-1)


def mrope(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    head_dim: int,
    mrope_section: Sequence[int],
    interleaved: bool = False,
    is_neox: bool = True,
) -> torch.Tensor:
    """float64 multimodal RoPE of ``x [T, H*head_dim]`` (:func:`mrope_cos_sin_rows`)."""
    rows = mrope_cos_sin_rows(cos_sin_cache, positions, mrope_section, interleaved=interleaved)
    return rotate(x, rows, head_dim=head_dim, is_neox=is_neox)


def qk_rope(
    q: Tensor, k: Tensor | None, positions: Tensor, cos_sin_cache: Tensor, *, head_dim: int,
    is_neox: bool = True,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """float64 RoPE of separate ``q [T, Hq*D]`` and ``k [T, Hkv*D]`` (:func:`fqr.qk_rope`):
    each head's first R features times ``cos + i sin`` of its token's table row, the rest
    unchanged (``k`` None: ``(q, None)``). vLLM's ``RotaryEmbedding.forward_native``."""
    rows = cos_sin_rows(cos_sin_cache, positions)
    q = rotate(q, rows, head_dim=head_dim, is_neox=is_neox)
    return q, None if k is None else rotate(k, rows, head_dim=head_dim, is_neox=is_neox)


def qk_mrope(
    q: Tensor, k: Tensor | None, positions: Tensor, cos_sin_cache: Tensor, *, head_dim: int,
    mrope_section: Sequence[int], mrope_interleaved: bool = False, is_neox: bool = True,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """float64 multimodal RoPE of separate ``q`` and ``k`` (:func:`fqr.qk_mrope`): the angle
    rows of :func:`mrope_cos_sin_rows` (``positions [3, T]`` or ``[T]``), then :func:`rotate`
    (``k`` None: ``(q, None)``). vLLM's ``MRotaryEmbedding.forward_native``."""
    rows = mrope_cos_sin_rows(
        cos_sin_cache, positions, mrope_section, interleaved=mrope_interleaved
    )
    q = rotate(q, rows, head_dim=head_dim, is_neox=is_neox)
    return q, None if k is None else rotate(k, rows, head_dim=head_dim, is_neox=is_neox)


def gated_qkv_sections(num_heads: int, num_kv_heads: int, head_dim: int) -> tuple[Section, ...]:
    """The packed row of Qwen3.5's / Qwen3-Next's gated attention, ``[q_0 g_0 q_1 g_1 ... | k |
    v]`` (vLLM ``Qwen3NextAttention``: ``q_gate`` viewed ``[T, Hq, 2*D]`` and chunked in two):
    the sections q, k, v, gate."""
    d = head_dim
    q_end = 2 * num_heads * d
    return (
        Section(num_heads, d, 0, 2 * d),
        Section(num_kv_heads, d, q_end),
        Section(num_kv_heads, d, q_end + num_kv_heads * d),
        Section(num_heads, d, d, 2 * d),
    )


def mrope_prologue(
    qkv: Tensor, positions: Tensor, cos_sin_cache: Tensor, q_weight: Tensor, k_weight: Tensor, *,
    num_heads: int, num_kv_heads: int, head_dim: int, mrope_section: Sequence[int],
    mrope_interleaved: bool = False, eps: float = 1e-6, is_neox: bool = True,
    q_bias: Tensor | None = None, k_bias: Tensor | None = None, weight_offset: float = 0.0,
    output_gate: bool = False,
) -> tuple[Tensor, ...]:  # fmt: skip
    """The prologue of :func:`fqr.split_qkv_rmsnorm_mrope` by its formulas: split the row
    (:func:`gated_qkv_sections` with ``output_gate``, else ``[q | k | v]``), per-head RMSNorm
    of q and k, multimodal RoPE of both; float64 ``q, k``, and ``v`` (and the gate) copied in
    qkv's dtype."""
    if output_gate:
        sections = gated_qkv_sections(num_heads, num_kv_heads, head_dim)
    else:
        sections = qkv_sections(num_heads, num_kv_heads, head_dim)
    q, k, v, *gate = split_row(qkv, sections)
    rows = mrope_cos_sin_rows(
        cos_sin_cache, positions, mrope_section, interleaved=mrope_interleaved
    )
    per_head = dict(head_dim=head_dim, eps=eps, is_neox=is_neox, weight_offset=weight_offset)
    q = head_norm_rotate(q, q_weight, rows, bias=q_bias, **per_head)
    k = head_norm_rotate(k, k_weight, rows, bias=k_bias, **per_head)
    return (q, k, v, *gate)


def vnorm_prologue(
    qkv: Tensor, positions: Tensor, cos_sin_cache: Tensor, q_weight: Tensor, k_weight: Tensor, *,
    num_heads: int, num_kv_heads: int, head_dim: int, eps: float = 1e-6, is_neox: bool = True,
    q_bias: Tensor | None = None, k_bias: Tensor | None = None, weight_offset: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Gemma 4's prologue (:func:`fqr.split_qkv_rmsnorm_rope_vnorm`): float64 q and k each head
    normalised with its weight, plus its bias when given (``x / sqrt(mean(x^2) + eps) *
    (weight_offset + w) + b``), then rotated; v each head normalised without weight or bias
    (``v / sqrt(mean(v^2) + eps)``, no rotation). vLLM ``Gemma4Attention.forward``; the biases
    as vllm-ascend's ``split_qkv_rmsnorm_rope_vnorm`` adds them."""
    q, k, v = split_row(qkv, qkv_sections(num_heads, num_kv_heads, head_dim))
    rows = cos_sin_rows(cos_sin_cache, positions)
    per_head = dict(head_dim=head_dim, eps=eps, is_neox=is_neox, weight_offset=weight_offset)
    q = head_norm_rotate(q, q_weight, rows, bias=q_bias, **per_head)
    k = head_norm_rotate(k, k_weight, rows, bias=k_bias, **per_head)
    return q, k, rms_norm(v, eps=eps, group_size=head_dim)


def attn_temperature(positions: torch.Tensor, *, floor_scale: float, attn_scale: float):
    """float64 ``[T]`` scales ``log(floor((p + 1) / floor_scale) + 1) * attn_scale + 1`` (Llama
    4's NoPE-layer temperature, :mod:`fqr.ops.temperature`)."""
    p = positions.to(F64)
    return torch.log(torch.floor((p + 1.0) / floor_scale) + 1.0) * attn_scale + 1.0


def rope_l2norm_prologue(
    qkv: Tensor, positions: Tensor, cos_sin_cache: Tensor | None, *, num_heads: int,
    num_kv_heads: int, head_dim: int, eps: float = 1e-5, is_neox: bool = False,
    floor_scale: float | None = None, attn_scale: float = 0.1,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Llama 4's prologue (:func:`fqr.split_qkv_rope_l2norm`), float64: with a
    ``cos_sin_cache`` (RoPE layers) q and k rotated, then each head L2-normalised without
    weight (``x / sqrt(mean(x^2) + eps)``); without one (NoPE layers) q and k as split, and
    with ``floor_scale`` q times :func:`attn_temperature`. v copied in qkv's dtype."""
    q, k, v = split_row(qkv, qkv_sections(num_heads, num_kv_heads, head_dim))
    q, k = _f64(q), _f64(k)
    if cos_sin_cache is not None:
        rows = cos_sin_rows(cos_sin_cache, positions)
        q, k = (
            rms_norm(
                rotate(x, rows, head_dim=head_dim, is_neox=is_neox), eps=eps, group_size=head_dim
            )
            for x in (q, k)
        )
    if floor_scale is not None:
        scale = attn_temperature(positions, floor_scale=floor_scale, attn_scale=attn_scale)
        q = q * scale[:, None]
    return q, k, v


def rope_rmsnorm_prologue(
    qkv: Tensor, positions: Tensor, cos_sin_cache: Tensor, q_weight: Tensor, k_weight: Tensor, *,
    num_heads: int, num_kv_heads: int, head_dim: int, eps: float = 1e-5, is_neox: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Hunyuan's prologue (:func:`fqr.split_qkv_rope_rmsnorm`), float64: q and k rotated, then
    each head normalised with its weight (``x / sqrt(mean(x^2) + eps) * w``); v copied in qkv's
    dtype."""
    q, k, v = split_row(qkv, qkv_sections(num_heads, num_kv_heads, head_dim))
    rows = cos_sin_rows(cos_sin_cache, positions)
    out = [
        rms_norm(rotate(x, rows, head_dim=head_dim, is_neox=is_neox), w, eps=eps,
                 group_size=head_dim)
        for x, w in ((q, q_weight), (k, k_weight))
    ]  # fmt: skip
    return out[0], out[1], v


# ------------------------------------------------------- Multi-head Latent Attention (MLA)
#
# vLLM's MLA layer (``vllm/model_executor/layers/mla.py``, DeepSeek-V2/V3/R1, V3.2, Kimi-K2):
# the fused ``q_a`` / ``kv_a`` projection gives a row ``[q_c | kv_c | k_pe]`` (DeepSeek-V3:
# 1536 + 512 + 64; without ``q_lora_rank``, V2-Lite, ``[kv_c | k_pe]``); ``q_c`` and ``kv_c``
# each get an RMSNorm over their whole width, ``k_pe`` is one head rotated GPT-J style; then
# ``concat_and_cache_mla`` / ``concat_and_cache_ds_mla`` (``csrc/cache_kernels.cu``) write
# ``[kv_c | k_pe]`` into the paged cache at ``slot_mapping[t]`` (negative: nothing written).

FLT_MIN = 2.0**-126  # the smallest normal float32: the floor of an fp8_ds_mla tile scale


def mla_kv(
    kv_a: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_a_weight: torch.Tensor | None,
    kv_a_weight: torch.Tensor,
    *,
    q_lora_rank: int,
    kv_lora_rank: int,
    eps: float = 1e-6,
    is_neox: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """float64 ``(q_c, kv_c, k_pe)`` of the MLA prologue: the row ``kv_a [T, q_lora_rank +
    kv_lora_rank + R]`` (``q_lora_rank`` 0: no ``q_c``, then ``q_c`` is None) cut by column,
    ``q_c`` and ``kv_c`` each divided by ``sqrt(mean(x^2) + eps)`` over their whole width and
    scaled by their weight, ``k_pe`` (R = the table's width) one head rotated by the token's
    angle row (GPT-J pairs unless ``is_neox``)."""
    x = _f64(kv_a)
    q_c = x[:, :q_lora_rank]
    kv_c = x[:, q_lora_rank : q_lora_rank + kv_lora_rank]
    k_pe = x[:, q_lora_rank + kv_lora_rank :]
    if k_pe.shape[1] != cos_sin_cache.shape[1]:
        raise ValueError(
            f"the row leaves {k_pe.shape[1]} rope columns, the table is {cos_sin_cache.shape[1]} "
            f"wide"
        )

    def norm(v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return v / torch.sqrt((v * v).mean(dim=-1, keepdim=True) + eps) * _f64(w)

    q_c_normed = norm(q_c, q_a_weight) if q_lora_rank else None
    rows = cos_sin_rows(cos_sin_cache, positions)
    r = k_pe.shape[1]
    if is_neox:
        z = torch.complex(k_pe[:, : r // 2].contiguous(), k_pe[:, r // 2 :].contiguous())
    else:
        z = torch.complex(k_pe[:, 0::2].contiguous(), k_pe[:, 1::2].contiguous())
    w = z * torch.complex(rows[:, : r // 2], rows[:, r // 2 :])
    if is_neox:
        rotated = torch.cat([w.real, w.imag], dim=-1)
    else:
        rotated = torch.stack([w.real, w.imag], dim=-1).flatten(-2)
    return q_c_normed, norm(kv_c, kv_a_weight), rotated


def _stored_tokens(slot_mapping: torch.Tensor, rows: torch.Tensor) -> int:
    """N, the tokens a slot mapping ``[N]`` stores (N <= T, the rows' count)."""
    if slot_mapping.shape[0] > rows.shape[0]:
        raise ValueError(f"{slot_mapping.shape[0]} slots for {rows.shape[0]} tokens")
    return slot_mapping.shape[0]


def mla_cache_entry(
    cache: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``concat_and_cache_mla``'s write, float64: returns ``(expected, written)``.
    ``expected`` is ``cache [blocks, block_size, L + R]`` as float64 with entry ``[kv_c[t] |
    k_pe[t]]`` at slot ``s = slot_mapping[t] >= 0`` (block ``s // block_size``, row ``s %
    block_size``), unrounded; for an FP8 cache each value is ``clamp(x / scale, +-448)``
    (``scale`` the per-tensor ``[1]`` scale, default 1). ``written``: bool ``[blocks,
    block_size]``, the entries written (the others hold the cache's own values: compare them
    bit for bit). ``slot_mapping`` may be ``[N]`` with N <= T: tokens ``t >= N`` are not
    written."""
    blocks, block_size, width = cache.shape
    tokens = _stored_tokens(slot_mapping, kv_c)
    entry = torch.cat([_f64(kv_c[:tokens]), _f64(k_pe[:tokens])], dim=-1)
    if entry.shape[1] != width:
        raise ValueError(f"kv_c and k_pe are {entry.shape[1]} wide, the entry {width}")
    if cache.dtype in FP8_MAX:
        entry = saturate_fp8(entry, scale, cache.dtype)
    expected = _f64(cache).clone()
    written = torch.zeros(blocks, block_size, dtype=torch.bool, device=cache.device)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    expected[slots // block_size, slots % block_size] = entry[keep]
    written[slots // block_size, slots % block_size] = True
    return expected, written


# The last column of a packed fp8_ds_mla expectation where an entry was written: the dtype of
# its rope part (vLLM stores k_pe in the model dtype, bf16 or fp16).
DS_MLA_ROPE_CODES = {torch.bfloat16: 1.0, torch.float16: 2.0}


@dataclass(frozen=True)
class DsMlaEntry:
    """The expected ``fp8_ds_mla`` cache (:func:`ds_mla_entry`), float64, unrounded:
    ``values [blocks, block_size, L]`` (each ``kv_c`` value divided by its tile's scale,
    clamped to +-448: what the E4M3 byte rounds), ``scales [blocks, block_size, L / tile]``,
    ``rope [blocks, block_size, R]`` (what the 16-bit rope values round), ``written [blocks,
    block_size]``; ``tile``, and the byte layout: values at byte 0, the float32 scales at
    byte ``L``, the rope values from byte ``L + 4 * L / tile``."""

    values: torch.Tensor
    scales: torch.Tensor
    rope: torch.Tensor
    written: torch.Tensor
    tile: int
    rope_dtype: torch.dtype = torch.bfloat16

    @property
    def scale_offset(self) -> int:
        return self.values.shape[-1]

    @property
    def rope_offset(self) -> int:
        return self.scale_offset + 4 * self.scales.shape[-1]

    def packed(self, original: torch.Tensor) -> torch.Tensor:
        """The whole expected cache as one float64 tensor ``[blocks, block_size, L + L/tile +
        R + 1]``: each written entry's values, scales and rope values, then the rope's dtype
        code (:data:`DS_MLA_ROPE_CODES`: 1 bf16, 2 fp16); every other entry as ``original``
        (the cache before the call) holds it, decoded (E4M3 values, float32 scales, rope
        values), then 0 (``fqr.numerics``' ``fp8-ds-mla`` kind)."""
        raw = original.detach().to(self.values.device)
        n, tiles, r = self.values.shape[-1], self.scales.shape[-1], self.rope.shape[-1]

        def decode(start: int, count: int, dtype: torch.dtype) -> torch.Tensor:
            size = torch.empty(0, dtype=dtype).element_size()
            return raw[..., start : start + count * size].contiguous().view(dtype).to(F64)

        before = torch.cat(
            [
                decode(0, n, torch.float8_e4m3fn),
                decode(self.scale_offset, tiles, torch.float32),
                decode(self.rope_offset, r, self.rope_dtype),
            ],
            dim=-1,
        )
        mine = torch.cat([self.values, self.scales, self.rope], dim=-1)
        entries = torch.where(self.written[..., None], mine, before)
        code = self.written.to(F64) * DS_MLA_ROPE_CODES[self.rope_dtype]
        return torch.cat([entries, code[..., None]], dim=-1)


def ds_mla_entry(
    cache: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    tile: int = 128,
    rope_dtype: torch.dtype = torch.bfloat16,
) -> DsMlaEntry:
    """``concat_and_cache_ds_mla``'s write into the ``uint8`` ``fp8_ds_mla`` cache ``[blocks,
    block_size, L + 4 * L / tile + 2 * R]``, float64: for each written token, ``kv_c [L]`` in
    tiles of ``tile``, tile ``j``'s scale ``max(max|x_j| / 448, FLT_MIN)`` and its values
    ``clamp(x / scale_j, +-448)``; ``k_pe [R]`` as is (rounded to the 16-bit model dtype
    ``rope_dtype``, bf16 or fp16, by the store). Tokens with a negative slot write nothing;
    ``slot_mapping`` may be ``[N]`` with N <= T: tokens ``t >= N`` are not written."""
    tokens = _stored_tokens(slot_mapping, kv_c)
    kv_c, k_pe = kv_c[:tokens], k_pe[:tokens]
    blocks, block_size, entry_bytes = cache.shape
    n, r = kv_c.shape[1], k_pe.shape[1]
    if n % tile or entry_bytes != n + 4 * (n // tile) + 2 * r:
        raise ValueError(
            f"an fp8_ds_mla entry of {n} values in tiles of {tile} and {r} rope values is "
            f"{n + 4 * (n // tile) + 2 * r} bytes, the cache's is {entry_bytes}"
        )
    tiles = _f64(kv_c).reshape(kv_c.shape[0], n // tile, tile)
    scales = (tiles.abs().amax(dim=-1) / E4M3_MAX).clamp_min(FLT_MIN)
    quantized = (tiles / scales[..., None]).clamp(-E4M3_MAX, E4M3_MAX).reshape(-1, n)
    device = kv_c.device  # built where the data is
    values = torch.zeros(blocks, block_size, n, dtype=F64, device=device)
    scale_at = torch.zeros(blocks, block_size, n // tile, dtype=F64, device=device)
    rope = torch.zeros(blocks, block_size, r, dtype=F64, device=device)
    written = torch.zeros(blocks, block_size, dtype=torch.bool, device=device)
    slot_mapping = slot_mapping.to(device)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    at = (slots // block_size, slots % block_size)
    values[at] = quantized[keep]
    scale_at[at] = scales[keep]
    rope[at] = _f64(k_pe)[keep]
    written[at] = True
    return DsMlaEntry(values, scale_at, rope, written, tile, rope_dtype)
