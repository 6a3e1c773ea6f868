"""split_heads: one primitive for every packed layout (sections with their own head counts,
head dims, offsets and head strides), checked against plain index arithmetic."""

from __future__ import annotations

import pytest
import torch

import fqr
from fqr import ops
from fqr.core import Section, Views, spec


def _packed(gen, tokens, width, dtype=torch.bfloat16):
    return (torch.randn(tokens, width, generator=gen, dtype=torch.float64) * 2).to(dtype)


def test_gate_interleaved_q_and_gate_are_two_strided_views(gen):
    # Qwen3.5's gated attention: [q0 g0 q1 g1 q2 g2 | k0 | v0], D = 64.
    hq, hkv, d, t = 3, 1, 64, 5
    row = _packed(gen, t, (2 * hq + 2 * hkv) * d)
    q, gate, k, v = ops.split_heads(
        row,
        [
            Section(hq, d, 0, 2 * d),
            Section(hq, d, d, 2 * d),
            Section(hkv, d, 2 * hq * d),
            Section(hkv, d, (2 * hq + hkv) * d),
        ],
    )
    pairs = row[:, : 2 * hq * d].reshape(t, hq, 2, d)
    assert torch.equal(q, pairs[:, :, 0].reshape(t, -1))
    assert torch.equal(gate, pairs[:, :, 1].reshape(t, -1))
    assert torch.equal(k, row[:, 2 * hq * d : (2 * hq + hkv) * d])
    assert torch.equal(v, row[:, (2 * hq + hkv) * d :])
    for out in (q, gate, k, v):
        assert out.is_contiguous() and out.dtype == row.dtype
        assert out.untyped_storage().data_ptr() != row.untyped_storage().data_ptr()


def test_sections_with_their_own_head_dims_and_head_counts(gen):
    # q 4x64, k 2x64, v 3x48 (k and v differ), indexer q 2x32, indexer k 1x32.
    t = 4
    layout = [(4, 64), (2, 64), (3, 48), (2, 32), (1, 32)]
    sections, offset = [], 0
    for heads, d in layout:
        sections.append(Section(heads, d, offset))
        offset += heads * d
    row = _packed(gen, t, offset, torch.float16)
    outs = ops.split_heads(row, sections)
    starts = [s.offset for s in sections] + [offset]
    for out, (heads, d), a, b in zip(outs, layout, starts, starts[1:]):
        assert out.shape == (t, heads * d)
        assert torch.equal(out, row[:, a:b])


def test_padded_heads_skip_their_padding(gen):
    # [T, H, D + pad]: the padding is never part of an output.
    t, h, d, pad = 3, 5, 40, 8
    row = _packed(gen, t, h * (d + pad), torch.float32)
    (x,) = ops.split_heads(row, [Section(h, d, 0, d + pad)])
    assert torch.equal(x, row.reshape(t, h, d + pad)[..., :d].reshape(t, -1))


def test_split_qkv_is_three_back_to_back_sections():
    program = fqr.trace(lambda x: ops.split_qkv(x, 32, 8, 128), spec("T", 6144))
    (eqn,) = program.eqns
    assert eqn.prim is ops.split_heads_p
    assert eqn.facts() == Views((Section(32, 128, 0), Section(8, 128, 4096), Section(8, 128, 5120)))
    assert "split_heads[sections=(32x128@0,8x128@4096,8x128@5120)] a" in str(program)


def test_strided_sections_print_their_stride():
    program = fqr.trace(
        lambda x: ops.split_heads(x, [Section(2, 64, 0, 128), Section(2, 64, 64, 128)]),
        spec("T", 256),
    )
    assert "split_heads[sections=(2x64@0/128,2x64@64/128)]" in str(program)


@pytest.mark.parametrize(
    "sections, width, message",
    [
        (
            [Section(2, 64, 0), Section(1, 64, 100)],
            256,
            r"sections\[0\] .* and sections\[1\] .* overlap",
        ),
        ([Section(2, 64, 0, 128), Section(2, 64, 32, 128)], 256, "overlap at column 32"),
        ([Section(4, 64, 0)], 200, r"sections\[0\] \(4x64@0\) reads columns up to 256, past"),
        ([], 128, "at least one section"),
    ],
)
def test_bad_sections_are_named(sections, width, message):
    with pytest.raises(ValueError, match=message):
        fqr.trace(lambda x: ops.split_heads(x, sections), spec("T", width))


def test_section_checks_its_own_fields():
    with pytest.raises(ValueError, match="head_stride 32 < head_dim 64"):
        Section(2, 64, 0, 32)
    with pytest.raises(ValueError, match="heads >= 1"):
        Section(0, 64)
    with pytest.raises(TypeError, match="head_dim must be an int"):
        Section(2, 64.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"sections\[1\] must be a fqr.core.Section"):
        ops.split_heads(torch.zeros(1, 128), [Section(1, 64), (1, 64, 64)])
