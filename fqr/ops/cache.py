"""cache_insert: write each token's heads into a paged KV cache through a slot mapping.

A functional update, ``cache.at[slots].set(x)`` in JAX's words: the output is ``cache`` with
token ``t``'s heads written at slot ``s = slot_mapping[t]``::

    out = cache.clone()
    out[s // block_size, s % block_size, h, :] = store(x[t, h*D : (h+1)*D])   for s >= 0

``cache`` is ``[num_blocks, block_size, num_kv_heads, head_dim]`` (vLLM's
``reshape_and_cache_flash`` layout, any strides with a contiguous last dim); a negative slot
(vLLM's padding slots) writes nothing, and so does a slot past the cache's last row (the
reference backend refuses one: it is a bad slot mapping). ``slot_mapping`` may be shorter than
x, ``[N]`` with ``N <= T`` (vLLM's ``reshape_and_cache_flash`` takes its token count from the
slot mapping: a batch padded for CUDA graphs stores its ``num_actual_tokens`` rows): tokens
``t >= N`` write nothing, and the kernel reads no slot past N (N is a runtime argument).
Rows no slot names keep their contents. ``store`` rounds to the cache's dtype; for a
float8_e4m3fn cache it is vLLM's FP8 KV-cache convention with the per-tensor ``scale``
(``k_scale`` / ``v_scale``, float32 ``[1]``, default 1)::

    store(x) = e4m3(clamp(x / scale, -448, 448))

(vLLM's ``reshape_and_cache_flash`` -> ``scaled_convert``: ``__nv_cvt_float_to_fp8(x / scale,
__NV_SATFINITE, __NV_E4M3)``). An E5M2 cache (vLLM's ``fp8_e5m2``) is given to the op as its
uint8 bytes with ``encoding="e5m2"``: ``store(x) = e5m2(clamp(x / scale, -57344, 57344))``,
its byte encoded on the fp32 bits in the kernel (:func:`fqr.ops.fp8.e5m2_code_lines`: one
encoding on every target, no float8_e5m2 type needed by any compiler). A 16-bit cache takes
no scale: the op refuses one (a program never holds a scale it does not read); the public
ops take the scale vLLM passes with a model-dtype cache and leave it out of the program, as
vLLM's kernels ignore it (``fqr.prologue.params.reads_cache_scale``).

**Entry caches.** A 3-D ``cache [num_blocks, block_size, entry_width]`` holds one entry per
slot, and ``column`` says where the value goes in it: ``x [T, w]`` is written at entry
columns ``[column, column + w)``::

    out[s // block_size, s % block_size, column : column + w] = store(x[t])   for s >= 0

(the rest of the entry keeps its contents). Several inserts fill one entry: the second one's
``cache`` is the first one's output, and in a fused kernel both write into the one buffer
(the program stays functional; :meth:`fqr.core.Program.aliases` maps the last output to the
cache input). This is vLLM's MLA cache, ``concat_and_cache_mla`` (``csrc/cache_kernels.cu``):
``[kv_c_normed | k_pe]`` into ``[num_blocks, block_size, kv_lora_rank + rope_dim]``, in the
model dtype or FP8 E4M3 with the per-tensor ``scale`` (``scaled_convert(src, *scale)``), as
two inserts at columns 0 and ``kv_lora_rank``. One op serves both forms rather than a second
primitive beside it: the math (``store``), the slot rules and the scale are the same, only
where the values land in a row differs, and the emitter addresses both through
:meth:`~fqr.core.EmitContext.scatter_rows`. The 4-D form prints and lowers exactly as it did
(``column`` is a param of the 3-D form only). Entries holding values of several dtypes (a
``uint8`` cache) are :mod:`fqr.ops.byte_cache`.

Lowering: facts :class:`~fqr.core.PagedStore`: the output aliases the cache input, so the
kernel stores the rows in place into the buffer it is given (the public op donates the
caller's cache, as vLLM's cache kernels update it in place); a 3-D cache declares the
:class:`~fqr.core.EntryField` it writes (the planner refuses overlapping inserts into one
entry). The reference it matches is :func:`fqr.reference.cache_insert` (4-D) and
:func:`fqr.reference.mla_cache_entry` (the MLA entry).
"""

from __future__ import annotations

import torch

from ..core import Aval, EmitContext, EntryField, Eqn, PagedStore, Role, primitive
from .fp8 import (
    FP8_E4M3,
    FP8_E4M3_MAX,
    FP8_E5M2_MAX,
    check_scale,
    e5m2_bytes,
    e5m2_code_lines,
    saturate_lines,
)

CACHE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, FP8_E4M3)
# Encodings a cache holds as the bytes of another dtype (a uint8 cache): float8_e5m2
ENCODINGS = ("e5m2",)

cache_insert_p = primitive("cache_insert")


def cache_insert(
    cache, x, slot_mapping, scale=None, *, column: int | None = None, encoding: str | None = None
):
    """See the module docstring (``column``: the entry column of a 3-D cache, default 0;
    ``encoding="e5m2"``: a uint8 cache holding float8_e5m2 bytes)."""
    params: dict = {"fp8": cache.dtype == FP8_E4M3}
    if encoding is not None:
        params["encoding"] = encoding
    if len(cache.shape) == 3:
        params["column"] = 0 if column is None else column
    elif column is not None:
        raise ValueError(
            f"column applies to a 3-D [num_blocks, block_size, entry] cache, not to a "
            f"{len(cache.shape)}-D one"
        )
    return cache_insert_p.bind(cache, x, slot_mapping, scale, **params)


@cache_insert_p.def_abstract
def _insert_abstract(
    cache: Aval, x: Aval, slots: Aval, scale: Aval | None, *, fp8, column=None, encoding=None
) -> Aval:
    if cache.ndim not in (3, 4):
        raise ValueError(
            f"cache must be 4-D [num_blocks, block_size, num_kv_heads, head_dim] or 3-D "
            f"[num_blocks, block_size, entry_width], got {cache}"
        )
    if encoding is not None:
        if encoding not in ENCODINGS or cache.dtype != torch.uint8:
            raise TypeError(
                f"encoding {encoding!r} stores float8_e5m2 bytes into a uint8 cache, got "
                f"{cache.dtype}"
            )
    elif cache.dtype not in CACHE_DTYPES:
        raise TypeError(f"cache must be bf16, fp16, fp32 or float8_e4m3fn, got {cache.dtype}")
    for name, n in zip(("block_size", "num_kv_heads", "head_dim"), cache.shape[1:]):
        if cache.ndim == 3:
            name = {"num_kv_heads": "entry_width"}.get(name, name)
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"the cache's {name} must be a static int >= 1, got {n!r}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"the value must be a floating tensor, got {x.dtype}")
    if cache.ndim == 4:
        _, _, heads, head_dim = cache.shape
        assert isinstance(heads, int) and isinstance(head_dim, int)
        if x.ndim != 2 or x.shape[1] != heads * head_dim:
            raise ValueError(
                f"the value must be [T, num_kv_heads * head_dim] = [T, {heads}*{head_dim}] to "
                f"match the cache {cache}, got {x}"
            )
        if column is not None:
            raise ValueError("column applies to a 3-D cache only")
    else:
        entry = cache.shape[2]
        assert isinstance(entry, int)
        if not isinstance(column, int) or isinstance(column, bool) or column < 0:
            raise ValueError(f"column must be an int >= 0, got {column!r}")
        width = x.shape[1] if x.ndim == 2 else None
        if not isinstance(width, int) or column + width > entry:
            raise ValueError(
                f"the value must be [T, w] with column + w <= entry_width: column {column}, "
                f"value {x}, cache {cache}"
            )
    if slots.ndim != 1 or not slots_fit(slots.shape[0], x.shape[0]):
        raise ValueError(
            f"slot_mapping must be [T] with T = {x.shape[0]}, or [N] with N <= T, got {slots}"
        )
    if slots.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slot_mapping must be int32 or int64, got {slots.dtype}")
    check_scale(scale)
    if fp8 != (cache.dtype == FP8_E4M3):
        raise ValueError(f"fp8={fp8} does not match the cache dtype {cache.dtype}")
    if scale is not None and cache.dtype != FP8_E4M3 and encoding is None:
        raise ValueError(
            f"a scale applies only to a float8_e4m3fn cache or an E5M2 one (float8_e5m2 "
            f"bytes, encoding='e5m2'), not to a {cache.dtype} cache"
        )
    return Aval(cache.shape, cache.dtype)


def slots_fit(n: int | str, tokens: int | str) -> bool:
    """Whether ``n`` slots serve ``tokens`` tokens: one each (``n == tokens``), or ``n <= T``:
    the first ``n`` tokens are stored, the rest are not (vLLM's ``num_actual_tokens`` slots
    under a batch padded for CUDA graphs). A length symbol other than T is such an ``N``;
    the public op checks ``N <= T`` on every call."""
    if n == tokens or isinstance(n, str):
        return True
    return isinstance(tokens, int) and n <= tokens


def overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory, from its sizes and strides: a dim of
    more than one element with stride 0 (an expanded tensor), or strides that do not nest
    (sorted by stride, each dim's stride must exceed the farthest offset the dims of smaller
    strides reach: an ``as_strided`` view whose rows overlap). The nesting test is sufficient,
    not necessary: a layout that interleaves two dims without overlap (no cache allocator makes
    one) fails it too. A cache is written in place: every backend's scatter (the kernels'
    stores, the reference's copy back) needs each element at its own address."""
    reach = 0  # the farthest element offset the dims seen so far reach
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def written_slots(slots, blocks: int, block_size: int):
    """``(keep, block, row)``: the tokens with a slot ``>= 0`` and where their slots are,
    refusing a slot past the cache's last row (a bad slot mapping). A ``meta`` slot mapping
    holds no values to tell padding apart: every token is kept (``keep`` is ``slice(None)``),
    so the write has the shapes and devices of a real one."""
    if slots.is_meta:
        slot = slots.long()
        return slice(None), slot // block_size, slot % block_size
    keep = slots >= 0
    slot = slots[keep].long()
    if slot.numel() and int(slot.max()) >= blocks * block_size:
        raise ValueError(
            f"slot_mapping names slot {int(slot.max())}, past the cache's "
            f"{blocks} blocks x {block_size} rows"
        )
    return keep, slot // block_size, slot % block_size


@cache_insert_p.def_impl
def _insert_impl(cache, x, slots, scale, *, fp8, column=None, encoding=None):
    out = cache.clone()
    blocks, block_size = cache.shape[:2]
    keep, block, row = written_slots(slots, blocks, block_size)
    value = x[: slots.shape[0]][keep]  # tokens past a shorter slot mapping are not stored
    if scale is not None:
        value = value / scale.to(value.dtype)
    if fp8:
        value = value.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)  # torch.clamp keeps NaN
    if encoding is not None:  # e5m2: saturated, then its bytes
        value = e5m2_bytes(value.clamp(-FP8_E5M2_MAX, FP8_E5M2_MAX))
    if cache.ndim == 4:
        out[block, row] = value.reshape(-1, *cache.shape[2:]).to(out.dtype)
    else:
        out[block, row, column : column + x.shape[1]] = value.to(out.dtype)
    return out


@cache_insert_p.def_facts
def _insert_facts(
    cache: Aval, x: Aval, slots: Aval, scale: Aval | None, *, fp8, column=None, encoding=None
) -> PagedStore:
    roles = (Role.CACHE, Role.VALUE, Role.INDEX, Role.SCALAR if scale is not None else None)
    if cache.ndim == 3:  # any head structure: the value's features go back to back
        width = x.shape[1]
        assert isinstance(width, int) and column is not None
        return PagedStore(roles, fields=(EntryField(column, cache.dtype, width),))
    head_dim = cache.shape[3]
    assert isinstance(head_dim, int)
    return PagedStore(roles, head_dim=head_dim)


@cache_insert_p.def_lowering
def _insert_lowering(b: EmitContext, eqn: Eqn) -> None:
    cache_var, x_var, slots_var, scale_var = eqn.inputs
    assert cache_var is not None and x_var is not None and slots_var is not None
    x = b.pieces(x_var)
    scale = b.scalar(scale_var) if scale_var is not None else None
    if eqn.params["fp8"]:
        x = {name: saturate_lines(b, v, scale, f"kv_{name}_") for name, v in x.items()}
    if eqn.params.get("encoding") == "e5m2":  # the bytes, stored into the uint8 cache
        x = {name: e5m2_code_lines(b, v, scale, f"e5m2_{name}_") for name, v in x.items()}
    b.scatter_rows(cache_var, slots_var, x, offset=eqn.params.get("column") or 0)
