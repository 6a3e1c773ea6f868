"""The packed row as a checkpoint stores it (``qkv_layout``): GPT-NeoX's per-head ``[q_h | k_h |
v_h]`` and CodeGen's model-parallel shards of ``[q | v | k]``, read in place by the split op on
the reference and interpreted-kernel backends, against the float64 formulation (which splits
with the models' own reshapes, :func:`fqr.reference.split_qkv_layout`)."""

from __future__ import annotations

import pytest
import torch
from conftest import real_table

import fqr
from fqr import ops, reference
from fqr.core import Section
from fqr.numerics import compare

BACKENDS = ("reference", "interpret")


def _row(gen, tokens, width, dtype=torch.bfloat16):
    return (torch.randn(tokens, width, generator=gen, dtype=torch.float64) * 2).to(dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "layout, heads, d, rotary, neox, norm",
    [
        ("per-head", 3, 32, 8, True, "none"),  # Pythia: a quarter of each head, NeoX halves
        ("per-head", 2, 24, 24, True, "head"),  # Persimmon-like rows with a per-head norm
        ("codegen-mp2", 4, 20, 16, False, "none"),  # CodeGen: grouped heads, GPT-J pairs
        ("codegen-mp1", 3, 16, 16, False, "full"),  # one shard: [q | v | k]
    ],
)
def test_a_checkpoint_row_is_read_in_place(gen, backend, layout, heads, d, rotary, neox, norm):
    t, dtype = 5, torch.bfloat16
    qkv = _row(gen, t, 3 * heads * d, dtype)
    positions = torch.randint(0, 500, (t,), generator=gen)
    table = real_table(rotary, 512, 1e4)
    width = {"none": None, "head": d, "full": heads * d}[norm]
    weights = (None, None)
    if width is not None:
        weights = tuple(
            (1 + 0.3 * torch.randn(width, generator=gen, dtype=torch.float64)).to(dtype)
            for _ in range(2)
        )
    kwargs = dict(num_heads=heads, num_kv_heads=heads, head_dim=d, is_neox=neox, norm=norm)
    q, k, v = fqr.split_qkv_rmsnorm_rope(
        qkv, positions, table, *weights, qkv_layout=layout, backend=backend, **kwargs
    )
    eq, ek, ev = reference.prologue(qkv, positions, table, *weights, qkv_layout=layout, **kwargs)
    assert compare(q, eq, head_dim=d).passed and compare(k, ek, head_dim=d).passed
    assert torch.equal(v, ev)
    # the other reading of the row (vLLM's [q | k | v]) differs
    plain = reference.prologue(qkv, positions, table, *weights, **kwargs)
    assert not compare(k, plain[1], head_dim=d).passed


def test_the_layouts_are_the_models_reshapes(gen):
    t, h, d = 3, 8, 5
    row = _row(gen, t, 3 * h * d, torch.float32)
    q, k, v = ops.split_qkv(row, h, h, d, layout="per-head")
    per_head = row.view(t, h, 3 * d).chunk(3, dim=-1)  # HF GPTNeoXAttention
    for ours, theirs in zip((q, k, v), per_head):
        assert torch.equal(ours, theirs.reshape(t, -1))
    q, k, v = ops.split_qkv(row, h, h, d, layout="codegen-mp4")
    local = h * d // 4
    hq, hv, hk = row.view(t, 4, 3 * local).split(local, dim=-1)  # HF CodeGenAttention
    for ours, theirs in zip((q, k, v), (hq, hk, hv)):
        assert torch.equal(ours, theirs.reshape(t, -1))


def test_grouped_sections_place_each_head():
    s = Section(6, 4, 2, 5, 3, 40)
    assert [c for c, _ in s.head_columns()] == [2, 7, 12, 42, 47, 52]
    assert s.end == 56 and str(s) == "6x4@2/5:3/40"
    assert Section(6, 4, 0, 4, 6, 100) == Section(6, 4)  # one group is the plain layout
    with pytest.raises(ValueError, match="group_heads 4 does not divide"):
        Section(6, 4, 0, 4, 4, 100)
    with pytest.raises(ValueError, match="groups would overlap"):
        Section(6, 4, 0, 4, 3, 11)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(qkv_layout="neox"), "qkv_layout must be one of"),
        (dict(qkv_layout="codegen-mp0"), "qkv_layout must be one of"),
        (dict(qkv_layout="codegen-mp3"), "3 model-parallel shards do not divide num_heads 4"),
        (dict(qkv_layout="per-head", num_kv_heads=2), "needs num_kv_heads == num_heads"),
        (dict(qkv_layout="per-head", head_stride=40), "head_stride must be None"),
        (dict(qkv_layout="per-head", inplace=True), "inplace=True needs qkv_layout='qkv'"),
    ],
)
def test_a_layout_the_row_cannot_have_is_refused(gen, kwargs, match):
    h, d = 4, 32
    hkv = kwargs.pop("num_kv_heads", h)
    qkv = _row(gen, 2, (h + 2 * hkv) * d)
    with pytest.raises(ValueError, match=match):
        fqr.split_qkv_rmsnorm_rope(
            qkv, torch.tensor([0, 1]), real_table(d, 64, 1e4), None, None, num_heads=h,
            num_kv_heads=hkv, head_dim=d, norm="none", **kwargs,
        )  # fmt: skip
    with pytest.raises(TypeError, match="qkv_layout must be a string"):
        fqr.split_qkv_rmsnorm_rope(
            qkv, torch.tensor([0, 1]), real_table(d, 64, 1e4), None, None, num_heads=h,
            num_kv_heads=hkv, head_dim=d, norm="none", qkv_layout=3,
        )  # fmt: skip
