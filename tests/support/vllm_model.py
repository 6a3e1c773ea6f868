"""A small vLLM-style model (written as vLLM's model code writes the attention prologue, not
from ``fqr.unfused``, from which the fusion patterns are traced), and its float64
expectation. Shared by the CPU fusion tests and the GPU ones."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from fqr import reference
from fqr.rope_cache import rope_cos_sin_cache

HIDDEN = 64
MAX_POS = 2048
# Fresh weights and inputs each run (the compiled models are module fixtures, so one seed per
# module); replay a failure with FQR_TEST_SEED=<seed>.
SEED = int(os.environ.get("FQR_TEST_SEED") or random.SystemRandom().randrange(2**31))


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
        self.register_buffer(
            "cos_sin_cache",
            rope_cos_sin_cache(rotary_dim, MAX_POS, 1e6, dtype=dtype),
            persistent=False,
        )

    def forward(self, positions, query, key):
        positions = positions.flatten()
        num_tokens = positions.shape[0]
        cos_sin = self.cos_sin_cache.index_select(0, positions)
        cos, sin = cos_sin.chunk(2, dim=-1)
        query_shape = query.shape
        query = query.view(num_tokens, -1, self.head_size)
        query_rot = query[..., : self.rotary_dim]
        query_pass = query[..., self.rotary_dim :]
        query_rot = apply_rotary_emb_torch(query_rot, cos, sin, self.is_neox_style)
        query = torch.cat((query_rot, query_pass), dim=-1).reshape(query_shape)
        key_shape = key.shape
        key = key.view(num_tokens, -1, self.head_size)
        key_rot = key[..., : self.rotary_dim]
        key_pass = key[..., self.rotary_dim :]
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
        self.qkv_proj = nn.Linear(
            HIDDEN, self.q_size + 2 * self.kv_size, bias=spec.bias, dtype=dtype
        )
        self.o_proj = nn.Linear(self.q_size, HIDDEN, bias=False, dtype=dtype)
        base = 0.0 if spec.gemma else 1.0
        self.q_weight = nn.Parameter(
            (base + 0.2 * torch.randn(spec.d, generator=gen, device=gen.device)).to(dtype)
        )
        self.k_weight = nn.Parameter(
            (base + 0.2 * torch.randn(spec.d, generator=gen, device=gen.device)).to(dtype)
        )
        self.q_bias = self.k_bias = None
        if spec.bias:
            self.q_bias = nn.Parameter(
                (0.2 * torch.randn(spec.d, generator=gen, device=gen.device)).to(dtype)
            )
            self.k_bias = nn.Parameter(
                (0.2 * torch.randn(spec.d, generator=gen, device=gen.device)).to(dtype)
            )
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
            q.view(t, s.hq, s.d).transpose(0, 1),
            k.view(t, s.hkv, s.d).transpose(0, 1),
            v.reshape(t, s.hkv, s.d).transpose(0, 1),
            is_causal=True,
            enable_gqa=True,
        )
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
    q, k = qkv[:, : layer.q_size], qkv[:, layer.q_size : layer.q_size + layer.kv_size]
    return reference.qk_prologue(
        q,
        k,
        positions,
        layer.rotary_emb.cos_sin_cache,
        layer.q_weight,
        layer.k_weight,
        head_dim=s.d,
        eps=s.eps,
        is_neox=s.neox,
        q_bias=layer.q_bias,
        k_bias=layer.k_bias,
        weight_offset=1.0 if s.gemma else 0.0,
    )


def inputs(tokens, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, MAX_POS, (tokens,), generator=g, device=g.device),
        torch.randn(tokens, HIDDEN, generator=g, device=g.device).to(dtype),
    )
