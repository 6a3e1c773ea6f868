"""Argument checks for the public fused ops and the prologue description, run before any kernel.

:func:`check_prologue_args` guards :func:`fqr.split_qkv_rmsnorm_rope`, :func:`check_qk_args`
:func:`fqr.qk_rmsnorm_rope`, :func:`check_spec_params` :class:`fqr.presets.PrologueSpec`; all
three are made of the checks below, so one argument is checked (and named) the same way
everywhere. Every failure is a ``ValueError`` or ``TypeError`` whose message starts with the
argument's name, so the CLI can print it as one line. Positions are range-checked on the host
for CPU tensors; on an accelerator (no host sync on the hot path) the kernel checks them instead
and rotates an out-of-range token by NaN.
"""

from __future__ import annotations

import torch

from .core import ACTIVATION_DTYPE_NAMES, DTYPE_NAMES, dtype_of

ACTIVATION_DTYPES = tuple(dtype_of(name) for name in ACTIVATION_DTYPE_NAMES)
POSITION_DTYPES = (torch.int32, torch.int64)
NORM_KINDS = ("head", "full", "none")
NUMERICS = ("fused", "unfused", "unfused-hf")


# ------------------------------------------------------------------------------- scalars


def check_positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


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


def check_choice(name: str, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


def check_head_counts(num_heads, num_kv_heads) -> None:
    """Positive head counts, q heads a multiple of kv heads (grouped-query attention)."""
    check_positive_int("num_heads", num_heads)
    check_positive_int("num_kv_heads", num_kv_heads)
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )


def check_head_params(*, head_dim, eps, is_neox, weight_offset) -> None:
    """The per-head parameters both ops and the spec share."""
    check_positive_int("head_dim", head_dim)
    check_finite_scalar("eps", eps, positive=True)
    check_finite_scalar("weight_offset", weight_offset)
    if not isinstance(is_neox, bool):
        raise TypeError(f"is_neox must be a bool, got {type(is_neox).__name__}")


def check_rotary_dim(rotary_dim: int, head_dim: int, what: str = "rotary_dim") -> None:
    """Even, at least 2, at most ``head_dim``."""
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"{what} must be even and >= 2, got {rotary_dim}")
    if rotary_dim > head_dim:
        raise ValueError(f"{what} {rotary_dim} exceeds head_dim {head_dim}")


def check_mrope_section(mrope_section, mrope_interleaved, rotary_dim: int) -> None:
    """Three non-negative ints ``(t, h, w)`` summing to ``rotary_dim / 2`` (the frequencies);
    interleaved, the h and w sections take every third frequency from 1 and 2, which must
    exist (``3*h - 2`` and ``3*w - 1`` below ``rotary_dim / 2``; :mod:`fqr.ops.mrope`)."""
    if not isinstance(mrope_interleaved, bool):
        raise TypeError(f"mrope_interleaved must be a bool, got {type(mrope_interleaved).__name__}")
    if not isinstance(mrope_section, (tuple, list)) or len(mrope_section) != 3:
        raise ValueError(f"mrope_section must be three ints (t, h, w), got {mrope_section!r}")
    for s in mrope_section:
        if not isinstance(s, int) or isinstance(s, bool) or s < 0:
            raise ValueError(
                f"mrope_section must be three non-negative ints, got {list(mrope_section)}"
            )
    half = rotary_dim // 2
    if sum(mrope_section) != half:
        raise ValueError(f"mrope_section {list(mrope_section)} must sum to rotary_dim/2 = {half}")
    _, s_h, s_w = mrope_section
    if mrope_interleaved and ((s_h and 3 * s_h - 2 >= half) or (s_w and 3 * s_w - 1 >= half)):
        raise ValueError(
            f"mrope_section {list(mrope_section)} does not fit {half} interleaved frequencies "
            f"(h takes 1, 4, ... below 3*h, w takes 2, 5, ... below 3*w)"
        )


def check_spec_params(
    *, num_heads, num_kv_heads, head_dim, rotary_dim, eps, is_neox, weight_offset, norm
) -> None:
    """The fields of a :class:`fqr.presets.PrologueSpec`."""
    check_head_counts(num_heads, num_kv_heads)
    check_head_params(head_dim=head_dim, eps=eps, is_neox=is_neox, weight_offset=weight_offset)
    check_positive_int("rotary_dim", rotary_dim)
    check_rotary_dim(rotary_dim, head_dim)
    check_choice("norm", norm, NORM_KINDS)


def _check_call_options(numerics, backend) -> None:
    check_choice("numerics", numerics, NUMERICS)
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, got {type(backend).__name__}")


# ------------------------------------------------------------------------------- tensors


def check_norm_stats(norm_stats) -> None:
    """Anything with :class:`fqr.NormStats`' fields (two tensors, two positive counts)."""
    fields = ("q_sum_sq", "k_sum_sq", "q_count", "k_count")
    if not all(hasattr(norm_stats, f) for f in fields):
        raise TypeError(
            f"norm_stats must be a fqr.NormStats ({', '.join(fields)}), "
            f"got {type(norm_stats).__name__}"
        )
    for count in ("q_count", "k_count"):
        check_positive_int(f"norm_stats.{count}", getattr(norm_stats, count))


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


def check_activation(name: str, x, what: str = "[T, width]") -> None:
    """``x [T, width]`` in an activation dtype, unit stride along a row."""
    _tensor(name, x)
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D {what}, got shape {list(x.shape)}")
    if x.dtype not in ACTIVATION_DTYPES:
        names = ", ".join(ACTIVATION_DTYPE_NAMES)
        raise TypeError(f"{name} must be {names}, got {DTYPE_NAMES.get(x.dtype, x.dtype)}")
    if x.shape[0] > 0 and x.stride(1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim (stride {x.stride(1)})")


def check_row_stride(name: str, x: torch.Tensor, width: int) -> None:
    """Rows do not overlap (the row stride may exceed the width)."""
    if x.shape[0] > 1 and x.stride(0) < width:
        raise ValueError(f"{name} row stride {x.stride(0)} is smaller than its width {width}")


def check_positions(positions, tokens: int, rows_of: str = "qkv") -> None:
    _tensor("positions", positions)
    if positions.dtype not in POSITION_DTYPES:
        raise TypeError(f"positions must be int32 or int64, got {positions.dtype}")
    if positions.dim() != 1 or positions.shape[0] != tokens:
        raise ValueError(
            f"positions must be [T] with T = {tokens} ({rows_of} rows), "
            f"got shape {list(positions.shape)}"
        )
    check_unit_stride("positions", positions)


def check_cos_sin_cache(cos_sin_cache, head_dim: int) -> int:
    """A ``[max_position, rotary_dim]`` float table, unit stride along a row; its rotary_dim."""
    _tensor("cos_sin_cache", cos_sin_cache)
    if cos_sin_cache.dim() != 2:
        raise ValueError(
            f"cos_sin_cache must be 2-D [max_position, rotary_dim], "
            f"got shape {list(cos_sin_cache.shape)}"
        )
    if not cos_sin_cache.dtype.is_floating_point:
        raise TypeError(f"cos_sin_cache must be floating, got {cos_sin_cache.dtype}")
    rotary_dim = cos_sin_cache.shape[1]
    check_rotary_dim(rotary_dim, head_dim, what="cos_sin_cache width (rotary_dim)")
    if cos_sin_cache.stride(1) != 1:
        raise ValueError("cos_sin_cache must be contiguous in its last dim")
    if cos_sin_cache.shape[0] < 1:
        raise ValueError("cos_sin_cache has no rows")
    return rotary_dim


def check_norm_vectors(weights_and_biases, *, norm: str, what: str) -> None:
    """``(name, tensor, length)`` for q_weight, k_weight, q_bias, k_bias: weights required
    with a norm, biases optional but together, all absent without a norm; each a contiguous
    float vector of its length (``what`` says what that length is)."""
    for name, t, length in weights_and_biases:
        if norm == "none":
            if t is not None:
                raise ValueError(f"{name} must be None when norm='none'")
            continue
        if t is None:
            if name.endswith("weight"):
                raise ValueError(f"{name} is required when norm={norm!r}")
            continue
        _tensor(name, t)
        if t.dim() != 1 or t.shape[0] != length:
            raise ValueError(f"{name} must be [{length}] ({what}), got shape {list(t.shape)}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be floating, got {t.dtype}")
        if t.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous")
    biases = {name: t for name, t, _ in weights_and_biases if name.endswith("bias")}
    if len({t is None for t in biases.values()}) > 1:
        raise ValueError("q_bias and k_bias must be given together")


def check_same_device(anchor: str, device: torch.device, tensors) -> None:
    """Every ``(name, tensor)`` (None skipped) on ``device``, the device of ``anchor``."""
    for name, t in tensors:
        if t is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device} but {anchor} is on {device}")


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


# ------------------------------------------------------------------------------- the ops


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
    num_v_heads=None,
    v_head_dim=None,
    head_stride=None,
    inplace=False,
) -> None:
    """The arguments of :func:`fqr.split_qkv_rmsnorm_rope`."""
    check_head_counts(num_heads, num_kv_heads)
    check_head_params(head_dim=head_dim, eps=eps, is_neox=is_neox, weight_offset=weight_offset)
    check_choice("norm", norm, NORM_KINDS)
    _check_call_options(numerics, backend)
    for name, value in (("num_v_heads", num_v_heads), ("v_head_dim", v_head_dim)):
        if value is not None:
            check_positive_int(name, value)
    v_heads = num_kv_heads if num_v_heads is None else num_v_heads
    v_dim = head_dim if v_head_dim is None else v_head_dim
    if not isinstance(inplace, bool):
        raise TypeError(f"inplace must be a bool, got {type(inplace).__name__}")

    check_activation("qkv", qkv)
    if head_stride is None:
        width = (num_heads + num_kv_heads) * head_dim + v_heads * v_dim
        layout = (
            f"num_heads*head_dim + num_kv_heads*head_dim + num_v_heads*v_head_dim = "
            f"{num_heads}*{head_dim} + {num_kv_heads}*{head_dim} + {v_heads}*{v_dim} = {width}"
        )
        if num_v_heads is None and v_head_dim is None:
            layout = (
                f"(num_heads + 2*num_kv_heads) * head_dim = "
                f"({num_heads} + 2*{num_kv_heads}) * {head_dim} = {width}"
            )
    else:
        check_positive_int("head_stride", head_stride)
        if head_stride < max(head_dim, v_dim):
            raise ValueError(
                f"head_stride {head_stride} is smaller than a head "
                f"(head_dim {head_dim}, v_head_dim {v_dim})"
            )
        if inplace:
            raise ValueError(
                "inplace=True needs heads back to back (head_stride None): the in-place form "
                "writes q and k as contiguous blocks of the row"
            )
        width = (num_heads + num_kv_heads + v_heads) * head_stride
        layout = (
            f"(num_heads + num_kv_heads + num_v_heads) * head_stride = "
            f"({num_heads} + {num_kv_heads} + {v_heads}) * {head_stride} = {width}"
        )
    if qkv.shape[1] != width:
        raise ValueError(f"qkv width {qkv.shape[1]} != {layout}")
    check_row_stride("qkv", qkv, width)
    tokens, device = qkv.shape[0], qkv.device
    if cos_sin_cache is None:
        if positions is not None:  # accepted as vLLM's callers pass it; unused without RoPE
            check_positions(positions, tokens)
    else:
        if positions is None:
            raise ValueError("positions is required with a cos_sin_cache (None only without RoPE)")
        check_positions(positions, tokens)
        check_cos_sin_cache(cos_sin_cache, head_dim)

    q_len = head_dim if norm == "head" else num_heads * head_dim
    k_len = head_dim if norm == "head" else num_kv_heads * head_dim
    check_norm_vectors(
        (
            ("q_weight", q_weight, q_len),
            ("k_weight", k_weight, k_len),
            ("q_bias", q_bias, q_len),
            ("k_bias", k_bias, k_len),
        ),
        norm=norm,
        what="head_dim" if norm == "head" else "the full q/k width",
    )
    check_same_device(
        "qkv",
        device,
        (("q_weight", q_weight), ("k_weight", k_weight), ("q_bias", q_bias), ("k_bias", k_bias)),
    )

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
            check_same_device("qkv", device, ((name, t),))
            if count < local:
                raise ValueError(
                    f"{name[:-7]}count {count} is smaller than the local width {local}"
                )

    check_same_device("qkv", device, (("positions", positions), ("cos_sin_cache", cos_sin_cache)))
    if cos_sin_cache is not None:
        check_positions_in_range(positions, cos_sin_cache.shape[0])
    if inplace:
        tensors = (qkv, positions, cos_sin_cache, q_weight, k_weight, q_bias, k_bias)
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
            raise ValueError(
                "inplace=True cannot write into qkv while an input requires grad (autograd "
                "needs the values it read); use inplace=False or torch.no_grad()"
            )


def check_mrope_positions(positions, tokens: int) -> None:
    """``positions [3, T]`` (temporal, height, width) or ``[T]`` (text: one position for all
    three planes), int32/int64, each plane contiguous along T."""
    _tensor("positions", positions)
    if positions.dtype not in POSITION_DTYPES:
        raise TypeError(f"positions must be int32 or int64, got {positions.dtype}")
    if positions.dim() == 1:
        check_positions(positions, tokens)
        return
    if positions.dim() != 2 or positions.shape != (3, tokens):
        raise ValueError(
            f"positions must be [3, T] or [T] with T = {tokens} (qkv rows), "
            f"got shape {list(positions.shape)}"
        )
    if tokens > 1 and positions.stride(1) != 1:
        raise ValueError(
            f"positions must be contiguous along T (stride 1), got stride {positions.stride(1)};"
            f" pass positions.contiguous()"
        )


def check_mrope_args(
    qkv,
    positions,
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
    backend,
) -> None:
    """The arguments of :func:`fqr.split_qkv_rmsnorm_mrope`."""
    check_head_counts(num_heads, num_kv_heads)
    check_head_params(head_dim=head_dim, eps=eps, is_neox=is_neox, weight_offset=weight_offset)
    _check_call_options(numerics, backend)
    if not isinstance(output_gate, bool):
        raise TypeError(f"output_gate must be a bool, got {type(output_gate).__name__}")
    check_activation("qkv", qkv)
    q_cols = (2 if output_gate else 1) * num_heads
    width = (q_cols + 2 * num_kv_heads) * head_dim
    if qkv.shape[1] != width:
        gate = "2*" if output_gate else ""
        raise ValueError(
            f"qkv width {qkv.shape[1]} != ({gate}num_heads + 2*num_kv_heads) * head_dim = "
            f"({gate}{num_heads} + 2*{num_kv_heads}) * {head_dim} = {width}"
            + (" (each q head followed by its gate head)" if output_gate else "")
        )
    check_row_stride("qkv", qkv, width)
    check_mrope_positions(positions, qkv.shape[0])
    rotary_dim = check_cos_sin_cache(cos_sin_cache, head_dim)
    check_mrope_section(mrope_section, mrope_interleaved, rotary_dim)
    check_norm_vectors(
        (
            ("q_weight", q_weight, head_dim),
            ("k_weight", k_weight, head_dim),
            ("q_bias", q_bias, head_dim),
            ("k_bias", k_bias, head_dim),
        ),
        norm="head",
        what="head_dim",
    )
    check_same_device(
        "qkv",
        qkv.device,
        (
            ("positions", positions),
            ("cos_sin_cache", cos_sin_cache),
            ("q_weight", q_weight),
            ("k_weight", k_weight),
            ("q_bias", q_bias),
            ("k_bias", k_bias),
        ),
    )
    check_positions_in_range(positions, cos_sin_cache.shape[0])


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
    """The arguments of :func:`fqr.qk_rmsnorm_rope` (a per-head norm of separate q and k)."""
    check_head_params(head_dim=head_dim, eps=eps, is_neox=is_neox, weight_offset=weight_offset)
    _check_call_options(numerics, backend)
    for name, x in (("q", q), ("k", k)):
        if x is None and name == "k":  # q alone
            for other, t in (("k_weight", k_weight), ("k_bias", k_bias)):
                if t is not None:
                    raise ValueError(f"{other} must be None when k is None (q alone)")
            continue
        check_activation(name, x, what="[T, heads*head_dim]")
        if x.shape[1] % head_dim:
            raise ValueError(f"{name} width {x.shape[1]} is not a multiple of head_dim {head_dim}")
        check_row_stride(name, x, x.shape[1])
    if k is not None and k.dtype != q.dtype:
        raise TypeError(f"k must have q's dtype {q.dtype}, got {k.dtype}")
    if k is not None and k.shape[0] != q.shape[0]:
        raise ValueError(f"k has {k.shape[0]} tokens but q has {q.shape[0]}")
    check_positions(positions, q.shape[0], rows_of="q")
    check_cos_sin_cache(cos_sin_cache, head_dim)
    check_norm_vectors(
        (
            ("q_weight", q_weight, head_dim),
            *((("k_weight", k_weight, head_dim),) if k is not None else ()),
            ("q_bias", q_bias, head_dim),
            *((("k_bias", k_bias, head_dim),) if k is not None else ()),
        ),
        norm="head",
        what="head_dim",
    )
    check_same_device(
        "q",
        q.device,
        (
            ("k", k),
            ("positions", positions),
            ("cos_sin_cache", cos_sin_cache),
            ("q_weight", q_weight),
            ("k_weight", k_weight),
            ("q_bias", q_bias),
            ("k_bias", k_bias),
        ),
    )
    check_positions_in_range(positions, cos_sin_cache.shape[0])


# ----------------------------------------------------------------- the per-call fast path


def call_metadata(token_tensors, tensors, statics: tuple) -> tuple | None:
    """Everything the checks of a call read, as a hashable key: None when the call cannot be
    keyed (an argument is not a tensor, a token tensor's rows differ from the first one's).

    ``token_tensors``: the ``[T, ...]`` arguments (the first one's rows are T); ``tensors``:
    the other tensor arguments (None for an absent one); ``statics``: the scalar arguments.
    The checks of the ops read of a token tensor its dtype, device, the sizes after the first,
    its strides and whether T is 0, 1 or more; of the other tensors their dtype, device, shape
    and strides; of the scalars their values and types (``True`` is not ``1``). The key holds
    exactly these, so two calls with one key pass or fail the checks alike, and a call whose
    key was checked once costs this tuple and one dict lookup (:func:`fqr.prologue`'s ops
    keep the keys that passed). Values (the positions' range on CPU) are not in the key: the
    caller checks them on every call.

    Keys that passed the checks (:func:`remember_checked_key`) have a generated guard
    (:func:`key_guard`): the arguments are first compared against the last few of them in
    straight-line code, and a guard that matches returns its key object itself, equal to the
    key built below (the guard compares exactly the fields the key holds, with the key's own
    equality), so no tuple is built on the hot path. No guard matching: the key is built."""
    for guard in _GUARDS:
        key = guard(token_tensors, tensors, statics)
        if key is not None:
            return key
    key = metadata_key(token_tensors, tensors, statics)
    if key is not None and _GUARD_OF:
        guard = _GUARD_OF.get(key)
        if guard is not None:  # checked before, its guard pushed out since: back in front
            _push_guard(guard)
    return key


def metadata_key(token_tensors, tensors, statics: tuple) -> tuple | None:
    """The key of :func:`call_metadata`, always built (no guard)."""
    rows = token_tensors[0]
    if not isinstance(rows, torch.Tensor):
        return None
    shape = rows.shape
    if not shape:
        return None
    tokens = shape[0]
    key: list = [min(tokens, 2), statics, tuple(map(type, statics))]
    for t in token_tensors:
        if not isinstance(t, torch.Tensor):
            return None
        shape = t.shape
        if not shape or shape[0] != tokens:
            return None
        key.append((t.dtype, t.device, len(shape), shape[1:], t.stride()))
    for t in tensors:
        if t is None:
            key.append(None)
        elif isinstance(t, torch.Tensor):
            key.append((t.dtype, t.device, t.shape, t.stride()))
        else:
            return None
    return tuple(key)


MAX_GUARDS = 4  # guards tried before the key is built (most recently checked or used first)
_GUARDS: list = []
_GUARD_OF: dict = {}  # key -> its guard, for every key remembered
MAX_REMEMBERED = 4096


def _push_guard(guard) -> None:
    # a new list, bound at once: a thread iterating the old one is not disturbed
    global _GUARDS
    _GUARDS = [guard, *(g for g in _GUARDS if g is not guard)][:MAX_GUARDS]


def remember_checked_key(key: tuple) -> None:
    """``key`` (a :func:`call_metadata` key) passed the checks: guard later calls with it."""
    guard = _GUARD_OF.get(key)
    if guard is None:
        if len(_GUARD_OF) >= MAX_REMEMBERED:
            return
        guard = _GUARD_OF[key] = key_guard(key)
    _push_guard(guard)


def forget_checked_keys() -> None:
    """Drop every guard (the next calls build their keys)."""
    global _GUARDS
    _GUARDS = []
    _GUARD_OF.clear()


def key_guard(key: tuple):
    """A generated function ``guard(token_tensors, tensors, statics)`` that returns ``key``
    itself when :func:`metadata_key` of those arguments would equal ``key``, else None.

    Read from the key's layout (T's class, the statics, their types, one 5-tuple per token
    tensor, then one 4-tuple or None per other tensor), it compares field by field what
    ``==`` of two keys compares: the statics' types by identity, then the statics as one tuple
    (the same element equality, identity first, as the key's; with the types equal it is each
    recorded type's own ``==``, so an odd argument cannot raise here), for each tensor
    ``isinstance``, dtype (``torch.dtype`` equality is identity), device (``==``), rank and
    every size (the token tensors' first size equal to the first one's T, T in the key's class
    0, 1 or >= 2) and the stride tuple (``==``). Its source is compiled in memory, never
    written to disk."""
    tokens_class, statics, types = key[0], key[1], key[2]
    entries = key[3:]
    token_entries = [e for e in entries if e is not None and len(e) == 5]
    other_entries = entries[len(token_entries) :]
    ns: dict = {"KEY": key, "STATICS": statics, "TENSOR": torch.Tensor}
    lines = ["def guard(token_tensors, tensors, statics):"]
    # the statics' types first, one by one: with them equal, ``==`` of each static is its
    # recorded type's own, so an odd argument (a tensor for eps) cannot raise here
    lines.append(f"    if not isinstance(statics, tuple) or len(statics) != {len(statics)}:")
    lines.append("        return None")
    if statics:
        names = [f"s{i}" for i in range(len(statics))]
        lines.append(f"    {', '.join(names)}, = statics")
        for i, kind in enumerate(types):
            ns[f"TYPE{i}"] = kind
        checks = " or ".join(f"type({n}) is not TYPE{i}" for i, n in enumerate(names))
        lines.append(f"    if {checks}:")
        lines.append("        return None")
    lines.append("    if not (statics == STATICS):")
    lines.append("        return None")
    lines.append(
        f"    if len(token_tensors) != {len(token_entries)} or len(tensors) != "
        f"{len(other_entries)}:"
    )
    lines.append("        return None")

    def tensor_lines(name: str, j: str, dtype, device, stride) -> None:
        ns[f"DT{j}"], ns[f"DEV{j}"], ns[f"ST{j}"] = dtype, device, stride
        lines.append(f"    if {name}.dtype is not DT{j} or {name}.device != DEV{j}:")
        lines.append("        return None")
        lines.append(f"    if {name}.stride() != ST{j}:")
        lines.append("        return None")

    for i, (dtype, device, rank, sizes, stride) in enumerate(token_entries):
        name = f"r{i}"
        lines.append(f"    {name} = token_tensors[{i}]")
        lines.append(f"    if not isinstance({name}, TENSOR):")
        lines.append("        return None")
        lines.append(f"    sh = {name}.shape")
        lines.append(f"    if len(sh) != {rank}:")
        lines.append("        return None")
        if i == 0:
            lines.append("    T = sh[0]")
            test = {0: "T != 0", 1: "T != 1"}.get(tokens_class, "T < 2")
            lines.append(f"    if {test}:")
        else:
            lines.append("    if sh[0] != T:")
        lines.append("        return None")
        for d, size in enumerate(sizes, start=1):
            lines.append(f"    if sh[{d}] != {int(size)}:")
            lines.append("        return None")
        tensor_lines(name, f"r{i}", dtype, device, stride)
    for i, entry in enumerate(other_entries):
        name = f"t{i}"
        lines.append(f"    {name} = tensors[{i}]")
        if entry is None:
            lines.append(f"    if {name} is not None:")
            lines.append("        return None")
            continue
        dtype, device, shape, stride = entry
        ns[f"SH{i}"] = shape
        lines.append(f"    if not isinstance({name}, TENSOR) or {name}.shape != SH{i}:")
        lines.append("        return None")
        tensor_lines(name, f"t{i}", dtype, device, stride)
    lines.append("    return KEY")
    exec(compile("\n".join(lines) + "\n", "<fqr call guard>", "exec"), ns)
    return ns["guard"]


FP8_E4M3 = torch.float8_e4m3fn
CACHE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, FP8_E4M3)


def check_fp8_scale(name: str, scale, device: torch.device) -> None:
    """A per-tensor FP8 scale: a float32 tensor of shape [1] on ``device`` (vLLM's k_scale)."""
    _tensor(name, scale)
    if scale.shape != (1,) or scale.dtype != torch.float32:
        raise ValueError(
            f"{name} must be a float32 tensor of shape [1], got {scale.dtype} {list(scale.shape)}"
        )
    check_same_device("qkv", device, ((name, scale),))


def check_index_prologue_args(
    qkv,
    positions,
    cos_sin_cache,
    weights,
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
    backend,
) -> None:
    """The arguments of :func:`fqr.split_qkv_index_rmsnorm_rope` (``weights``: ``(name,
    tensor, length)`` for q_weight, k_weight, index_q_weight, index_k_weight)."""
    check_head_counts(num_heads, num_kv_heads)
    check_head_params(head_dim=head_dim, eps=eps, is_neox=is_neox, weight_offset=weight_offset)
    check_positive_int("num_index_heads", num_index_heads)
    check_positive_int("index_head_dim", index_head_dim)
    for name, flag in (("attn_fp8", attn_fp8), ("index_fp8", index_fp8)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    _check_call_options(numerics, backend)
    width = (num_heads + 2 * num_kv_heads) * head_dim + (num_index_heads + 1) * index_head_dim
    check_activation("qkv", qkv, what="[T, q | k | v | index_q | index_k]")
    if qkv.shape[1] != width:
        raise ValueError(
            f"qkv width {qkv.shape[1]} != (num_heads + 2*num_kv_heads) * head_dim + "
            f"(num_index_heads + 1) * index_head_dim = ({num_heads} + 2*{num_kv_heads}) * "
            f"{head_dim} + ({num_index_heads} + 1) * {index_head_dim} = {width}"
        )
    check_row_stride("qkv", qkv, width)
    check_positions(positions, qkv.shape[0])
    check_cos_sin_cache(cos_sin_cache, min(head_dim, index_head_dim))
    check_norm_vectors(weights, norm="head", what="its head_dim")
    check_same_device(
        "qkv",
        qkv.device,
        (("positions", positions), ("cos_sin_cache", cos_sin_cache))
        + tuple((name, t) for name, t, _ in weights),
    )
    check_positions_in_range(positions, cos_sin_cache.shape[0])


def check_cache_args(
    qkv,
    key_cache,
    value_cache,
    slot_mapping,
    k_scale,
    v_scale,
    *,
    num_kv_heads: int,
    head_dim: int,
) -> None:
    """The paged caches of :func:`fqr.split_qkv_rmsnorm_rope_cache` (the rest of its arguments
    are :func:`check_prologue_args`'): ``[num_blocks, block_size, num_kv_heads, head_dim]``,
    one dtype (qkv's, or float8_e4m3fn with optional float32 ``[1]`` scales), contiguous last
    dim; ``slot_mapping [T]`` int32/int64 (negative: padding), on qkv's device."""
    device = qkv.device
    want = [None, None, num_kv_heads, head_dim]
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        _tensor(name, cache)
        if cache.dim() != 4 or list(cache.shape[2:]) != want[2:]:
            raise ValueError(
                f"{name} must be [num_blocks, block_size, num_kv_heads={num_kv_heads}, "
                f"head_dim={head_dim}], got shape {list(cache.shape)}"
            )
        if cache.shape[0] < 1 or cache.shape[1] < 1:
            raise ValueError(f"{name} has no rows (shape {list(cache.shape)})")
        if cache.dtype not in (qkv.dtype, FP8_E4M3):
            raise TypeError(
                f"{name} must be qkv's dtype {DTYPE_NAMES.get(qkv.dtype)} or fp8e4m3, "
                f"got {DTYPE_NAMES.get(cache.dtype, cache.dtype)}"
            )
        if cache.stride(3) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim (head_dim)")
        check_same_device("qkv", device, ((name, cache),))
    if value_cache.dtype != key_cache.dtype or value_cache.shape[:2] != key_cache.shape[:2]:
        raise ValueError(
            f"value_cache ({DTYPE_NAMES.get(value_cache.dtype)} {list(value_cache.shape)}) must "
            f"match key_cache ({DTYPE_NAMES.get(key_cache.dtype)} {list(key_cache.shape)})"
        )
    check_distinct_caches(key_cache, value_cache)
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            continue
        if key_cache.dtype != FP8_E4M3:
            raise ValueError(
                f"{name} applies only to a float8_e4m3fn cache, not to a "
                f"{DTYPE_NAMES.get(key_cache.dtype)} cache"
            )
        check_fp8_scale(name, scale, device)
    _tensor("slot_mapping", slot_mapping)
    if slot_mapping.dtype not in POSITION_DTYPES:
        raise TypeError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != qkv.shape[0]:
        raise ValueError(
            f"slot_mapping must be [T] with T = {qkv.shape[0]} (qkv rows), "
            f"got shape {list(slot_mapping.shape)}"
        )
    check_unit_stride("slot_mapping", slot_mapping)
    check_same_device("qkv", device, (("slot_mapping", slot_mapping),))
    check_slots_in_range(slot_mapping, key_cache)
    # On an accelerator (no host sync) the kernel stores nothing for a slot past the cache.


def check_slots_in_range(slot_mapping: torch.Tensor, cache: torch.Tensor) -> None:
    """On the host (a CPU ``slot_mapping``; an accelerator's would need a sync), every slot is
    below the cache's ``num_blocks * block_size`` rows (negative slots are padding)."""
    if slot_mapping.device.type != "cpu" or not slot_mapping.numel():
        return
    top = int(slot_mapping.max())
    if top >= cache.shape[0] * cache.shape[1]:
        raise ValueError(
            f"slot_mapping names slot {top}, past the caches' {cache.shape[0]} blocks x "
            f"{cache.shape[1]} rows"
        )


def check_distinct_caches(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """The two caches are different buffers (checked on every call: the per-call key holds
    their metadata, not their addresses)."""
    if key_cache.data_ptr() == value_cache.data_ptr() and key_cache.numel():
        raise ValueError("key_cache and value_cache must be different buffers")


def check_out_buffers(out, qkv: torch.Tensor, widths: tuple[int, ...], inputs) -> None:
    """``out=`` of :func:`fqr.split_qkv_rmsnorm_rope`: one caller buffer per output, each a
    ``[T, width]`` tensor (``widths``: q, k, v) in qkv's dtype on qkv's device, unit stride in
    its last dim (rows may be strided: views into a wider buffer), not overlapping ``qkv``
    (``inplace=True`` is the form that writes into it) nor another buffer, and no input that
    requires grad (autograd does not record writes into caller buffers)."""
    names = ("q", "k", "v")[: len(widths)]
    if not isinstance(out, (tuple, list)) or len(out) != len(widths):
        raise TypeError(
            f"out must be a tuple of {len(widths)} tensors ({', '.join(names)}), "
            f"got {type(out).__name__}"
            + (f" of {len(out)}" if isinstance(out, (tuple, list)) else "")
        )
    tokens = qkv.shape[0]
    for i, (buf, width, name) in enumerate(zip(out, widths, names)):
        what = f"out[{i}] ({name})"
        if not isinstance(buf, torch.Tensor):
            raise TypeError(f"{what} must be a torch.Tensor, got {type(buf).__name__}")
        if tuple(buf.shape) != (tokens, width):
            raise ValueError(f"{what} must have shape [{tokens}, {width}], got {list(buf.shape)}")
        if buf.dtype != qkv.dtype:
            raise TypeError(f"{what} must be {qkv.dtype} (qkv's dtype), got {buf.dtype}")
        if buf.device != qkv.device:
            raise ValueError(f"{what} is on {buf.device}, qkv on {qkv.device}")
        if buf.numel() and buf.stride(1) != 1:
            raise ValueError(
                f"{what} must have unit stride in its last dim, got strides {list(buf.stride())}"
            )
        if buf.numel() and buf.stride(0) < width:
            raise ValueError(f"{what} rows overlap: row stride {buf.stride(0)} < width {width}")
    for i, buf in enumerate(out):
        for j, other in enumerate([qkv, *out[:i]]):
            if _overlaps(buf, other):
                what = f"out[{j - 1}]" if j else "qkv (inplace=True writes q and k there)"
                raise ValueError(f"out[{i}] ({names[i]}) overlaps {what}")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
        raise ValueError(
            "out= cannot record gradients (an input requires grad); use torch.no_grad() or no out="
        )


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` share an element. Exact for row-strided ``[T, width]`` views of
    one buffer with the same row stride (``q = buf[:, :4096]``, ``k = buf[:, 4096:5120]``
    do not overlap), else whether their spans (first to last element) intersect."""
    if not a.numel() or not b.numel():
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    row = a.stride(0) if a.dim() == 2 else None
    if (
        b.dim() == 2
        and row == b.stride(0)
        and a.stride(1) == b.stride(1) == 1
        and a.dtype == b.dtype
        and max(a.shape[1], b.shape[1]) <= row
    ):
        # b's first element sits `rows` rows and `col` columns after a's; its columns are
        # [col, col + wb) of a's row grid, wrapping into the next row past the stride.
        rows, col = divmod(b.storage_offset() - a.storage_offset(), row)
        (ta, wa), (tb, wb) = a.shape, b.shape

        def rows_meet(first: int) -> bool:  # b's rows first .. first+tb-1 against a's 0..ta-1
            return first < ta and first + tb > 0

        return (col < wa and rows_meet(rows)) or (col + wb > row and rows_meet(rows + 1))

    def span(t: torch.Tensor) -> tuple[int, int]:
        start = t.data_ptr()
        last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
        return start, start + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1
