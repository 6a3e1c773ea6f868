"""The lowering knows no op: generalised splits, a new op defined here, narrow rotary tables and
strided outputs, each run on the reference interpreter and as the interpreted kernel against an
independent float64 computation (plain index arithmetic + fqr.golden's exact formulas), on fresh
random inputs, real RoPE tables and NaN-poisoned outputs."""

from __future__ import annotations

import pytest
import torch
from support.compositions import (
    POS,
    gated_case,
    indexer_case,
    narrow_case,
    narrow_program,
    padded_case,
    positions,
    randn,
    table,
    table_spec,
)
from support.programs import check_outputs, check_reference_and_kernel

import fqr
from fqr import ops, reference
from fqr.backends import BACKENDS
from fqr.core import HeadOp, Primitive, Role, Section, spec
from fqr.lowering import kernel_source, lower
from fqr.lowering.plan import Layout, PlanError, plan_program

needs_interpreter = pytest.mark.skipif(
    not BACKENDS["interpret"].available, reason=BACKENDS["interpret"].unavailable_reason() or ""
)


def act(width, dtype=torch.bfloat16):
    return spec("T", width, dtype=dtype)


def check_case(case, **options):
    return check_reference_and_kernel(
        case.program, case.args, case.expected, case.head_dims, case.copies, **options
    )


# ----------------------------------------------------------------------- generalised splits


@needs_interpreter
def test_gate_interleaved_split_qwen35_style(gen):
    """[q0 g0 q1 g1 q2 g2 | k | v]: q and the gate are views of head stride 2*D."""
    case = gated_case(gen, 7)
    kernel = check_case(case)
    assert "head stride 128" in kernel.source and "(row0 + 0 + hh * 128)" in kernel.source
    assert "(row1 + 64 + hh * 128)" in kernel.source  # the gate: offset D, stride 2*D


@needs_interpreter
def test_sections_with_different_head_dims_and_tables(gen):
    """[q | k | v | index_q | index_k]: indexer heads of 32 features beside heads of 64, with
    their own norms and their own GPT-J table."""
    case = indexer_case(gen, 6)
    assert [
        (c.heads, c.head_dim, c.head_layout.tag) for c in plan_program(case.program).chains
    ] == [
        (3, 64, "neox64"),
        (1, 64, "neox64"),
        (1, 64, "plain"),
        (2, 32, "gptj16"),
        (1, 32, "gptj16"),
    ]
    check_case(case)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kv_with_different_head_counts_in_padded_heads(gen, dtype):
    """q 4, k 2, v 3 heads of 48 features, each padded to 64 columns (NaN in the padding)."""
    check_case(padded_case(gen, 9, dtype=dtype))


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
    row, pos, cache = randn(gen, t, 4 * d, scale=2.0), positions(gen, t), table(gen, r)
    w = randn(gen, d, scale=0.3, centre=1.0)
    s = randn(gen, t, scale=0.5, centre=1.0, dtype=torch.float32)

    def scaled64(x):
        return (x.double().reshape(t, -1, d) * w.double() * s.double()[:, None, None]).reshape(
            t, -1
        )

    expected = [
        reference.rope(scaled64(row[:, : 2 * d]), pos, cache, head_dim=d),
        scaled64(row[:, 2 * d : 3 * d]),
        row[:, 3 * d :],
    ]
    kernel = check_reference_and_kernel(
        program, (row, pos, cache, w, s), expected, [d] * 3, copies=(2,)
    )
    assert kernel.source.count("scaled") >= 4


# ----------------------------------------------------------------------- narrow rotary


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
    check_case(narrow_case(gen, 3, 512, 2, is_neox))


# ----------------------------------------------------------------------- strided outputs


@needs_interpreter
def test_outputs_may_be_rows_of_a_wider_buffer(gen):
    """``out=`` tensors whose rows are strided (views into a wider buffer): the kernel writes
    each output row at its stride and nothing else (the padding keeps its NaN)."""
    d, t = 64, 10
    case = narrow_case(gen, t, d, 32)
    program = case.program
    buffers = [torch.full((t, w + 24), float("nan"), dtype=torch.bfloat16) for w in (128, 64, 64)]
    outs = [b[:, :w] for b, w in zip(buffers, (128, 64, 64))]
    lower(program, "interpret")(*case.args, out=outs)
    check_outputs(outs, case.expected, case.head_dims, case.copies)
    for b, w in zip(buffers, (128, 64, 64)):
        assert torch.isnan(b[:, w:]).all()
    with pytest.raises(ValueError, match=r"out\[0\] must be a bf16\[T,128\] tensor"):
        lower(program, "interpret")(*case.args, out=[buffers[0][:, :64], *outs[1:]])


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
