"""Outputs whose heads sit at a stride: ``out`` entries that are ``[T, H, D]`` views with strides
``(row, head_stride, 1)`` (``Kernel.launch``, ``Backend.launch`` on every backend, the generated
host function). vLLM's MLA rotates the rope part of each q head in place after ``q_b_proj``
(``q[..., 128:]`` of ``[T, H, 192]`` heads, GPT-J pairs): ``split_heads`` with a strided section,
``rope``, and ``out=[q.view(T, H, 192)[:, :, 128:]]`` must rotate exactly those columns and leave
every nope column's bits as they were."""

from __future__ import annotations

import pytest
import torch

from fqr import ops, reference
from fqr.backends import BACKENDS
from fqr.core import Aval, Section, trace
from fqr.lowering import lower, lower_by_tokens
from fqr.lowering.host import host_function
from fqr.numerics import compare
from fqr.rope_cache import rope_cos_sin_cache

needs_interpreter = pytest.mark.skipif(
    not BACKENDS["interpret"].available, reason=BACKENDS["interpret"].unavailable_reason() or ""
)
H, NOPE, ROPE = 5, 128, 64  # DeepSeek's q heads: [nope 128 | rope 64]
QK = NOPE + ROPE


def q_rope(q, positions, table):
    (pe,) = ops.split_heads(q, [Section(H, ROPE, offset=NOPE, head_stride=QK)])
    return ops.rope(pe, positions, table, head_dim=ROPE, is_neox=False)


def program(dtype=torch.bfloat16):
    return trace(
        q_rope,
        Aval(("T", H * QK), dtype),
        Aval(("T",), torch.int64),
        Aval(("P", ROPE), torch.float32),
    )


def draw(gen, tokens, dtype=torch.bfloat16):
    q = (torch.randn(tokens, H * QK, generator=gen) * 2).to(dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    return q, positions, rope_cos_sin_cache(ROPE, 4096, 1e4)


def expected_rope(q, positions, table):
    """float64 rope of each head's last 64 columns (index arithmetic, then fqr.reference)."""
    pe = q.view(q.shape[0], H, QK)[:, :, NOPE:].reshape(q.shape[0], H * ROPE)
    return reference.rope(pe, positions, table, head_dim=ROPE, is_neox=False)


def check_in_place(q_after, q_before, want):
    heads_after = q_after.view(q_after.shape[0], H, QK)
    heads_before = q_before.view(q_before.shape[0], H, QK)
    nope_bits = heads_after[:, :, :NOPE].view(torch.int16)
    assert torch.equal(nope_bits, heads_before[:, :, :NOPE].view(torch.int16)), "a nope column"
    got = heads_after[:, :, NOPE:].reshape(q_after.shape[0], H * ROPE)
    c = compare(got, want, head_dim=ROPE)
    assert c.passed, c
    assert not torch.equal(got, heads_before[:, :, NOPE:].reshape(got.shape))  # it did rotate


@needs_interpreter
@pytest.mark.parametrize("backend", ["interpret", "reference"])
def test_q_rope_in_place_through_a_strided_view(gen, backend):
    q, positions, table = draw(gen, 7)
    before = q.clone()
    want = expected_rope(q, positions, table)
    view = q.view(q.shape[0], H, QK)[:, :, NOPE:]
    assert view.stride() == (H * QK, QK, 1)
    (out,) = BACKENDS[backend].launch(program(), [q, positions, table], out=[view])
    assert out is view
    check_in_place(q, before, want)


@needs_interpreter
def test_the_strided_variant_and_its_checks(gen):
    """A [T, H, D] out runs the sibling kernel whose outputs take their head strides (one more
    int per output; DENSE when the view is contiguous), lowered once; the plain kernel's source
    does not change; Kernel(...) checks the view's shape."""
    prog = program()
    kernel = lower(prog, "interpret")
    assert "hstride" not in kernel.source and not kernel.strided_outputs
    strided = kernel.strided_variant()
    assert strided is kernel.strided_variant() and strided.strided_outputs
    assert strided.strided_variant() is strided
    assert "out0_hstride" in strided.source and "+ hh * out0_hstride" in strided.source
    assert "out0_hstride = 64" in strided.source  # DENSE: a contiguous [T, H, 64] out
    q, positions, table = draw(gen, 5)
    want = expected_rope(q, positions, table)
    dense = torch.full((5, H, ROPE), float("nan"), dtype=torch.bfloat16)
    (out,) = kernel(q, positions, table, out=[dense])
    assert out is dense
    assert compare(dense.reshape(5, H * ROPE), want, head_dim=ROPE).passed
    _, _, key = strided.launch_arguments([q, positions, table], [dense], 5, False)
    assert key[0] is True  # DENSE
    flat, _, key = strided.launch_arguments(
        [q, positions, table], [q.view(5, H, QK)[:, :, NOPE:]], 5, False
    )
    assert key[0] is False and flat[-3:] == [H * QK, QK, 5]  # row stride, head stride, T
    with pytest.raises(ValueError, match=r"\[T, heads, head_dim\] = \[5, 5, 64\]"):
        kernel(q, positions, table, out=[torch.empty(5, H, 2 * ROPE)[:, :, :ROPE].contiguous()])
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        kernel(q, positions, table, out=[torch.empty(5, H, 2 * ROPE, dtype=q.dtype)[:, :, ::2]])


@needs_interpreter
def test_the_host_function_writes_a_strided_view(gen):
    """The generated host function for a [T, H, D] out launches the strided variant (after
    the general path lowered it), and one made for [T, width] outs refuses a 3-D one."""
    prog = program()
    variants = lower_by_tokens(prog, "interpret")
    q, positions, table = draw(gen, 6)
    flat_out = [torch.empty(6, H * ROPE, dtype=q.dtype)]
    variants.launch([q, positions, table], flat_out)
    plain = host_function(variants, [q, positions, table], flat_out)
    view = [q.view(6, H, QK)[:, :, NOPE:]]
    assert plain is not None and plain.fn([q, positions, table], view) is None
    variants.launch([q.clone(), positions, table], [v.clone() for v in view])  # lowers it
    fast = host_function(variants, [q, positions, table], view)
    assert fast is not None and f"!= ({H * QK}, {QK}, 1)" in fast.source
    for tokens in (6, 3):
        q, positions, table = draw(gen, tokens)
        before, want = q.clone(), expected_rope(q, positions, table)
        (out,) = fast.fn([q, positions, table], [q.view(tokens, H, QK)[:, :, NOPE:]])
        check_in_place(q, before, want)
