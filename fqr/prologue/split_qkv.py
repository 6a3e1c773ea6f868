"""``split_qkv_rmsnorm_rope``: split vLLM's packed QKV row, RMS-normalise q and k, rotate them.

The composition (:func:`attention_prologue`) is ``split_qkv`` -> ``rms_norm`` of q and of k (per
head, over the whole width as OLMo2, or none) -> ``rope`` of both; v is a copy. Its float64
reference is :func:`fqr.reference.prologue`. The declaration below derives the public function
(``fqr.split_qkv_rmsnorm_rope``), its checks and fast path, and ``torch.ops.fqr.
split_qkv_rmsnorm_rope``; the variant ``split-qkv`` binds the presets to it (:mod:`.variant`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .. import ops, reference
from ..core import Aval
from ..peers import vllm_prologue
from ..validate import (
    NORM_KINDS,
    check_norm_stats,
    check_out_buffers,
    check_positive_int,
    check_tensor,
    check_unit_stride,
)
from . import params
from .blocks import norm_then_rope
from .declare import (
    BACKEND,
    Call,
    Form,
    Output,
    Rows,
    Static,
    Tensor,
    TensorKind,
    choice,
    declare,
    flag,
    numerics,
    optional_positive_int,
)
from .projected import projected
from .variant import CaseSpec, Variant, draw_row, register_variant, row_chain


@dataclass(frozen=True)
class NormStats:
    """All-reduced statistics of a full-width norm whose q/k width is split over TP ranks.

    ``q_sum_sq``/``k_sum_sq``: float32 ``[T]`` sums of squares over the whole (unsharded) q/k
    projection; ``q_count``/``k_count``: the unsharded widths (``total_heads * head_dim``).
    """

    q_sum_sq: torch.Tensor
    k_sum_sq: torch.Tensor
    q_count: int
    k_count: int


# ------------------------------------------------------------------------ the composition


def attention_prologue(
    qkv,
    positions,
    cos_sin_cache,
    q_weight,
    k_weight,
    q_bias,
    k_bias,
    q_sum_sq,
    k_sum_sq,
    *,
    num_heads,
    num_kv_heads,
    head_dim,
    eps,
    is_neox,
    weight_offset,
    norm,
    numerics,
    q_count=None,
    k_count=None,
    num_v_heads=None,
    v_head_dim=None,
    head_stride=None,
    qkv_layout="qkv",
    with_v=True,
):
    """Split the packed row, then norm + RoPE q and k (traced into one program); without a
    ``cos_sin_cache`` no RoPE; ``with_v=False`` returns ``(q, k)`` only (the in-place form,
    where v stays where it is in the packed row)."""
    q, k, v = ops.split_qkv(
        qkv,
        num_heads,
        num_kv_heads,
        head_dim,
        num_v_heads=num_v_heads,
        v_head_dim=v_head_dim,
        head_stride=head_stride,
        layout=qkv_layout,
    )
    groups = {
        "none": None,
        "head": (head_dim, head_dim),
        "full": (num_heads * head_dim, num_kv_heads * head_dim),
    }[norm]
    q, k = norm_then_rope(
        q,
        k,
        positions,
        cos_sin_cache,
        (q_weight, k_weight),
        (q_bias, k_bias),
        groups=groups,
        sums=(q_sum_sq, k_sum_sq),
        counts=(q_count, k_count),
        head_dim=head_dim,
        eps=eps,
        is_neox=is_neox,
        weight_offset=weight_offset,
        numerics=numerics,
        full_norm=norm == "full",
    )
    return (q, k, v) if with_v else (q, k)


# --------------------------------------------------------------------------- the checks


def _v_heads(call: Call) -> tuple[int, int]:
    hv = call.num_kv_heads if call.num_v_heads is None else call.num_v_heads
    dv = call.head_dim if call.v_head_dim is None else call.v_head_dim
    return hv, dv


def packed_width(call: Call) -> tuple[int, str]:
    """The width of the packed row the layout arguments describe, and how it is made."""
    hq, hkv, d = call.num_heads, call.num_kv_heads, call.head_dim
    hv, dv = _v_heads(call)
    if call.head_stride is not None:
        s = call.head_stride
        width = (hq + hkv + hv) * s
        return width, (
            f"(num_heads + num_kv_heads + num_v_heads) * head_stride = "
            f"({hq} + {hkv} + {hv}) * {s} = {width}"
        )
    if call.num_v_heads is None and call.v_head_dim is None:
        return params.qkv_width(call)
    width = (hq + hkv) * d + hv * dv
    return width, (
        f"num_heads*head_dim + num_kv_heads*head_dim + num_v_heads*v_head_dim = "
        f"{hq}*{d} + {hkv}*{d} + {hv}*{dv} = {width}"
    )


def _layout(call: Call) -> None:
    """Head counts, the padded layout's stride, the in-place form's needs, a checkpoint's own
    row layout (``qkv_layout``)."""
    params.heads_divide(call)
    if call.qkv_layout != "qkv":
        params.layout_fits(call)
        for name in ("num_v_heads", "v_head_dim", "head_stride"):
            if getattr(call, name) is not None:
                raise ValueError(
                    f"{name} must be None with qkv_layout={call.qkv_layout!r} (v's heads are "
                    "k's, back to back within their group)"
                )
        if call.inplace:
            raise ValueError(
                f"inplace=True needs qkv_layout='qkv' (q and k as contiguous blocks of the row), "
                f"got {call.qkv_layout!r}"
            )
    if call.head_stride is not None:
        check_positive_int("head_stride", call.head_stride)
        if call.head_stride < max(call.head_dim, _v_heads(call)[1]):
            raise ValueError(
                f"head_stride {call.head_stride} is smaller than a head "
                f"(head_dim {call.head_dim}, v_head_dim {_v_heads(call)[1]})"
            )
        if call.inplace:
            raise ValueError(
                "inplace=True needs heads back to back (head_stride None): the in-place form "
                "writes q and k as contiguous blocks of the row"
            )


def _norm_lengths(call: Call, which: str) -> int:
    if call.norm == "head":
        return call.head_dim
    return (call.num_heads if which == "q" else call.num_kv_heads) * call.head_dim


def _norm_what(call: Call) -> str:
    return "head_dim" if call.norm == "head" else "the full q/k width"


def _presence(call: Call) -> None:
    """Weights with a norm (biases optional, together), nothing without one; positions with a
    table."""
    for name in ("q_weight", "k_weight", "q_bias", "k_bias"):
        t = getattr(call, name)
        if call.norm == "none":
            if t is not None:
                raise ValueError(f"{name} must be None when norm='none'")
        elif t is None and name.endswith("weight"):
            raise ValueError(f"{name} is required when norm={call.norm!r}")
    params.biases_together(call)
    if call.cos_sin_cache is not None and call.positions is None:
        raise ValueError("positions is required with a cos_sin_cache (None only without RoPE)")
    if call.norm_stats is not None and call.norm != "full":
        raise ValueError("norm_stats is only meaningful with norm='full'")


@dataclass(frozen=True)
class Stats(TensorKind):
    """``norm_stats``: a :class:`NormStats` (or anything with its fields) of a full-width norm
    sharded over TP ranks; gives the program its two ``[T]`` float32 sums, its counts join the
    program's statics (and the call's key)."""

    leading = "T"
    token_dim = 0

    def check(self, name, x, call):
        check_norm_stats(x)
        for which, t, count in (("q", x.q_sum_sq, x.q_count), ("k", x.k_sum_sq, x.k_count)):
            field = f"{name}.{which}_sum_sq"
            check_tensor(field, t)
            if t.dtype != torch.float32 or t.shape != (call._tokens,):
                raise ValueError(
                    f"{field} must be float32 [T={call._tokens}], got {t.dtype} {list(t.shape)}"
                )
            check_unit_stride(field, t)
            qkv = call.qkv
            if t.device != qkv.device:
                raise ValueError(f"{field} is on {t.device} but qkv is on {qkv.device}")
            local = _norm_lengths(call, which)
            if count < local:
                raise ValueError(
                    f"{name}.{which}_count {count} is smaller than the local width {local}"
                )

    def operands(self, x):
        return (x.q_sum_sq, x.k_sum_sq)

    def avals(self, x):
        return (Aval(("T",), torch.float32),) * 2

    def guard_tensors(self, x):
        return (x.q_sum_sq, x.k_sum_sq) if type(x) is NormStats else (x,)

    def key(self, x):
        return (type(x), x.q_count, x.k_count) if type(x) is NormStats else type(x)

    def guard_entries(self, x):
        return [(t, [None], [t.stride(0)], 0) for t in (x.q_sum_sq, x.k_sum_sq)]

    program_inputs = 2


def _program_statics(call: Call) -> dict:
    statics: dict = {}
    if call.inplace:
        statics["with_v"] = False
    if call.norm_stats is not None:
        statics.update(q_count=call.norm_stats.q_count, k_count=call.norm_stats.k_count)
    return statics


def _widths(call: Call) -> tuple[int, int, int]:
    hv, dv = _v_heads(call)
    return call.num_heads * call.head_dim, call.num_kv_heads * call.head_dim, hv * dv


def _out(call: Call) -> list | None:
    if call.out is not None:
        return list(call.out)
    if call.inplace:  # q and k written back where they were read
        q_size, kv_size, _ = _widths(call)
        return [call.qkv[:, :q_size], call.qkv[:, q_size : q_size + kv_size]]
    return None


def _writes(call: Call) -> list:
    """The caller's memory the call writes: the ``out=`` buffers, or qkv (``inplace``)."""
    if call.out is not None:
        return [(f"out[{i}] ({n})", b) for i, (n, b) in enumerate(zip("qkv", call.out))]
    return [("qkv", call.qkv)] if call.inplace else []


def _returns(call: Call, outs: tuple):
    if call.inplace and call.out is None:  # outs: _out's views of q and k, written
        q_size, kv_size, _ = _widths(call)
        return (*outs, call.qkv[:, q_size + kv_size :])
    return tuple(outs)


def _inputs(call: Call) -> tuple:
    """The tensors the call reads (None where absent)."""
    names = ("qkv", "positions", "cos_sin_cache", "q_weight", "k_weight", "q_bias", "k_bias")
    return tuple(getattr(call, n) for n in names)


def _check_out(call: Call) -> None:
    if call.inplace:
        raise ValueError("out= and inplace=True both say where q and k go: give one")
    check_out_buffers(call.out, call.qkv, _widths(call), _inputs(call))


def _check_inplace_grad(call: Call) -> None:
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in _inputs(call)):
        raise ValueError(
            "inplace=True cannot write into qkv while an input requires grad (autograd "
            "needs the values it read); use inplace=False or torch.no_grad()"
        )


def _row_layout(name: str, *, doc: str, check=optional_positive_int) -> Static:
    """An optional int of the packed row's layout (None: vLLM's ``[q | k | v]`` of
    ``head_dim`` heads back to back): a layout of the public op's callers, not in the torch
    op."""
    return Static(
        name, None, torch_op=False, annotation="int | None", check=check, schema="int?", doc=doc
    )


# ----------------------------------------------------------------------- the declaration

SPLIT_QKV_RMSNORM_ROPE = declare(
    "split_qkv_rmsnorm_rope",
    attention_prologue,
    (
        replace(params.QKV, kind=Rows(width=packed_width)),
        Tensor(
            "positions",
            keyword=False,
            annotation=params.OPTIONAL_TENSOR,
            kind=type(params.POSITIONS.kind)(used=lambda call: call.cos_sin_cache is not None),
            optional=True,
            doc=params.POSITIONS.doc + " (None only without a cos_sin_cache)",
        ),
        Tensor(
            "cos_sin_cache",
            keyword=False,
            annotation=params.OPTIONAL_TENSOR,
            kind=params.COS_SIN_CACHE.kind,
            optional=True,
            doc=params.COS_SIN_CACHE.doc + "; None: a layer without RoPE (the norm alone)",
        ),
        *(
            Tensor(
                p.name,
                keyword=False,
                annotation=params.OPTIONAL_TENSOR,
                kind=type(p.kind)(
                    length=lambda call, w=p.name[0]: _norm_lengths(call, w), what=_norm_what
                ),
                optional=True,
                doc=f"RMSNorm weight of {p.name[0]}: ``[D]`` (norm='head'), ``[H*D]`` of its "
                "heads (norm='full'), None (norm='none'); contiguous, any floating dtype (it "
                "need not be qkv's)",
            )
            for p in (params.Q_WEIGHT, params.K_WEIGHT)
        ),
        params.NUM_HEADS,
        params.NUM_KV_HEADS,
        params.HEAD_DIM,
        params.EPS,
        params.IS_NEOX,
        *(
            Tensor(
                p.name,
                None,
                annotation=params.OPTIONAL_TENSOR,
                kind=type(p.kind)(
                    length=lambda call, w=p.name[0]: _norm_lengths(call, w), what=_norm_what
                ),
                optional=True,
                doc=p.doc,
            )
            for p in (params.Q_BIAS, params.K_BIAS)
        ),
        params.WEIGHT_OFFSET,
        Static(
            "norm",
            "head",
            annotation="str",
            check=choice(*NORM_KINDS),
            schema="str",
            doc="'head': per-head QK norm (Qwen3, Gemma 3); 'full': one norm over the whole q "
            "and the whole k (OLMo2); 'none': split + RoPE only (Llama 3, GLM-4)",
        ),
        Tensor(
            "norm_stats",
            None,
            annotation="NormStats | None",
            kind=Stats(),
            optional=True,
            torch_op=False,  # a graph passes the statistics' tensors through the public op
            doc="all-reduced statistics of a full-width norm sharded over TP ranks (fqr.NormStats)",
        ),
        _row_layout(
            "num_v_heads",
            doc="v's own head count (default num_kv_heads): the row is [q | k | v] with "
            "num_v_heads*v_head_dim columns of v",
        ),
        _row_layout("v_head_dim", doc="v's own head width (default head_dim)"),
        _row_layout(
            "head_stride",
            check=lambda name, v: None,  # the layout check names it (it reads head_dim too)
            doc="every head of the row starts head_stride >= head_dim columns after the previous "
            "one (a padded [T, heads, head_stride] layout; the padding is neither read nor "
            "written); the outputs are contiguous",
        ),
        numerics(),
        params.QKV_LAYOUT,
        Form(
            "inplace",
            False,
            annotation="bool",
            check=flag,
            doc="write q and k back into qkv where they were read (vLLM's in-place ops; nothing "
            "else of qkv is written) and return views (q, k, v) of qkv; needs heads back to back "
            "and no input that requires grad",
        ),
        BACKEND,
        Form(
            "out",
            None,
            annotation="tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None",
            keyed=False,
            doc="caller buffers (q, k, v) written instead of new tensors (as vLLM's kernels take "
            "their output buffers) and returned as given: [T, Hq*D], [T, Hkv*D], [T, Hv*Dv] in "
            "qkv's dtype on its device, unit stride in the last dim (rows may be strided), "
            "overlapping neither qkv nor each other",
        ),
    ),
    (Output("q"), Output("k"), Output("v", copy=True)),
    reference=reference.prologue,
    static_checks=(_layout, _presence),
    value_checks=(
        (lambda call: call.out is not None, _check_out),
        (lambda call: call.inplace and call.out is None, _check_inplace_grad),
    ),
    program_statics=_program_statics,
    out=_out,
    writes=_writes,
    returns=_returns,
    doc=f"""
    Split the packed QKV row, RMS-normalise q and k, rotate them; return new q, k, v.

    Math per head (see ``fqr.ops``): ``y = x * rsqrt(mean(x^2) + eps) * (weight_offset + w) + b``
    then RoPE on the first R features (R = the ``cos_sin_cache`` width); v is copied bit for bit.
    Returns contiguous ``q [T, Hq*D]``, ``k [T, Hkv*D]``, ``v [T, Hkv*D]`` in qkv's dtype. The
    reference it matches is :func:`fqr.reference.prologue`. ``numerics="fused"`` computes in fp32
    and rounds once at the store; ``"unfused"`` rounds where vLLM's native code and Hugging Face's
    Qwen3 / Gemma 3 modules round, bit for bit; ``"unfused-hf"`` as Hugging Face's code where it
    rounds otherwise than vLLM's (norms that multiply the weight in fp32: OLMo2's full-width
    norm, AFMoE's per-head ones; :mod:`fqr.numerics`).

    {params.EXAMPLE_HEADING}

        >>> import torch, fqr
        >>> preset = fqr.get_preset("qwen3-0.6b")  # 16 q heads, 8 kv heads, head_dim 128
        >>> table = preset.cos_sin_cache()  # [40960, 128] float32, vLLM's cos | sin layout
        >>> qkv = torch.randn(3, (16 + 2 * 8) * 128).to(torch.bfloat16)
        >>> w = torch.ones(128, dtype=torch.bfloat16)  # q_norm.weight / k_norm.weight, any float
        >>> q, k, v = fqr.split_qkv_rmsnorm_rope(
        ...     qkv, torch.tensor([0, 1, 2]), table, w, w, **preset.spec.kwargs()
        ... )  # spec.kwargs(): heads, head_dim, eps, is_neox, weight_offset, norm
        >>> q.shape, k.shape, v.shape
        (torch.Size([3, 2048]), torch.Size([3, 1024]), torch.Size([3, 1024]))
        >>> torch.equal(v, qkv[:, 3072:])  # v is copied bit for bit
        True
    """,
)
# the same op from the hidden states: x @ w_qkv.T, then this prologue (.projected)
SPLIT_QKV_RMSNORM_ROPE_PROJ = projected(
    SPLIT_QKV_RMSNORM_ROPE,
    f"""{params.EXAMPLE_WITH_TABLE}
        >>> x = torch.randn(2, 96, dtype=torch.float32)  # hidden states, K = 96
        >>> w_qkv = torch.randn((4 + 2 * 2) * 64, 96) / 96**0.5  # 4 q heads, 2 kv heads of 64
        >>> w = torch.ones(64)
        >>> q, k, v = fqr.split_qkv_rmsnorm_rope_proj(
        ...     x, w_qkv, torch.tensor([0, 7]), table, w, w, num_heads=4, num_kv_heads=2,
        ...     head_dim=64,
        ... )
        >>> q2, k2, v2 = fqr.split_qkv_rmsnorm_rope(  # fp32: the same row, the same values
        ...     x @ w_qkv.T, torch.tensor([0, 7]), table, w, w, num_heads=4, num_kv_heads=2,
        ...     head_dim=64,
        ... )
        >>> torch.equal(q, q2), torch.equal(k, k2), torch.equal(v, v2)
        (True, True, True)""",
)

split_qkv_rmsnorm_rope = SPLIT_QKV_RMSNORM_ROPE.function


# --------------------------------------------------------------------- the golden cases

POS_2_18 = 1 << 18
# Every preset; bf16/fp16/fp32; T = 1, 7, 257 (TP-sharded views keep the 257-token cases
# small); bias; NeoX and GPT-J; partial rotary (glm4); (1+w) (gemma3); full-width norm (olmo2,
# also sharded with all-reduced statistics); no norm (llama3, glm4); fused and unfused
# numerics; positions up to 2^18; int32 positions; row stride > width.
CASES: tuple[CaseSpec, ...] = (
    CaseSpec("qwen3-0.6b", "bf16", 7),
    CaseSpec("qwen3-0.6b", "fp16", 7, bias=True),
    CaseSpec("qwen3-0.6b", "fp32", 7),
    CaseSpec("qwen3-0.6b", "bf16", 257, "unfused", tp=8),
    CaseSpec("qwen3-8b", "bf16", 1),
    CaseSpec("qwen3-8b", "bf16", 257, tp=8, positions_dtype="int32", row_pad=64),
    CaseSpec("qwen3-8b", "fp16", 7, "unfused"),
    CaseSpec("qwen3-32b", "bf16", 7, tp=8, bias=True, is_neox=False),
    CaseSpec("qwen3-30b-a3b", "fp16", 257, tp=8),
    CaseSpec("qwen3-235b-a22b", "bf16", 7, tp=8, bias=True),
    CaseSpec("gemma3-1b", "bf16", 7),
    CaseSpec("gemma3-1b", "fp32", 257, tp=2, max_position=POS_2_18),
    CaseSpec("gemma3-27b", "bf16", 257, "unfused", tp=16),
    CaseSpec("gemma3-27b", "fp16", 1),
    CaseSpec("olmo2-7b", "bf16", 7),
    CaseSpec("olmo2-7b", "fp16", 7, bias=True, row_pad=32),
    CaseSpec("olmo2-7b", "fp32", 1, "unfused"),
    CaseSpec("olmo2-7b", "bf16", 7, tp=4),
    CaseSpec("llama3-8b", "bf16", 7, max_position=POS_2_18),
    CaseSpec("llama3-8b", "fp16", 257, "unfused", tp=8),
    CaseSpec("llama3-8b", "fp32", 1),
    CaseSpec("glm4-9b", "bf16", 7),
    CaseSpec("glm4-9b", "bf16", 257, tp=8, max_position=POS_2_18, positions_dtype="int32"),
    CaseSpec("glm4-9b", "fp16", 7, "unfused"),
)
# The peer layouts and forms (fqr.golden.PEER_FORMS): a layer without RoPE, v with its own heads,
# padded heads, the in-place form.
PEER_CASES: tuple[CaseSpec, ...] = (
    CaseSpec("qwen3-0.6b", "bf16", 7, tp=4, peer="nope"),
    CaseSpec("gemma3-1b", "fp16", 1, "unfused", peer="nope"),
    CaseSpec("qwen3-0.6b", "bf16", 7, tp=2, peer="vheads"),
    CaseSpec("qwen3-8b", "fp16", 7, tp=8, row_pad=8, peer="padded"),
    CaseSpec("qwen3-0.6b", "bf16", 7, tp=4, row_pad=16, peer="inplace"),
    # partial rotary and GPT-J pairs written in place
    CaseSpec("glm4-9b", "bf16", 1, "unfused", tp=8, peer="inplace"),
)
# The projected form (split_qkv_rmsnorm_rope_proj, CaseSpec.hidden: x's features K): one
# kernel from the hidden states, small (K <= 256, the few heads of a wide TP view), fused only;
# the projection's bias, K not a power of two, NeoX and GPT-J, partial rotary (glm4), norm bias,
# (1 + w) (gemma3), full-width norm (olmo2), no norm (llama3), bf16/fp16/fp32.
PROJECTED_CASES: tuple[CaseSpec, ...] = (
    CaseSpec("qwen3-0.6b", "bf16", 7, tp=16, hidden=200, qkv_bias=True),
    CaseSpec("qwen3-8b", "fp16", 1, tp=16, hidden=80),
    CaseSpec("qwen3-32b", "bf16", 5, tp=16, bias=True, is_neox=False, hidden=96),
    CaseSpec("gemma3-1b", "fp32", 3, tp=4, hidden=80),
    CaseSpec("olmo2-7b", "bf16", 5, tp=16, hidden=128),
    CaseSpec("llama3-8b", "bf16", 7, tp=16, max_position=POS_2_18, hidden=256),
    CaseSpec("glm4-9b", "fp16", 3, tp=16, hidden=200, qkv_bias=True),
)


# ------------------------------------------------------------------------- the variant


def _sharded_stats(preset, inputs: dict) -> dict:
    """A full-width norm at tp > 1 takes the all-reduced sums of squares (:class:`NormStats`)."""
    if preset.spec.norm != "full":
        return inputs
    tokens, d = inputs["qkv"].shape[0], preset.head_dim
    sums = torch.ones(tokens, device=inputs["qkv"].device)
    stats = NormStats(sums, sums, preset.total_heads * d, preset.total_kv_heads * d)
    return dict(inputs, norm_stats=stats)


SPLIT_QKV = register_variant(
    Variant(
        "split-qkv",
        SPLIT_QKV_RMSNORM_ROPE,
        kwargs=lambda preset: preset.spec.kwargs(),
        draw_inputs=draw_row,
        eager_chain=row_chain(vllm_prologue),
        has_bias=True,
        sharded_stats=_sharded_stats,
        golden=CASES + PEER_CASES + PROJECTED_CASES,
    )
)
