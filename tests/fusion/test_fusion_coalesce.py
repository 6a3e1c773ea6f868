"""Split coalescing (fqr.fusion.coalesce): graphs that cut qkv with separate splits or slices.

The unit tests trace small functions with make_fx (fake tensors: the metadata Inductor's graphs
carry), coalesce, and run the rewritten graph on fresh random inputs against eager. The slow
tests compile vLLM-style models whose layers split q, k and v separately and check that each
layer's prologue fuses exactly once, within the ``unfused`` numerics contract of float64.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.vllm_model import SEED, Layer, VllmAttention, VllmModel, inputs, vllm_exact
from torch.fx.experimental.proxy_tensor import make_fx

import fqr.fusion
from fqr.fusion.coalesce import coalesce_splits, finest_chain
from fqr.numerics import compare

aten = torch.ops.aten
Q, KV, T = 96, 32, 5  # q_size, kv_size, tokens
WIDTH = Q + 2 * KV


def count(gm, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is target)


def coalesced(fn, *args):
    """make_fx ``fn`` (fake tensors), coalesce, recompile; returns (gm, redirected)."""
    gm = make_fx(fn, tracing_mode="fake")(*args)
    redirected = coalesce_splits(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return gm, redirected


def check_same_values(gm, fn, *args):
    for got, want in zip(gm(*args), fn(*args)):
        assert got.shape == want.shape and torch.equal(got, want)


def three_splits(qkv):
    q, _, _ = qkv.split([Q, KV, KV], dim=-1)
    _, k, _ = qkv.split([Q, KV, KV], dim=-1)
    _, _, v = qkv.split([Q, KV, KV], dim=-1)
    return q + 1, k * 2, v - 3


def three_slices(qkv):
    q = qkv[:, :Q]
    k = qkv[:, Q : Q + KV]
    v = qkv[..., Q + KV :]
    return q + 1, k * 2, v - 3


def test_three_splits_become_one(gen):
    qkv = torch.randn(T, WIDTH, generator=gen)
    gm, redirected = coalesced(three_splits, qkv)
    assert redirected > 0
    assert count(gm, aten.split_with_sizes.default) == 1
    (split,) = [n for n in gm.graph.nodes if n.target is aten.split_with_sizes.default]
    assert list(split.args[1]) == [Q, KV, KV]
    assert {u.args[1] for u in split.users} == {0, 1, 2}
    check_same_values(gm, three_splits, qkv)


def test_three_slices_become_one_split(gen):
    qkv = torch.randn(T, WIDTH, generator=gen)
    gm, redirected = coalesced(three_slices, qkv)
    assert redirected == 3
    assert count(gm, aten.slice.Tensor) == 0
    (split,) = [n for n in gm.graph.nodes if n.target is aten.split_with_sizes.default]
    assert list(split.args[1]) == [Q, KV, KV] and split.args[2] == -1
    assert sorted(u.args[1] for u in split.users) == [0, 1, 2]
    check_same_values(gm, three_slices, qkv)


def test_nested_slices_coalesce_on_the_root(gen):
    def nested(qkv):
        kv = qkv[:, Q:]
        return qkv[:, :Q] * 3, kv[:, :KV] + 1, kv[:, KV:] - 1

    qkv = torch.randn(T, WIDTH, generator=gen)
    gm, _ = coalesced(nested, qkv)
    (split,) = [n for n in gm.graph.nodes if n.target is aten.split_with_sizes.default]
    assert list(split.args[1]) == [Q, KV, KV]
    check_same_values(gm, nested, qkv)


def test_unrelated_slice_of_the_same_tensor_keeps_its_node(gen):
    def with_unrelated(qkv):
        qk = qkv[:, : Q + KV]  # overlaps q and k: not part of the q | k | v chain
        q, k, v = three_slices(qkv)
        return q, k, v, qk.sum(-1, keepdim=True)

    qkv = torch.randn(T, WIDTH, generator=gen)
    gm, _ = coalesced(with_unrelated, qkv)
    (split,) = [n for n in gm.graph.nodes if n.target is aten.split_with_sizes.default]
    assert list(split.args[1]) == [Q, KV, KV]
    (kept,) = [n for n in gm.graph.nodes if n.target is aten.slice.Tensor]
    assert kept.args[0].op == "placeholder" and kept.args[3] == Q + KV
    check_same_values(gm, with_unrelated, qkv)


def test_a_split_into_other_sizes_is_not_merged(gen):
    def two_splits(qkv):
        q, k, v = qkv.split([Q, KV, KV], dim=-1)
        qk, v2 = qkv.split([Q + KV, KV], dim=-1)
        return q + 1, k * 2, v - 3, qk * 5, v2 * 7

    qkv = torch.randn(T, WIDTH, generator=gen)
    gm, redirected = coalesced(two_splits, qkv)
    assert redirected == 0
    sizes = sorted(
        tuple(n.args[1]) for n in gm.graph.nodes if n.target is aten.split_with_sizes.default
    )
    assert sizes == [(Q, KV, KV), (Q + KV, KV)]
    check_same_values(gm, two_splits, qkv)


def test_pieces_that_do_not_cover_the_row_are_left_alone(gen):
    def q_and_k_only(qkv):
        return qkv[:, :Q] + 1, qkv[:, Q : Q + KV] * 2

    qkv = torch.randn(T, WIDTH, generator=gen)
    gm, redirected = coalesced(q_and_k_only, qkv)
    assert redirected == 0 and count(gm, aten.slice.Tensor) == 2
    check_same_values(gm, q_and_k_only, qkv)


def test_finest_chain():
    assert finest_chain([(0, 4), (4, 6), (6, 8), (0, 6)], 8) == [(0, 4), (4, 6), (6, 8)]
    assert finest_chain([(0, 4), (4, 6)], 8) is None
    assert finest_chain([(0, 8)], 8) == [(0, 8)]
    assert finest_chain([(0, 3), (2, 8)], 8) is None  # overlapping pieces never chain


# ------------------------------------------------------------- compiled models (Inductor)


class SeparateSplitAttention(VllmAttention):
    """vLLM's Qwen3 attention, but q, k and v are cut from qkv by separate calls."""

    def __init__(self, spec, dtype, gen, how: str):
        super().__init__(spec, dtype, gen)
        self.how = how

    def split(self, qkv):
        qs, kvs = self.q_size, self.kv_size
        if self.how == "splits":
            q, _, _ = qkv.split([qs, kvs, kvs], dim=-1)
            _, k, _ = qkv.split([qs, kvs, kvs], dim=-1)
            _, _, v = qkv.split([qs, kvs, kvs], dim=-1)
        else:
            q, k, v = qkv[:, :qs], qkv[:, qs : qs + kvs], qkv[:, qs + kvs :]
        return q, k, v

    def forward(self, positions, hidden_states):
        s, d = self.spec, self.head_dim
        qkv = self.qkv_proj(hidden_states)
        q, k, v = self.split(qkv)
        # An unrelated reader of the same qkv: a split into other sizes, never merged.
        qk, _ = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        gate = torch.sigmoid(qk.float().mean(-1, keepdim=True)).to(qkv.dtype)
        q_by_head = q.view(*q.shape[:-1], s.hq, d)
        q_by_head = self.norm(q_by_head, self.q_weight, s.eps, self.q_bias)
        k_by_head = k.view(*k.shape[:-1], s.hkv, d)
        k_by_head = self.norm(k_by_head, self.k_weight, s.eps, self.k_bias)
        q, k = self.rotary_emb(positions, q_by_head.view(q.shape), k_by_head.view(k.shape))
        t = hidden_states.shape[0]
        attn = F.scaled_dot_product_attention(
            q.view(t, s.hq, d).transpose(0, 1),
            k.view(t, s.hkv, d).transpose(0, 1),
            v.reshape(t, s.hkv, d).transpose(0, 1),
            is_causal=True,
            enable_gqa=True,
        )
        out = self.o_proj(attn.transpose(0, 1).reshape(t, self.q_size)) * gate
        return hidden_states + out, (qkv, q, k, v)


LAYERS = [
    Layer(4, 2, 32, 32, neox=True, bias=False, eps=1e-6),
    Layer(6, 2, 16, 8, neox=False, bias=True, eps=1e-5),
]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["splits", "slices"])
def test_model_splitting_q_k_v_separately_fuses_once_per_layer(how):
    print(f"FQR_TEST_SEED={SEED}")
    dtype = torch.bfloat16
    model = VllmModel(LAYERS, dtype, seed=SEED)
    gen = torch.Generator().manual_seed(SEED)
    model.layers = torch.nn.ModuleList(
        SeparateSplitAttention(spec, dtype, gen, how) for spec in LAYERS
    )
    model.eval()
    fusion = fqr.fusion.backend()
    positions, hidden = inputs(9, dtype, SEED + 5)
    torch._dynamo.mark_dynamic(positions, 0)
    torch._dynamo.mark_dynamic(hidden, 0)
    with torch.no_grad():
        fused_out = torch.compile(model, backend=fusion)(positions, hidden)
        eager_out = model(positions, hidden)
    torch._dynamo.reset()
    (graph,) = fusion.stats.graphs
    assert graph.coalesced_splits > 0, "the graph needed no coalescing: the test proves nothing"
    assert fusion.stats.sites == len(LAYERS)
    assert graph.ops["fqr.split_qkv_rmsnorm_rope.default"] == len(LAYERS)
    # the unrelated [q+kv | kv] split survives, once per layer
    assert graph.ops["aten.split_with_sizes.default"] == len(LAYERS)
    assert "aten.rsqrt.default" not in graph.ops
    for layer, (qkv, q, k, v) in zip(model.layers, fused_out[1]):
        exact_q, exact_k = vllm_exact(layer, qkv, positions)
        for out, exact in ((q, exact_q), (k, exact_k)):
            c = compare(out, exact, head_dim=layer.spec.d, numerics="unfused")
            assert c.passed, (layer.spec, c)
        assert torch.equal(v, qkv[:, layer.q_size + layer.kv_size :])
    scale = eager_out[0].double().abs().max()
    assert (fused_out[0].double() - eager_out[0].double()).abs().max() <= 2.0**-5 * scale
