"""The lowering knows no op: generalised splits, a new op defined here, narrow rotary tables and
strided outputs, each run on the reference interpreter and as the interpreted kernel against an
independent float64 computation (plain index arithmetic + fqr.golden's exact formulas), on fresh
random inputs, real RoPE tables and NaN-poisoned outputs."""

from __future__ import annotations

import pytest
import torch
from conftest import real_table
from support.programs import check_outputs, check_reference_and_kernel

import fqr
from fqr import ops
from fqr.backends import BACKENDS
from fqr.core import HeadOp, Primitive, Role, Section, spec
from fqr.golden import exact_rms_norm, exact_rope
from fqr.lowering import kernel_source, lower
from fqr.lowering.plan import Layout, PlanError, plan_program

needs_interpreter = pytest.mark.skipif(
    not BACKENDS["interpret"].available, reason=BACKENDS["interpret"].unavailable_reason() or ""
)
MAX_POS = 4099


def randn(gen, *shape, scale=1.0, centre=0.0, dtype=torch.bfloat16):
    x = torch.randn(*shape, generator=gen, dtype=torch.float64) * scale + centre
    return x.to(dtype)


def positions(gen, tokens):
    return torch.randint(0, MAX_POS, (tokens,), generator=gen)


def norm64(x, w, d, offset=0.0):
    return exact_rms_norm(x, w, eps=1e-6, group_size=d, weight_offset=offset)


def act(width, dtype=torch.bfloat16):
    return spec("T", width, dtype=dtype)


POS = spec("T", dtype=torch.int64)


def table_spec(rotary_dim):
    return spec("P", rotary_dim, dtype=torch.float32)


# ----------------------------------------------------------------------- generalised splits


@needs_interpreter
def test_gate_interleaved_split_qwen35_style(gen):
    """[q0 g0 q1 g1 q2 g2 | k | v]: q and the gate are views of head stride 2*D; q and k get
    Gemma-style (1 + w) norms and partial NeoX RoPE, the gate and v are copied."""
    hq, hkv, d, r, t = 3, 1, 64, 16, 7

    def gated(row, pos, cache, qw, kw):
        q, gate, k, v = ops.split_heads(
            row,
            [
                Section(hq, d, 0, 2 * d),
                Section(hq, d, d, 2 * d),
                Section(hkv, d, 2 * hq * d),
                Section(hkv, d, (2 * hq + hkv) * d),
            ],
        )
        q = ops.rms_norm(q, qw, eps=1e-6, group_size=d, weight_offset=1.0)
        k = ops.rms_norm(k, kw, eps=1e-6, group_size=d, weight_offset=1.0)
        return ops.rope(q, pos, cache, head_dim=d), gate, ops.rope(k, pos, cache, head_dim=d), v

    width = (2 * hq + 2 * hkv) * d
    program = fqr.trace(gated, act(width), POS, table_spec(r), spec(d), spec(d))
    row, pos, cache = (
        randn(gen, t, width, scale=2.0),
        positions(gen, t),
        real_table(r, MAX_POS, 1e6),
    )
    qw, kw = randn(gen, d, scale=0.2), randn(gen, d, scale=0.2)
    pairs = row[:, : 2 * hq * d].reshape(t, hq, 2, d)
    q_in, gate = pairs[:, :, 0].reshape(t, -1), pairs[:, :, 1].reshape(t, -1)
    k_in, v = row[:, 2 * hq * d : (2 * hq + hkv) * d], row[:, (2 * hq + hkv) * d :]
    expected = [
        exact_rope(norm64(q_in, qw, d, 1.0), pos, cache, head_dim=d),
        gate,
        exact_rope(norm64(k_in, kw, d, 1.0), pos, cache, head_dim=d),
        v,
    ]
    kernel = check_reference_and_kernel(
        program, (row, pos, cache, qw, kw), expected, [d] * 4, copies=(1, 3)
    )
    assert "head stride 128" in kernel.source and "(row0 + 0 + hh * 128)" in kernel.source
    assert "(row1 + 64 + hh * 128)" in kernel.source  # the gate: offset D, stride 2*D


@needs_interpreter
def test_sections_with_different_head_dims_and_tables(gen):
    """MiniMax-M3-like row [q | k | v | index_q | index_k]: the indexer heads have their own
    head_dim (32 vs 64), their own (1 + w) norms and their own GPT-J table."""
    hq, hkv, d, hi, di, r, ri, t = 3, 1, 64, 2, 32, 64, 16, 6
    widths = [hq * d, hkv * d, hkv * d, hi * di, di]
    offsets = [sum(widths[:i]) for i in range(5)]

    def indexed(row, pos, cache, icache, qw, kw, iqw, ikw):
        q, k, v, iq, ik = ops.split_heads(
            row,
            [
                Section(hq, d, offsets[0]),
                Section(hkv, d, offsets[1]),
                Section(hkv, d, offsets[2]),
                Section(hi, di, offsets[3]),
                Section(1, di, offsets[4]),
            ],
        )
        q = ops.rope(ops.rms_norm(q, qw, eps=1e-6, group_size=d), pos, cache, head_dim=d)
        k = ops.rope(ops.rms_norm(k, kw, eps=1e-6, group_size=d), pos, cache, head_dim=d)
        iq = ops.rms_norm(iq, iqw, eps=1e-6, group_size=di, weight_offset=1.0)
        ik = ops.rms_norm(ik, ikw, eps=1e-6, group_size=di, weight_offset=1.0)
        iq = ops.rope(iq, pos, icache, head_dim=di, is_neox=False)
        ik = ops.rope(ik, pos, icache, head_dim=di, is_neox=False)
        return q, k, v, iq, ik

    program = fqr.trace(
        indexed,
        act(sum(widths)),
        POS,
        table_spec(r),
        table_spec(ri),
        spec(d),
        spec(d),
        spec(di),
        spec(di),
    )
    row = randn(gen, t, sum(widths), scale=2.0)
    pos = positions(gen, t)
    cache, icache = real_table(r, MAX_POS, 1e6), real_table(ri, MAX_POS, 1e4)
    qw, kw = randn(gen, d, scale=0.2, centre=1.0), randn(gen, d, scale=0.2, centre=1.0)
    iqw, ikw = randn(gen, di, scale=0.2), randn(gen, di, scale=0.2)
    part = [row[:, a : a + w] for a, w in zip(offsets, widths)]
    expected = [
        exact_rope(norm64(part[0], qw, d), pos, cache, head_dim=d),
        exact_rope(norm64(part[1], kw, d), pos, cache, head_dim=d),
        part[2],
        exact_rope(norm64(part[3], iqw, di, 1.0), pos, icache, head_dim=di, is_neox=False),
        exact_rope(norm64(part[4], ikw, di, 1.0), pos, icache, head_dim=di, is_neox=False),
    ]
    plan = plan_program(program)
    assert [(c.heads, c.head_dim, c.head_layout.tag) for c in plan.chains] == [
        (3, 64, "neox64"),
        (1, 64, "neox64"),
        (1, 64, "plain"),
        (2, 32, "gptj16"),
        (1, 32, "gptj16"),
    ]
    check_reference_and_kernel(
        program,
        (row, pos, cache, icache, qw, kw, iqw, ikw),
        expected,
        [d, d, d, di, di],
        copies=(2,),
    )


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kv_with_different_head_counts_in_padded_heads(gen, dtype):
    """q 4, k 2, v 3 heads of 48 features, each head padded to 64 columns ([T, H, D + pad]);
    the padding holds NaN, so a kernel that read it would fail."""
    heads, d, stride, r, t = (4, 2, 3), 48, 64, 32, 9
    offsets = [0, heads[0] * stride, (heads[0] + heads[1]) * stride]

    def padded(row, pos, cache, qw, kw):
        q, k, v = ops.split_heads(
            row, [Section(h, d, off, stride) for h, off in zip(heads, offsets)]
        )
        q = ops.rope(ops.rms_norm(q, qw, eps=1e-6, group_size=d), pos, cache, head_dim=d)
        k = ops.rope(ops.rms_norm(k, kw, eps=1e-6, group_size=d), pos, cache, head_dim=d)
        return q, k, v

    width = sum(heads) * stride
    program = fqr.trace(padded, act(width, dtype), POS, table_spec(r), spec(d, dtype=dtype),
                        spec(d, dtype=dtype))  # fmt: skip
    full = randn(gen, t, sum(heads), stride, scale=2.0, dtype=dtype)
    full[..., d:] = float("nan")
    row = full.reshape(t, width)
    pos, cache = positions(gen, t), real_table(r, MAX_POS, 1e6)
    qw, kw = (randn(gen, d, scale=0.2, centre=1.0, dtype=dtype) for _ in range(2))
    q_in, k_in, v = (
        full[:, a : a + h, :d].reshape(t, -1)
        for a, h in zip((0, heads[0], heads[0] + heads[1]), heads)
    )
    expected = [
        exact_rope(norm64(q_in, qw, d), pos, cache, head_dim=d),
        exact_rope(norm64(k_in, kw, d), pos, cache, head_dim=d),
        v,
    ]
    check_reference_and_kernel(program, (row, pos, cache, qw, kw), expected, [d] * 3, copies=(2,))


# ----------------------------------------------------------------------- an op defined here

scale_heads_p = Primitive("scale_heads")  # not registered: fqr itself never sees this op


def scale_heads(x, w, s):
    """``y[t, h, i] = x[t, h, i] * w[i] * s[t]`` (a per-head vector and a per-token scale)."""
    return scale_heads_p.bind(x, w, s)


@scale_heads_p.def_abstract
def _scale_abstract(x, w, s):
    return x


@scale_heads_p.def_impl
def _scale_impl(x, w, s):
    d = w.shape[0]
    return (x.reshape(x.shape[0], -1, d) * w * s[:, None, None]).reshape(x.shape)


@scale_heads_p.def_facts
def _scale_facts(x, w, s):
    return HeadOp((Role.VALUE, Role.HEAD_VECTOR, Role.TOKEN_VALUE), head_dim=w.shape[0])


@scale_heads_p.def_lowering
def _scale_lowering(b, eqn):
    x, w, s = eqn.inputs
    wp, sv = b.vector(w, Role.HEAD_VECTOR), b.token_values(s)
    out = {}
    for name, v in b.pieces(x).items():
        out[name] = b.fresh("scaled")
        b.emit(f"{out[name]} = {v} * {wp[name]} * {sv}[:, None, None]")
    b.set(eqn.outputs[0], out)


@needs_interpreter
def test_an_op_defined_outside_fqr_is_planned_and_emitted_from_its_rules(gen):
    """A new op is its rules: nothing in fqr/lowering names it, and it fuses with the others."""
    d, r, t = 64, 64, 6

    def composition(row, pos, cache, w, s):
        q, k, v = ops.split_qkv(row, 2, 1, d)
        return ops.rope(scale_heads(q, w, s), pos, cache, head_dim=d), scale_heads(k, w, s), v

    program = fqr.trace(
        composition, act(4 * d), POS, table_spec(r), spec(d), spec("T", dtype=torch.float32)
    )
    row, pos, cache = (
        randn(gen, t, 4 * d, scale=2.0),
        positions(gen, t),
        real_table(r, MAX_POS, 1e6),
    )
    w = randn(gen, d, scale=0.3, centre=1.0)
    s = randn(gen, t, scale=0.5, centre=1.0, dtype=torch.float32)

    def scaled64(x):
        return (x.double().reshape(t, -1, d) * w.double() * s.double()[:, None, None]).reshape(
            t, -1
        )

    expected = [
        exact_rope(scaled64(row[:, : 2 * d]), pos, cache, head_dim=d),
        scaled64(row[:, 2 * d : 3 * d]),
        row[:, 3 * d :],
    ]
    kernel = check_reference_and_kernel(
        program, (row, pos, cache, w, s), expected, [d] * 3, copies=(2,)
    )
    assert kernel.source.count("scaled") >= 4


# ----------------------------------------------------------------------- narrow rotary


def narrow_program(head_dim, rotary_dim, is_neox=True, dtype=torch.bfloat16):
    def prologue(row, pos, cache, qw, kw):
        q, k, v = ops.split_qkv(row, 2, 1, head_dim)
        q = ops.rms_norm(q, qw, eps=1e-6, group_size=head_dim)
        k = ops.rms_norm(k, kw, eps=1e-6, group_size=head_dim)
        q = ops.rope(q, pos, cache, head_dim=head_dim, is_neox=is_neox)
        return q, ops.rope(k, pos, cache, head_dim=head_dim, is_neox=is_neox), v

    return fqr.trace(
        prologue,
        act(4 * head_dim, dtype),
        POS,
        table_spec(rotary_dim),
        spec(head_dim, dtype=dtype),
        spec(head_dim, dtype=dtype),
    )


@pytest.mark.parametrize("head_dim", [256, 512, 769])
@pytest.mark.parametrize("is_neox", [True, False])
def test_a_narrow_table_on_a_wide_head_takes_few_pieces(head_dim, is_neox):
    """rotary_dim 2: the pass-through is cut in power-of-two runs (at most log2(D) + 1), not
    feature by feature (which made a 546 KB kernel for D = 769)."""
    layout = Layout(head_dim, 2, "neox" if is_neox else "gptj")
    assert len(layout.slots) <= head_dim.bit_length() + 2
    covered = sorted(
        f for s in layout.slots for f in range(s.start, s.start + s.count * len(s.names))
    )
    assert covered == list(range(head_dim))  # every feature exactly once
    source = kernel_source(narrow_program(head_dim, 2, is_neox), "cuda")
    assert len(source) < 40_000, len(source)
    assert source.count("tl.load(") < 80


@needs_interpreter
@pytest.mark.parametrize("is_neox", [True, False])
def test_narrow_rotary_on_a_512_head_is_right(gen, is_neox):
    d, t = 512, 3
    program = narrow_program(d, 2, is_neox)
    row, pos, cache = (
        randn(gen, t, 4 * d, scale=2.0),
        positions(gen, t),
        real_table(2, MAX_POS, 1e6),
    )
    qw, kw = randn(gen, d, scale=0.2, centre=1.0), randn(gen, d, scale=0.2, centre=1.0)
    expected = [
        exact_rope(norm64(row[:, : 2 * d], qw, d), pos, cache, head_dim=d, is_neox=is_neox),
        exact_rope(norm64(row[:, 2 * d : 3 * d], kw, d), pos, cache, head_dim=d, is_neox=is_neox),
        row[:, 3 * d :],
    ]
    check_reference_and_kernel(program, (row, pos, cache, qw, kw), expected, [d] * 3, copies=(2,))


# ----------------------------------------------------------------------- strided outputs


@needs_interpreter
def test_outputs_may_be_rows_of_a_wider_buffer(gen):
    """``out=`` tensors whose rows are strided (views into a wider buffer): the kernel writes
    each output row at its stride and nothing else (the padding keeps its NaN)."""
    d, t = 64, 10
    program = narrow_program(d, 32)
    row, pos, cache = (
        randn(gen, t, 4 * d, scale=2.0),
        positions(gen, t),
        real_table(32, MAX_POS, 1e6),
    )
    qw, kw = randn(gen, d, scale=0.2, centre=1.0), randn(gen, d, scale=0.2, centre=1.0)
    buffers = [torch.full((t, w + 24), float("nan"), dtype=torch.bfloat16) for w in (128, 64, 64)]
    outs = [b[:, :w] for b, w in zip(buffers, (128, 64, 64))]
    lower(program, "interpret")(row, pos, cache, qw, kw, out=outs)
    expected = [
        exact_rope(norm64(row[:, : 2 * d], qw, d), pos, cache, head_dim=d),
        exact_rope(norm64(row[:, 2 * d : 3 * d], kw, d), pos, cache, head_dim=d),
        row[:, 3 * d :],
    ]
    check_outputs(outs, expected, [d] * 3, copies=(2,))
    for b, w in zip(buffers, (128, 64, 64)):
        assert torch.isnan(b[:, w:]).all()
    with pytest.raises(ValueError, match=r"out\[0\] must be a bf16\[T,128\] tensor"):
        lower(program, "interpret")(row, pos, cache, qw, kw, out=[buffers[0][:, :64], *outs[1:]])


# ----------------------------------------------------------------------- plan errors


def test_a_primitive_without_lowering_facts_is_refused_by_name():
    opaque = Primitive("opaque")
    opaque.def_abstract(lambda x: x)
    program = fqr.trace(lambda x: opaque.bind(x), act(128))
    with pytest.raises(PlanError, match="opaque has no lowering facts"):
        plan_program(program)


def test_two_register_layouts_for_one_value_are_refused():
    def twice(x, pos, c):
        y = ops.rope(x, pos, c, head_dim=64, is_neox=True)
        return ops.rope(y, pos, c, head_dim=64, is_neox=False)

    program = fqr.trace(twice, act(128), POS, table_spec(64))
    with pytest.raises(PlanError, match="two register layouts"):
        plan_program(program)


def test_an_op_on_heads_of_another_width_is_refused():
    def mismatch(row, pos, c):
        (q,) = ops.split_heads(row, [Section(2, 64)])
        return ops.rope(q, pos, c, head_dim=32)

    program = fqr.trace(mismatch, act(128), POS, table_spec(32))
    with pytest.raises(PlanError, match="rope works on heads of 32 features, but its operand"):
        plan_program(program)


def test_one_input_in_two_roles_is_refused():
    def confused(x, x1, w):
        # w: a head vector of x's two heads, and the row vector of x1 (one row of 64)
        return ops.rms_norm(x, w, eps=1e-6, group_size=64), ops.rms_norm(
            x1, w, eps=1e-6, group_size=64
        )

    program = fqr.trace(confused, act(128), act(64), spec(64))
    with pytest.raises(PlanError, match="read as a head vector and as a row vector"):
        plan_program(program)


def test_a_chunked_row_reduction_must_read_the_loaded_value():
    def rope_then_full_norm(x, pos, c, w):
        y = ops.rope(x, pos, c, head_dim=64)
        return ops.rms_norm(y, w, eps=1e-6, group_size=8 * 64)

    program = fqr.trace(rope_then_full_norm, act(8 * 64), POS, table_spec(64), spec(8 * 64))
    kernel_source(program, "cuda")  # whole rows: fine
    with pytest.raises(PlanError, match="must read the loaded value directly"):
        kernel_source(program, "cuda", tile_elems=128)
