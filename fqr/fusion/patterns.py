"""Inductor replacement patterns: the unfused prologue -> one ``torch.ops.fqr`` call.

vLLM form (packed QKV; :func:`fqr.fusion.unfused.vllm_qk_norm_rope`)::

    unfused                                            fused
    q, k, v = split_with_sizes(qkv, [qs, kvs, kvs])    q, k, v = fqr.split_qkv_rmsnorm_rope(
    qh = reshape(q, [T, Hq, D])                            qkv, positions, cos_sin_cache,
    qn = to(to(qh, f32) * rsqrt(mean(pow(.,2)) + eps),     q_weight, k_weight, q_bias, k_bias,
            bf16) * q_weight  (+ q_bias)                   Hq, Hkv, D, eps, is_neox, offset,
    (k likewise)                                           "head", "unfused")
    cs = index(cos_sin_cache, [positions]); cos, sin = split(cs, R/2)
    q = cat(rope(qn[..., :R], cos, sin), qn[..., R:])  (NeoX: halves; GPT-J: even/odd)
    k = cat(rope(kn[..., :R], cos, sin), kn[..., R:])

Hugging Face form (separate projections; :func:`fqr.fusion.unfused.hf_qk_norm_rope`)::

    q = q_weight * to(to(qh, f32) * rsqrt(...), bf16)  qo, ko = fqr.qk_rmsnorm_rope(
    q = transpose(q, 1, 2)  (k likewise)                  q.reshape(T, Hq*D), k..., arange(T),
    q = q * cos + cat(-q[..., D/2:], q[..., :D/2]) * sin    cat(cos[..., :D/2], sin[..., :D/2]),
                                                           q_weight, k_weight, D, eps, ...)
                                                       q = qo.view(B, S, Hq, D).transpose(1, 2)

Nothing about a model is global here. Each pattern is traced once with small example shapes;
the head sizes (``qs``, ``kvs``: the split sizes) and ``eps`` are pattern *arguments*
(``scalar_workaround``), read from every matched subgraph; ``D`` is the norm weight's length
and ``R`` the cache width. Inductor then re-traces the pattern with the match's real shapes
and values and checks it matches node for node before replacing (``register_replacement``), so
a model mixing attention shapes, eps values or RoPE styles fuses every layer correctly.

One registration per graph shape that the unfused code can take: activation dtype class
(16-bit, where the norm has casts; fp32, where they vanish), cos/sin cache dtype (the
activation's; or fp32 under 16-bit activations, which adds a cast), NeoX / GPT-J, with / without
a norm bias, vLLM ``RMSNorm`` / ``GemmaRMSNorm`` (1 + w), full / partial rotary (a full one has
no pass-through slice): 48 vLLM-form patterns and 2 Hugging Face ones. The fused op runs
with ``numerics="unfused"``: it rounds where the unfused
code rounds (after the norm, each RoPE multiply and add), so fused and unfused models agree
within the ``unfused`` numerics contract (:mod:`fqr.numerics`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch._inductor import pattern_matcher as pm
from torch._inductor.fx_passes.joint_graph import joint_graph_passes
from torch._inductor.fx_passes.post_grad import view_to_reshape

from . import (
    custom_ops,  # noqa: F401  (registers torch.ops.fqr.*)
    unfused,
)

# Example sizes for tracing. The split sizes and eps become pattern arguments through
# `scalar_workaround`, which works by value: they must differ from every other constant in the
# traced graph (token count, head counts, head_dim, cache rows and widths), and should not be
# sizes a real model has (q_size 1016 = 127 x 8, kv_size 984 = 123 x 8): a model constant equal
# to one of them would make Inductor's re-check fail, leaving that site unfused (never wrong).
_T, _HQ, _HKV, _D, _ROWS = 3, 127, 123, 8, 23
_EPS = 1e-6
_SCALARS = {"q_size": _HQ * _D, "kv_size": _HKV * _D, "eps": _EPS}
_HF_SCALARS = {"eps": _EPS}


def trace_like_inductor(fn, args, *, get_decomp_fn=None, **_):
    """Trace ``fn`` into the aten graph that Inductor's post-grad passes see.

    ``fwd_only`` gives the decomposed inference graph; the model's graph has in addition been
    through Inductor's joint-graph passes (noop removal, pointless view/convert folding) and
    ``view_to_reshape`` before a ``post_grad_custom_post_pass`` runs, so the pattern goes
    through them too.
    """
    kwargs = {} if get_decomp_fn is None else {"get_decomp_fn": get_decomp_fn}
    gm = pm.fwd_only(fn, args, **kwargs)
    gm = joint_graph_passes(gm)
    view_to_reshape(gm)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


@dataclass(frozen=True)
class VllmVariant:
    """One graph shape of the vLLM-form prologue (see the module docstring)."""

    dtype: torch.dtype  # activation dtype used for tracing (bf16 stands for bf16/fp16)
    cache_dtype: torch.dtype
    is_neox: bool
    bias: bool
    gemma: bool
    partial_rotary: bool

    @property
    def name(self) -> str:
        return "vllm-" + "-".join(
            [
                "16bit" if self.dtype != torch.float32 else "fp32",
                "cache-same" if self.cache_dtype == self.dtype else "cache-other",
                "neox" if self.is_neox else "gptj",
                "bias" if self.bias else "nobias",
                "gemma" if self.gemma else "rmsnorm",
                "partial" if self.partial_rotary else "full",
            ]
        )

    @property
    def weight_offset(self) -> float:
        return 1.0 if self.gemma else 0.0

    def example_inputs(self) -> list[torch.Tensor]:
        rotary = _D // 2 if self.partial_rotary else _D
        tensors = [
            torch.zeros(_T, (_HQ + 2 * _HKV) * _D, dtype=self.dtype),
            torch.zeros(_T, dtype=torch.int64),
            torch.zeros(_ROWS, rotary, dtype=self.cache_dtype),
            torch.zeros(_D, dtype=self.dtype),
            torch.zeros(_D, dtype=self.dtype),
        ]
        if self.bias:
            tensors += [torch.zeros(_D, dtype=self.dtype), torch.zeros(_D, dtype=self.dtype)]
        return tensors

    def search_and_replace(self):
        neox, gemma, offset = self.is_neox, self.gemma, self.weight_offset

        def fused(
            qkv, positions, cos_sin_cache, q_weight, k_weight, q_bias, k_bias, q_size, kv_size, eps
        ):
            d = q_weight.shape[0]
            return torch.ops.fqr.split_qkv_rmsnorm_rope(
                qkv,
                positions.flatten(),
                cos_sin_cache,
                q_weight,
                k_weight,
                q_bias,
                k_bias,
                q_size // d,
                kv_size // d,
                d,
                eps,
                neox,
                offset,
                "head",
                "unfused",
            )

        if self.bias:

            def search(
                qkv,
                positions,
                cos_sin_cache,
                q_weight,
                k_weight,
                q_bias,
                k_bias,
                q_size,
                kv_size,
                eps,
            ):
                return unfused.vllm_qk_norm_rope(
                    qkv,
                    positions,
                    cos_sin_cache,
                    q_weight,
                    k_weight,
                    q_size=q_size,
                    kv_size=kv_size,
                    eps=eps,
                    is_neox=neox,
                    gemma=gemma,
                    q_bias=q_bias,
                    k_bias=k_bias,
                )

            def replace(
                qkv,
                positions,
                cos_sin_cache,
                q_weight,
                k_weight,
                q_bias,
                k_bias,
                q_size,
                kv_size,
                eps,
            ):
                return fused(
                    qkv,
                    positions,
                    cos_sin_cache,
                    q_weight,
                    k_weight,
                    q_bias,
                    k_bias,
                    q_size,
                    kv_size,
                    eps,
                )
        else:

            def search(qkv, positions, cos_sin_cache, q_weight, k_weight, q_size, kv_size, eps):
                return unfused.vllm_qk_norm_rope(
                    qkv,
                    positions,
                    cos_sin_cache,
                    q_weight,
                    k_weight,
                    q_size=q_size,
                    kv_size=kv_size,
                    eps=eps,
                    is_neox=neox,
                    gemma=gemma,
                )

            def replace(qkv, positions, cos_sin_cache, q_weight, k_weight, q_size, kv_size, eps):
                return fused(
                    qkv,
                    positions,
                    cos_sin_cache,
                    q_weight,
                    k_weight,
                    None,
                    None,
                    q_size,
                    kv_size,
                    eps,
                )

        return search, replace


def vllm_variants() -> list[VllmVariant]:
    """Every registered vLLM-form variant. Gemma's come before plain RMSNorm's: in fp32 the
    plain pattern also matches a Gemma norm (with ``weight = 1 + w`` computed outside)."""
    out = []
    # (activation, cache): vLLM casts the cache to the activations' dtype; a 16-bit model may
    # also keep an fp32 cache (as vLLM's FlashInfer RoPE path does).
    dtypes = (
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float32),
    )
    for (dtype, cache_dtype), neox, bias, gemma, partial in itertools.product(
        dtypes, (True, False), (False, True), (True, False), (False, True)
    ):
        out.append(VllmVariant(dtype, cache_dtype, neox, bias, gemma, partial))
    return out


@dataclass(frozen=True)
class HfVariant:
    """Hugging Face Qwen3 form (NeoX ``rotate_half``, cos/sin in the activation dtype)."""

    dtype: torch.dtype

    @property
    def name(self) -> str:
        return "hf-qwen3-" + ("16bit" if self.dtype != torch.float32 else "fp32")

    def example_inputs(self) -> list[torch.Tensor]:
        b, s = 1, _T
        return [
            torch.zeros(b, s, _HQ, _D, dtype=self.dtype),
            torch.zeros(b, s, _HKV, _D, dtype=self.dtype),
            torch.zeros(b, s, _D, dtype=self.dtype),
            torch.zeros(b, s, _D, dtype=self.dtype),
            torch.zeros(_D, dtype=self.dtype),
            torch.zeros(_D, dtype=self.dtype),
        ]

    def search_and_replace(self):
        def search(q_by_head, k_by_head, cos, sin, q_weight, k_weight, eps):
            q = unfused.hf_rms_norm(q_by_head, q_weight, eps).transpose(1, 2)
            k = unfused.hf_rms_norm(k_by_head, k_weight, eps).transpose(1, 2)
            return unfused.hf_apply_rotary_pos_emb(q, k, cos, sin)

        def replace(q_by_head, k_by_head, cos, sin, q_weight, k_weight, eps):
            d = q_weight.shape[0]
            lead = q_by_head.shape[:-2]
            q = q_by_head.reshape(-1, q_by_head.shape[-2] * d)
            k = k_by_head.reshape(-1, k_by_head.shape[-2] * d)
            half = cos.shape[-1] // 2
            # HF's cos/sin repeat their halves: [cos | cos]; vLLM's cache row is [cos | sin].
            cos = cos.expand(*lead, cos.shape[-1])[..., :half]
            sin = sin.expand(*lead, sin.shape[-1])[..., :half]
            cache = torch.cat([cos, sin], dim=-1).reshape(-1, 2 * half)
            positions = torch.arange(q.shape[0], device=q.device)
            qo, ko = torch.ops.fqr.qk_rmsnorm_rope(
                q, k, positions, cache, q_weight, k_weight, None, None, d, eps, True, 0.0, "unfused"
            )
            return (
                qo.view(q_by_head.shape).transpose(1, 2),
                ko.view(k_by_head.shape).transpose(1, 2),
            )

        return search, replace


def hf_variants() -> list[HfVariant]:
    return [HfVariant(torch.bfloat16), HfVariant(torch.float32)]


# ------------------------------------------------------------------------------- checks


def _val(x):
    return x.meta.get("val") if isinstance(x, torch.fx.Node) else x


def _vllm_check(match: pm.Match) -> bool:
    """Sizes that the re-traced pattern cannot check by itself, and dtype preservation."""
    kw = match.kwargs
    qkv, w = _val(kw["qkv"]), _val(kw["q_weight"])
    cache, positions = _val(kw["cos_sin_cache"]), _val(kw["positions"])
    q_size, kv_size = kw["q_size"], kw["kv_size"]
    if qkv is None or w is None or cache is None or positions is None:
        return False
    d = w.shape[0]
    if not (isinstance(q_size, int) and isinstance(kv_size, int)) or q_size % d or kv_size % d:
        return False
    if qkv.dim() != 2 or positions.dim() != 1 or positions.dtype not in (torch.int32, torch.int64):
        return False
    if cache.shape[-1] % 2 or cache.shape[-1] > d:
        return False
    return _outputs_keep_dtype(match, qkv.dtype)


def _hf_check(match: pm.Match) -> bool:
    kw = match.kwargs
    q, w, cos = _val(kw["q_by_head"]), _val(kw["q_weight"]), _val(kw["cos"])
    if q is None or w is None or cos is None or q.dim() != 4 or cos.dim() != 3:
        return False
    if cos.shape[-1] != w.shape[0] or cos.shape[-1] % 2:
        return False
    return _outputs_keep_dtype(match, q.dtype)


def _outputs_keep_dtype(match: pm.Match, dtype: torch.dtype) -> bool:
    """The fused ops return the activation dtype; the unfused code may have promoted (a
    weight or cache of a wider dtype): then it is not the same computation, leave it."""
    for node in match.output_nodes():
        val = _val(node) if node is not None else None
        if val is not None and val.dtype != dtype:
            return False
    return True


def _register(search, replace, example_inputs, pass_dict, extra_check, scalars, name) -> bool:
    return bool(
        pm.register_replacement(
            search,
            replace,
            example_inputs,
            trace_like_inductor,
            pass_dict,
            extra_check=extra_check,
            scalar_workaround=dict(scalars),
            pattern_name=name,
        )
    )


def register_patterns(pass_dict: pm.PatternMatcherPass) -> int:
    """Register every variant into ``pass_dict``; returns how many were registered."""
    count = 0
    with torch.no_grad():
        for v in vllm_variants():
            search, replace = v.search_and_replace()
            count += _register(
                search, replace, v.example_inputs(), pass_dict, _vllm_check, _SCALARS, v.name
            )
        for v in hf_variants():
            search, replace = v.search_and_replace()
            count += _register(
                search, replace, v.example_inputs(), pass_dict, _hf_check, _HF_SCALARS, v.name
            )
    return count
