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

from .presets import PrologueSpec
from .unfused import (
    vllm_gemma_rms_norm,
    vllm_mrotary_embedding,
    vllm_rms_norm,
    vllm_rotary_embedding,
)

PEER_NAMES = ("eager", "compile", "liger")


# --------------------------------------------------------------- eager, as vLLM writes it
# (the op-for-op copies of vLLM's code in fqr.unfused, which the fusion patterns are
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


def hunyuan_prologue(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    spec: PrologueSpec,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM's / Hugging Face's HunYuan attention up to attention: ``rotary_emb`` first, then
    ``query_layernorm`` / ``key_layernorm`` on each head (``RMSNorm.forward_native``: ``x *
    rstd`` rounded to the model dtype, then times the weight)."""
    q, k, v = qkv.split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
    q, k = vllm_rotary_embedding(positions, q, k, spec.head_dim, cos_sin_cache, spec.is_neox)
    d = spec.head_dim
    q = _norm(q.reshape(*q.shape[:-1], q.shape[-1] // d, d), q_weight, spec).flatten(-2)
    k = _norm(k.reshape(*k.shape[:-1], k.shape[-1] // d, d), k_weight, spec).flatten(-2)
    return q, k, v


def _checkpoint_split(qkv: torch.Tensor, hq: int, hkv: int, d: int, layout: str):
    """q, k, v ``[T, H, D]`` of a packed row as Hugging Face's modeling code splits it:
    ``"qkv"`` (``split``), GPT-NeoX's ``"per-head"`` (``view(T, H, 3 * D).chunk(3)``),
    CodeGen's ``"codegen-mpN"`` (``view(T, N, 3 * W).split(W)`` as query, value, key)."""
    t = qkv.shape[0]
    if layout == "qkv":
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        return q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
    if layout == "per-head":
        q, k, v = qkv.view(t, hq, 3 * d).chunk(3, dim=-1)
        return q, k, v
    shards = int(layout.removeprefix("codegen-mp"))
    local = hq * d // shards
    q, v, k = qkv.view(t, shards, 3 * local).split(local, dim=-1)
    return (x.reshape(t, hq, d) for x in (q, k, v))


def checkpoint_row_prologue(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    spec: PrologueSpec,
    layout: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A checkpoint's own packed row (GPT-NeoX's per-head ``[q_h | k_h | v_h]``, CodeGen's
    ``codegen-mpN`` shards of ``[q | v | k]``) split as Hugging Face's modeling code splits it
    (:func:`_checkpoint_split`), then :func:`vllm_prologue`'s norm and rotation on
    ``[q | k | v]``; v a new tensor (the views are not contiguous)."""
    t, h, d = qkv.shape[0], spec.num_heads, spec.head_dim
    q, k, v = _checkpoint_split(qkv, h, spec.num_kv_heads, d, layout)
    packed = torch.cat([x.reshape(t, -1) for x in (q, k, v)], dim=-1)
    return vllm_prologue(packed, positions, cos_sin_cache, q_weight, k_weight, spec)


def hf_layernorm_prologue(
    inputs: dict,
    cos_sin_cache: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float,
    is_neox: bool,
    norm_weights: str,
    qkv_layout: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hugging Face's ``PersimmonAttention`` / ``ChameleonAttention`` up to attention: the row
    split as the model splits it, ``q_layernorm`` / ``k_layernorm`` (``nn.LayerNorm(head_dim)``:
    ``F.layer_norm`` with its affine) or ``q_norm`` / ``k_norm`` (``ChameleonLayerNorm``:
    ``F.layer_norm`` without, then ``* weight + bias`` of ``[H, D]``), then the rotation in the
    model dtype (:func:`vllm_rotary_embedding`, the ``cos_sin_cache`` held in it)."""
    d, t = head_dim, inputs["qkv"].shape[0]
    q, k, v = _checkpoint_split(inputs["qkv"], num_heads, num_kv_heads, d, qkv_layout)
    normed = []
    for x, which in ((q, "q"), (k, "k")):
        w, b = inputs[f"{which}_weight"], inputs.get(f"{which}_bias")
        if norm_weights == "shared":
            x = torch.nn.functional.layer_norm(x, (d,), w, b, eps)
        else:
            x = torch.nn.functional.layer_norm(x, (d,), None, None, eps) * w.view(-1, d)
            x = x if b is None else x + b.view(-1, d)
        normed.append(x.reshape(t, -1))
    q, k = vllm_rotary_embedding(inputs["positions"], *normed, d, cos_sin_cache, is_neox)
    return q, k, v.reshape(t, -1)


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


def vllm_mrope_prologue(
    inputs: dict,
    cos_sin_cache: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    mrope_section,
    mrope_interleaved: bool,
    eps: float,
    is_neox: bool,
    weight_offset: float,
    output_gate: bool,
):
    """The model's own unfused chain, as vLLM's Qwen3-VL / Qwen3.5 attention writes it:
    ``qkv.split`` (and for the gate ``q_gate.view(T, H, 2*D)`` chunked in two), ``q_norm`` /
    ``k_norm`` per head (``RMSNorm.forward_static``, or ``GemmaRMSNorm``'s ``(1 + w)`` in
    fp32), then ``MRotaryEmbedding.forward_native``: ``cos_sin_cache`` (held in the model
    dtype) gathered per plane, the sections joined (``torch.cat`` or
    ``apply_interleaved_rope``), ``apply_rotary_emb`` on the first R features."""
    hq, hkv, d = num_heads, num_kv_heads, head_dim
    section, interleaved = mrope_section, mrope_interleaved
    gemma = weight_offset == 1.0
    if weight_offset not in (0.0, 1.0):
        raise ValueError(f"weight_offset {weight_offset}: vLLM's norms have 0 or 1")
    table = cos_sin_cache

    def norm(x, weight):
        shape, x = x.shape, x.reshape(x.shape[0], -1, d)
        orig = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
        x = (x * (1.0 + weight.float())).to(orig) if gemma else x.to(orig) * weight
        return x.reshape(shape)

    qkv, positions = inputs["qkv"], inputs["positions"]
    t = qkv.shape[0]
    if output_gate:
        q_gate, k, v = qkv.split([2 * hq * d, hkv * d, hkv * d], dim=-1)
        q, gate = torch.chunk(q_gate.view(t, hq, 2 * d), 2, dim=-1)
        q, gate = q.reshape(t, -1), gate.reshape(t, -1)
    else:
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k = norm(q, inputs["q_weight"]), norm(k, inputs["k_weight"])
    planes = positions if positions.dim() == 2 else positions.expand(3, -1)
    q, k = vllm_mrotary_embedding(planes, q, k, d, table, is_neox, section, interleaved)
    return (q, k, v, gate) if output_gate else (q, k, v)


# ------------------------------------------- MiniMax-M3, as vllm-ascend's fallback writes it


def vllm_head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float):
    """vLLM's per-head norms: ``GemmaRMSNorm.forward_static`` (offset 1: ``(1 + w)`` in fp32,
    one rounding) or ``RMSNorm.forward_native`` (offset 0: rounded, then ``* w`` in x's
    dtype)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)
    if offset == 0.0:
        return h.to(dtype) * weight
    return (h * (offset + weight.float())).to(dtype)


def vllm_rotary_native(positions, x, head_dim, cos_sin_cache, is_neox):
    """vLLM's ``RotaryEmbedding.forward_native`` on one tensor ``[T, H*head_dim]``: the first
    R (the table width) features of each head rotated in x's dtype, the rest passed."""
    t = positions.shape[0]
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
    heads = x.view(t, -1, head_dim)
    rot, rest = heads[..., : cos.shape[-1] * 2], heads[..., cos.shape[-1] * 2 :]
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
    if is_neox:
        x1, x2 = torch.chunk(rot, 2, dim=-1)
        rot = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = rot[..., ::2], rot[..., 1::2]
        rot = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((rot, rest), dim=-1).reshape(x.shape)


def vllm_norm_rope(x, weight, positions, cos_sin_cache, head_dim, spec: PrologueSpec):
    """A per-head norm (:func:`vllm_head_rms_norm`) then ``rotary_emb`` of one tensor."""
    t = x.shape[0]
    normed = vllm_head_rms_norm(
        x.reshape(t, -1, head_dim), weight, spec.eps, spec.weight_offset
    ).reshape(t, -1)
    return vllm_rotary_native(positions, normed, head_dim, cos_sin_cache, spec.is_neox)


def fp8_store(
    x: torch.Tensor, scale: torch.Tensor | None = None, dtype: torch.dtype = torch.float8_e4m3fn
) -> torch.Tensor:
    """vllm-ascend's ``clamp(y, -448, 448).to(float8_e4m3fn)`` (with vLLM's ``x / scale``);
    ``dtype=torch.float8_e5m2``: ``clamp(y, -57344, 57344).to(float8_e5m2)``."""
    if scale is not None:
        x = x.float() / scale
    top = torch.finfo(dtype).max
    return x.clamp(-top, top).to(dtype)


def minimax_index_prologue(
    inputs: dict,
    cos_sin_cache: torch.Tensor,
    spec: PrologueSpec,
    *,
    num_index_heads: int,
    index_head_dim: int,
    attn_fp8: bool,
    index_fp8: bool,
    quantize_dtype: torch.dtype | None = None,
):
    """MiniMax-M3's own unfused chain (vllm-ascend ``MiniMaxM3SparseAttention.
    _sparse_prepare`` fallback: ``narrow`` x 5, ``GemmaRMSNorm`` x 4, ``rotary_emb`` x 2,
    ``clamp`` + cast for FP8, to ``quantize_dtype``: E4M3 by default), in the model dtype
    with the table held in it."""
    d, di, hi = spec.head_dim, index_head_dim, num_index_heads
    sizes = [spec.q_size, spec.kv_size, spec.kv_size, hi * di, di]
    pos = inputs["positions"]
    q, k, v, iq, ik = inputs["qkv"].split(sizes, dim=-1)
    q = vllm_norm_rope(q, inputs["q_weight"], pos, cos_sin_cache, d, spec)
    k = vllm_norm_rope(k, inputs["k_weight"], pos, cos_sin_cache, d, spec)
    iq = vllm_norm_rope(iq, inputs["index_q_weight"], pos, cos_sin_cache, di, spec)
    ik = vllm_norm_rope(ik, inputs["index_k_weight"], pos, cos_sin_cache, di, spec)
    v = v.contiguous()
    fp8 = quantize_dtype or torch.float8_e4m3fn
    attn = [fp8_store(x, dtype=fp8) for x in (q, k, v)] if attn_fp8 else [q, k, v]
    index = [fp8_store(x, dtype=fp8) for x in (iq, ik)] if index_fp8 else [iq, ik]
    return (*attn, *index)


def minimax_index_cache_prologue(
    inputs: dict,
    cos_sin_cache: torch.Tensor,
    spec: PrologueSpec,
    *,
    num_index_heads: int,
    index_head_dim: int,
):
    """MiniMax-M3's unfused chain with its caches (vllm-ascend ``MiniMaxM3SparseAttention``'s
    fallback for ``minimax_qknorm_rope_cache``): :func:`minimax_index_prologue`, then k and v
    by :func:`vllm_reshape_and_cache_flash` with ``slot_mapping``, index_k by
    ``index_slot_mapping`` into the 3-D index cache (an FP8 one: clamped and cast, no scale),
    index_q cast like the index cache. Updates the given caches in place; returns ``(q,
    index_q, key_cache, value_cache, index_cache)``."""
    q, k, v, iq, ik = minimax_index_prologue(
        inputs, cos_sin_cache, spec, num_index_heads=num_index_heads,
        index_head_dim=index_head_dim, attn_fp8=False, index_fp8=False,
    )  # fmt: skip
    key_cache, value_cache = inputs["key_cache"], inputs["value_cache"]
    shape = (-1, spec.num_kv_heads, spec.head_dim)
    vllm_reshape_and_cache_flash(
        k.reshape(shape), v.reshape(shape), key_cache, value_cache, inputs["slot_mapping"],
        inputs.get("k_scale"), inputs.get("v_scale"),
    )  # fmt: skip
    index_cache, index_slots = inputs["index_cache"], inputs["index_slot_mapping"]
    keep = index_slots >= 0
    slots, block_size = index_slots[keep].long(), index_cache.shape[1]
    if index_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        ik, iq = fp8_store(ik, dtype=index_cache.dtype), fp8_store(iq, dtype=index_cache.dtype)
    index_cache[slots // block_size, slots % block_size] = ik[keep].to(index_cache.dtype)
    return q, iq, key_cache, value_cache, index_cache


def minimax_cache_prologue(inputs: dict, cos_sin_cache: torch.Tensor, spec: PrologueSpec):
    """The model's unfused chain with the cache insert: split, ``GemmaRMSNorm`` on q and k,
    ``rotary_emb``, then vLLM's ``reshape_and_cache_flash`` as an ``index_put`` on the valid
    slots (FP8: ``x / scale`` clamped and cast); updates the given caches in place, returns
    ``(q, key_cache, value_cache)``."""
    d = spec.head_dim

    pos, slots = inputs["positions"], inputs["slot_mapping"]
    q, k, v = inputs["qkv"].split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
    q = vllm_norm_rope(q, inputs["q_weight"], pos, cos_sin_cache, d, spec)
    k = vllm_norm_rope(k, inputs["k_weight"], pos, cos_sin_cache, d, spec)
    key_cache, value_cache = inputs["key_cache"], inputs["value_cache"]
    shape = (-1, spec.num_kv_heads, d)
    vllm_reshape_and_cache_flash(
        k.view(shape), v.reshape(shape), key_cache, value_cache, slots,
        inputs.get("k_scale"), inputs.get("v_scale"),
    )  # fmt: skip
    return q, key_cache, value_cache


def vllm_reshape_and_cache_flash(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """vLLM's ``reshape_and_cache_flash`` in torch: ``key``/``value [T, H, D]`` of the first
    ``N = len(slot_mapping)`` tokens with a slot ``>= 0`` put at rows ``slot`` of the caches
    ``[blocks, block_size, H, D]`` (any strides: an advanced-index put, in place); an FP8
    cache (float8_e4m3fn, or vLLM's uint8 bytes of it) takes ``x / scale`` clamped to +-448."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    n = slot_mapping.shape[0]
    for cache, x, scale in ((key_cache, key, k_scale), (value_cache, value, v_scale)):
        x = x[:n][keep]
        typed = cache.view(torch.float8_e4m3fn) if cache.dtype == torch.uint8 else cache
        if typed.dtype == torch.float8_e4m3fn:
            x = fp8_store(x, scale)
        block_size = cache.shape[1]
        typed[slots // block_size, slots % block_size] = x.to(typed.dtype)
