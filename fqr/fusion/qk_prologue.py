"""The no-split prologue: RMS-normalise each head of q and of k, then rotate them.

Models with separate q/k/v projections (Hugging Face's ``Qwen3Attention``) have no packed row
to split; what remains of the prologue is, per head of q and of k::

    y = x * rsqrt(mean(x^2) + eps) * (weight_offset + w) + b       (fqr.ops.rms_norm)
    y = rope(y, cos_sin_cache[positions])                           (fqr.ops.rope)

:func:`qk_norm_rope_prologue` is that composition of the pure ops (the function that gets
traced, the sibling of :func:`fqr.prologue.attention_prologue`); :func:`qk_rmsnorm_rope`
validates its arguments, traces once per signature and runs the program on a backend
(``auto``: the generated kernel on CUDA / NPU, the reference interpreter on CPU).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .. import ops
from ..core import Aval, Program, trace
from ..validate import (
    ACTIVATION_DTYPES,
    check_finite_scalar,
    check_positions_in_range,
    check_unit_stride,
)

NUMERICS = ("fused", "unfused")


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
    """Per-head RMSNorm then RoPE on q and on k (traced into one program)."""
    q = ops.rms_norm(
        q, q_weight, eps=eps, group_size=head_dim, bias=q_bias, weight_offset=weight_offset
    )
    k = ops.rms_norm(
        k, k_weight, eps=eps, group_size=head_dim, bias=k_bias, weight_offset=weight_offset
    )
    round_to = None
    if numerics == "unfused":
        round_to = q.dtype
        q = ops.reduce_precision(q, round_to)
        k = ops.reduce_precision(k, round_to)
    q = ops.rope(q, positions, cos_sin_cache, head_dim=head_dim, is_neox=is_neox, round_to=round_to)
    k = ops.rope(k, positions, cos_sin_cache, head_dim=head_dim, is_neox=is_neox, round_to=round_to)
    return q, k


@lru_cache(maxsize=256)
def qk_program(signature: tuple) -> Program:
    avals, static = signature
    return trace(qk_norm_rope_prologue, *avals, **dict(static))


def check_qk_args(
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
    backend,
) -> None:
    """ValueError/TypeError naming the bad argument, before anything runs."""
    if not isinstance(head_dim, int) or isinstance(head_dim, bool):
        raise TypeError(f"head_dim must be an int, got {type(head_dim).__name__}")
    if head_dim < 1:
        raise ValueError(f"head_dim must be >= 1, got {head_dim}")
    check_finite_scalar("eps", eps, positive=True)
    if not isinstance(is_neox, bool):
        raise TypeError(f"is_neox must be a bool, got {type(is_neox).__name__}")
    check_finite_scalar("weight_offset", weight_offset)
    if numerics not in NUMERICS:
        raise ValueError(f"numerics must be 'fused' or 'unfused', got {numerics!r}")
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, got {type(backend).__name__}")
    for name, x in (("q", q), ("k", k)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 2:
            raise ValueError(f"{name} must be 2-D [T, heads*head_dim], got shape {list(x.shape)}")
        if x.dtype not in ACTIVATION_DTYPES:
            raise TypeError(f"{name} must be bf16, fp16 or fp32, got {x.dtype}")
        if x.shape[1] % head_dim:
            raise ValueError(f"{name} width {x.shape[1]} is not a multiple of head_dim {head_dim}")
    if k.dtype != q.dtype:
        raise TypeError(f"k must have q's dtype {q.dtype}, got {k.dtype}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k has {k.shape[0]} tokens but q has {q.shape[0]}")
    tokens, device = q.shape[0], q.device
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"positions must be a torch.Tensor, got {type(positions).__name__}")
    if positions.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"positions must be int32 or int64, got {positions.dtype}")
    if positions.dim() != 1 or positions.shape[0] != tokens:
        raise ValueError(
            f"positions must be [T] with T = {tokens}, got shape {list(positions.shape)}"
        )
    check_unit_stride("positions", positions)
    if not isinstance(cos_sin_cache, torch.Tensor):
        raise TypeError(f"cos_sin_cache must be a torch.Tensor, got {type(cos_sin_cache).__name__}")
    if cos_sin_cache.dim() != 2 or not cos_sin_cache.dtype.is_floating_point:
        raise ValueError(
            f"cos_sin_cache must be a 2-D float [max_position, rotary_dim] tensor, "
            f"got {cos_sin_cache.dtype} {list(cos_sin_cache.shape)}"
        )
    rotary_dim = cos_sin_cache.shape[1]
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(
            f"cos_sin_cache width (rotary_dim) must be even, >= 2 and <= head_dim "
            f"{head_dim}, got {rotary_dim}"
        )
    for name, t, required in (
        ("q_weight", q_weight, True),
        ("k_weight", k_weight, True),
        ("q_bias", q_bias, False),
        ("k_bias", k_bias, False),
    ):
        if t is None:
            if required:
                raise ValueError(f"{name} is required")
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.shape != (head_dim,) or not t.dtype.is_floating_point:
            raise ValueError(
                f"{name} must be a float [{head_dim}] (head_dim) tensor, "
                f"got {t.dtype} {list(t.shape)}"
            )
    if (q_bias is None) != (k_bias is None):
        raise ValueError("q_bias and k_bias must be given together")
    for name, t in (
        ("k", k),
        ("positions", positions),
        ("cos_sin_cache", cos_sin_cache),
        ("q_weight", q_weight),
        ("k_weight", k_weight),
        ("q_bias", q_bias),
        ("k_bias", k_bias),
    ):
        if t is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device} but q is on {device}")
    check_positions_in_range(positions, cos_sin_cache.shape[0])


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

    Same math, arguments and numerics modes as :func:`fqr.split_qkv_rmsnorm_rope` with
    ``norm="head"``, minus the split. Returns new contiguous ``q`` and ``k`` in q's dtype.
    """
    check_qk_args(
        q,
        k,
        positions,
        cos_sin_cache,
        q_weight,
        k_weight,
        q_bias,
        k_bias,
        head_dim=head_dim,
        eps=eps,
        is_neox=is_neox,
        weight_offset=weight_offset,
        numerics=numerics,
        backend=backend,
    )
    from ..backends import resolve_backend

    static = dict(
        head_dim=head_dim,
        eps=float(eps),
        is_neox=is_neox,
        weight_offset=float(weight_offset),
        numerics=numerics,
    )
    tensors = (q, k, positions, cos_sin_cache, q_weight, k_weight, q_bias, k_bias)
    avals = (
        Aval.of(q, "T"),
        Aval.of(k, "T"),
        Aval.of(positions, "T"),
        Aval.of(cos_sin_cache, "P"),
        Aval.of(q_weight),
        Aval.of(k_weight),
        Aval.of(q_bias),
        Aval.of(k_bias),
    )
    program = qk_program((avals, tuple(sorted(static.items()))))
    runner = resolve_backend(backend, q.device)  # a bad backend is refused at any T
    if q.shape[0] == 0:
        return q.new_empty(q.shape), k.new_empty(k.shape)
    args = [t for t in tensors if t is not None]
    q_out, k_out = runner.run(program, args)
    return q_out, k_out
