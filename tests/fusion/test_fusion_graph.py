"""The fusion pass on compiled models (CPU, Inductor).

The models are written here, independently of ``fqr.unfused`` (from which the patterns
are traced), the way vLLM's and Hugging Face's model code writes the attention prologue. Each
model mixes two attention shapes and, across its layers, NeoX / GPT-J, bias on / off, eps 1e-6 /
1e-5, Gemma's (1 + w) norm and partial rotary. Per dtype one model is compiled once and shared
by the asserts (torch.compile on CPU is slow): fused sites == layers, no unfused norm/RoPE op
left, every layer's q/k within the ``unfused`` numerics contract of float64 computed from that
model's own qkv (and the eager unfused model's too), v bit-exact, one compile for several
token counts.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from support.vllm_model import (
    HIDDEN,
    MAX_POS,
    SEED,
    VLLM_LAYERS,
    Layer,
    VllmModel,
    inputs,
    vllm_exact,
)

import fqr.fusion
from fqr import reference
from fqr.fusion.fusion_pass import FusionPass
from fqr.numerics import compare
from fqr.rope_cache import rope_cos_sin_cache

pytestmark = pytest.mark.slow  # torch.compile of whole models on CPU

UNFUSED_LEFTOVERS = (
    "aten.rsqrt.default",
    "aten.mean.dim",
    "aten.pow.Tensor_Scalar",
    "aten.index.Tensor",
    "aten.index_select.default",
    "aten.cat.default",
    "aten.split.Tensor",
    "aten.split_with_sizes.default",
    "aten.slice.Tensor",
)


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def vllm_compiled(request):
    """One model per dtype, compiled once with the fusion backend and run at two token counts."""
    dtype = request.param
    print(f"FQR_TEST_SEED={SEED}")
    model = VllmModel(VLLM_LAYERS, dtype, seed=SEED).eval()
    fusion = fqr.fusion.backend()
    compiled = torch.compile(model, backend=fusion)
    runs = []
    with torch.no_grad():
        for tokens, seed in ((11, SEED + 1), (6, SEED + 2)):
            positions, hidden = inputs(tokens, dtype, seed)
            torch._dynamo.mark_dynamic(positions, 0)
            torch._dynamo.mark_dynamic(hidden, 0)
            runs.append((positions, hidden, compiled(positions, hidden), model(positions, hidden)))
    torch._dynamo.reset()
    return dtype, model, fusion, runs


def test_vllm_every_layer_fused_once(vllm_compiled):
    _, model, fusion, _ = vllm_compiled
    graphs = fusion.stats.graphs
    assert len(graphs) == 1, "a new token count must not recompile"
    assert fusion.stats.sites == len(VLLM_LAYERS)
    assert graphs[0].fused_ops == len(VLLM_LAYERS)
    assert graphs[0].ops["fqr.split_qkv_rmsnorm_rope.default"] == len(VLLM_LAYERS)
    left = {op: n for op, n in graphs[0].ops.items() if op in UNFUSED_LEFTOVERS}
    assert not left, f"unfused prologue ops left in the graph: {left}"


def test_vllm_outputs_within_numerics_contract(vllm_compiled):
    dtype, model, _, runs = vllm_compiled
    for positions, _hidden, fused_out, eager_out in runs:
        for name, (_, per_layer) in (("fused", fused_out), ("eager unfused", eager_out)):
            for layer, (qkv, q, k, v) in zip(model.layers, per_layer):
                exact_q, exact_k = vllm_exact(layer, qkv, positions)
                for out, exact in ((q, exact_q), (k, exact_k)):
                    assert out.dtype == dtype
                    c = compare(out, exact, head_dim=layer.spec.d, numerics="unfused")
                    assert c.passed, (name, layer.spec, c)
                assert torch.equal(v, qkv[:, layer.q_size + layer.kv_size :])
        # The models' outputs agree: first layer q/k (same qkv up to the projection's rounding)
        # and the final hidden states.
        fused_hidden, eager_hidden = fused_out[0].double(), eager_out[0].double()
        scale = eager_hidden.abs().max()
        tol = 2.0**-5 if dtype == torch.bfloat16 else 2.0**-14
        assert (fused_hidden - eager_hidden).abs().max() <= tol * scale
        for i in (1, 2):
            a, b = fused_out[1][0][i].double(), eager_out[1][0][i].double()
            assert (a - b).abs().max() <= 2 * tol * b.abs().max()


# ------------------------------------------------------------- Hugging Face Qwen3-style code


class Qwen3RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps, dtype, gen):
        super().__init__()
        self.weight = nn.Parameter((1.0 + 0.2 * torch.randn(hidden_size, generator=gen)).to(dtype))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


class Qwen3RotaryEmbedding(nn.Module):
    """cos/sin ``[B, S, D]`` with repeated halves, from the real table (fqr.rope_cache)."""

    def __init__(self, head_dim, dtype):
        super().__init__()
        self.dtype = dtype
        self.register_buffer("table", rope_cos_sin_cache(head_dim, MAX_POS, 1e6), persistent=False)

    def forward(self, position_ids):
        cos, sin = self.table[position_ids].chunk(2, dim=-1)
        return torch.cat((cos, cos), -1).to(self.dtype), torch.cat((sin, sin), -1).to(self.dtype)


class Qwen3Attention(nn.Module):
    def __init__(self, hq, hkv, head_dim, eps, dtype, gen):
        super().__init__()
        self.head_dim, self.groups = head_dim, hq // hkv
        self.q_proj = nn.Linear(HIDDEN, hq * head_dim, bias=False, dtype=dtype)
        self.k_proj = nn.Linear(HIDDEN, hkv * head_dim, bias=False, dtype=dtype)
        self.v_proj = nn.Linear(HIDDEN, hkv * head_dim, bias=False, dtype=dtype)
        self.o_proj = nn.Linear(hq * head_dim, HIDDEN, bias=False, dtype=dtype)
        self.q_norm = Qwen3RMSNorm(head_dim, eps, dtype, gen)
        self.k_norm = Qwen3RMSNorm(head_dim, eps, dtype, gen)
        self.rotary_emb = Qwen3RotaryEmbedding(head_dim, dtype)

    def forward(self, hidden_states, position_ids):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q_lin, k_lin = self.q_proj(hidden_states), self.k_proj(hidden_states)
        query_states = self.q_norm(q_lin.view(hidden_shape)).transpose(1, 2)
        key_states = self.k_norm(k_lin.view(hidden_shape)).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = self.rotary_emb(position_ids)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        attn = F.scaled_dot_product_attention(
            query_states,
            key_states.repeat_interleave(self.groups, 1),
            value_states.repeat_interleave(self.groups, 1),
            is_causal=True,
        )
        out = self.o_proj(attn.transpose(1, 2).reshape(*input_shape, -1))
        return hidden_states + out, (q_lin, k_lin, cos, sin, query_states, key_states)


HF_LAYERS = [(4, 2, 32, 1e-6), (2, 1, 64, 1e-6), (4, 2, 32, 1e-5)]


class Qwen3Model(nn.Module):
    def __init__(self, dtype, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(
            Qwen3Attention(hq, hkv, d, eps, dtype, gen) for hq, hkv, d, eps in HF_LAYERS
        )

    def forward(self, hidden_states, position_ids):
        outs = []
        for layer in self.layers:
            hidden_states, o = layer(hidden_states, position_ids)
            outs.append(o)
        return hidden_states, outs


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def hf_compiled(request):
    """Compiled with the pass in Inductor's post_grad_custom_post_pass (no fqr backend)."""
    dtype = request.param
    print(f"FQR_TEST_SEED={SEED}")
    model = Qwen3Model(dtype, seed=SEED).eval()
    fusion_pass = FusionPass()
    g = torch.Generator().manual_seed(SEED + 3)
    batch, seq = 2, 5
    hidden = torch.randn(batch, seq, HIDDEN, generator=g).to(dtype)
    # bf16: a position row per sequence; fp32: one row broadcast over the batch (cos [1, S, D])
    rows = batch if dtype == torch.bfloat16 else 1
    position_ids = torch.randint(0, MAX_POS, (rows, seq), generator=g)
    patches = {"post_grad_custom_post_pass": fusion_pass, "fx_graph_cache": False}
    with (
        torch.no_grad(),
        torch._inductor.config.patch(patches),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        fused_out = torch.compile(model)(hidden, position_ids)
        eager_out = model(hidden, position_ids)
    torch._dynamo.reset()
    return dtype, model, fusion_pass, fused_out, eager_out


def test_hf_every_layer_fused(hf_compiled):
    _, model, fusion_pass, _, _ = hf_compiled
    (graph,) = fusion_pass.stats.graphs
    assert fusion_pass.stats.sites == len(HF_LAYERS)
    assert graph.ops["fqr.qk_rmsnorm_rope.default"] == len(HF_LAYERS)
    left = {
        op: n
        for op, n in graph.ops.items()
        if op
        in ("aten.rsqrt.default", "aten.mean.dim", "aten.pow.Tensor_Scalar", "aten.neg.default")
    }
    assert not left, f"unfused norm/RoPE ops left in the graph: {left}"


def test_hf_outputs_within_numerics_contract(hf_compiled):
    dtype, model, _, fused_out, eager_out = hf_compiled
    for name, (_, per_layer) in (("fused", fused_out), ("eager unfused", eager_out)):
        for layer, (hq, hkv, d, eps), (q_lin, k_lin, cos, sin, q, k) in zip(
            model.layers, HF_LAYERS, per_layer
        ):
            b, s = q_lin.shape[:2]
            # cos/sin may be [1, S, D] (one position row for the whole batch): broadcast; the
            # angle rows are [cos | sin] of the first half of each (HF repeats it).
            rows = torch.cat(
                [t.expand(b, s, d)[..., : d // 2].reshape(b * s, d // 2) for t in (cos, sin)], -1
            )
            for lin, norm, out, heads in (
                (q_lin, layer.q_norm, q, hq),
                (k_lin, layer.k_norm, k, hkv),
            ):
                normed = reference.rms_norm(
                    lin.reshape(b * s, -1), norm.weight, eps=eps, group_size=d
                )
                exact = reference.rotate(normed, rows, head_dim=d)
                assert out.shape == (b, heads, s, d) and out.dtype == dtype
                got = out.transpose(1, 2).reshape(b * s, heads * d)
                c = compare(got, exact, head_dim=d, numerics="unfused")
                assert c.passed, (name, d, c)
    scale = eager_out[0].double().abs().max()
    tol = 2.0**-5 if dtype == torch.bfloat16 else 2.0**-14
    assert (fused_out[0].double() - eager_out[0].double()).abs().max() <= tol * scale


# ------------------------------------------------------------------------------ near misses


def rms_norm_over_heads(x, weight, eps, bias=None):
    """Not an RMSNorm per head: the statistic runs over the heads (dim -2). Sizes and dims are
    wildcards in the first match, so this reaches Inductor's re-check, which must reject it."""
    orig_dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(dim=-2, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    return x.to(orig_dtype) * weight


def test_near_miss_is_left_unfused():
    layers = [VLLM_LAYERS[0], Layer(4, 2, 32, 32, neox=True, bias=False, eps=1e-6)]
    model = VllmModel(layers, torch.float32, seed=SEED).eval()
    model.layers[1].norm = rms_norm_over_heads
    fusion = fqr.fusion.backend()
    positions, hidden = inputs(9, torch.float32, SEED + 4)
    with torch.no_grad():
        fused_out = torch.compile(model, backend=fusion)(positions, hidden)
        eager_out = model(positions, hidden)
    torch._dynamo.reset()
    assert fusion.stats.sites == 1
    assert fusion.stats.graphs[0].ops["aten.rsqrt.default"] == 2  # layer 1's q and k norms
    for (_, qf, kf, _), (_, qe, ke, _) in zip(fused_out[1], eager_out[1]):
        assert torch.allclose(qf, qe, rtol=1e-5, atol=1e-5)
        assert torch.allclose(kf, ke, rtol=1e-5, atol=1e-5)
