"""Small randomly initialised attention stacks written like vLLM model code (unfused).

Each :class:`VllmStyleAttention` layer is vLLM's ``Qwen3Attention`` (Gemma 3's with
``gemma=True``) made small: packed ``qkv_proj``, per-head q/k RMSNorm, RoPE from a
``cos_sin_cache`` in the model dtype, causal GQA attention over the tokens (SDPA on
``[1, H, T, D]`` views in the model dtype, k/v heads shared through ``enable_gqa``: the flash
or cuDNN backend on CUDA, as vLLM runs FlashAttention), ``o_proj`` and a residual add. Layers
may have different shapes (a mixed-shape model). The model returns the final hidden states
and, per layer, ``(qkv, q, k, v)`` so that callers can check each
prologue against a float64 reference. Used by ``fqr fuse`` and the fusion tests.

The ``qkv_proj`` path (``prologue="dispatch"``): the layer runs its projection and prologue as
one call, ``torch.ops.fqr.split_qkv_rmsnorm_rope_proj_dispatch(hidden, qkv_proj.weight, ...,
qkv_bias=qkv_proj.bias)`` (:mod:`fqr.projection`): the fused GEMM + prologue kernel where the
dispatch table measured it faster for this device, shape and token count, else ``qkv_proj``
(cuBLAS on CUDA) then fqr's prologue op. Each layer's record is then ``(hidden, q, k, v)``, the
states the prologue started from, and :meth:`VllmStyleAttention.check_prologue` holds it to
what the dispatch ran (:meth:`VllmStyleAttention.check_projected`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from .. import projection, reference
from ..numerics import compare
from ..presets import Preset, PrologueSpec
from ..rope_cache import rope_cos_sin_cache
from ..unfused import vllm_qk_norm_rope

# The models `fqr fuse --device cuda` compiles (fqr.fusion.compiled): this module's vLLM-shaped
# stack at a preset's shapes, and Hugging Face transformers' Qwen3 (fqr.fusion.hf_models).
MODELS = ("hf-qwen3", "vllm")
# How a VllmStyleAttention runs its projection and prologue: vLLM's unfused code (what the fusion
# pass matches), or one call through the projection dispatch (fqr.projection).
PROLOGUES = ("unfused", "dispatch")


@dataclass(frozen=True)
class AttentionShape:
    """One layer: its prologue (per-head QK norm), a qkv_proj and norm bias, its RoPE table."""

    spec: PrologueSpec
    bias: bool = False  # qkv_proj bias and a norm bias
    rope_theta: float = 1e6
    max_position: int = 4096

    @property
    def gemma(self) -> bool:
        """GemmaRMSNorm: the norm scales by ``(1 + w)``."""
        return self.spec.weight_offset == 1.0

    @classmethod
    def from_preset(
        cls, preset: Preset, *, bias: bool = False, max_position: int = 4096
    ) -> AttentionShape:
        if preset.norm != "head" or preset.variant != "split-qkv":
            raise ValueError(
                f"preset {preset.name} has norm={preset.norm!r}, variant {preset.variant!r}; the "
                f"fusion patterns cover the split-qkv per-head QK-norm prologue (norm='head': "
                f"Qwen3, Gemma 3)"
            )
        return cls(
            preset.spec,
            bias=bias,
            rope_theta=preset.rope_theta,
            max_position=min(max_position, preset.max_position),
        )


class VllmStyleAttention(nn.Module):
    """One layer (module docstring); ``prologue``: ``"unfused"`` (vLLM's code: ``qkv_proj``,
    then the unfused split, norm and RoPE) or ``"dispatch"`` (the ``qkv_proj`` path: projection
    and prologue through :func:`fqr.projection.proj_dispatch`)."""

    def __init__(
        self,
        hidden_size: int,
        shape: AttentionShape,
        dtype: torch.dtype,
        *,
        prologue: str = "unfused",
    ):
        super().__init__()
        if prologue not in PROLOGUES:
            raise ValueError(f"prologue must be one of {', '.join(PROLOGUES)}, got {prologue!r}")
        s, d = shape.spec, shape.spec.head_dim
        self.shape = shape
        self.prologue = prologue
        self.qkv_proj = nn.Linear(hidden_size, s.qkv_width, bias=shape.bias, dtype=dtype)
        self.o_proj = nn.Linear(s.q_size, hidden_size, bias=False, dtype=dtype)
        # Gemma stores w with the norm scaling by (1 + w): keep both near a unit scale.
        base = 0.0 if shape.gemma else 1.0
        self.q_weight = nn.Parameter((base + 0.1 * torch.randn(d)).to(dtype))
        self.k_weight = nn.Parameter((base + 0.1 * torch.randn(d)).to(dtype))
        self.q_bias = nn.Parameter((0.1 * torch.randn(d)).to(dtype)) if shape.bias else None
        self.k_bias = nn.Parameter((0.1 * torch.randn(d)).to(dtype)) if shape.bias else None
        # vLLM keeps the cache in the model dtype (RotaryEmbedding._match_cos_sin_cache_dtype).
        self.register_buffer(
            "cos_sin_cache",
            rope_cos_sin_cache(s.rotary_dim, shape.max_position, shape.rope_theta, dtype=dtype),
            persistent=False,
        )

    def projected_prologue(self, positions: torch.Tensor, hidden: torch.Tensor):
        """The ``qkv_proj`` path: ``(q, k, v)`` of ``hidden`` through the projection dispatch
        (``torch.ops.fqr.split_qkv_rmsnorm_rope_proj_dispatch``; a torch op, so a compiled
        model calls it too and the choice is made per call, at run time)."""
        return torch.ops.fqr.split_qkv_rmsnorm_rope_proj_dispatch(
            hidden,
            self.qkv_proj.weight,
            positions,
            self.cos_sin_cache,
            self.q_weight,
            self.k_weight,
            qkv_bias=self.qkv_proj.bias,
            q_bias=self.q_bias,
            k_bias=self.k_bias,
            **self.shape.spec.kwargs(),
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor):
        s = self.shape.spec
        if self.prologue == "dispatch":
            q, k, v = self.projected_prologue(positions, hidden)
            return self._attend(hidden, q, k, v), (hidden, q, k, v)
        qkv = self.qkv_proj(hidden)
        q, k, v = vllm_qk_norm_rope(
            qkv,
            positions,
            self.cos_sin_cache,
            self.q_weight,
            self.k_weight,
            q_size=s.q_size,
            kv_size=s.kv_size,
            eps=s.eps,
            is_neox=s.is_neox,
            gemma=self.shape.gemma,
            q_bias=self.q_bias,
            k_bias=self.k_bias,
        )
        return self._attend(hidden, q, k, v), (qkv, q, k, v)

    def _attend(self, hidden, q, k, v):
        """Causal GQA attention over the tokens, ``o_proj`` and the residual add."""
        t = hidden.shape[0]
        q4, k4, v4 = self.attention_inputs(q, k, v)
        attn = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True)
        return hidden + self.o_proj(attn.transpose(1, 2).reshape(t, self.shape.spec.q_size))

    def attention_inputs(self, q, k, v):
        """q ``[T, Hq*D]``, k and v ``[T, Hkv*D]`` as the ``[1, H, T, D]`` views SDPA takes (no
        copy, k/v not repeated: GQA is the kernel's, ``enable_gqa=True``). Four dimensions and
        the model dtype are what let the flash (or memory-efficient) backend run; 3-D inputs
        fall back to the math backend, which on CUDA computes bf16 attention in fp32 GEMMs."""
        s = self.shape.spec
        t = q.shape[0]
        return (
            q.view(1, t, s.num_heads, s.head_dim).transpose(1, 2),
            k.view(1, t, s.num_kv_heads, s.head_dim).transpose(1, 2),
            v.view(1, t, s.num_kv_heads, s.head_dim).transpose(1, 2),
        )

    def check_prologue(self, positions, qkv, q, k, v) -> dict:
        """This layer's q and k (fused or not) against the float64 formulation of its
        ``qkv`` (:func:`fqr.reference.prologue`) under the ``unfused`` contract, and v the copy
        of qkv's v columns. With ``prologue="dispatch"`` the record's first entry is the
        layer's hidden states: :meth:`check_projected`."""
        if self.prologue == "dispatch":
            return self.check_projected(positions, qkv, q, k, v)
        s = self.shape.spec
        exact_q, exact_k, _ = reference.prologue(
            qkv,
            positions,
            self.cos_sin_cache,
            self.q_weight,
            self.k_weight,
            **s.kwargs(q_bias=self.q_bias, k_bias=self.k_bias),
        )
        cq = compare(q, exact_q, head_dim=s.head_dim, numerics="unfused")
        ck = compare(k, exact_k, head_dim=s.head_dim, numerics="unfused")
        v_exact = bool(torch.equal(v, qkv[:, s.q_size + s.kv_size :]))  # v is a copy
        return {
            "max_rel_head": max(cq.max_rel_head, ck.max_rel_head),
            "tolerance": cq.tolerance,
            "v_exact": v_exact,
            "passed": cq.passed and ck.passed and v_exact,
        }

    def check_projected(self, positions, hidden, q, k, v) -> dict:
        """The ``qkv_proj`` path's q, k, v against float64, under what the dispatch ran for
        ``hidden`` (``choice``): the fused kernel against :func:`fqr.reference.project` then
        the prologue, all three within the fused contract; the pair against the prologue of
        the row ``qkv_proj`` rounded (as the pair computed it, on the same device), q and k
        within the fused contract, v that row's v columns bit for bit."""
        s = self.shape.spec
        w, b = self.qkv_proj.weight.detach(), self.qkv_proj.bias
        b = None if b is None else b.detach()
        args = (positions, self.cos_sin_cache, self.q_weight, self.k_weight)
        biases = dict(q_bias=self.q_bias, k_bias=self.k_bias)
        choice = projection.choice_for(
            "split_qkv_rmsnorm_rope", hidden, w, *args, qkv_bias=b, **biases, **s.kwargs()
        )
        with torch.no_grad():
            row = reference.project(hidden, w, b) if choice == "fused" else F.linear(hidden, w, b)
        exact_q, exact_k, exact_v = reference.prologue(row, *args, **s.kwargs(**biases))
        cq = compare(q, exact_q, head_dim=s.head_dim)
        ck = compare(k, exact_k, head_dim=s.head_dim)
        if choice == "fused":
            v_ok = compare(v, exact_v, head_dim=s.head_dim).passed
        else:
            v_ok = bool(torch.equal(v, row[:, s.q_size + s.kv_size :]))
        return {
            "choice": choice,
            "max_rel_head": max(cq.max_rel_head, ck.max_rel_head),
            "tolerance": cq.tolerance,
            "v_exact": v_ok,
            "passed": cq.passed and ck.passed and v_ok,
        }

    def sdpa_backend(self, tokens: int) -> str:
        """The SDPA backend PyTorch picks for this layer's attention over ``tokens`` tokens on
        its device and dtype (``flash_attention``, ``efficient_attention``, ``math``, ...)."""
        s = self.shape.spec
        like = self.o_proj.weight
        q = like.new_empty(tokens, s.q_size)
        k = like.new_empty(tokens, s.kv_size)
        choice = torch._fused_sdp_choice(
            *self.attention_inputs(q, k, k), is_causal=True, enable_gqa=True
        )
        return SDPBackend(choice).name.lower()


class VllmStyleModel(nn.Module):
    """A stack of :class:`VllmStyleAttention` layers, one :class:`AttentionShape` each, all
    running ``prologue`` (``"unfused"`` or ``"dispatch"``: the ``qkv_proj`` path)."""

    def __init__(
        self,
        hidden_size: int,
        shapes: list[AttentionShape],
        dtype: torch.dtype,
        *,
        prologue: str = "unfused",
    ):
        super().__init__()
        self.hidden_size = hidden_size
        self.layers = nn.ModuleList(
            VllmStyleAttention(hidden_size, s, dtype, prologue=prologue) for s in shapes
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor):
        prologues = []
        for layer in self.layers:
            hidden, prologue = layer(positions, hidden)
            prologues.append(prologue)
        return hidden, prologues


def preset_model(
    preset: Preset,
    layers: int,
    dtype: torch.dtype,
    *,
    seed: int = 0,
    bias: bool = False,
    device: str | torch.device = "cpu",
    prologue: str = "unfused",
) -> VllmStyleModel:
    """``layers`` layers of ``preset``'s attention shapes, random weights from ``seed``;
    ``prologue="dispatch"``: the ``qkv_proj`` path (:class:`VllmStyleAttention`)."""
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    shape = AttentionShape.from_preset(preset, bias=bias)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = VllmStyleModel(preset.spec.q_size, [shape] * layers, dtype, prologue=prologue)
    return model.to(device).eval()
