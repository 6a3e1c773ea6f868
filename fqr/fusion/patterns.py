"""Inductor replacement patterns: the unfused prologue -> one ``torch.ops.fqr`` call.

vLLM form (packed QKV; :func:`fqr.unfused.vllm_qk_norm_rope`)::

    unfused                                            fused
    q, k, v = split_with_sizes(qkv, [qs, kvs, kvs])    q, k, v = fqr.split_qkv_rmsnorm_rope(
    qh = reshape(q, [T, Hq, D])                            qkv, positions, cos_sin_cache,
    qn = to(to(qh, f32) * rsqrt(mean(pow(.,2)) + eps),     q_weight, k_weight, q_bias, k_bias,
            bf16) * q_weight  (+ q_bias)                   Hq, Hkv, D, eps, is_neox, offset,
    (k likewise)                                           "head", "unfused")
    cs = index(cos_sin_cache, [positions]); cos, sin = split(cs, R/2)
    q = cat(rope(qn[..., :R], cos, sin), qn[..., R:])  (NeoX: halves; GPT-J: even/odd)
    k = cat(rope(kn[..., :R], cos, sin), kn[..., R:])

Hugging Face form (separate projections; :func:`fqr.unfused.hf_qk_norm_rope`)::

    q = q_weight * to(to(qh, f32) * rsqrt(...), bf16)  qo, ko = fqr.qk_rmsnorm_rope(
    q = transpose(q, 1, 2)  (k likewise)                  q.reshape(T, Hq*D), k..., arange(T),
    q = q * cos + cat(-q[..., D/2:], q[..., :D/2]) * sin    cat(cos[..., :D/2], sin[..., :D/2]),
                                                           q_weight, k_weight, D, eps, ...)
                                                       q = qo.view(B, S, Hq, D).transpose(1, 2)

QKV projection (vLLM form; :mod:`fqr.projection`), run after the patterns above, on the fused op
they left: one packed ``qkv_proj`` GEMM (``mm``, ``addmm`` with its bias, or ``mm`` then a bias
``add``) whose row only the prologue reads::

    unfused (after the patterns above)              fused
    qkv = mm(x, permute(w_qkv, [1, 0])) (+ bias)    q, k, v = fqr.split_qkv_rmsnorm_rope_proj_
    q, k, v = fqr.split_qkv_rmsnorm_rope(qkv,           dispatch(x, w_qkv, positions,
        positions, cos_sin_cache, q_weight,             cos_sin_cache, q_weight, k_weight, bias,
        k_weight, q_bias, k_bias, Hq, Hkv, D, eps,      q_bias, k_bias, Hq, Hkv, D, eps,
        is_neox, offset, "head", "unfused")             is_neox, offset, "head")

The dispatching op picks, per call, the fused GEMM + prologue kernel or the pair (the GEMM,
then the prologue op) as the dispatch table measured (:mod:`fqr.projection`), so with a dynamic
T the choice is made at run time. A site is rewritten only where the table can pick the fused
kernel for its device, dtype and shape (at its T when T is static); elsewhere (another device,
an unmeasured shape, a static T whose bucket keeps the pair) the graph stays as the patterns
above left it: Inductor's GEMM, then fqr's op. The rewritten site runs the ``fused`` contract
(the projected form has no ``unfused`` mode): one rounding where the model's code rounds after
each step, so its q and k are closer to float64 than the unfused chain's.

Nothing about a model is global here. Each pattern is traced once with small example shapes
and example scalars; the first match ignores every int and float constant (sizes, split sizes,
eps). The split sizes (``q_size``, ``kv_size``) and ``eps`` of a match are then read from the
matched graph itself (:func:`read_split_sizes`: the sizes of its ``split_with_sizes`` node;
:func:`read_norm_eps`: the constant added to the norms' mean), ``D`` is the norm weight's length
and ``R`` the cache width. The pattern is re-traced with the match's real shapes and scalars and
must match the graph node for node (:func:`matches_exactly`) before anything is replaced, so a
model mixing attention shapes, eps values or RoPE styles fuses every layer correctly, and a near
miss (a statistic over the wrong dim, q and k norms with different eps) is left alone. Nothing
here reads scalars from keyword arguments of the matcher: the same code runs on torch 2.11 and
newer (older Inductors do not pass ``scalar_workaround`` values through ``Match.kwargs``).

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

import contextlib
import functools
import inspect
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch._inductor import pattern_matcher as pm
from torch._inductor.fx_passes.joint_graph import joint_graph_passes
from torch._inductor.fx_passes.post_grad import view_to_reshape

from .. import (
    prologue,  # noqa: F401  (registers torch.ops.fqr.*)
    unfused,
)
from .coalesce import coalesce_splits

aten = torch.ops.aten

# Example sizes for tracing. The first match ignores int and float constants, so their values
# do not matter for matching; distinct ones keep the traced graphs easy to read.
_T, _HQ, _HKV, _D, _ROWS = 3, 127, 123, 8, 23
_EPS = 1e-6
_VLLM_SCALARS = {"q_size": _HQ * _D, "kv_size": _HKV * _D, "eps": _EPS}
_HF_SCALARS = {"eps": _EPS}

# Constants the first match ignores (they are checked by the exact re-match).
_IGNORED_CONSTANTS = (int, float, list, torch.device, torch.dtype)


def trace_like_inductor(fn, args, *, get_decomp_fn=None, **_):
    """Trace ``fn`` into the aten graph that Inductor's post-grad passes see.

    ``fwd_only`` gives the decomposed inference graph; the model's graph has in addition been
    through Inductor's joint-graph passes (noop removal, pointless view/convert folding) and
    ``view_to_reshape`` before a ``post_grad_custom_post_pass`` runs, so the pattern goes
    through them too, and through the fusion pass's own split coalescing
    (:mod:`fqr.fusion.coalesce`).
    """
    kwargs = {} if get_decomp_fn is None else {"get_decomp_fn": get_decomp_fn}
    gm = pm.fwd_only(fn, args, **kwargs)
    gm = joint_graph_passes(gm)
    view_to_reshape(gm)
    coalesce_splits(gm.graph)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


# ----------------------------------------------------------------- reading a match's scalars


def _val(x):
    return x.meta.get("val") if isinstance(x, torch.fx.Node) else x


def read_split_sizes(match: pm.Match, source: torch.fx.Node) -> dict | None:
    """``q_size``, ``kv_size`` from the match's ``split_with_sizes`` of ``source`` into
    ``[q_size, kv_size, kv_size]`` (static ints), else None."""
    splits = [
        n
        for n in match.nodes
        if n.target is aten.split_with_sizes.default and n.args and n.args[0] is source
    ]
    if len(splits) != 1:
        return None
    sizes = list(splits[0].args[1])
    if len(sizes) != 3 or not all(type(s) is int for s in sizes) or sizes[1] != sizes[2]:
        return None
    return {"q_size": sizes[0], "kv_size": sizes[1]}


def read_norm_eps(match: pm.Match) -> dict | None:
    """``eps``: the one float added to a ``mean`` in the match (every norm of one prologue
    shares it), else None (two different eps, or an eps that is a graph input)."""
    found = set()
    for n in match.nodes:
        if n.target not in (aten.add.Tensor, aten.add.Scalar) or len(n.args) != 2:
            continue
        a, b = n.args
        if isinstance(a, torch.fx.Node) and a.target is aten.mean.dim and type(b) is float:
            found.add(b)
    return {"eps": found.pop()} if len(found) == 1 else None


# ----------------------------------------------------------------------- exact re-matching


def matches_exactly(match: pm.Match, fn: Callable, argnames: tuple[str, ...]) -> bool:
    """Re-trace ``fn`` (the search function with the match's scalars bound) on fresh fake
    tensors of the matched inputs' real shapes, strides and dtypes, and match the result,
    every constant included, at the match's first output.

    Symbolic sizes (a dynamic token count) become extra leading arguments, so that the
    re-traced graph refers to them as inputs the way the model's graph does (Inductor's own
    ``register_replacement`` re-check does the same).
    """
    vals = [_val(match.kwargs[name]) for name in argnames]
    if any(not isinstance(v, torch.Tensor) for v in vals):
        return False
    fake_mode = torch._guards.detect_fake_mode(vals)
    if fake_mode is None:
        return False
    sym_args: list = []
    with fake_mode:
        fresh = []
        for v in vals:
            t = torch.empty_strided(v.size(), v.stride(), dtype=v.dtype, device=v.device)
            for s in itertools.chain(t.shape, t.stride()):
                if isinstance(s, torch.SymInt) and all(
                    torch.fx.experimental.symbolic_shapes.statically_known_true(s != a)
                    for a in sym_args
                ):
                    sym_args.append(s)
            fresh.append(t)
        n_sym = len(sym_args)

        def with_sizes(*args):
            return fn(*args[n_sym:])

        try:
            gm = trace_like_inductor(with_sizes, [*sym_args, *fresh])
        except RuntimeError:  # the pattern does not apply to these shapes
            return False
        names = [f"size{i}" for i in range(n_sym)] + list(argnames)
        exact = pm.fx_to_pattern(gm, argnames=names)
    first_output = match.output_nodes()[0]
    return first_output is not None and pm.is_match(exact.match(first_output))


@dataclass(frozen=True)
class Replacement:
    """One registered rewrite: the unfused prologue traced from ``search`` -> ``replace``.

    ``search(*tensors, **scalars)`` and ``replace(*tensors, **scalars)`` take the pattern's
    tensors (named by ``search``'s parameters) and its scalars by keyword; ``read_scalars``
    finds the scalars of one match in the graph, ``check`` decides what the exact re-match
    cannot (ranks, dtypes, cache width).
    """

    name: str
    search: Callable
    replace: Callable
    example_inputs: tuple
    example_scalars: dict
    read_scalars: Callable[[pm.Match], dict | None]
    check: Callable[[pm.Match, dict], bool]
    ignored: tuple = _IGNORED_CONSTANTS  # the constant types the first match ignores
    fake: bool = False  # trace on fake tensors (a search calling an fqr op: one fake mode)

    @property
    def argnames(self) -> tuple[str, ...]:
        params = inspect.signature(self.search).parameters.values()
        return tuple(p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD)

    def pattern(self) -> pm.PatternExpr:
        """The search graph with every int/float constant a wildcard (the first match)."""
        inputs = list(self.example_inputs)
        fake_mode = torch._subclasses.FakeTensorMode() if self.fake else contextlib.nullcontext()
        with fake_mode:
            if self.fake:
                inputs = [fake_mode.from_tensor(t) for t in inputs]  # type: ignore[union-attr]
            gm = trace_like_inductor(functools.partial(self.search, **self.example_scalars), inputs)
        return pm.fx_to_pattern(gm, ignore_types=self.ignored, argnames=self.argnames)

    def accepts(self, match: pm.Match) -> bool:
        scalars = self.read_scalars(match)
        if scalars is None or not self.check(match, scalars):
            return False
        return matches_exactly(match, functools.partial(self.search, **scalars), self.argnames)

    def rewrite(self, match: pm.Match, *_args, **kwargs) -> None:
        scalars = self.read_scalars(match)
        inputs = [kwargs[name] for name in self.argnames]
        match.replace_by_example(functools.partial(self.replace, **scalars), inputs)

    def register(self, pass_dict: pm.PatternMatcherPass) -> None:
        pm.register_graph_pattern(self.pattern(), extra_check=self.accepts, pass_dict=pass_dict)(
            self.rewrite
        )


# ------------------------------------------------------------------------------ vLLM form


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

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
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
        return tuple(tensors)

    def replacement(self) -> Replacement:
        neox, gemma, offset = self.is_neox, self.gemma, self.weight_offset

        def fused(qkv, positions, cos_sin_cache, q_weight, k_weight, q_bias, k_bias, s):
            d = q_weight.shape[0]
            return torch.ops.fqr.split_qkv_rmsnorm_rope(
                qkv,
                positions.flatten(),
                cos_sin_cache,
                q_weight,
                k_weight,
                q_bias,
                k_bias,
                s["q_size"] // d,
                s["kv_size"] // d,
                d,
                s["eps"],
                neox,
                offset,
                "head",
                "unfused",
            )

        def unfused_prologue(qkv, positions, cos_sin_cache, q_weight, k_weight, q_bias, k_bias, s):
            return unfused.vllm_qk_norm_rope(
                qkv,
                positions,
                cos_sin_cache,
                q_weight,
                k_weight,
                q_size=s["q_size"],
                kv_size=s["kv_size"],
                eps=s["eps"],
                is_neox=neox,
                gemma=gemma,
                q_bias=q_bias,
                k_bias=k_bias,
            )

        if self.bias:

            def search(
                qkv, positions, cos_sin_cache, q_weight, k_weight, q_bias, k_bias, **scalars
            ):
                args = (qkv, positions, cos_sin_cache, q_weight, k_weight, q_bias, k_bias)
                return unfused_prologue(*args, scalars)

            def replace(
                qkv, positions, cos_sin_cache, q_weight, k_weight, q_bias, k_bias, **scalars
            ):
                args = (qkv, positions, cos_sin_cache, q_weight, k_weight, q_bias, k_bias)
                return fused(*args, scalars)
        else:

            def search(qkv, positions, cos_sin_cache, q_weight, k_weight, **scalars):
                args = (qkv, positions, cos_sin_cache, q_weight, k_weight, None, None)
                return unfused_prologue(*args, scalars)

            def replace(qkv, positions, cos_sin_cache, q_weight, k_weight, **scalars):
                args = (qkv, positions, cos_sin_cache, q_weight, k_weight, None, None)
                return fused(*args, scalars)

        def read_scalars(match: pm.Match) -> dict | None:
            sizes = read_split_sizes(match, match.kwargs["qkv"])
            eps = read_norm_eps(match)
            return None if sizes is None or eps is None else {**sizes, **eps}

        return Replacement(
            self.name,
            search,
            replace,
            self.example_inputs(),
            _VLLM_SCALARS,
            read_scalars,
            _vllm_check,
        )


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


# ----------------------------------------------------------------------- Hugging Face form


@dataclass(frozen=True)
class HfVariant:
    """Hugging Face Qwen3 form (NeoX ``rotate_half``, cos/sin in the activation dtype)."""

    dtype: torch.dtype

    @property
    def name(self) -> str:
        return "hf-qwen3-" + ("16bit" if self.dtype != torch.float32 else "fp32")

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        b, s = 1, _T
        return (
            torch.zeros(b, s, _HQ, _D, dtype=self.dtype),
            torch.zeros(b, s, _HKV, _D, dtype=self.dtype),
            torch.zeros(b, s, _D, dtype=self.dtype),
            torch.zeros(b, s, _D, dtype=self.dtype),
            torch.zeros(_D, dtype=self.dtype),
            torch.zeros(_D, dtype=self.dtype),
        )

    def replacement(self) -> Replacement:
        def search(q_by_head, k_by_head, cos, sin, q_weight, k_weight, *, eps):
            q = unfused.hf_rms_norm(q_by_head, q_weight, eps).transpose(1, 2)
            k = unfused.hf_rms_norm(k_by_head, k_weight, eps).transpose(1, 2)
            return unfused.hf_apply_rotary_pos_emb(q, k, cos, sin)

        def replace(q_by_head, k_by_head, cos, sin, q_weight, k_weight, *, eps):
            d = q_weight.shape[0]
            lead = q_by_head.shape[:-2]
            q = q_by_head.reshape(-1, q_by_head.shape[-2] * d)
            k = k_by_head.reshape(-1, k_by_head.shape[-2] * d)
            half = cos.shape[-1] // 2
            # HF's cos/sin repeat their halves: [cos | cos] (checked by _hf_check); vLLM's
            # cache row is [cos | sin].
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

        return Replacement(
            self.name,
            search,
            replace,
            self.example_inputs(),
            _HF_SCALARS,
            lambda match: read_norm_eps(match),
            _hf_check,
        )


def hf_variants() -> list[HfVariant]:
    return [HfVariant(torch.bfloat16), HfVariant(torch.float32)]


# ------------------------------------------------------------------------- QKV projection

# The forms of vLLM's ``qkv_proj`` (``F.linear`` of 2-D hidden states) in a post-grad graph.
PROJECTION_FORMS = ("mm", "addmm", "mm-add")
# The projection patterns also ignore bools (is_neox) in their first match.
_PROJECTION_IGNORED = (*_IGNORED_CONSTANTS, bool)
# The fused op runs while the pattern is traced: its example heads must be a valid GQA layout.
_PROJECTION_SCALARS = {"hq": 6, "hkv": 2, "d": _D, "eps": _EPS, "neox": True, "offset": 0.0}
_PROLOGUE_OP = torch.ops.fqr.split_qkv_rmsnorm_rope.default


@dataclass(frozen=True)
class ProjectionVariant:
    """One graph shape of ``qkv_proj`` then the fused prologue (module docstring): the
    projection's form and whether the norm has a bias."""

    form: str  # PROJECTION_FORMS
    norm_bias: bool

    @property
    def name(self) -> str:
        return f"proj-{self.form}-{'bias' if self.norm_bias else 'nobias'}"

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        s = _PROJECTION_SCALARS
        hidden, width = 5, (s["hq"] + 2 * s["hkv"]) * _D
        tensors = [
            torch.zeros(_T, hidden),
            torch.zeros(width, hidden),
            torch.zeros(_T, dtype=torch.int64),
            torch.zeros(_ROWS, _D),
            torch.zeros(_D),
            torch.zeros(_D),
        ]
        if self.norm_bias:
            tensors += [torch.zeros(_D), torch.zeros(_D)]
        if self.form != "mm":
            tensors.append(torch.zeros(width))
        return tuple(tensors)

    def replacement(self) -> Replacement:
        form, norm_bias = self.form, self.norm_bias

        def split(tensors):
            """(x, w, positions, cache, q_weight, k_weight, q_bias, k_bias, bias)."""
            x, w, positions, cache, qw, kw, *rest = tensors
            qb, kb = (rest[0], rest[1]) if norm_bias else (None, None)
            bias = rest[-1] if form != "mm" else None
            return x, w, positions, cache, qw, kw, qb, kb, bias

        def search_of(*tensors, hq, hkv, d, eps, neox, offset):
            x, w, positions, cache, qw, kw, qb, kb, bias = split(tensors)
            if form == "addmm":
                qkv = aten.addmm(bias, x, aten.permute(w, [1, 0]))
            else:
                qkv = aten.mm(x, aten.permute(w, [1, 0]))
                if form == "mm-add":
                    qkv = aten.add(qkv, bias)
            statics = (hq, hkv, d, eps, neox, offset, "head", "unfused")
            return _PROLOGUE_OP(qkv, positions, cache, qw, kw, qb, kb, *statics)

        def replace_of(*tensors, hq, hkv, d, eps, neox, offset):
            x, w, positions, cache, qw, kw, qb, kb, bias = split(tensors)
            return torch.ops.fqr.split_qkv_rmsnorm_rope_proj_dispatch(
                x, w, positions, cache, qw, kw, bias, qb, kb, hq, hkv, d, eps, neox, offset, "head"
            )

        names = ["x", "w_qkv", "positions", "cos_sin_cache", "q_weight", "k_weight"]
        names += ["q_bias", "k_bias"] if norm_bias else []
        names += ["bias"] if form != "mm" else []
        search = _with_names(search_of, names)
        replace = _with_names(replace_of, names)
        return Replacement(
            self.name,
            search,
            replace,
            self.example_inputs(),
            _PROJECTION_SCALARS,
            read_prologue_scalars,
            _projection_check,
            _PROJECTION_IGNORED,
            fake=True,
        )


def _with_names(fn: Callable, names: list[str]) -> Callable:
    """``fn(*tensors, **scalars)`` as a function whose parameters are ``names`` (the pattern's
    argument names, read from the signature by :class:`Replacement`), then the scalars."""
    params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names]
    params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY) for n in _PROJECTION_SCALARS]

    def named(*args, **kwargs):
        bound = inspect.Signature(params).bind(*args, **kwargs)
        tensors = [bound.arguments[n] for n in names]
        return fn(*tensors, **{n: bound.arguments[n] for n in _PROJECTION_SCALARS})

    named.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    return named


def projection_variants() -> list[ProjectionVariant]:
    return [ProjectionVariant(f, b) for f in PROJECTION_FORMS for b in (False, True)]


def read_prologue_scalars(match: pm.Match) -> dict | None:
    """``hq, hkv, d, eps, neox, offset`` from the match's ``split_qkv_rmsnorm_rope`` node (its
    arguments 7 to 12, as the vLLM-form replacement wrote them), else None."""
    (node,) = [n for n in match.nodes if n.target is _PROLOGUE_OP] or [None]
    if node is None or len(node.args) != 15:
        return None
    hq, hkv, d, eps, neox, offset = node.args[7:13]
    if not (type(hq) is type(hkv) is type(d) is int and type(neox) is bool):
        return None
    if type(eps) is not float or type(offset) is not float:
        return None
    return {"hq": hq, "hkv": hkv, "d": d, "eps": eps, "neox": neox, "offset": offset}


def _projection_check(match: pm.Match, scalars: dict) -> bool:
    """The projected form takes the call (its own checks, on the matched tensors' metadata)
    and the dispatch table can pick the fused kernel for it: for its token count when that is
    static, in some bucket when it is symbolic (:func:`fqr.projection.choose`)."""
    from .. import projection

    kw = match.kwargs
    tensors = {name: _val(kw[name]) if name in kw else None for name in
               ("x", "w_qkv", "positions", "cos_sin_cache", "q_weight", "k_weight", "q_bias",
                "k_bias")}  # fmt: skip
    x, w = tensors["x"], tensors["w_qkv"]
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor) or x.dim() != 2:
        return False
    proj = projection.projected_declaration("split_qkv_rmsnorm_rope")
    given = dict(tensors, qkv_bias=_val(kw["bias"]) if "bias" in kw else None,
                 num_heads=scalars["hq"], num_kv_heads=scalars["hkv"], head_dim=scalars["d"],
                 eps=scalars["eps"], is_neox=scalars["neox"],
                 weight_offset=scalars["offset"])  # fmt: skip
    fake_mode = torch._guards.detect_fake_mode([x, w])
    try:
        with fake_mode or contextlib.nullcontext():
            call = proj.bound(proj.bind((), given))
            proj.validate(call, values_too=False)
    except (TypeError, ValueError):
        return False
    tokens = x.shape[0] if isinstance(x.shape[0], int) else None
    return projection.choose(projection.key_of(proj, call), tokens) == "fused"


# ------------------------------------------------------------------------------- checks


def _vllm_check(match: pm.Match, scalars: dict) -> bool:
    """What the exact re-match cannot see: ranks, whole heads, the cache width, dtypes."""
    kw = match.kwargs
    qkv, w = _val(kw["qkv"]), _val(kw["q_weight"])
    cache, positions = _val(kw["cos_sin_cache"]), _val(kw["positions"])
    if qkv is None or w is None or cache is None or positions is None:
        return False
    d = w.shape[0]
    if scalars["q_size"] % d or scalars["kv_size"] % d:
        return False
    if qkv.dim() != 2 or positions.dim() != 1 or positions.dtype not in (torch.int32, torch.int64):
        return False
    if cache.shape[-1] % 2 or cache.shape[-1] > d:
        return False
    return _outputs_keep_dtype(match, qkv.dtype)


def _hf_check(match: pm.Match, scalars: dict) -> bool:
    kw = match.kwargs
    q, w, cos = _val(kw["q_by_head"]), _val(kw["q_weight"]), _val(kw["cos"])
    if q is None or w is None or cos is None or q.dim() != 4 or cos.dim() != 3:
        return False
    if cos.shape[-1] != w.shape[0] or cos.shape[-1] % 2:
        return False
    if not (halves_repeated(kw["cos"]) and halves_repeated(kw["sin"])):
        return False
    return _outputs_keep_dtype(match, q.dtype)


def halves_repeated(node) -> bool:
    """Whether the graph proves ``node[..., :D/2] == node[..., D/2:]``.

    HF builds cos/sin as ``emb = cat((freqs, freqs), -1)`` followed by pointwise ops of that
    one tensor (``cos()``, ``* attention_scaling``, ``.to(dtype)``); Inductor may rewrite the
    ``cat`` of one tensor with itself as ``reshape(clone(expand(unsqueeze(freqs, -2), [..., 2,
    D/2])), [..., D])``. Both forms are accepted. The fused op reads only the first half of
    HF's cos/sin, so a site whose halves are not proven equal is left unfused.
    """
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        val = _val(node)
        if not isinstance(val, torch.Tensor) or val.dim() == 0:
            return False
        if node.target is aten.cat.default:
            parts = node.args[0]
            dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
            return dim in (-1, val.dim() - 1) and len(parts) == 2 and parts[0] is parts[1]
        if node.target in (aten.reshape.default, aten.view.default):
            return _pair_of_copies(node.args[0], val.shape[-1])
        if node.target is aten.clone.default or (
            node.target is aten._to_copy.default and node.kwargs.keys() <= {"dtype"}
        ):
            node = node.args[0]  # a copy or a cast: the same values
            continue
        tensor_args = [a for a in node.args if isinstance(a, torch.fx.Node)]
        tags = getattr(node.target, "tags", ())
        if (
            torch.Tag.pointwise not in tags
            or len(tensor_args) != 1
            or node.kwargs.keys() - {"dtype"}
        ):
            return False
        if _val(tensor_args[0]) is None or _val(tensor_args[0]).shape != val.shape:
            return False  # a broadcast could mix the halves
        node = tensor_args[0]
    return False


def _pair_of_copies(node, width) -> bool:
    """``node`` is ``[..., 2, width / 2]`` expanded from ``[..., 1, width / 2]`` (through
    clones), so that flattening its last two dims repeats one half twice."""
    while isinstance(node, torch.fx.Node) and node.target is aten.clone.default:
        node = node.args[0]
    if not isinstance(node, torch.fx.Node) or node.target is not aten.expand.default:
        return False
    out, src = _val(node), _val(node.args[0])
    if out is None or src is None or out.dim() < 2 or src.dim() != out.dim():
        return False
    return (
        out.shape[-2] == 2
        and src.shape[-2] == 1
        and out.shape[-1] == src.shape[-1]
        and 2 * out.shape[-1] == width
    )


def _outputs_keep_dtype(match: pm.Match, dtype: torch.dtype) -> bool:
    """The fused ops return the activation dtype; the unfused code may have promoted (a
    weight or cache of a wider dtype): then it is not the same computation, leave it."""
    for node in match.output_nodes():
        val = _val(node) if node is not None else None
        if val is not None and val.dtype != dtype:
            return False
    return True


def replacements() -> list[Replacement]:
    """Every rewrite, in registration order."""
    return [v.replacement() for v in vllm_variants()] + [v.replacement() for v in hf_variants()]


def register_patterns(pass_dict: pm.PatternMatcherPass) -> int:
    """Register every rewrite into ``pass_dict``; returns how many were registered."""
    count = 0
    with torch.no_grad():
        for r in replacements():
            r.register(pass_dict)
            count += 1
    return count


def register_projection_patterns(pass_dict: pm.PatternMatcherPass) -> int:
    """Register the QKV projection rewrites (applied after :func:`register_patterns`' on the
    same graph); returns how many were registered."""
    with torch.no_grad():
        for v in projection_variants():
            v.replacement().register(pass_dict)
    return len(projection_variants())
