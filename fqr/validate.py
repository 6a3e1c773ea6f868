"""Argument checks for the public fused op, run before any kernel is launched.

Every failure is a ``ValueError`` or ``TypeError`` whose message starts with the argument's
name, so the CLI can print it as one line. Positions are range-checked on the host for CPU
tensors; on an accelerator (no host sync on the hot path) the kernel checks them instead and
rotates an out-of-range token by NaN.
"""

from __future__ import annotations

import torch

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
NORM_KINDS = ("head", "full", "none")


def _positive_int(name: str, v) -> None:
    if not isinstance(v, int) or isinstance(v, bool):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if v < 1:
        raise ValueError(f"{name} must be >= 1, got {v}")


FLOAT32_MAX = 3.4028234663852886e38  # the compute dtype's range: a scalar outside it is inf
FLOAT32_TRUE_MIN = 1.401298464324817e-45  # (or 0) inside the kernel and the reference


def check_finite_scalar(name: str, value, *, positive: bool = False) -> None:
    """A real number (not bool) that stays finite (and non-zero when ``positive``) in float32,
    the compute dtype: ``inf``/``nan`` would be emitted into a kernel as bare names and turn
    the reference's outputs into zeros."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    v = float(value)
    if positive and not FLOAT32_TRUE_MIN <= v <= FLOAT32_MAX:
        raise ValueError(
            f"{name} must be a positive number within float32's range "
            f"[{FLOAT32_TRUE_MIN:.3g}, {FLOAT32_MAX:.3g}], got {value!r}"
        )
    if not -FLOAT32_MAX <= v <= FLOAT32_MAX:  # nan fails both comparisons
        raise ValueError(f"{name} must be finite within float32's range, got {value!r}")


def check_norm_stats(norm_stats) -> None:
    """Anything with :class:`fqr.NormStats`' fields (two tensors, two positive counts)."""
    fields = ("q_sum_sq", "k_sum_sq", "q_count", "k_count")
    if not all(hasattr(norm_stats, f) for f in fields):
        raise TypeError(
            f"norm_stats must be a fqr.NormStats ({', '.join(fields)}), "
            f"got {type(norm_stats).__name__}"
        )
    for count in ("q_count", "k_count"):
        _positive_int(f"norm_stats.{count}", getattr(norm_stats, count))


def check_unit_stride(name: str, t: torch.Tensor) -> None:
    """A ``[T]`` vector the kernel reads at ``ptr + t``: consecutive elements (stride 1)."""
    if t.shape[0] > 1 and t.stride(0) != 1:
        raise ValueError(
            f"{name} must be contiguous (stride 1), got stride {t.stride(0)}; pass "
            f"{name}.contiguous()"
        )


def _tensor(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def check_prologue_args(
    qkv,
    positions,
    cos_sin_cache,
    q_weight,
    k_weight,
    q_bias,
    k_bias,
    norm_stats,
    *,
    num_heads,
    num_kv_heads,
    head_dim,
    eps,
    is_neox,
    weight_offset,
    norm,
    numerics,
    backend,
) -> None:
    _positive_int("num_heads", num_heads)
    _positive_int("num_kv_heads", num_kv_heads)
    _positive_int("head_dim", head_dim)
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    check_finite_scalar("eps", eps, positive=True)
    check_finite_scalar("weight_offset", weight_offset)
    if not isinstance(is_neox, bool):
        raise TypeError(f"is_neox must be a bool, got {type(is_neox).__name__}")
    if norm not in NORM_KINDS:
        raise ValueError(f"norm must be one of {NORM_KINDS}, got {norm!r}")
    if numerics not in ("fused", "unfused"):
        raise ValueError(f"numerics must be 'fused' or 'unfused', got {numerics!r}")
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, got {type(backend).__name__}")

    _tensor("qkv", qkv)
    if qkv.dim() != 2:
        raise ValueError(f"qkv must be 2-D [T, width], got shape {list(qkv.shape)}")
    if qkv.dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"qkv must be bf16, fp16 or fp32, got {qkv.dtype}")
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.shape[1] != width:
        raise ValueError(
            f"qkv width {qkv.shape[1]} != (num_heads + 2*num_kv_heads) * head_dim = "
            f"({num_heads} + 2*{num_kv_heads}) * {head_dim} = {width}"
        )
    if qkv.shape[0] > 0 and qkv.stride(1) != 1:
        raise ValueError(f"qkv must be contiguous in its last dim (stride {qkv.stride(1)})")
    if qkv.shape[0] > 1 and qkv.stride(0) < width:
        raise ValueError(f"qkv row stride {qkv.stride(0)} is smaller than its width {width}")
    tokens, device = qkv.shape[0], qkv.device

    _tensor("positions", positions)
    if positions.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"positions must be int32 or int64, got {positions.dtype}")
    if positions.dim() != 1 or positions.shape[0] != tokens:
        raise ValueError(
            f"positions must be [T] with T = {tokens} (qkv rows), got shape {list(positions.shape)}"
        )
    check_unit_stride("positions", positions)

    _tensor("cos_sin_cache", cos_sin_cache)
    if cos_sin_cache.dim() != 2:
        raise ValueError(
            f"cos_sin_cache must be 2-D [max_position, rotary_dim], "
            f"got shape {list(cos_sin_cache.shape)}"
        )
    if not cos_sin_cache.dtype.is_floating_point:
        raise TypeError(f"cos_sin_cache must be floating, got {cos_sin_cache.dtype}")
    rotary_dim = cos_sin_cache.shape[1]
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(
            f"cos_sin_cache width (rotary_dim) must be even and >= 2, got {rotary_dim}"
        )
    if rotary_dim > head_dim:
        raise ValueError(
            f"cos_sin_cache width (rotary_dim) {rotary_dim} exceeds head_dim {head_dim}"
        )
    if cos_sin_cache.stride(1) != 1:
        raise ValueError("cos_sin_cache must be contiguous in its last dim")
    if cos_sin_cache.shape[0] < 1:
        raise ValueError("cos_sin_cache has no rows")

    q_len = head_dim if norm == "head" else num_heads * head_dim
    k_len = head_dim if norm == "head" else num_kv_heads * head_dim
    for name, t, n in (
        ("q_weight", q_weight, q_len),
        ("k_weight", k_weight, k_len),
        ("q_bias", q_bias, q_len),
        ("k_bias", k_bias, k_len),
    ):
        if norm == "none":
            if t is not None:
                raise ValueError(f"{name} must be None when norm='none'")
            continue
        if t is None:
            if name.endswith("weight"):
                raise ValueError(f"{name} is required when norm={norm!r}")
            continue
        _tensor(name, t)
        if t.dim() != 1 or t.shape[0] != n:
            what = "head_dim" if norm == "head" else "the full q/k width"
            raise ValueError(f"{name} must be [{n}] ({what}), got shape {list(t.shape)}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be floating, got {t.dtype}")
        if t.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but qkv is on {device}")
    if (q_bias is None) != (k_bias is None):
        raise ValueError("q_bias and k_bias must be given together")

    if norm_stats is not None:
        if norm != "full":
            raise ValueError("norm_stats is only meaningful with norm='full'")
        check_norm_stats(norm_stats)
        for name, t, local, count in (
            ("norm_stats.q_sum_sq", norm_stats.q_sum_sq, q_len, norm_stats.q_count),
            ("norm_stats.k_sum_sq", norm_stats.k_sum_sq, k_len, norm_stats.k_count),
        ):
            _tensor(name, t)
            if t.dtype != torch.float32 or t.shape != (tokens,):
                raise ValueError(
                    f"{name} must be float32 [T={tokens}], got {t.dtype} {list(t.shape)}"
                )
            check_unit_stride(name, t)
            if t.device != device:
                raise ValueError(f"{name} is on {t.device} but qkv is on {device}")
            if count < local:
                raise ValueError(
                    f"{name[:-7]}count {count} is smaller than the local width {local}"
                )

    for name, t in (("positions", positions), ("cos_sin_cache", cos_sin_cache)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but qkv is on {device}")
    check_positions_in_range(positions, cos_sin_cache.shape[0])


def check_positions_in_range(positions: torch.Tensor, max_position: int) -> None:
    if positions.numel() == 0:
        return
    if positions.device.type == "cpu":
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0 or hi >= max_position:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"positions out of range: {bad} not in [0, {max_position}) (cos_sin_cache rows)"
            )
    # On an accelerator a host check would sync and an async assert costs several launches per
    # call; instead the generated kernel bounds-checks every position against the table rows and
    # rotates an out-of-range token by NaN (never reading outside the table), so it cannot pass
    # the numerics contract silently.
