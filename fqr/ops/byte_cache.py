"""Byte-layout cache entries: values of several dtypes at byte offsets of a ``uint8`` entry.

A ``uint8`` paged cache ``[num_blocks, block_size, entry_bytes]`` holds one entry per slot,
and each entry packs values of other dtypes at byte offsets. Two functional updates write
into it through a slot mapping (token ``t`` at slot ``s = slot_mapping[t]``: block
``s // block_size``, row ``s % block_size``; a negative slot writes nothing, a slot past the
cache is a bad mapping), each returning the updated cache:

* ``cache_insert_bytes(cache, x, slot_mapping, offset=, dtype=)``: ``x [T, w]`` rounded once
  to ``dtype`` (bf16, fp16 or fp32; round to nearest even) and stored as ``w`` consecutive
  ``dtype`` values from byte ``offset`` of the entry (``offset`` a multiple of ``dtype``'s
  size)::

      bytes(out[s // bs, s % bs, offset : offset + w * size]) = dtype(x[t])

* ``cache_insert_fp8_tiles(cache, x, slot_mapping, tile=, offset=, scale_offset=)``: ``x
  [T, w]`` cut into ``w / tile`` tiles of ``tile`` features; tile ``j`` is quantized with its
  own float32 scale::

      amax_j  = max |x[t, j*tile : (j+1)*tile]|
      scale_j = max(amax_j / 448, FLT_MIN)                     (float32 arithmetic)
      byte offset + i       = e4m3(clamp(x[t, i] / scale_j, -448, 448))   for i in tile j
      bytes scale_offset + 4j .. + 4j + 3 = float32 scale_j

``slot_mapping`` may be ``[N]`` with ``N <= T`` (vLLM's cache kernels take the token count
from it: a batch padded for CUDA graphs stores its first N tokens): tokens ``t >= N`` write
nothing, as :func:`fqr.ops.cache_insert`'s.

This is vLLM's ``fp8_ds_mla`` cache of DeepSeek-V3.2 (``concat_and_cache_ds_mla_kernel`` in
``csrc/cache_kernels.cu``): a 656-byte entry, bytes 0..511 the 512 ``kv_c`` values as E4M3 in
4 tiles of 128 (``tile_scale = fmaxf(max_abs / 448.f, FLT_MIN)``, each value
``scaled_convert(v, tile_scale)``, a saturating E4M3 conversion of ``v / tile_scale``), bytes
512..527 the four float32 scales, bytes 528..655 the 64 rope values in the model dtype; that
is ``cache_insert_fp8_tiles(cache, kv_c, slots, tile=128, offset=0, scale_offset=512)`` then
``cache_insert_bytes(cache, k_pe, slots, offset=528, dtype=bf16)`` on its output. vLLM takes
the tile's max over the bf16 ``kv_c`` the norm returned; under fqr's ``fused`` contract the
max, the scale and the quantized values come from the unrounded fp32 norm output (the float64
reference, :func:`fqr.reference.ds_mla_entry`, likewise).

Two ops, not a ``dtype`` option of :func:`fqr.ops.cache_insert`: that op's columns count the
cache's own elements and its values are the cache's dtype, whereas here an entry is bytes and
each store says what it puts where; the tile quantization is a computation of its own (a
per-tile reduction and a second, per-tile output).

Lowering: facts :class:`~fqr.core.PagedStore` with the :class:`~fqr.core.EntryField` s each
store writes (the planner checks they lie in the entry, are aligned and do not overlap, and
the Ascend target sees the E4M3 field: FP8 stores need the 950). Stores chain as
:func:`fqr.ops.cache_insert`'s do: the second one's cache is the first one's output, one
buffer in the kernel. In a fused program ``cache_insert_fp8_tiles``' value is held as heads
of ``tile`` features, one head per tile (split its section as ``Section(w // tile, tile,
offset)``; a norm over the whole ``w`` is then a reduction over the row of those heads); the
emit rule takes each head's max (:meth:`~fqr.core.EmitContext.head_amax`), stores the values
through :meth:`~fqr.core.EmitContext.scatter_rows` as E4M3 at a byte offset and the scales
through :meth:`~fqr.core.EmitContext.scatter_head_values`. The byte addresses are read as
typed pointers (``ptr.to(tl.pointer_type(tl.float32))``): the block and row strides of the
cache must keep each field aligned to its dtype (multiples of 4 bytes for the scales).
"""

from __future__ import annotations

import math

import torch

from ..core import Aval, EmitContext, EntryField, Eqn, PagedStore, Role, primitive
from .cache import slots_fit, written_slots
from .fp8 import FP8_E4M3, FP8_E4M3_MAX, saturate_lines

BYTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FLT_MIN = float(torch.finfo(torch.float32).tiny)  # 2^-126: the smallest scale of a tile
SCALE_DTYPE = torch.float32

cache_insert_bytes_p = primitive("cache_insert_bytes")
cache_insert_fp8_tiles_p = primitive("cache_insert_fp8_tiles")


def cache_insert_bytes(cache, x, slot_mapping, *, offset: int, dtype: torch.dtype):
    """``x [T, w]`` as ``dtype`` values at byte ``offset`` of each slot's entry of the
    ``uint8`` cache (module docstring)."""
    return cache_insert_bytes_p.bind(cache, x, slot_mapping, offset=offset, dtype=dtype)


def cache_insert_fp8_tiles(
    cache, x, slot_mapping, *, tile: int = 128, offset: int = 0, scale_offset: int
):
    """``x [T, w]`` as E4M3 tiles of ``tile`` values at byte ``offset``, each tile's float32
    scale at ``scale_offset + 4 * j`` (module docstring)."""
    return cache_insert_fp8_tiles_p.bind(
        cache, x, slot_mapping, tile=tile, offset=offset, scale_offset=scale_offset
    )


def _check_common(cache: Aval, x: Aval, slots: Aval) -> tuple[int, int]:
    """The checks both stores share; returns (the value's width, the entry's bytes)."""
    if cache.ndim != 3 or cache.dtype != torch.uint8:
        raise ValueError(
            f"cache must be a uint8 [num_blocks, block_size, entry_bytes] tensor, got {cache}"
        )
    for name, n in zip(("block_size", "entry_bytes"), cache.shape[1:]):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"the cache's {name} must be a static int >= 1, got {n!r}")
    if x.ndim != 2 or not isinstance(x.shape[1], int):
        raise ValueError(f"the value must be 2-D [T, width], got {x}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"the value must be a floating tensor, got {x.dtype}")
    if slots.ndim != 1 or not slots_fit(slots.shape[0], x.shape[0]):
        raise ValueError(
            f"slot_mapping must be [T] with T = {x.shape[0]}, or [N] with N <= T, got {slots}"
        )
    if slots.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slot_mapping must be int32 or int64, got {slots.dtype}")
    entry = cache.shape[2]
    assert isinstance(entry, int)
    return x.shape[1], entry


def _check_field(name: str, offset, dtype: torch.dtype, count: int, entry: int) -> None:
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise ValueError(f"{name} must be an int >= 0, got {offset!r}")
    if offset % dtype.itemsize:
        raise ValueError(f"{name} {offset} must be a multiple of {dtype}'s {dtype.itemsize} bytes")
    if offset + count * dtype.itemsize > entry:
        raise ValueError(
            f"{count} {dtype} values at byte {name} {offset} end at byte "
            f"{offset + count * dtype.itemsize}, past the {entry}-byte entry"
        )


# ----------------------------------------------------------------------- cache_insert_bytes


@cache_insert_bytes_p.def_abstract
def _bytes_abstract(cache: Aval, x: Aval, slots: Aval, *, offset, dtype) -> Aval:
    width, entry = _check_common(cache, x, slots)
    if dtype not in BYTE_DTYPES:
        raise TypeError(f"dtype must be bf16, fp16 or fp32, got {dtype}")
    _check_field("offset", offset, dtype, width, entry)
    return Aval(cache.shape, cache.dtype)


def _write_bytes(out, keep, block, row, start: int, values: torch.Tensor) -> None:
    """``values`` ``[n, ...]`` (already in their stored dtype) as bytes at ``start``."""
    width = math.prod(values.shape[1:]) * values.element_size()
    raw = values.contiguous().view(torch.uint8).reshape(values.shape[0], width)
    out[block, row, start : start + raw.shape[1]] = raw


@cache_insert_bytes_p.def_impl
def _bytes_impl(cache, x, slots, *, offset, dtype):
    out = cache.clone()
    keep, block, row = written_slots(slots, cache.shape[0], cache.shape[1])
    _write_bytes(out, keep, block, row, offset, x[: slots.shape[0]][keep].to(dtype))
    return out


@cache_insert_bytes_p.def_facts
def _bytes_facts(cache: Aval, x: Aval, slots: Aval, *, offset, dtype) -> PagedStore:
    width = x.shape[1]
    assert isinstance(width, int)
    return PagedStore(
        (Role.CACHE, Role.VALUE, Role.INDEX), fields=(EntryField(offset, dtype, width),)
    )


@cache_insert_bytes_p.def_lowering
def _bytes_lowering(b: EmitContext, eqn: Eqn) -> None:
    cache_var, x_var, slots_var = eqn.inputs
    assert cache_var is not None and x_var is not None and slots_var is not None
    p = eqn.params
    b.scatter_rows(cache_var, slots_var, b.pieces(x_var), offset=p["offset"], dtype=p["dtype"])


# ------------------------------------------------------------------- cache_insert_fp8_tiles


@cache_insert_fp8_tiles_p.def_abstract
def _tiles_abstract(cache: Aval, x: Aval, slots: Aval, *, tile, offset, scale_offset) -> Aval:
    width, entry = _check_common(cache, x, slots)
    if not isinstance(tile, int) or isinstance(tile, bool) or tile < 1 or width % tile:
        raise ValueError(f"tile must be an int >= 1 that divides the width {width}, got {tile!r}")
    _check_field("offset", offset, FP8_E4M3, width, entry)
    _check_field("scale_offset", scale_offset, SCALE_DTYPE, width // tile, entry)
    values = (offset, offset + width)
    scales = (scale_offset, scale_offset + 4 * (width // tile))
    if values[0] < scales[1] and scales[0] < values[1]:
        raise ValueError(f"the values (bytes {values}) and the scales (bytes {scales}) overlap")
    return Aval(cache.shape, cache.dtype)


def tile_scales(x: torch.Tensor, tile: int) -> torch.Tensor:
    """float32 ``max(amax / 448, FLT_MIN)`` of each ``tile`` of ``x [n, w]``: ``[n, w/tile]``
    (the division in ``x``'s dtype, then rounded to float32)."""
    amax = x.reshape(x.shape[0], -1, tile).abs().amax(dim=-1)
    return (amax / FP8_E4M3_MAX).to(SCALE_DTYPE).clamp_min(FLT_MIN)


@cache_insert_fp8_tiles_p.def_impl
def _tiles_impl(cache, x, slots, *, tile, offset, scale_offset):
    out = cache.clone()
    keep, block, row = written_slots(slots, cache.shape[0], cache.shape[1])
    value = x[: slots.shape[0]][keep]  # tokens past a shorter slot mapping are not stored
    scales = tile_scales(value, tile)
    tiles = value.reshape(value.shape[0], -1, tile) / scales[..., None].to(value.dtype)
    quantized = tiles.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_E4M3)  # clamp keeps NaN
    _write_bytes(out, keep, block, row, offset, quantized)
    _write_bytes(out, keep, block, row, scale_offset, scales)
    return out


@cache_insert_fp8_tiles_p.def_facts
def _tiles_facts(cache: Aval, x: Aval, slots: Aval, *, tile, offset, scale_offset) -> PagedStore:
    width = x.shape[1]
    assert isinstance(width, int)
    fields = (
        EntryField(offset, FP8_E4M3, width),
        EntryField(scale_offset, SCALE_DTYPE, width // tile),
    )
    return PagedStore((Role.CACHE, Role.VALUE, Role.INDEX), head_dim=tile, fields=fields)


@cache_insert_fp8_tiles_p.def_lowering
def _tiles_lowering(b: EmitContext, eqn: Eqn) -> None:
    # The value is held as heads of ``tile`` features (facts): one head, one tile.
    cache_var, x_var, slots_var = eqn.inputs
    assert cache_var is not None and x_var is not None and slots_var is not None
    p = eqn.params
    name = b.var_name(eqn.outputs[0])
    amax = b.head_amax(x_var)
    scale = b.fresh(f"{name}_scale")
    # IEEE divisions, as vLLM's CUDA code divides (Triton's fp32 "/" is div.full.f32 on NVIDIA)
    b.emit(f"{scale} = tl.maximum(tl.math.div_rn({amax}, {FP8_E4M3_MAX!r}), {FLT_MIN!r})")
    quantized = {
        piece: saturate_lines(b, v, f"{scale}[:, :, None]", f"{name}_{piece}_", exact_division=True)
        for piece, v in b.pieces(x_var).items()
    }
    b.scatter_rows(cache_var, slots_var, quantized, offset=p["offset"], dtype=FP8_E4M3)
    b.scatter_head_values(cache_var, slots_var, scale, offset=p["scale_offset"], dtype=SCALE_DTYPE)
