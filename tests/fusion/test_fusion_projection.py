"""The QKV projection with its prologue in the vLLM-shaped example (``fqr.fusion.models``) and in
the fusion pass (``fqr.fusion.patterns``, "QKV projection"), on CPU.

The layer's ``qkv_proj`` path (``prologue="dispatch"``) runs ``torch.ops.fqr.
split_qkv_rmsnorm_rope_proj_dispatch``; each layer's q, k, v are held to float64 under what the
dispatch ran (the pair with the shipped table, which has no CPU entry; the fused kernel with a
table that picks it on CPU). One small model compiled with the pass (dynamic T): the layer whose
shape the table can fuse gets the dispatching op instead of ``mm`` + the fused prologue, the
other keeps them; the compiled model agrees with eager at a T whose bucket picks the fused
kernel and at one whose bucket keeps the pair, without recompiling."""

from __future__ import annotations

import pytest
import torch

import fqr.fusion
from fqr.fusion.models import AttentionShape, VllmStyleModel
from fqr.presets import PrologueSpec
from fqr.projection import Key, entry_doc, table_doc, use_table

DTYPE = torch.bfloat16
HIDDEN = 64
# Two layer shapes: a Qwen2-like one with a qkv_proj bias (addmm) and a Gemma-like GPT-J one
# without (mm), partial rotary.
SHAPES = [
    AttentionShape(PrologueSpec(4, 2, 16, 16), bias=True, max_position=512),
    AttentionShape(PrologueSpec(2, 1, 32, 16, is_neox=False, weight_offset=1.0), max_position=512),
]


def _key(shape: AttentionShape) -> Key:
    s = shape.spec
    return Key("cpu", DTYPE, "split_qkv_rmsnorm_rope", s.qkv_width, HIDDEN,
               (s.num_heads, s.num_kv_heads, s.head_dim), "head", shape.bias)  # fmt: skip


def _cpu_table(*shapes: AttentionShape) -> dict:
    """The fused kernel at T <= 16 on CPU for these shapes, the pair from T = 17."""
    measured = [(1, 2.0, 1.0), (16, 2.0, 1.0), (1024, 2.0, 3.0)]
    return table_doc([entry_doc(_key(s), measured) for s in shapes], source="test")


def _inputs(tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 512, (tokens,), generator=g)
    return positions, torch.randn(tokens, HIDDEN, generator=g).to(DTYPE)


def _model(prologue: str) -> VllmStyleModel:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(40)
        return VllmStyleModel(HIDDEN, SHAPES, DTYPE, prologue=prologue).eval()


@pytest.mark.parametrize("table", ["shipped", "cpu"])
def test_layer_qkv_proj_path_against_float64(table):
    model = _model("dispatch")
    positions, hidden = _inputs(7, 1)
    chosen = _cpu_table(*SHAPES) if table == "cpu" else None
    with use_table(chosen), torch.no_grad():
        out, records = model(positions, hidden)
        for layer, record in zip(model.layers, records):
            check = layer.check_prologue(positions, *record)
            assert check["passed"], check
            assert check["choice"] == ("fused" if table == "cpu" else "pair")
    assert torch.isfinite(out).all()
    # the same weights through vLLM's unfused code: the same layer up to the roundings
    unfused = _model("unfused")
    with torch.no_grad():
        want, _ = unfused(positions, hidden)
    assert (out.float() - want.float()).abs().max() <= 2.0**-5 * want.float().abs().max()


def test_a_bad_prologue_is_refused():
    with pytest.raises(ValueError, match="prologue must be one of unfused, dispatch"):
        VllmStyleModel(HIDDEN, SHAPES, DTYPE, prologue="fused")


@pytest.mark.slow  # one torch.compile on CPU
def test_pass_puts_the_projection_into_the_dispatching_op():
    model = _model("unfused")
    fusion = fqr.fusion.backend()
    # vLLM's model code: the hidden states out, the qkv row read by the prologue alone
    compiled = torch.compile(lambda positions, hidden: model(positions, hidden)[0], backend=fusion)
    runs = []
    with use_table(_cpu_table(SHAPES[0])), torch.no_grad():  # only the first shape is fusable
        for tokens, seed in ((5, 2), (23, 3)):  # buckets: the fused kernel; the pair
            positions, hidden = _inputs(tokens, seed)
            torch._dynamo.mark_dynamic(positions, 0)
            torch._dynamo.mark_dynamic(hidden, 0)
            runs.append((compiled(positions, hidden), model(positions, hidden)[0]))
    torch._dynamo.reset()
    (graph,) = fusion.stats.graphs  # one compile for both token counts
    assert graph.sites == 2 and graph.projected == 1
    assert graph.ops["fqr.split_qkv_rmsnorm_rope_proj_dispatch.default"] == 1
    assert graph.ops["fqr.split_qkv_rmsnorm_rope.default"] == 1  # the shape not in the table
    assert "aten.mm.default" in graph.ops  # its qkv_proj stays Inductor's GEMM
    assert graph.fused_ops == 2 and not graph.unfused_ops
    for got, want in runs:
        scale = want.float().abs().max()
        assert (got.float() - want.float()).abs().max() <= 2.0**-5 * scale
