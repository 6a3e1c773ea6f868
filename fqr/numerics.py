"""The numerics contract, and the comparisons that enforce it.

Every output is compared with the float64-exact value of the math on the (already rounded)
inputs, head by head:

==========  ==================  ==============================================================
numerics    output dtype        passes when
==========  ==================  ==============================================================
fused       bf16, fp16          every element within 1 ULP of the correctly rounded float64
                                value. Elements whose exact value is below the fp32 compute
                                floor of their head (``|err| <= 2^-20 * max|head|``) pass on
                                that absolute bound instead (fp32 arithmetic cannot resolve
                                RoPE cancellation below it).
fused       fp32                ``|err| <= 2^-16 * max|head|`` (head-relative, ~1.5e-5)
unfused     bf16                ``|err| <= 2^-5  * max|head|`` (8 x bf16 epsilon)
unfused     fp16                ``|err| <= 2^-8  * max|head|`` (8 x fp16 epsilon)
unfused     fp32                as fused fp32
any         float8_e4m3fn       within 1 E4M3 ULP of the float64 value clamped to +-448 and
                                correctly rounded (the clamp is the FP8 store's saturation)
any         any                 NaN or Inf in an output never passes
projected   as above            as above, plus the fp32 accumulation floor of the product
                                (:func:`accumulation_bound`, ``~K * 2^-24 * sum|x_k*w_k|``,
                                carried through the norm and RoPE): it matters only where the
                                dot product cancels; the projected forms of
                                ``fqr.prologue.projected``
==========  ==================  ==============================================================

``unfused`` rounds (to the activation dtype, nearest even) exactly where vLLM's native code
(``RMSNorm`` / ``GemmaRMSNorm.forward_static``, ``RotaryEmbedding.forward_static``) and Hugging
Face's ``Qwen3RMSNorm`` / ``Gemma3RMSNorm`` / ``apply_rotary_pos_emb`` round, and equals them bit
for bit (``tests/core/test_unfused_models.py``); the fp32 statistic ``rstd = rsqrt(sum(x^2)/D +
eps)`` is the only unrounded intermediate (the generated kernels round at the same points; their
fp32 sum of squares adds in another order, so where that moves ``rstd`` by an fp32 ulp an element
on a rounding boundary of ``x * rstd``, about 2^-16 of them, can land one ULP away):

1. norm, offset 0: ``n = round(round(x * rstd) * w)``; offset 1 (Gemma): ``n = round(x * rstd *
   (1 + w))``; a bias: ``n = round(n + b)``;
2. the table row gathered and rounded: ``c = round(cos)``, ``s = round(sin)`` (mRoPE: each
   frequency's row from its position plane, vLLM's ``MRotaryEmbedding.forward_native``, which
   then rotates as ``RotaryEmbedding`` does);
3. each rotated pair: ``round(round(n1*c) - round(n2*s))``, ``round(round(n2*c) + round(n1*s))``.

Its bound follows from those points (u = 2^-8 bf16, 2^-11 fp16 unit roundoff): a product carries
at most four roundings (two in the norm, the table, the product), the sum one more, and
``|n1*c| + |n2*s| <= |(n1, n2)| <= sqrt(2) * max|head|`` (the rotation keeps the pair's length),
so ``|err| <= ((1+u)^4 - 1) * sqrt(2) * max|head| + u * max|head| ~ 6.7 u * max|head|``, inside
the ``8 u`` of the table (a bias adds one rounding of the biased value).

``unfused-hf`` is ``unfused`` where Hugging Face's code rounds elsewhere than vLLM's: with a
full-width norm (``norm="full"``, OLMo2) HF's ``Olmo2RMSNorm`` rounds once, ``n = round(x * rstd
* w)``, and its ``apply_rotary_pos_emb`` multiplies the bf16 ``n`` by fp32 cos/sin and rounds
once, ``round(n1*c - n2*s)`` (vLLM's OLMo2 uses ``RMSNorm`` and its rotary embedding:
``unfused``). With per-head norms of offset 0, HF's AFMoE / Flint / Lara norms also multiply the
weight in fp32, ``n = round(x * rstd * w)``, and then rotate as Llama's (rounding points 2 and 3
above), where HF's Qwen3 rounds as vLLM's (``unfused``). The MLA ops
(``split_mla_rmsnorm_rope_cache``, ``mla_q_rope``): HF's DeepSeek-V2 rotates with an fp32
complex product (``apply_rotary_emb``) rounded once, its norms round as vLLM's (HF's DeepSeek-V3
rounds as vLLM: ``unfused``). ``(1 + w)`` norms, no norm and their RoPE round the same in both
(HF Gemma 3 / Llama = vLLM), so there the two modes are one.

The norm variants (issue 15): a norm without weight rounds once, ``n = round(x * rstd)``
(vLLM's ``RMSNorm(has_weight=False)``: Gemma 4's v norm, Llama 4's ``qk_norm`` on ``q.float()``;
HF's ``Llama4TextL2Norm``); Llama 4 rotates first (vLLM's rounding points 2 and 3 above, or
under ``unfused-hf`` HF's ``apply_rotary_emb``: the fp32 complex product rounded once) and then
norms; its NoPE temperature ``round(q * s(p))`` (``s`` in fp32) is one rounding in every mode.

``v`` is a copy and must match bit for bit. ULPs are counted on the bit patterns (bit-cast in
torch; numpy has no bf16), so +0 and -0 are the same value and neighbours are 1 apart.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .core import lookup

COMPUTE_FLOOR = 2.0**-20
HEAD_RELATIVE_BOUND = {
    ("fused", torch.float32): 2.0**-16,
    ("unfused", torch.float32): 2.0**-16,
    ("unfused", torch.bfloat16): 2.0**-5,
    ("unfused", torch.float16): 2.0**-8,
}
_INT_OF = {
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float32: torch.int32,
    torch.float8_e4m3fn: torch.int8,
    torch.float8_e5m2: torch.int8,
}
FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
# The FP8 output dtypes and the value each store saturates to (E4M3 448, E5M2 57344)
FP8_MAX = {d: float(torch.finfo(d).max) for d in (torch.float8_e4m3fn, torch.float8_e5m2)}


FP32_UNIT_ROUNDOFF = 2.0**-24


def accumulation_bound(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None):
    """float64 ``[T, N]``: how far an fp32 accumulation of ``x [T, K] @ w [N, K].T (+ bias)``
    may land from the exact product, in any order of the sum, with or without FMA: the floor
    of the projected form's contract (:mod:`fqr.prologue.projected`), which the fused
    contract's 1 ULP does not include.

    Derivation (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., eq. 3.5):
    each of the ``K`` products and the ``K - 1`` additions (one more with a bias) is exact or
    rounded once to fp32, ``u = 2^-24``, so ``|s_hat - s| <= gamma_n * sum_k |x_k * w_k|``
    (``+ |bias|``), ``gamma_n = n*u / (1 - n*u)``, ``n = K + 1`` (``K + 2`` with a bias; a
    bf16 / fp16 product is exact in fp32, so this counts one rounding more than it needs).
    A kernel's split-K partial sums and their fix-up are additions of the same sum: the
    bound holds for every schedule.

    What it gives the outputs: a copied value (v) rounded once is within ``1/2 ulp + bound``
    of the float64 value, which is inside the 1 ULP of the fused contract wherever the bound
    is below half an ULP of the value (``|s| >> K * 2^-24 * sum|x*w|``: no cancellation);
    where the dot product cancels, the bound takes over. Through an RMSNorm of a head
    (``y_i = s_i * r * w_i``, ``r = rsqrt(mean(s^2) + eps)``) an error ``e_j`` of each input
    moves ``y_i`` by at most ``r * |w_i| * max_j e_j * (1 + |s_i| / rms(s))`` (first order:
    ``|sum_j s_j e_j| <= |s| * |e|``); RoPE rotates each pair, which keeps the length of its
    error: at most ``sqrt(2)`` times the pair's larger bound.
    """
    k = x.shape[1] + 1 + (bias is not None)
    gamma = k * FP32_UNIT_ROUNDOFF / (1 - k * FP32_UNIT_ROUNDOFF)
    magnitude = x.detach().double().abs() @ w.detach().double().abs().T
    if bias is not None:
        magnitude = magnitude + bias.detach().double().abs()
    return gamma * magnitude


def contract_of(numerics: str) -> str:
    """The contract a numerics mode is held to: ``unfused-hf`` rounds at other points than
    ``unfused`` (one fewer), under the same bound."""
    return "unfused" if numerics.startswith("unfused") else numerics


# An FP8 output of an unfused chain is the E4M3 of a value already rounded to the model dtype
# between the ops (vllm-ascend's clamp + cast of the bf16 result): within one E4M3 step, or
# within the model dtype's unfused bound where that bound is wider (elements small in their
# head, where E4M3's steps are finer than the bf16 chain's error).
FP8_UNFUSED_RELATIVE_BOUND = HEAD_RELATIVE_BOUND[("unfused", torch.bfloat16)]


def tolerance_text(numerics: str, dtype: torch.dtype) -> str:
    if dtype in FP8_MAX:
        unit = "e4m3" if dtype == torch.float8_e4m3fn else "e5m2"
        if contract_of(numerics) == "unfused":
            return f"<=1 {unit} ulp or <={FP8_UNFUSED_RELATIVE_BOUND:.2g} x head max"
        return f"<=1 {unit} ulp"
    numerics = contract_of(numerics)
    if numerics == "fused" and dtype in (torch.bfloat16, torch.float16):
        return "<=1 ulp"
    return f"<={HEAD_RELATIVE_BOUND[(numerics, dtype)]:.2g} x head max"


def ordered_bits(x: torch.Tensor) -> torch.Tensor:
    """Map floats to int64 so that adjacent representable values differ by 1 (+0 == -0)."""
    bits = x.contiguous().view(_INT_OF[x.dtype]).to(torch.int64)
    width = torch.finfo(x.dtype).bits
    sign = bits < 0
    magnitude = bits & ((1 << (width - 1)) - 1)
    return torch.where(sign, -magnitude, magnitude)


def _from_ordered(o: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    width = torch.finfo(dtype).bits
    bits = torch.where(o < 0, (-o) | (1 << (width - 1)), o)
    bits = torch.where(bits >= (1 << (width - 1)), bits - (1 << width), bits)  # to signed range
    return bits.to(_INT_OF[dtype]).view(dtype)


def round_nearest(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Correctly rounded (nearest, ties to even) float64 -> ``dtype``.

    torch's float64 -> bf16 conversion goes through float32 and can double-round; this picks
    the nearest of the three neighbours of that result, measured exactly in float64.
    """
    ref = ref.to(torch.float64)
    approx = ref.to(dtype)
    if dtype == torch.float32:
        return approx  # float64 -> float32 is a single rounding
    base = ordered_bits(approx)
    cands = torch.stack([_from_ordered(base + d, dtype) for d in (-1, 0, 1)])
    err = (cands.to(torch.float64) - ref).abs()
    finite = torch.isfinite(cands.to(torch.float64))
    err = torch.where(finite, err, torch.full_like(err, float("inf")))
    best = err.min(dim=0).values
    is_best = err == best
    even = (ordered_bits(cands.reshape(-1)).reshape(cands.shape) % 2) == 0
    choice = torch.where(is_best & even, 0, torch.where(is_best, 1, 2)).argmin(dim=0)
    ints = cands.view(_INT_OF[dtype])  # on the bits: torch has no fp8 gather/where
    picked = ints.gather(0, choice.unsqueeze(0)).squeeze(0)
    return torch.where(torch.isfinite(ref), picked, approx.view(_INT_OF[dtype])).view(dtype)


@dataclass
class Comparison:
    max_ulp: int | None  # None for fp32 outputs
    max_abs: float
    max_rel_head: float  # max |err| / max|head| over heads
    bad: int  # elements outside the tolerance
    nonfinite: int
    passed: bool
    tolerance: str
    # The worst element's error as a fraction of what the tolerance allows it (<= 1 passes):
    # a large ULP count far below the bound of an unfused contract reads as what it is.
    error_ratio: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


# Elements of one piece of a comparison: its float64 / int64 temporaries (a dozen of them,
# three for each of round_nearest's candidates) stay near 1 GiB whatever the output's size.
COMPARE_CHUNK = 1 << 23


def compare(
    out: torch.Tensor,
    exact: torch.Tensor,
    *,
    head_dim: int,
    numerics: str = "fused",
    bitwise: bool = False,
) -> Comparison:
    """Compare ``out`` (any dtype, [T, H*D]) with float64 ``exact`` under the contract above.

    Runs where ``out`` is (``exact`` is moved there if it is elsewhere): a GPU output is
    compared on the GPU, nothing copied to the host but the few numbers of the result. The
    heads are taken in pieces of at most :data:`COMPARE_CHUNK` elements, so the float64
    temporaries stay bounded for any size; the result is the same as in one piece (maxima
    and counts over the pieces)."""
    if out.shape != exact.shape:
        raise ValueError(
            f"shape mismatch: output {list(out.shape)} vs expected {list(exact.shape)}"
        )
    dtype, numerics = out.dtype, contract_of(numerics)
    if out.numel() == 0:
        return Comparison(0, 0.0, 0.0, 0, 0, True, "empty", 0.0)
    out = out.detach()
    exact = exact.detach().to(device=out.device)
    t = out.shape[0]
    heads_out = out.reshape(t, -1, head_dim).reshape(-1, head_dim)
    heads_exact = exact.reshape(t, -1, head_dim).reshape(-1, head_dim)
    rows = max(1, COMPARE_CHUNK // head_dim)
    parts = [
        _compare_heads(heads_out[i : i + rows], heads_exact[i : i + rows], dtype, numerics, bitwise)
        for i in range(0, heads_out.shape[0], rows)
    ]
    stats = torch.stack([p for p, _ in parts]).amax(dim=0)  # one copy to the host, at the end
    counts = torch.stack([c for _, c in parts]).sum(dim=0)
    max_abs, max_rel, max_ulp, ratio = stats.tolist()
    bad, nonfinite = (int(x) for x in counts.tolist())
    tol = _tolerance_label(dtype, numerics, bitwise)
    if bitwise:
        ratio = 0.0 if bad == 0 else float("inf")
    elif not (
        dtype in FP8_MAX or (numerics == "fused" and dtype in (torch.bfloat16, torch.float16))
    ):
        ratio = max_rel / HEAD_RELATIVE_BOUND[(numerics, dtype)]
    has_ulp = dtype in (torch.bfloat16, torch.float16, *FP8_MAX)
    passed = bad == 0 and nonfinite == 0
    return Comparison(
        int(max_ulp) if has_ulp else None, max_abs, max_rel, bad, nonfinite, passed, tol, ratio
    )


def _tolerance_label(dtype: torch.dtype, numerics: str, bitwise: bool) -> str:
    if bitwise:
        return "bit-exact"
    if dtype in FP8_MAX:
        return tolerance_text(numerics, dtype)
    if numerics == "fused" and dtype in (torch.bfloat16, torch.float16):
        return "<=1 ulp"
    return f"<={HEAD_RELATIVE_BOUND[(numerics, dtype)]:.2g} x head max"


def _compare_heads(
    out: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype, numerics: str, bitwise: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """One piece of :func:`compare`: heads ``[n, D]`` of ``out`` and of the float64 ``exact``.
    Returns float64 ``[max_abs, max_rel, max_ulp, ratio]`` and int64 ``[bad, nonfinite]`` as
    tensors on the heads' device (no host synchronisation per piece)."""
    exact64 = exact.to(torch.float64)
    out64 = out.to(torch.float64)
    nonfinite = (~torch.isfinite(out64)).sum()
    head_max = exact64.abs().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    err = (out64 - exact64).abs()
    del out64
    err = torch.where(torch.isfinite(err), err, torch.full_like(err, float("inf")))
    rel = err / head_max
    zero = torch.zeros((), dtype=torch.float64, device=out.device)
    max_ulp = zero
    if dtype in FP8_MAX:  # the store saturates: compare with the clamped value
        top = FP8_MAX[dtype]
        exact64 = torch.where(exact64.isnan(), exact64, exact64.clamp(-top, top))
    ulp = None
    if dtype in (torch.bfloat16, torch.float16, *FP8_MAX):
        nearest = round_nearest(exact64, dtype)
        ulp = (ordered_bits(out) - ordered_bits(nearest)).abs()
        max_ulp = ulp.max().to(torch.float64)
    ratio = zero
    if bitwise:
        ok = err == 0
    elif dtype in FP8_MAX:
        assert ulp is not None
        ok = ulp <= 1
        ratio_each = ulp.to(torch.float64)
        if numerics == "unfused":
            ok = ok | (rel <= FP8_UNFUSED_RELATIVE_BOUND)
            ratio_each = torch.minimum(ratio_each, rel / FP8_UNFUSED_RELATIVE_BOUND)
        ratio = ratio_each.max()
    elif numerics == "fused" and dtype in (torch.bfloat16, torch.float16):
        assert ulp is not None
        ok = (ulp <= 1) | (rel <= COMPUTE_FLOOR)
        # an element passes on either bound: its ratio is the kinder of the two
        ratio = torch.minimum(ulp.to(torch.float64), rel / COMPUTE_FLOOR).max()
    else:
        ok = rel <= HEAD_RELATIVE_BOUND[(numerics, dtype)]
    stats = torch.stack([err.max(), rel.max(), max_ulp, ratio.to(torch.float64)])
    counts = torch.stack([(~ok).sum(), nonfinite]).to(torch.int64)
    return stats, counts


# The tolerance kinds an output of a prologue variant is held to (``Variant.tolerance``): the
# contract above for computed values, bit for bit for copies. A new kind (FP8, cache contents)
# is one entry here, a function with :func:`compare`'s signature.
TOLERANCE_KINDS = {
    "contract": lambda out, exact, *, head_dim, numerics: compare(
        out, exact, head_dim=head_dim, numerics=numerics
    ),
    "bitwise": lambda out, exact, *, head_dim, numerics: compare(
        out, exact, head_dim=head_dim, bitwise=True
    ),
}


def compare_kind(
    kind: str, out: torch.Tensor, exact: torch.Tensor, *, head_dim: int, numerics: str = "fused"
) -> Comparison:
    """Compare one output with its expectation under the tolerance ``kind``
    (:data:`TOLERANCE_KINDS`)."""
    rule = lookup(TOLERANCE_KINDS, kind, "tolerance kind")
    return rule(out, exact, head_dim=head_dim, numerics=numerics)


def kind_text(kind: str, numerics: str, dtype: torch.dtype) -> str:
    """The manifest's text for an output held to ``kind``."""
    return (
        tolerance_text(numerics, dtype)
        if kind == "contract"
        else {"bitwise": "bit-exact"}.get(kind, kind)
    )


# ---------------------------------------------------------------- byte-layout cache entries


@dataclass
class EntryComparison:
    """A byte-layout cache (``fp8_ds_mla``) against its float64 expectation, part by part
    (:func:`compare_ds_mla_entry`): each written part's :class:`Comparison`, and whether every
    entry no slot names kept its bytes."""

    parts: dict[str, Comparison]
    untouched_equal: bool

    @property
    def passed(self) -> bool:
        return self.untouched_equal and all(c.passed for c in self.parts.values())


def _float32_scales(
    out: torch.Tensor,
    exact: torch.Tensor,
    bound: float = HEAD_RELATIVE_BOUND[("fused", torch.float32)],
) -> Comparison:
    """float32 scales against float64 under the fp32 contract, relative to each scale:
    ``|err| <= 2^-16 * |exact|`` (``bound``). A scale is a tile's max over values the kernel
    computes in fp32 (a norm's ``x * rsqrt(mean(x^2) + eps) * w``: a sum of squares and an
    rsqrt away from float64), so it lands a few fp32 ULPs from the float64 one, not one."""
    exact64 = exact.to(torch.float64)
    err = (out.to(torch.float64) - exact64).abs()
    err = torch.where(torch.isfinite(err), err, torch.full_like(err, float("inf")))
    rel = err / exact64.abs().clamp_min(torch.finfo(torch.float64).tiny)
    ulp = (ordered_bits(out) - ordered_bits(round_nearest(exact64, torch.float32))).abs()
    nonfinite = int((~torch.isfinite(out)).sum())
    bad = int((rel > bound).sum())
    max_rel = float(rel.max()) if rel.numel() else 0.0
    return Comparison(
        int(ulp.max()) if ulp.numel() else 0,
        float(err.max()) if err.numel() else 0.0,
        max_rel,
        bad,
        nonfinite,
        bad == 0 and nonfinite == 0,
        f"<={bound:.2g} x scale",
        max_rel / bound,
    )


def compare_ds_mla_entry(
    out: torch.Tensor, original: torch.Tensor, expected, *, rope_dtype: torch.dtype
) -> EntryComparison:
    """Decode the ``uint8`` ``fp8_ds_mla`` cache ``out [blocks, block_size, entry]`` and hold
    each part of the written entries to the contract against ``expected`` (a
    :class:`fqr.reference.DsMlaEntry`: float64 ``values``, ``scales``, ``rope``, ``written``,
    ``tile``, ``scale_offset``, ``rope_offset``):

    * ``values`` (bytes ``[0, L)``, E4M3): within 1 E4M3 ULP of the float64 value divided by
      the float64 tile scale, clamped to +-448, correctly rounded;
    * ``scales`` (``L / tile`` float32 at ``scale_offset``): the fp32 contract, ``|err| <=
      2^-16 * scale`` against the float64 ``max(amax / 448, FLT_MIN)`` (not 1 fp32 ULP: the
      tile's max is taken over fp32 norm outputs, a few ULPs from float64 in the reference
      backend as in a kernel; the E4M3 values above absorb that difference);
    * ``rope`` (``R`` ``rope_dtype`` values at ``rope_offset``): the 16-bit ``fused`` contract
      (1 ULP, or the fp32 compute floor of the head);
    * every entry ``expected.written`` does not mark equals ``original``'s bytes.
    """
    out, original = out.detach(), original.detach().to(out.device)  # compared where out is
    written = expected.written.to(out.device)
    rows = out[written]  # [n, entry] bytes of the written entries
    n, width = expected.values.shape[-1], expected.rope.shape[-1]
    tiles = expected.scales.shape[-1]
    size = torch.empty(0, dtype=rope_dtype).element_size()

    def decode(start: int, count: int, dtype: torch.dtype) -> torch.Tensor:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        raw = rows[:, start : start + count * itemsize].contiguous()
        return raw.view(dtype).reshape(rows.shape[0], count)

    values = decode(0, n, torch.float8_e4m3fn)
    scales = decode(expected.scale_offset, tiles, torch.float32)
    rope = decode(expected.rope_offset, width, rope_dtype)
    assert expected.rope_offset + width * size <= out.shape[-1]
    parts = {
        "values": compare(values, expected.values.to(out.device)[written], head_dim=expected.tile),
        "scales": _float32_scales(scales, expected.scales.to(out.device)[written]),
        "rope": compare(rope, expected.rope.to(out.device)[written], head_dim=width),
    }
    untouched = bool(torch.equal(out[~written], original[~written]))
    return EntryComparison(parts, untouched)


def compare_packed_ds_mla(
    out: torch.Tensor, packed: torch.Tensor, *, rope_dim: int, numerics: str = "fused"
) -> Comparison:
    """The tolerance kind ``fp8-ds-mla``: the ``uint8`` ``fp8_ds_mla`` cache ``out [blocks,
    block_size, L + 4*L/128 + 2*R]`` against its float64 expectation packed as one tensor
    ``[blocks, block_size, L + L/128 + R + 1]`` (:meth:`fqr.reference.DsMlaEntry.packed`:
    values, scales and rope of each entry, then where the call wrote it the code of the rope's
    dtype, 1 bf16 or 2 fp16). Written entries are
    held part by part as :func:`compare_ds_mla_entry` holds them (``unfused``: the tile's max
    is taken over the model-dtype norm outputs, so the scale gets the unfused bound); every
    other entry must decode to exactly what it held before (the expectation holds the cache's
    own decoded values there). One :class:`Comparison`: the worst part's."""
    tile = 128
    width = packed.shape[-1] - 1 - rope_dim
    n = width * tile // (tile + 1)
    tiles = n // tile
    out = out.detach()
    packed = packed.to(out.device)  # compared where out is
    codes = packed[..., -1]
    written = codes != 0
    # the entry's rope part is the 16-bit model dtype (vLLM's), named by the written code
    # (fqr.reference.DS_MLA_ROPE_CODES: 1 bf16, 2 fp16)
    rope_dtype = torch.float16 if bool((codes == 2).any()) else torch.bfloat16
    size = 2

    def decode(start: int, count: int, dtype: torch.dtype) -> torch.Tensor:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        raw = out[..., start : start + count * itemsize].contiguous()
        return raw.view(dtype).to(torch.float64)

    values = decode(0, n, torch.float8_e4m3fn)
    scales = decode(n, tiles, torch.float32)
    rope = decode(n + 4 * tiles, rope_dim, rope_dtype)
    assert n + 4 * tiles + rope_dim * size == out.shape[-1], "not an fp8_ds_mla entry"
    got = torch.cat([values, scales, rope], dim=-1)
    want = packed[..., :-1].to(torch.float64)
    # entries not written: exactly what they held (NaN where NaN)
    same = (got == want) | (got.isnan() & want.isnan())
    untouched_bad = int((~same[~written]).sum())
    contract = contract_of(numerics)
    parts = [
        compare(
            values[written].to(torch.float8_e4m3fn),
            want[written][:, :n],
            head_dim=tile,
            numerics=contract,
        ),
        _float32_scales(
            scales[written].to(torch.float32),
            want[written][:, n : n + tiles],
            HEAD_RELATIVE_BOUND[(contract, torch.float32 if contract == "fused" else rope_dtype)],
        ),
        compare(
            rope[written].to(rope_dtype),
            want[written][:, n + tiles :],
            head_dim=rope_dim,
            numerics=contract,
        ),
    ]
    worst = max(parts, key=lambda c: (not c.passed, c.error_ratio or 0.0))
    bad = sum(c.bad for c in parts) + untouched_bad
    nonfinite = sum(c.nonfinite for c in parts)
    return Comparison(
        worst.max_ulp,
        worst.max_abs,
        worst.max_rel_head,
        bad,
        nonfinite,
        bad == 0 and nonfinite == 0,
        "fp8_ds_mla: values <=1 e4m3 ulp, scales fp32 contract, rope 16-bit contract; "
        "unwritten entries unchanged",
        worst.error_ratio,
    )


TOLERANCE_KINDS["fp8-ds-mla"] = lambda out, exact, *, head_dim, numerics: compare_packed_ds_mla(
    out, exact, rope_dim=head_dim, numerics=numerics
)
# A per-tensor FP8 cache held as vLLM allocates it, uint8 bytes of E4M3 values: compared as the
# E4M3 values it holds (the contract's FP8 rule).
TOLERANCE_KINDS["fp8-e4m3-bytes"] = lambda out, exact, *, head_dim, numerics: compare(
    out.view(torch.float8_e4m3fn) if out.dtype == torch.uint8 else out,
    exact,
    head_dim=head_dim,
    numerics=numerics,
)
# ... and E5M2 bytes (vLLM's fp8_e5m2 cache, uint8) as the E5M2 values they hold
TOLERANCE_KINDS["fp8-e5m2-bytes"] = lambda out, exact, *, head_dim, numerics: compare(
    out.view(torch.float8_e5m2) if out.dtype == torch.uint8 else out,
    exact,
    head_dim=head_dim,
    numerics=numerics,
)
