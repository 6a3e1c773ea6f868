"""``torch.ops.fqr.*``: the fused prologue as torch custom ops, for graphs and torch.compile.

================================  ===========================================================
``fqr::split_qkv_rmsnorm_rope``   packed ``qkv [T, (Hq+2Hkv)*D]`` -> new ``q, k, v`` (vLLM
                                  form); :func:`fqr.split_qkv_rmsnorm_rope`
``fqr::qk_rmsnorm_rope``          separate ``q [T, Hq*D]``, ``k [T, Hkv*D]`` -> new ``q, k``
                                  (Hugging Face form); :func:`fqr.qk_rmsnorm_rope`
================================  ===========================================================

Both are functional (``mutates_args=()``, outputs never alias inputs) and dispatch with
``backend="auto"``: the generated Triton kernel for CUDA tensors, Triton-Ascend for NPU
tensors, the reference program interpreter on CPU. Their fake implementations only compute
output shapes, so they trace under ``torch.compile`` with a symbolic token count.

(No ``from __future__ import annotations`` here: ``torch.library.custom_op`` reads the
annotations to build the schema.)
"""

from typing import Optional

import torch
from torch import Tensor

from ..prologue import qk_rmsnorm_rope, split_qkv_rmsnorm_rope


@torch.library.custom_op("fqr::split_qkv_rmsnorm_rope", mutates_args=())
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


@split_qkv_rmsnorm_rope_op.register_fake
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


@torch.library.custom_op("fqr::qk_rmsnorm_rope", mutates_args=())
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


@qk_rmsnorm_rope_op.register_fake
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
