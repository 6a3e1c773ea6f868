"""quantize_fp8: saturate a value to the FP8 E4M3 range and declare it stored as E4M3.

Per element, with an optional per-tensor ``scale`` (a ``[1]`` float32 tensor; vLLM's
convention for FP8 tensors: the stored number times ``scale`` is the value)::

    y = clamp(x / scale, -448, 448)          stored as float8_e4m3fn

448 is E4M3's largest finite value (``torch.finfo(torch.float8_e4m3fn).max``). This is
MiniMax-M3's FP8 path (vllm-ascend ``split_qkv_index_rmsnorm_rope``: ``clamp(y, -448, 448)
.to(float8_e4m3fn)``; vLLM's ``storeElemsFp8``: ``fminf(fmaxf(y, -448), 448)`` then a
saturating E4M3 conversion) and vLLM's ``scaled_convert`` (``__nv_cvt_float_to_fp8(x / scale,
__NV_SATFINITE, __NV_E4M3)``). NaN stays NaN (E4M3 has no infinity; +-Inf saturate to +-448).

With ``multiply=True`` the per-tensor factor multiplies instead (FlashInfer's convention for
its FP8 outputs, ``quant_scale_q`` of ``mla_rope_quantize_fp8``: ``cast(x * quant_scale_q)``)::

    y = clamp(x * scale, -448, 448)          stored as float8_e4m3fn

With ``dtype=torch.float8_e5m2`` (FlashInfer's ``quantize_dtype=torch.float8_e5m2``) the
value is saturated to E5M2's range and stored as float8_e5m2::

    y = clamp(x / scale, -57344, 57344)      stored as float8_e5m2   (x * scale with multiply)

Like every op, the value stays in fp32 inside a program: the rounding to the FP8 format
happens once, where the output is stored (round to nearest, ties to even, on every target;
the reference backend's ``Tensor.to(dtype)`` of the clamped value; the kernels encode E5M2 on
the fp32 bits, as the E5M2 cache stores do). The reference it matches is
:func:`fqr.reference.saturate_fp8` (rounded by the store).
"""

from __future__ import annotations

import torch

from ..core import Aval, EmitContext, Eqn, HeadOp, Role, primitive

FP8_E4M3 = torch.float8_e4m3fn
FP8_E4M3_MAX = float(torch.finfo(FP8_E4M3).max)  # 448.0
FP8_E5M2 = torch.float8_e5m2
FP8_E5M2_MAX = float(torch.finfo(FP8_E5M2).max)  # 57344.0
E5M2_MIN_NORMAL = 2.0**-14  # below it the spacing stays 2^-16 (subnormals)

FP8_MAX = {FP8_E4M3: FP8_E4M3_MAX, FP8_E5M2: FP8_E5M2_MAX}  # each format's largest finite

quantize_fp8_p = primitive("quantize_fp8")


def quantize_fp8(x, scale=None, *, multiply: bool = False, dtype: torch.dtype = FP8_E4M3):
    """See the module docstring (``multiply``: the scale multiplies, FlashInfer's; ``dtype``:
    float8_e4m3fn or float8_e5m2, the stored format)."""
    if multiply and scale is None:
        raise ValueError("multiply=True needs a scale")
    params: dict = {"multiply": True} if multiply else {}
    if dtype != FP8_E4M3:  # an E4M3 program's params stay as they were
        params["dtype"] = dtype
    return quantize_fp8_p.bind(x, scale, **params)


def check_scale(scale: Aval | None, name: str = "scale") -> None:
    """A per-tensor scale is a float32 tensor of shape [1]."""
    if scale is not None and (scale.shape != (1,) or scale.dtype != torch.float32):
        raise ValueError(f"{name} must be a float32 tensor of shape [1], got {scale}")


@quantize_fp8_p.def_abstract
def _quantize_abstract(x: Aval, scale: Aval | None, *, multiply: bool = False, dtype=FP8_E4M3):
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D [T, width], got shape {list(x.shape)}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"x must be a floating tensor, got {x.dtype}")
    if dtype not in FP8_MAX:
        raise TypeError(f"dtype must be float8_e4m3fn or float8_e5m2, got {dtype}")
    check_scale(scale)
    return Aval(x.shape, dtype)


@quantize_fp8_p.def_impl
def _quantize_impl(x, scale, *, multiply: bool = False, dtype=FP8_E4M3):
    if scale is None:
        y = x
    else:
        y = x * scale.to(x.dtype) if multiply else x / scale.to(x.dtype)
    top = FP8_MAX[dtype]
    return y.clamp(-top, top)  # torch.clamp keeps NaN


@quantize_fp8_p.def_facts
def _quantize_facts(x: Aval, scale: Aval | None, *, multiply: bool = False, dtype=None) -> HeadOp:
    return HeadOp((Role.VALUE, Role.SCALAR if scale is not None else None))  # elementwise


def saturate_lines(
    b: EmitContext,
    value: str,
    scale: str | None,
    prefix: str,
    *,
    exact_division: bool = False,
    multiply: bool = False,
    top: float = FP8_E4M3_MAX,
) -> str:
    """Emit ``clamp(value / scale, -top, top)`` keeping NaN (``top``: E4M3's 448 by default);
    return the new variable's name. ``exact_division``: divide with ``tl.math.div_rn`` (IEEE
    round to nearest; Triton's ``/`` on fp32 is ``div.full.f32`` on NVIDIA, within 2 ulp);
    ``multiply``: ``value * scale``."""
    y = b.fresh(prefix)
    if scale is None:
        scaled = value
    elif multiply:
        scaled = f"({value} * {scale})"
    elif exact_division:
        scaled = f"tl.math.div_rn({value}, {scale})"
    else:
        scaled = f"({value} / {scale})"
    b.emit(
        f"{y} = tl.where({scaled} != {scaled}, {scaled}, "
        f"tl.minimum(tl.maximum({scaled}, {-top!r}), {top!r}))"
    )
    return y


@quantize_fp8_p.def_lowering
def _quantize_lowering(b: EmitContext, eqn: Eqn) -> None:
    x_var, scale_var = eqn.inputs
    assert x_var is not None
    scale = b.scalar(scale_var) if scale_var is not None else None
    name = b.var_name(eqn.outputs[0])
    multiply = bool(eqn.params.get("multiply"))
    top = FP8_MAX[eqn.params.get("dtype", FP8_E4M3)]
    out = {
        piece: saturate_lines(b, v, scale, f"{name}_{piece}_", multiply=multiply, top=top)
        for piece, v in b.pieces(x_var).items()
    }
    b.set(eqn.outputs[0], out)


def e5m2_code_lines(b: EmitContext, value: str, scale: str | None, prefix: str) -> str:
    """Emit the float8_e5m2 byte of ``clamp(value / scale, -57344, 57344)`` (vLLM's
    ``__nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE, __NV_E5M2)``: saturate, round to
    nearest even) as a ``uint32`` tile of codes 0..255, encoded on the fp32 bits so that every
    target (the interpreters, Ascend, NVIDIA) stores the same byte: normals round to 2
    mantissa bits on the bits (the carry moves the exponent; bias 127 -> 15), subnormals
    (``|y| < 2^-14``) to multiples of 2^-16 by the 2^23 trick; NaN stays NaN (0x7F)."""
    y = b.fresh(prefix)
    scaled = value if scale is None else f"({value} / {scale})"
    b.emit(
        f"{y} = tl.where({scaled} != {scaled}, {scaled}, "
        f"tl.minimum(tl.maximum({scaled}, {-FP8_E5M2_MAX!r}), {FP8_E5M2_MAX!r}))"
    )
    a, bits, code = b.fresh(f"{prefix}abs"), b.fresh(f"{prefix}bits"), b.fresh(f"{prefix}code")
    b.emit(f"{a} = tl.abs({y})")
    b.emit(f"{bits} = {a}.to(tl.uint32, bitcast=True)")
    b.emit(f"{bits} = ({bits} + 0xFFFFF + (({bits} >> 21) & 1)) & 0xFFE00000")
    small = b.fresh(f"{prefix}sub")  # the subnormal range only (else 0: no NaN cast below)
    b.emit(f"{small} = tl.where({a} < {E5M2_MIN_NORMAL!r}, {a}, 0.0)")
    b.emit(
        f"{code} = tl.where({a} < {E5M2_MIN_NORMAL!r}, "
        f"(({small} * 65536.0 + 8388608.0) - 8388608.0).to(tl.uint32), "
        f"((({bits} >> 23) - 112) << 2) | (({bits} >> 21) & 3))"
    )
    sign = f"(({y}.to(tl.uint32, bitcast=True) >> 24) & 0x80)"
    b.emit(f"{code} = tl.where({y} != {y}, 0x7F, {code}) | {sign}")
    return code


def e5m2_bytes(x: torch.Tensor) -> torch.Tensor:
    """``x`` (already saturated to +-57344, NaN kept) as float8_e5m2 bytes, ``uint8`` (torch's
    conversion: round to nearest even)."""
    return x.to(FP8_E5M2).view(torch.uint8)
