"""The fusion pass on compiled models (CPU, Inductor).

The models are written here, independently of ``fqr.fusion.unfused`` (from which the patterns
are traced), the way vLLM's and Hugging Face's model code writes the attention prologue. Each
model mixes two attention shapes and, across its layers, NeoX / GPT-J, bias on / off, eps 1e-6 /
1e-5, Gemma's (1 + w) norm and partial rotary. Per dtype one model is compiled once and shared
by the asserts (torch.compile on CPU is slow): fused sites == layers, no unfused norm/RoPE op
left, every layer's q/k within the ``unfused`` numerics contract of float64 computed from that
model's own qkv (and the eager unfused model's too), v bit-exact, one compile for several
token counts.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fqr.fusion
from fqr.fusion.fusion_pass import FusionPass
from fqr.numerics import compare
from fqr.rope_cache import rope_cos_sin_cache

from test_fusion_ops import exact_heads

HIDDEN = 64
MAX_POS = 2048
# Fresh weights and inputs each run (the compiled models are module fixtures, so one seed per
# module); replay a failure with FQR_TEST_SEED=<seed>.
SEED = int(os.environ.get("FQR_TEST_SEED") or random.SystemRandom().randrange(2**31))
UNFUSED_LEFTOVERS = ("aten.rsqrt.default", "aten.mean.dim", "aten.pow.Tensor_Scalar",
                     "aten.index.Tensor", "aten.index_select.default", "aten.cat.default",
                     "aten.split.Tensor", "aten.split_with_sizes.default", "aten.slice.Tensor")


# ------------------------------------------------------------------- vLLM-style model code

def rms_norm_forward_native(x, weight, eps, bias=None):  # vLLM RMSNorm.forward_static
    orig_dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(dim=-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    x = x.to(orig_dtype)
    x = x * weight
    if bias is not None:
        x = x + bias
    return x


def gemma_rms_norm_forward_native(x, weight, eps, bias=None):  # vLLM GemmaRMSNorm
    orig_dtype = x.dtype
    x = x.float()
    variance = x.pow(2).mean(dim=-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    x = x * (1.0 + weight.float())
    x = x.to(orig_dtype)
    if bias is not None:
        x = x + bias
    return x


def apply_rotary_emb_torch(x, cos, sin, is_neox_style):  # vLLM rotary_embedding/common.py
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    if is_neox_style:
        x1, x2 = torch.chunk(x, 2, dim=-1)
    else:
        x1 = x[..., ::2]
        x2 = x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox_style:
        return torch.cat((o1, o2), dim=-1)
    return torch.stack((o1, o2), dim=-1).flatten(-2)


class RotaryEmbedding(nn.Module):  # vLLM RotaryEmbedding.forward_native
    def __init__(self, head_size, rotary_dim, is_neox_style, dtype):
        super().__init__()
        self.head_size, self.rotary_dim, self.is_neox_style = head_size, rotary_dim, is_neox_style
        self.register_buffer("cos_sin_cache",
                             rope_cos_sin_cache(rotary_dim, MAX_POS, 1e6, dtype=dtype),
                             persistent=False)

    def forward(self, positions, query, key):
        positions = positions.flatten()
        num_tokens = positions.shape[0]
        cos_sin = self.cos_sin_cache.index_select(0, positions)
        cos, sin = cos_sin.chunk(2, dim=-1)
        query_shape = query.shape
        query = query.view(num_tokens, -1, self.head_size)
        query_rot = query[..., : self.rotary_dim]
        query_pass = query[..., self.rotary_dim:]
        query_rot = apply_rotary_emb_torch(query_rot, cos, sin, self.is_neox_style)
        query = torch.cat((query_rot, query_pass), dim=-1).reshape(query_shape)
        key_shape = key.shape
        key = key.view(num_tokens, -1, self.head_size)
        key_rot = key[..., : self.rotary_dim]
        key_pass = key[..., self.rotary_dim:]
        key_rot = apply_rotary_emb_torch(key_rot, cos, sin, self.is_neox_style)
        key = torch.cat((key_rot, key_pass), dim=-1).reshape(key_shape)
        return query, key


@dataclass(frozen=True)
class Layer:
    hq: int
    hkv: int
    d: int
    rotary: int
    neox: bool
    bias: bool
    eps: float
    gemma: bool = False


# Two attention shapes (A: 4/2 heads of 32; B: 6/2 heads of 16), NeoX and GPT-J with bias on
# and off, eps 1e-6 and 1e-5, a Gemma (1 + w) norm, full and partial rotary.
VLLM_LAYERS = [
    Layer(4, 2, 32, 32, neox=True, bias=False, eps=1e-6),
    Layer(6, 2, 16, 8, neox=False, bias=True, eps=1e-5),
    Layer(4, 2, 32, 16, neox=True, bias=True, eps=1e-6, gemma=True),
    Layer(6, 2, 16, 16, neox=False, bias=False, eps=1e-5),
]


class VllmAttention(nn.Module):  # vLLM Qwen3Attention.forward, small
    def __init__(self, spec: Layer, dtype, gen):
        super().__init__()
        self.spec = spec
        self.head_dim = spec.d
        self.q_size, self.kv_size = spec.hq * spec.d, spec.hkv * spec.d
        self.variance_epsilon = spec.eps
        self.qkv_proj = nn.Linear(HIDDEN, self.q_size + 2 * self.kv_size, bias=spec.bias,
                                  dtype=dtype)
        self.o_proj = nn.Linear(self.q_size, HIDDEN, bias=False, dtype=dtype)
        base = 0.0 if spec.gemma else 1.0
        self.q_weight = nn.Parameter((base + 0.2 * torch.randn(spec.d, generator=gen)).to(dtype))
        self.k_weight = nn.Parameter((base + 0.2 * torch.randn(spec.d, generator=gen)).to(dtype))
        self.q_bias = self.k_bias = None
        if spec.bias:
            self.q_bias = nn.Parameter((0.2 * torch.randn(spec.d, generator=gen)).to(dtype))
            self.k_bias = nn.Parameter((0.2 * torch.randn(spec.d, generator=gen)).to(dtype))
        self.norm = gemma_rms_norm_forward_native if spec.gemma else rms_norm_forward_native
        self.rotary_emb = RotaryEmbedding(spec.d, spec.rotary, spec.neox, dtype)

    def forward(self, positions, hidden_states):
        qkv, _ = self.qkv_proj(hidden_states), None
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q_by_head = q.view(*q.shape[:-1], q.shape[-1] // self.head_dim, self.head_dim)
        q_by_head = self.norm(q_by_head, self.q_weight, self.variance_epsilon, self.q_bias)
        q = q_by_head.view(q.shape)
        k_by_head = k.view(*k.shape[:-1], k.shape[-1] // self.head_dim, self.head_dim)
        k_by_head = self.norm(k_by_head, self.k_weight, self.variance_epsilon, self.k_bias)
        k = k_by_head.view(k.shape)
        q, k = self.rotary_emb(positions, q, k)
        t, s = hidden_states.shape[0], self.spec
        attn = F.scaled_dot_product_attention(
            q.view(t, s.hq, s.d).transpose(0, 1), k.view(t, s.hkv, s.d).transpose(0, 1),
            v.reshape(t, s.hkv, s.d).transpose(0, 1), is_causal=True, enable_gqa=True)
        out = self.o_proj(attn.transpose(0, 1).reshape(t, self.q_size))
        return hidden_states + out, (qkv, q, k, v)


class VllmModel(nn.Module):
    def __init__(self, layers, dtype, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(VllmAttention(s, dtype, gen) for s in layers)

    def forward(self, positions, hidden_states):
        outs = []
        for layer in self.layers:
            hidden_states, o = layer(positions, hidden_states)
            outs.append(o)
        return hidden_states, outs


def vllm_exact(layer: VllmAttention, qkv, positions):
    s = layer.spec
    cos, sin = layer.rotary_emb.cos_sin_cache[positions].chunk(2, dim=-1)
    offset = 1.0 if s.gemma else 0.0
    q, k = qkv[:, : layer.q_size], qkv[:, layer.q_size: layer.q_size + layer.kv_size]
    return (exact_heads(q, layer.q_weight, layer.q_bias, offset, s.eps, cos, sin, s.d, s.neox),
            exact_heads(k, layer.k_weight, layer.k_bias, offset, s.eps, cos, sin, s.d, s.neox))


def inputs(tokens, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, MAX_POS, (tokens,), generator=g),
            torch.randn(tokens, HIDDEN, generator=g).to(dtype))


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
                assert torch.equal(v, qkv[:, layer.q_size + layer.kv_size:])
        # The models' outputs agree: first layer q/k (same qkv up to the projection's rounding)
        # and the final hidden states.
        fused_hidden, eager_hidden = fused_out[0].double(), eager_out[0].double()
        scale = eager_hidden.abs().max()
        tol = 2.0 ** -5 if dtype == torch.bfloat16 else 2.0 ** -14
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
    x2 = x[..., x.shape[-1] // 2:]
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
            query_states, key_states.repeat_interleave(self.groups, 1),
            value_states.repeat_interleave(self.groups, 1), is_causal=True)
        out = self.o_proj(attn.transpose(1, 2).reshape(*input_shape, -1))
        return hidden_states + out, (q_lin, k_lin, cos, sin, query_states, key_states)


HF_LAYERS = [(4, 2, 32, 1e-6), (2, 1, 64, 1e-6), (4, 2, 32, 1e-5)]


class Qwen3Model(nn.Module):
    def __init__(self, dtype, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(Qwen3Attention(hq, hkv, d, eps, dtype, gen)
                                    for hq, hkv, d, eps in HF_LAYERS)

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
    with torch.no_grad(), torch._inductor.config.patch(patches), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        fused_out = torch.compile(model)(hidden, position_ids)
        eager_out = model(hidden, position_ids)
    torch._dynamo.reset()
    return dtype, model, fusion_pass, fused_out, eager_out


def test_hf_every_layer_fused(hf_compiled):
    _, model, fusion_pass, _, _ = hf_compiled
    (graph,) = fusion_pass.stats.graphs
    assert fusion_pass.stats.sites == len(HF_LAYERS)
    assert graph.ops["fqr.qk_rmsnorm_rope.default"] == len(HF_LAYERS)
    left = {op: n for op, n in graph.ops.items()
            if op in ("aten.rsqrt.default", "aten.mean.dim", "aten.pow.Tensor_Scalar",
                      "aten.neg.default")}
    assert not left, f"unfused norm/RoPE ops left in the graph: {left}"


def test_hf_outputs_within_numerics_contract(hf_compiled):
    dtype, model, _, fused_out, eager_out = hf_compiled
    for name, (_, per_layer) in (("fused", fused_out), ("eager unfused", eager_out)):
        for layer, (hq, hkv, d, eps), (q_lin, k_lin, cos, sin, q, k) in zip(
                model.layers, HF_LAYERS, per_layer):
            b, s = q_lin.shape[:2]
            # cos/sin may be [1, S, D] (one position row for the whole batch): broadcast
            half_cos, half_sin = (t.expand(b, s, d)[..., : d // 2].reshape(b * s, d // 2)
                                  for t in (cos, sin))
            for lin, norm, out, heads in ((q_lin, layer.q_norm, q, hq),
                                          (k_lin, layer.k_norm, k, hkv)):
                exact = exact_heads(lin.reshape(b * s, -1), norm.weight, None, 0.0, eps,
                                    half_cos, half_sin, d, True)
                assert out.shape == (b, heads, s, d) and out.dtype == dtype
                got = out.transpose(1, 2).reshape(b * s, heads * d)
                c = compare(got, exact, head_dim=d, numerics="unfused")
                assert c.passed, (name, d, c)
    scale = eager_out[0].double().abs().max()
    tol = 2.0 ** -5 if dtype == torch.bfloat16 else 2.0 ** -14
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
