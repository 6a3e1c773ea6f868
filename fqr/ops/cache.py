"""cache_insert: write each token's heads into a paged KV cache through a slot mapping.

A functional update, ``cache.at[slots].set(x)`` in JAX's words: the output is ``cache`` with
token ``t``'s heads written at slot ``s = slot_mapping[t]``::

    out = cache.clone()
    out[s // block_size, s % block_size, h, :] = store(x[t, h*D : (h+1)*D])   for s >= 0

``cache`` is ``[num_blocks, block_size, num_kv_heads, head_dim]`` (vLLM's
``reshape_and_cache_flash`` layout, any strides with a contiguous last dim); a negative slot
(vLLM's padding slots) writes nothing, and so does a slot past the cache's last row (the
reference backend refuses one: it is a bad slot mapping). Rows no slot names keep their
contents. ``store`` rounds to the cache's dtype; for a float8_e4m3fn cache it is vLLM's FP8
KV-cache convention with the per-tensor ``scale`` (``k_scale`` / ``v_scale``, float32 ``[1]``,
default 1)::

    store(x) = e4m3(clamp(x / scale, -448, 448))

(vLLM's ``reshape_and_cache_flash`` -> ``scaled_convert``: ``__nv_cvt_float_to_fp8(x / scale,
__NV_SATFINITE, __NV_E4M3)``). A 16-bit cache takes no scale (vLLM ignores it there; fqr
refuses one rather than drop it).

Lowering: facts :class:`~fqr.core.PagedStore`: the output aliases the cache input, so the
kernel stores the rows in place into the buffer it is given (the public op donates the
caller's cache, as vLLM's cache kernels update it in place). The reference it matches is
:func:`fqr.reference.cache_insert`.
"""

from __future__ import annotations

import torch

from ..core import Aval, EmitContext, Eqn, PagedStore, Role, primitive
from .fp8 import FP8_E4M3, FP8_E4M3_MAX, check_scale, saturate_lines

CACHE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, FP8_E4M3)

cache_insert_p = primitive("cache_insert")


def cache_insert(cache, x, slot_mapping, scale=None):
    """See the module docstring."""
    return cache_insert_p.bind(cache, x, slot_mapping, scale, fp8=cache.dtype == FP8_E4M3)


@cache_insert_p.def_abstract
def _insert_abstract(cache: Aval, x: Aval, slots: Aval, scale: Aval | None, *, fp8) -> Aval:
    if cache.ndim != 4:
        raise ValueError(
            f"cache must be 4-D [num_blocks, block_size, num_kv_heads, head_dim], got {cache}"
        )
    if cache.dtype not in CACHE_DTYPES:
        raise TypeError(f"cache must be bf16, fp16, fp32 or float8_e4m3fn, got {cache.dtype}")
    _, block_size, heads, head_dim = cache.shape
    for name, n in (("block_size", block_size), ("num_kv_heads", heads), ("head_dim", head_dim)):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"the cache's {name} must be a static int >= 1, got {n!r}")
    assert isinstance(heads, int) and isinstance(head_dim, int)
    if x.ndim != 2 or x.shape[1] != heads * head_dim:
        raise ValueError(
            f"the value must be [T, num_kv_heads * head_dim] = [T, {heads}*{head_dim}] to match "
            f"the cache {cache}, got {x}"
        )
    if not x.dtype.is_floating_point:
        raise TypeError(f"the value must be a floating tensor, got {x.dtype}")
    if slots.ndim != 1 or slots.shape[0] != x.shape[0]:
        raise ValueError(f"slot_mapping must be [T] with T = {x.shape[0]}, got {slots}")
    if slots.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slot_mapping must be int32 or int64, got {slots.dtype}")
    check_scale(scale)
    if fp8 != (cache.dtype == FP8_E4M3):
        raise ValueError(f"fp8={fp8} does not match the cache dtype {cache.dtype}")
    if scale is not None and cache.dtype != FP8_E4M3:
        raise ValueError(
            f"a scale applies only to a float8_e4m3fn cache, not to a {cache.dtype} cache"
        )
    return Aval(cache.shape, cache.dtype)


@cache_insert_p.def_impl
def _insert_impl(cache, x, slots, scale, *, fp8):
    blocks, block_size, heads, head_dim = cache.shape
    out = cache.clone()
    rows = out.view(blocks * block_size, heads, head_dim)
    keep = slots >= 0
    slot = slots[keep].long()
    if slot.numel() and int(slot.max()) >= rows.shape[0]:
        raise ValueError(
            f"slot_mapping names slot {int(slot.max())}, past the cache's "
            f"{blocks} blocks x {block_size} rows"
        )
    value = x[keep].reshape(-1, heads, head_dim)
    if scale is not None:
        value = value / scale.to(value.dtype)
    if fp8:
        value = value.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)  # torch.clamp keeps NaN
    rows[slot] = value.to(rows.dtype)
    return out


@cache_insert_p.def_facts
def _insert_facts(cache: Aval, x: Aval, slots: Aval, scale: Aval | None, *, fp8) -> PagedStore:
    roles = (Role.CACHE, Role.VALUE, Role.INDEX, Role.SCALAR if scale is not None else None)
    head_dim = cache.shape[3]
    assert isinstance(head_dim, int)
    return PagedStore(roles, head_dim=head_dim)


@cache_insert_p.def_lowering
def _insert_lowering(b: EmitContext, eqn: Eqn) -> None:
    cache_var, x_var, slots_var, scale_var = eqn.inputs
    assert cache_var is not None and x_var is not None and slots_var is not None
    x = b.pieces(x_var)
    if eqn.params["fp8"]:
        scale = b.scalar(scale_var) if scale_var is not None else None
        x = {name: saturate_lines(b, v, scale, f"kv_{name}_") for name, v in x.items()}
    b.scatter_rows(cache_var, slots_var, x)
