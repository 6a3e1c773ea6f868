"""``torch.ops.fqr.*``: the fused prologue as torch custom ops, for graphs and torch.compile.

================================  ===========================================================
``fqr::split_qkv_rmsnorm_rope``   packed ``qkv [T, (Hq+2Hkv)*D]`` -> new ``q, k, v`` (vLLM
                                  form); :func:`fqr.split_qkv_rmsnorm_rope`
``fqr::qk_rmsnorm_rope``          separate ``q [T, Hq*D]``, ``k [T, Hkv*D]`` -> new ``q, k``
                                  (Hugging Face form); :func:`fqr.qk_rmsnorm_rope`
``fqr::split_qkv_rmsnorm_mrope``  packed row (with Qwen3.5's gate heads) and ``positions
                                  [3, T]`` -> ``[q, k, v]`` or ``[q, k, v, gate]`` (a list);
                                  :func:`fqr.split_qkv_rmsnorm_mrope`
``fqr::split_qkv_rmsnorm_rope_    Gemma 4: split, norm + RoPE of q and k, v normalised per
vnorm``                           head without weight; :func:`fqr.split_qkv_rmsnorm_rope_vnorm`
``fqr::split_qkv_rope_l2norm``    Llama 4: rotate, then L2-normalise q and k (NoPE layers:
                                  the attention temperature); :func:`fqr.split_qkv_rope_l2norm`
================================  ===========================================================

All are functional (no argument is mutated, outputs never alias inputs) and dispatch with
``backend="auto"``: the generated Triton kernel for CUDA tensors, Triton-Ascend for NPU
tensors, the reference program interpreter on CPU. Their fake implementations only compute
output shapes, so they trace under ``torch.compile`` with a symbolic token count.

They are registered the way vLLM registers its ops (``vllm.utils.direct_register_custom_op``):
``torch.library.Library("fqr", "DEF")``, ``define`` with the schema inferred from the Python
signature, ``impl`` of the public op for each device's dispatch key and ``_register_fake``.
``torch.library.custom_op`` would put its Python wrapper (``backend_impl``, an autograd
wrapper, alias checks) around every call: more than the op's own host cost (issue 12). The
ops are inference ops, as vLLM's are: no autograd kernel is registered (the public functions
carry the autograd policy, :class:`fqr.backends.DifferentiableRun`).

(No ``from __future__ import annotations`` here: ``infer_schema`` reads the annotations.)
"""

from typing import Optional

import torch
from torch import Tensor

from ..prologue import (
    qk_rmsnorm_rope,
    split_qkv_rmsnorm_mrope,
    split_qkv_rmsnorm_rope,
    split_qkv_rmsnorm_rope_vnorm,
    split_qkv_rope_l2norm,
)

LIBRARY = torch.library.Library("fqr", "DEF")
# The devices the op runs on: the reference rules on CPU, the kernels on CUDA and on NPUs
# (torch_npu's tensors dispatch as PrivateUse1).
DISPATCH_KEYS = ("CPU", "CUDA", "PrivateUse1")


def _register(name: str, impl, fake) -> None:
    """``fqr::name``: schema from ``impl``'s signature, ``impl`` for every dispatch key in
    :data:`DISPATCH_KEYS`, ``fake`` for tracing (vLLM's ``direct_register_custom_op``)."""
    LIBRARY.define(name + torch.library.infer_schema(impl, mutates_args=()))
    for key in DISPATCH_KEYS:
        LIBRARY.impl(name, impl, key)
    LIBRARY._register_fake(name, fake)


def split_qkv_rmsnorm_rope_op(
    qkv: Tensor,
    positions: Tensor,
    cos_sin_cache: Tensor,
    q_weight: Optional[Tensor],
    k_weight: Optional[Tensor],
    q_bias: Optional[Tensor],
    k_bias: Optional[Tensor],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float,
    is_neox: bool,
    weight_offset: float,
    norm: str,
    numerics: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`fqr.split_qkv_rmsnorm_rope` with ``backend="auto"``."""
    return split_qkv_rmsnorm_rope(
        qkv,
        positions,
        cos_sin_cache,
        q_weight,
        k_weight,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        eps=eps,
        is_neox=is_neox,
        q_bias=q_bias,
        k_bias=k_bias,
        weight_offset=weight_offset,
        norm=norm,
        numerics=numerics,
        backend="auto",
    )


def _split_qkv_rmsnorm_rope_fake(
    qkv,
    positions,
    cos_sin_cache,
    q_weight,
    k_weight,
    q_bias,
    k_bias,
    num_heads,
    num_kv_heads,
    head_dim,
    eps,
    is_neox,
    weight_offset,
    norm,
    numerics,
):
    width = (num_heads + 2 * num_kv_heads) * head_dim
    torch._check(
        qkv.dim() == 2 and qkv.shape[1] == width,
        lambda: f"qkv must be [T, {width}], got {list(qkv.shape)}",
    )
    tokens = qkv.shape[0]
    return (
        qkv.new_empty(tokens, num_heads * head_dim),
        qkv.new_empty(tokens, num_kv_heads * head_dim),
        qkv.new_empty(tokens, num_kv_heads * head_dim),
    )


def qk_rmsnorm_rope_op(
    q: Tensor,
    k: Tensor,
    positions: Tensor,
    cos_sin_cache: Tensor,
    q_weight: Tensor,
    k_weight: Tensor,
    q_bias: Optional[Tensor],
    k_bias: Optional[Tensor],
    head_dim: int,
    eps: float,
    is_neox: bool,
    weight_offset: float,
    numerics: str,
) -> tuple[Tensor, Tensor]:
    """:func:`fqr.qk_rmsnorm_rope` with ``backend="auto"``."""
    return qk_rmsnorm_rope(
        q,
        k,
        positions,
        cos_sin_cache,
        q_weight,
        k_weight,
        head_dim=head_dim,
        eps=eps,
        is_neox=is_neox,
        q_bias=q_bias,
        k_bias=k_bias,
        weight_offset=weight_offset,
        numerics=numerics,
        backend="auto",
    )


def _qk_rmsnorm_rope_fake(
    q,
    k,
    positions,
    cos_sin_cache,
    q_weight,
    k_weight,
    q_bias,
    k_bias,
    head_dim,
    eps,
    is_neox,
    weight_offset,
    numerics,
):
    torch._check(q.dim() == 2 and k.dim() == 2, lambda: "q and k must be 2-D [T, heads*head_dim]")
    return q.new_empty(q.shape), k.new_empty(k.shape)


_register("split_qkv_rmsnorm_rope", split_qkv_rmsnorm_rope_op, _split_qkv_rmsnorm_rope_fake)
_register("qk_rmsnorm_rope", qk_rmsnorm_rope_op, _qk_rmsnorm_rope_fake)


def split_qkv_rmsnorm_mrope_op(
    qkv: Tensor,
    positions: Tensor,
    cos_sin_cache: Tensor,
    q_weight: Tensor,
    k_weight: Tensor,
    q_bias: Optional[Tensor],
    k_bias: Optional[Tensor],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    mrope_section: list[int],
    mrope_interleaved: bool,
    eps: float,
    is_neox: bool,
    weight_offset: float,
    output_gate: bool,
    numerics: str,
) -> list[Tensor]:
    """:func:`fqr.split_qkv_rmsnorm_mrope` with ``backend="auto"``: ``[q, k, v]``, and the
    gate last with ``output_gate``."""
    return list(
        split_qkv_rmsnorm_mrope(
            qkv,
            positions,
            cos_sin_cache,
            q_weight,
            k_weight,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            mrope_section=tuple(mrope_section),
            mrope_interleaved=mrope_interleaved,
            eps=eps,
            is_neox=is_neox,
            q_bias=q_bias,
            k_bias=k_bias,
            weight_offset=weight_offset,
            output_gate=output_gate,
            numerics=numerics,
            backend="auto",
        )
    )


def _split_qkv_rmsnorm_mrope_fake(
    qkv,
    positions,
    cos_sin_cache,
    q_weight,
    k_weight,
    q_bias,
    k_bias,
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
    width = ((2 if output_gate else 1) * num_heads + 2 * num_kv_heads) * head_dim
    torch._check(
        qkv.dim() == 2 and qkv.shape[1] == width,
        lambda: f"qkv must be [T, {width}], got {list(qkv.shape)}",
    )
    tokens = qkv.shape[0]
    outs = [
        qkv.new_empty(tokens, num_heads * head_dim),
        qkv.new_empty(tokens, num_kv_heads * head_dim),
        qkv.new_empty(tokens, num_kv_heads * head_dim),
    ]
    if output_gate:
        outs.append(qkv.new_empty(tokens, num_heads * head_dim))
    return outs


_register("split_qkv_rmsnorm_mrope", split_qkv_rmsnorm_mrope_op, _split_qkv_rmsnorm_mrope_fake)


# ------------------------------------------- issue 15: Gemma 4's v norm, Llama 4's L2 norm


def split_qkv_rmsnorm_rope_vnorm_op(
    qkv: Tensor,
    positions: Tensor,
    cos_sin_cache: Tensor,
    q_weight: Tensor,
    k_weight: Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float,
    is_neox: bool,
    weight_offset: float,
    numerics: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`fqr.split_qkv_rmsnorm_rope_vnorm` with ``backend="auto"``."""
    return split_qkv_rmsnorm_rope_vnorm(
        qkv,
        positions,
        cos_sin_cache,
        q_weight,
        k_weight,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        eps=eps,
        is_neox=is_neox,
        weight_offset=weight_offset,
        numerics=numerics,
        backend="auto",
    )


def _packed_outputs(qkv, num_heads, num_kv_heads, head_dim):
    width = (num_heads + 2 * num_kv_heads) * head_dim
    torch._check(
        qkv.dim() == 2 and qkv.shape[1] == width,
        lambda: f"qkv must be [T, {width}], got {list(qkv.shape)}",
    )
    tokens = qkv.shape[0]
    return (
        qkv.new_empty(tokens, num_heads * head_dim),
        qkv.new_empty(tokens, num_kv_heads * head_dim),
        qkv.new_empty(tokens, num_kv_heads * head_dim),
    )


def _split_qkv_rmsnorm_rope_vnorm_fake(
    qkv,
    positions,
    cos_sin_cache,
    q_weight,
    k_weight,
    num_heads,
    num_kv_heads,
    head_dim,
    eps,
    is_neox,
    weight_offset,
    numerics,
):
    return _packed_outputs(qkv, num_heads, num_kv_heads, head_dim)


def split_qkv_rope_l2norm_op(
    qkv: Tensor,
    positions: Tensor,
    cos_sin_cache: Optional[Tensor],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float,
    is_neox: bool,
    floor_scale: Optional[float],
    attn_scale: float,
    numerics: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`fqr.split_qkv_rope_l2norm` with ``backend="auto"``."""
    return split_qkv_rope_l2norm(
        qkv,
        positions,
        cos_sin_cache,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        eps=eps,
        is_neox=is_neox,
        floor_scale=floor_scale,
        attn_scale=attn_scale,
        numerics=numerics,
        backend="auto",
    )


def _split_qkv_rope_l2norm_fake(
    qkv,
    positions,
    cos_sin_cache,
    num_heads,
    num_kv_heads,
    head_dim,
    eps,
    is_neox,
    floor_scale,
    attn_scale,
    numerics,
):
    return _packed_outputs(qkv, num_heads, num_kv_heads, head_dim)


_register(
    "split_qkv_rmsnorm_rope_vnorm",
    split_qkv_rmsnorm_rope_vnorm_op,
    _split_qkv_rmsnorm_rope_vnorm_fake,
)
_register("split_qkv_rope_l2norm", split_qkv_rope_l2norm_op, _split_qkv_rope_l2norm_fake)
