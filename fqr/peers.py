"""The unfused implementations that ``fqr bench`` measures the fused kernel against.

Each peer computes the same attention prologue as :func:`fqr.split_qkv_rmsnorm_rope`, the way a
serving stack does it today without fusion:

``eager``
    PyTorch eager, written as vLLM's model code writes it (``Qwen3Attention.forward``)::

        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q_norm(q.view(T, Hq, D)).view(T, Hq * D)        # RMSNorm.forward_native
        k = k_norm(k.view(T, Hkv, D)).view(T, Hkv * D)      #   (GemmaRMSNorm for (1 + w))
        q, k = rotary_emb(positions, q, k)                  # RotaryEmbedding.forward_native

    ``RMSNorm.forward_native``: ``x.float() * rsqrt(mean(x^2) + eps)``, rounded to the model dtype,
    then ``* w`` in the model dtype; ``GemmaRMSNorm.forward_static``: ``x * (1 + w.float())`` in
    fp32, rounded once. ``RotaryEmbedding.forward_native``: ``cos_sin_cache`` (held in the model
    dtype) gathered by ``positions``, ``apply_rotary_emb_torch`` on the first ``rotary_dim``
    features of each head in the model dtype, the rest concatenated back. OLMo2 (``norm="full"``)
    normalises the whole q and the whole k projection; Llama 3 / GLM-4 (``norm="none"``) have no
    QK norm. ``v`` stays the strided view of ``qkv`` that vLLM hands to attention (not copied).
``compile``
    ``torch.compile(fullgraph=True)`` of ``eager``, token dimension dynamic (as vLLM marks it).
``liger``
    Liger-Kernel's Triton ``liger_rms_norm`` (casting mode ``llama``, or ``gemma`` for ``(1 + w)``
    weights) on q and k, then ``liger_rope`` (Hugging Face layout: per-token ``cos``/``sin`` rows
    ``[T, D]`` gathered from tables precomputed once). Liger rotates whole heads NeoX-style only,
    so presets with partial rotary or GPT-J pairs have no Liger peer.

Their numerics are the ``unfused`` contract of :mod:`fqr.numerics` (roundings between the ops).
A peer is built once per (prologue spec, dtype, device) by :func:`build_peer`; tables it holds (the
cache in the model dtype, Liger's cos/sin tables) are prepared there, outside any timing.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

from .fusion.unfused import vllm_gemma_rms_norm, vllm_rms_norm, vllm_rotary_embedding
from .presets import PrologueSpec

PEER_NAMES = ("eager", "compile", "liger")


# --------------------------------------------------------------- eager, as vLLM writes it
# (the op-for-op copies of vLLM's code in fqr.fusion.unfused, which the fusion patterns are
# traced from too)


def _norm(x: torch.Tensor, weight: torch.Tensor, spec: PrologueSpec) -> torch.Tensor:
    if spec.weight_offset == 1.0:
        return vllm_gemma_rms_norm(x, weight, spec.eps)
    if spec.weight_offset:
        raise ValueError(f"weight_offset {spec.weight_offset}: vLLM's norms have offset 0 or 1")
    return vllm_rms_norm(x, weight, spec.eps)


def vllm_prologue(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    spec: PrologueSpec,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The unfused prologue of vLLM's attention modules (module docstring, ``eager``)."""
    q, k, v = qkv.split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
    if spec.norm == "head":
        d = spec.head_dim
        q = _norm(q.view(*q.shape[:-1], q.shape[-1] // d, d), q_weight, spec).view(q.shape)
        k = _norm(k.view(*k.shape[:-1], k.shape[-1] // d, d), k_weight, spec).view(k.shape)
    elif spec.norm == "full":
        q = _norm(q, q_weight, spec)
        k = _norm(k, k_weight, spec)
    q, k = vllm_rotary_embedding(positions, q, k, spec.head_dim, cos_sin_cache, spec.is_neox)
    return q, k, v


# ------------------------------------------------------------------------------- Liger


def _liger_unsupported(spec: PrologueSpec) -> str | None:
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger_kernel is not installed"
    if not spec.is_neox or spec.rotary_dim != spec.head_dim:
        return (
            "Liger's RoPE rotates whole heads NeoX-style only (this preset has "
            f"{'partial rotary' if spec.rotary_dim != spec.head_dim else 'GPT-J pairs'})"
        )
    return None


def _liger_prologue(spec: PrologueSpec, cos_sin_cache_fp32: torch.Tensor):
    from liger_kernel.transformers.functional import liger_rms_norm, liger_rope

    half = spec.rotary_dim // 2
    cos_half, sin_half = cos_sin_cache_fp32[:, :half], cos_sin_cache_fp32[:, half:]
    cos_table = torch.cat([cos_half, cos_half], dim=-1).contiguous()  # HF layout [P, D]
    sin_table = torch.cat([sin_half, sin_half], dim=-1).contiguous()
    casting = "gemma" if spec.weight_offset else "llama"

    def run(qkv, positions, q_weight, k_weight):
        t = qkv.shape[0]
        q, k, v = qkv.split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
        d = spec.head_dim
        if spec.norm == "head":
            q = liger_rms_norm(
                q.view(t, spec.num_heads, d), q_weight, spec.eps, spec.weight_offset, casting
            )
            k = liger_rms_norm(
                k.view(t, spec.num_kv_heads, d), k_weight, spec.eps, spec.weight_offset, casting
            )
        elif spec.norm == "full":
            q = liger_rms_norm(q, q_weight, spec.eps, spec.weight_offset, casting)
            k = liger_rms_norm(k, k_weight, spec.eps, spec.weight_offset, casting)
        else:
            q, k = q.contiguous(), k.contiguous()  # Liger's RoPE works in place
        cos = cos_table.index_select(0, positions).unsqueeze(0)
        sin = sin_table.index_select(0, positions).unsqueeze(0)
        q4 = q.reshape(1, t, spec.num_heads, d).transpose(1, 2)
        k4 = k.reshape(1, t, spec.num_kv_heads, d).transpose(1, 2)
        q4, k4 = liger_rope(q4, k4, cos, sin)
        return (
            q4.transpose(1, 2).reshape(t, spec.q_size),
            k4.transpose(1, 2).reshape(t, spec.kv_size),
            v,
        )

    return run


# ----------------------------------------------------------------------------- registry

PeerFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor],
]


def peer_unavailable_reason(name: str, spec: PrologueSpec) -> str | None:
    """None when peer ``name`` can run ``spec`` here, else why not."""
    if name not in PEER_NAMES:
        raise ValueError(f"peer must be one of {', '.join(PEER_NAMES)}; got {name!r}")
    if name == "liger":
        return _liger_unsupported(spec)
    return None


def build_peer(
    name: str, spec: PrologueSpec, cos_sin_cache_fp32: torch.Tensor, dtype: torch.dtype
) -> PeerFn:
    """Peer ``name`` for ``spec`` in ``dtype``: ``fn(qkv, positions, q_weight, k_weight)``.

    ``cos_sin_cache_fp32`` is the model's real table (:meth:`fqr.presets.Preset.cos_sin_cache`);
    vLLM's peers hold it in the model dtype as vLLM does, Liger gets Hugging Face cos/sin tables.
    """
    reason = peer_unavailable_reason(name, spec)
    if reason:
        raise ValueError(f"peer {name!r} cannot run here: {reason}")
    if name == "liger":
        return _liger_prologue(spec, cos_sin_cache_fp32)
    cache = cos_sin_cache_fp32.to(dtype)

    def eager(qkv, positions, q_weight, k_weight):
        return vllm_prologue(qkv, positions, cache, q_weight, k_weight, spec)

    if name == "eager":
        return eager
    compiled = torch.compile(vllm_prologue, fullgraph=True)

    def compiled_prologue(qkv, positions, q_weight, k_weight):
        if qkv.shape[0] >= 2:  # sizes 0 and 1 are always specialised
            torch._dynamo.mark_dynamic(qkv, 0)
            torch._dynamo.mark_dynamic(positions, 0)
        return compiled(qkv, positions, cache, q_weight, k_weight, spec)

    return compiled_prologue


# ------------------------------------------- the variants' unfused chains, as vLLM writes them


def vllm_weightless_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """vLLM ``RMSNorm(has_weight=False).forward_static``: the statistic and the product in fp32,
    rounded once to x's dtype."""
    orig_dtype = x.dtype
    x = x.float()
    variance = x.pow(2).mean(dim=-1, keepdim=True)
    return (x * torch.rsqrt(variance + eps)).to(orig_dtype)


def gemma4_prologue(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    spec: PrologueSpec,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM's ``Gemma4Attention.forward`` up to attention: ``q_norm``, ``k_norm`` and
    ``rotary_emb`` as :func:`vllm_prologue`, then ``v_norm`` (no weight) on each head of v."""
    q, k, v = vllm_prologue(qkv, positions, cos_sin_cache, q_weight, k_weight, spec)
    d = spec.head_dim
    v = vllm_weightless_rms_norm(v.unflatten(-1, (v.shape[-1] // d, d)), spec.eps).flatten(-2)
    return q, k, v


def llama4_prologue(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor | None,
    spec: PrologueSpec,
    floor_scale: float | None = None,
    attn_scale: float = 0.1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM's ``Llama4Attention.forward`` up to attention: on RoPE layers ``rotary_emb``, then
    ``qk_norm(q.float())`` (``RMSNorm(head_dim, has_weight=False)``) cast back to the model
    dtype; on NoPE layers (``cos_sin_cache`` None) with temperature tuning ``q = (q *
    _get_attn_scale(positions)).to(q.dtype)``. v is the view of qkv vLLM hands on."""
    q, k, v = qkv.split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
    d = spec.head_dim
    if cos_sin_cache is not None:
        q, k = vllm_rotary_embedding(positions, q, k, d, cos_sin_cache, spec.is_neox)
        q = vllm_weightless_rms_norm(q.reshape(-1, d).float(), spec.eps)
        q = q.reshape(-1, spec.q_size).to(qkv.dtype)
        k = vllm_weightless_rms_norm(k.reshape(-1, d).float(), spec.eps)
        k = k.reshape(-1, spec.kv_size).to(qkv.dtype)
    if floor_scale is not None:
        floor = torch.floor((positions + 1.0) / floor_scale)
        scale = (torch.log(floor + 1.0) * attn_scale + 1.0).unsqueeze(-1)
        q = (q * scale).to(q.dtype)
    return q, k, v
