"""split_qkv: split the packed QKV projection row into q, k and v.

``qkv[t] = [q_0 .. q_{Hq-1} | k_0 .. k_{Hkv-1} | v_0 .. v_{Hkv-1}]``, each head ``D`` wide (vLLM's
``qkv.split([q_size, kv_size, kv_size], dim=-1)``). The outputs are new contiguous tensors.
"""

from __future__ import annotations

import torch

from ..core import Aval, primitive

split_qkv_p = primitive("split_qkv", multiple_results=True)


def split_qkv(qkv, num_heads: int, num_kv_heads: int, head_dim: int):
    """``(q [T, Hq*D], k [T, Hkv*D], v [T, Hkv*D])`` from ``qkv [T, (Hq + 2*Hkv)*D]``."""
    return split_qkv_p.bind(qkv, hq=num_heads, hkv=num_kv_heads, d=head_dim)


@split_qkv_p.def_abstract
def _split_abstract(qkv: Aval, *, hq: int, hkv: int, d: int):
    for name, v in (("num_heads", hq), ("num_kv_heads", hkv), ("head_dim", d)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if qkv.ndim != 2:
        raise ValueError(f"qkv must be 2-D [T, width], got shape {list(qkv.shape)}")
    if not qkv.dtype.is_floating_point:
        raise TypeError(f"qkv must be a floating tensor, got {qkv.dtype}")
    width = (hq + 2 * hkv) * d
    if qkv.shape[1] != width:
        raise ValueError(
            f"qkv width {qkv.shape[1]} != (num_heads + 2*num_kv_heads) * head_dim "
            f"= ({hq} + 2*{hkv}) * {d} = {width}"
        )
    t = qkv.shape[0]
    return [
        Aval((t, hq * d), qkv.dtype),
        Aval((t, hkv * d), qkv.dtype),
        Aval((t, hkv * d), qkv.dtype),
    ]


@split_qkv_p.def_impl
def _split_impl(qkv: torch.Tensor, *, hq: int, hkv: int, d: int):
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.contiguous().clone(), k.contiguous().clone(), v.contiguous().clone()


@split_qkv_p.def_lowering
def _split_lowering(b, eqn):
    # q, k and v are views of the packed row: the kernel plan gave each its own chain, whose
    # first use loads it (fqr/lowering/plan.py). Nothing to emit here.
    return None
