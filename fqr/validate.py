"""Argument checks, run before any kernel: the pieces every public op's parameter kinds
(:mod:`fqr.prologue.declare`) and :class:`fqr.presets.PrologueSpec` are made of, so one argument
is checked (and named) the same way everywhere. Every failure is a ``ValueError`` or
``TypeError`` whose message starts with the argument's name, so the CLI can print it as one
line. Positions are range-checked on the host
for CPU tensors; on an accelerator (no host sync on the hot path) the kernel checks them instead
and rotates an out-of-range token by NaN.
"""

from __future__ import annotations

import functools

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
    try:
        v = float(value)
    except OverflowError:  # an int beyond any float (10**400)
        raise ValueError(
            f"{name} must be finite within float32's range, got an int of {value.bit_length()} bits"
        ) from None
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


def check_rotary_dim(
    rotary_dim: int, head_dim: int, what: str = "rotary_dim", bound: str = "head_dim"
) -> None:
    """Even, at least 2, at most ``head_dim`` (``bound``: what that limit is called)."""
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"{what} must be even and >= 2, got {rotary_dim}")
    if rotary_dim > head_dim:
        raise ValueError(f"{what} {rotary_dim} exceeds {bound} {head_dim}")


def check_mrope_section(mrope_section, mrope_interleaved, rotary_dim: int, *, config=False) -> None:
    """Three non-negative ints ``(t, h, w)``, read as vLLM reads them (:mod:`fqr.ops.mrope`).

    Contiguous sections must sum to ``rotary_dim / 2``: vLLM's ``MRotaryEmbedding`` asserts it
    and ``forward_native``'s ``split`` fails otherwise (its Triton kernel would give w the rest,
    vllm-ascend's would zero it). Interleaved, frequency ``i`` reads h when ``i % 3 == 1 and
    i < 3*h``, w when ``i % 3 == 2 and i < 3*w``, t otherwise, for any sizes (``[16, 24, 24]``
    over 64 frequencies is 22/21/21): vLLM's ``apply_interleaved_rope``, ``triton_mrope`` and
    ``fused_qk_norm_mrope`` accept them. ``config``: a model's config, where vLLM's
    ``MRotaryEmbedding`` asserts the sum for interleaved sections too."""
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
    if (config or not mrope_interleaved) and sum(mrope_section) != half:
        why = (
            "vLLM's MRotaryEmbedding asserts it"
            if mrope_interleaved
            else "contiguous sections: vLLM's MRotaryEmbedding asserts it and forward_native's "
            "split of the frequencies fails"
        )
        raise ValueError(
            f"mrope_section {list(mrope_section)} must sum to rotary_dim/2 = {half} ({why})"
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


def check_tensor(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def check_activation(name: str, x, what: str = "[T, width]") -> None:
    """``x [T, width]`` in an activation dtype, unit stride along a row."""
    check_tensor(name, x)
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
    check_tensor("positions", positions)
    if positions.dtype not in POSITION_DTYPES:
        raise TypeError(f"positions must be int32 or int64, got {positions.dtype}")
    if positions.dim() != 1 or positions.shape[0] != tokens:
        raise ValueError(
            f"positions must be [T] with T = {tokens} ({rows_of} rows), "
            f"got shape {list(positions.shape)}"
        )
    # any stride: every backend reads positions through it (``positions[:, 0]`` of [T, 2])


def check_cos_sin_cache(cos_sin_cache, head_dim: int, bound: str = "head_dim") -> int:
    """A ``[max_position, rotary_dim]`` float table, unit stride along a row, rotary_dim at
    most ``head_dim`` (``bound``: what that limit is called); its rotary_dim."""
    check_tensor("cos_sin_cache", cos_sin_cache)
    if cos_sin_cache.dim() != 2:
        raise ValueError(
            f"cos_sin_cache must be 2-D [max_position, rotary_dim], "
            f"got shape {list(cos_sin_cache.shape)}"
        )
    if not cos_sin_cache.dtype.is_floating_point:
        raise TypeError(f"cos_sin_cache must be floating, got {cos_sin_cache.dtype}")
    rotary_dim = cos_sin_cache.shape[1]
    check_rotary_dim(rotary_dim, head_dim, what="cos_sin_cache width (rotary_dim)", bound=bound)
    if cos_sin_cache.stride(1) != 1:
        raise ValueError("cos_sin_cache must be contiguous in its last dim")
    if cos_sin_cache.shape[0] < 1:
        raise ValueError("cos_sin_cache has no rows")
    return rotary_dim


def check_vector(name: str, t, length: int, what: str) -> None:
    """A contiguous floating ``[length]`` vector (``what``: what that length is)."""
    check_tensor(name, t)
    if t.dim() != 1 or t.shape[0] != length:
        raise ValueError(f"{name} must be [{length}] ({what}), got shape {list(t.shape)}")
    if not t.dtype.is_floating_point:
        raise TypeError(f"{name} must be floating, got {t.dtype}")
    if t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous")


def check_positions_in_range(positions: torch.Tensor, max_position: int) -> None:
    if positions.numel() == 0:
        return
    if positions.device.type == "cpu":
        lo, hi = (int(end) for end in torch.aminmax(positions))
        if lo < 0 or hi >= max_position:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"positions out of range: {bad} not in [0, {max_position}) (cos_sin_cache rows)"
            )
    # On an accelerator a host check would sync and an async assert costs several launches per
    # call; instead the generated kernel bounds-checks every position against the table rows and
    # rotates an out-of-range token by NaN (never reading outside the table), so it cannot pass
    # the numerics contract silently.


def check_slots_in_range(
    slot_mapping: torch.Tensor, cache: torch.Tensor, name: str = "slot_mapping"
) -> None:
    """On the host (a CPU ``slot_mapping``; an accelerator's would need a sync), every slot is
    below the cache's ``num_blocks * block_size`` rows (negative slots are padding); ``name``:
    the argument's, for the message."""
    if slot_mapping.device.type != "cpu" or not slot_mapping.numel():
        return
    top = int(slot_mapping.max())
    if top >= cache.shape[0] * cache.shape[1]:
        raise ValueError(
            f"{name} names slot {top}, past the caches' {cache.shape[0]} blocks x "
            f"{cache.shape[1]} rows"
        )


def check_out_buffers(out, qkv: torch.Tensor, widths: tuple[int, ...], inputs) -> None:
    """``out=`` of :func:`fqr.split_qkv_rmsnorm_rope`: one caller buffer per output, each a
    ``[T, width]`` tensor (``widths``: q, k, v) in qkv's dtype on qkv's device, unit stride in
    its last dim (rows may be strided: views into a wider buffer), and no input that requires
    grad (autograd does not record writes into caller buffers). That no buffer overlaps
    another argument or buffer in memory is every declaration's check (:func:`overlaps`)."""
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
    if torch.is_grad_enabled():
        for i, buf in enumerate(out):
            if buf.requires_grad:
                raise ValueError(
                    f"out[{i}] ({names[i]}) requires grad: out= buffers are written without "
                    "recording gradients; use torch.no_grad() or no out="
                )
        if any(t is not None and t.requires_grad for t in inputs):
            raise ValueError(
                "out= cannot record gradients (an input requires grad); use torch.no_grad() "
                "or no out="
            )


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` share a byte of memory, by address (two storages over one
    allocation, ``torch.from_numpy`` of one array twice, count as one memory).

    Exact where the two tensors' dims nest (sorted by stride, each stride is past the reach of
    the finer dims of both tensors): row-strided column slices of one buffer, the key and
    value halves of one ``[num_blocks, 2, block_size, H, D]`` cache, head-major views. Else
    whether their spans (first to last byte) meet, which may refuse two interleaved views
    that share no byte, never accepts two that do."""
    if not a.numel() or not b.numel() or a.device != b.device:
        return False
    if a.device.type == "meta" and a.untyped_storage()._cdata != b.untyped_storage()._cdata:
        return False  # no memory: every meta storage starts at address 0, views share one
    (a_first, a_last), (b_first, b_last) = byte_span(a), byte_span(b)
    if a_first > b_last or b_first > a_last:  # the spans do not meet
        return False
    d = b_first - a_first
    a_dims, _ = _byte_dims(tuple(a.shape), a.stride(), a.element_size())
    b_dims, _ = _byte_dims(tuple(b.shape), b.stride(), b.element_size())
    # one dim per byte stride: how far a's index may run ahead of b's, and behind
    ranges: dict[int, list[int]] = {}
    for stride, n in a_dims:
        ranges.setdefault(stride, [0, 0])[0] += n - 1
    for stride, n in b_dims:
        ranges.setdefault(stride, [0, 0])[1] += n - 1
    dims = sorted(((s, up, down) for s, (up, down) in ranges.items()), reverse=True)
    reach = [0] * (len(dims) + 1)  # how far the dims finer than i reach, either way
    for i in range(len(dims) - 1, -1, -1):
        s, up, down = dims[i]
        reach[i] = reach[i + 1] + s * max(up, down)
        if i + 1 < len(dims) and dims[i][0] <= reach[i + 1]:
            return True  # the dims do not nest: the spans met, so say they overlap

    def solvable(i: int, rest: int) -> bool:  # rest = sum of (a index - b index) * stride
        if i == len(dims):
            return rest == 0
        s, up, down = dims[i]
        low, high = -((reach[i + 1] - rest) // s), (rest + reach[i + 1]) // s
        return any(solvable(i + 1, rest - k * s) for k in range(max(low, -down), min(high, up) + 1))

    return solvable(0, d)


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """The addresses of ``t``'s first and last byte (a non-empty tensor; strides >= 0)."""
    first = t.data_ptr()
    if t.is_contiguous():  # its bytes back to back (the per-call write checks' common case)
        return first, first + t.nbytes - 1
    size = t.element_size()
    return first, first + size - 1 + size * sum((n - 1) * st for n, st in zip(t.shape, t.stride()))


@functools.lru_cache(maxsize=1024)
def _byte_dims(
    shape: tuple[int, ...], strides: tuple[int, ...], size: int
) -> tuple[tuple[tuple[int, int], ...], int]:
    """A tensor's dims (``shape``, element ``strides``, ``size`` bytes an element) as ``(byte
    stride, size)`` (the element's bytes a dim of stride 1), and the byte offset of its last
    byte from its first."""
    dims = [(1, size)]  # finest first; a dim that continues the finer one's bytes joins it
    for st, n in sorted((st * size, n) for n, st in zip(shape, strides) if n > 1):
        if st == dims[-1][0] * dims[-1][1]:
            dims[-1] = (dims[-1][0], dims[-1][1] * n)
        else:
            dims.append((st, n))
    return tuple(dims), sum((n - 1) * st for st, n in dims)
