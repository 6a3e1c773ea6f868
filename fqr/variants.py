"""The prologue family: one :class:`Variant` per composition a model runs, and its registry.

A variant ties together everything fqr needs to prove one member of the family right:

==================  =========================================================================
``program``         the traced composition for a preset (its TP view): what the golden kernel
                    snapshots (:mod:`fqr.tools.golden_kernels`), the Ascend compile sweep
                    (:mod:`fqr.tools.ascend_check`, ``fqr lower``) and the bench lower
``draw``            the case's inputs from a seeded generator (:mod:`fqr.inputs`), positions
                    included (``[T]``, or ``[3, T]`` for mRoPE)
``expected``        the float64 expectation of each output (:mod:`fqr.reference`, which shares
                    no code with :mod:`fqr.ops`); copies in the input dtype
``run``             the public op on those inputs (:mod:`fqr.prologue`)
``tolerance``       the tolerance kind of each output (:data:`fqr.numerics.TOLERANCE_KINDS`:
                    ``contract`` for computed values, ``bitwise`` for copies such as v or a gate)
==================  =========================================================================

A preset names its variant (:attr:`fqr.presets.Preset.variant`, default ``split-qkv``: the
prologue of :func:`fqr.split_qkv_rmsnorm_rope`) and carries the variant's fields
(:attr:`~fqr.presets.Preset.variant_params`); a golden case runs its preset's variant unless it
names another (``CaseSpec.variant``). ``fqr verify``, ``fqr golden list/regen``, the golden
kernels and the Ascend sweep go through this registry, so a new variant needs no code in them
(ARCHITECTURE.md, "How to add a variant").
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import replace
from typing import ClassVar

import torch

from . import reference
from .core import Aval, Program
from .inputs import random_norm_params, random_positions, random_qkv
from .peers import gemma4_prologue, llama4_prologue, vllm_prologue
from .presets import Preset
from .prologue import (
    mrope_preset_program,
    preset_program,
    rope_l2norm_program,
    split_qkv_rmsnorm_mrope,
    split_qkv_rmsnorm_rope,
    split_qkv_rmsnorm_rope_vnorm,
    split_qkv_rope_l2norm,
    vnorm_program,
)


class Variant(ABC):
    """One member of the prologue family (module docstring). Subclasses set :attr:`name`,
    :attr:`outputs` and :attr:`copies` and implement the methods; :meth:`check` validates a
    preset's :attr:`~fqr.presets.Preset.variant_params`."""

    name: ClassVar[str] = ""
    outputs: ClassVar[tuple[str, ...]] = ("q", "k", "v")
    copies: ClassVar[frozenset[str]] = frozenset({"v"})  # outputs that are copies of the input
    params: ClassVar[tuple[str, ...]] = ()  # the variant_params names it accepts (all required)

    def check(self, preset: Preset) -> None:
        """Raise a ``ValueError`` naming the preset and field when its variant fields do not
        fit this variant."""
        have = preset.params
        unknown = sorted(set(have) - set(self.params))
        if unknown:
            raise ValueError(
                f"preset {preset.name}: variant {self.name!r} has no field {unknown[0]!r}"
                f" (fields: {', '.join(self.params) or 'none'})"
            )
        missing = [p for p in self.params if p not in have]
        if missing:
            raise ValueError(f"preset {preset.name}: variant {self.name!r} needs {missing[0]!r}")

    def tolerance(self, output: str) -> str:
        """The tolerance kind of ``output`` (:data:`fqr.numerics.TOLERANCE_KINDS`)."""
        return "bitwise" if output in self.copies else "contract"

    def head_dim(self, preset: Preset, output: str) -> int:
        """The head width ``output`` is compared head by head with."""
        return preset.head_dim

    reads_table: ClassVar[bool] = True  # whether the program takes the RoPE table
    has_bias: ClassVar[bool] = True  # whether draw/program take bias=True (norm biases)

    def program_args(
        self, inputs: dict[str, torch.Tensor], cos_sin_cache: torch.Tensor
    ) -> list[torch.Tensor]:
        """The arguments of :meth:`program`'s program, in its input order: the packed row, the
        positions, the table (when :attr:`reads_table`), then the norm vectors and any other
        input in the order :meth:`draw` returns them."""
        first = ["qkv", "positions"] + (["cos_sin_cache"] if self.reads_table else [])
        named = dict(inputs, cos_sin_cache=cos_sin_cache)
        vectors = [n for n in ("q_weight", "k_weight", "q_bias", "k_bias") if n in inputs]
        rest = [n for n in inputs if n not in first and n not in vectors]
        return [named[n] for n in first + vectors + rest if n in named]

    @abstractmethod
    def program(
        self,
        preset: Preset,
        dtype: torch.dtype = torch.bfloat16,
        *,
        numerics: str = "fused",
        bias: bool = False,
        positions_dtype: torch.dtype = torch.int64,
        sharded_full_norm: bool = False,
    ) -> Program:
        """The composition traced for ``preset`` (its TP view)."""

    @abstractmethod
    def draw(
        self,
        preset: Preset,
        tokens: int,
        dtype: torch.dtype,
        generator: torch.Generator,
        *,
        max_position: int,
        positions_dtype: torch.dtype = torch.int64,
        bias: bool = False,
    ) -> dict[str, torch.Tensor]:
        """The inputs of one call, by name (``positions`` among them), in the order drawn."""

    @abstractmethod
    def expected(
        self, preset: Preset, inputs: dict[str, torch.Tensor], cos_sin_cache: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """float64 expectation of every output (copies in the input dtype), by output name."""

    @abstractmethod
    def run(
        self,
        preset: Preset,
        inputs: dict[str, torch.Tensor],
        cos_sin_cache: torch.Tensor,
        *,
        numerics: str = "fused",
        backend: str = "auto",
    ) -> tuple[torch.Tensor, ...]:
        """The public op on ``inputs``: the outputs in :attr:`outputs` order."""

    @abstractmethod
    def eager(
        self, preset: Preset, cos_sin_cache: torch.Tensor, dtype: torch.dtype
    ) -> Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, ...]]:
        """The model's own unfused torch chain over the inputs :meth:`draw` returns (separate
        split, norms, rotary and the variant's other ops in the model dtype, as vLLM's / Hugging
        Face's model code writes them; :mod:`fqr.peers`, independent of :mod:`fqr.ops`), the
        outputs in :attr:`outputs` order. ``cos_sin_cache`` is the fp32 table; the chain holds
        it as the model does. ``fqr bench`` times it as the ``eager`` peer and
        ``torch.compile(fullgraph=True)`` of it as the ``compile`` peer."""


VARIANTS: dict[str, Variant] = {}


def register_variant(variant: Variant) -> Variant:
    """Add ``variant`` to :data:`VARIANTS` under its name (once)."""
    if not variant.name or variant.name in VARIANTS:
        raise ValueError(f"variant name {variant.name!r} is empty or already registered")
    VARIANTS[variant.name] = variant
    return variant


def get_variant(name: str) -> Variant:
    try:
        return VARIANTS[name]
    except KeyError:
        raise ValueError(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}") from None


def variant_of(preset: Preset) -> Variant:
    """The preset's variant, its fields checked."""
    variant = get_variant(preset.variant)
    variant.check(preset)
    return variant


def program_of(preset: Preset, dtype: torch.dtype = torch.bfloat16, **options) -> Program:
    """The traced prologue of ``preset`` (any variant; options as :meth:`Variant.program`)."""
    return variant_of(preset).program(preset, dtype, **options)


# ---------------------------------------------------------------------------- split-qkv


class SplitQKV(Variant):
    """:func:`fqr.split_qkv_rmsnorm_rope`: split ``[q | k | v]``, RMS-normalise q and k (per
    head, full width or none), rotate them, copy v (:func:`fqr.reference.prologue`). Its golden
    cases keep their historical storage (:class:`fqr.golden.GoldenCase`: norm statistics of a
    sharded full-width norm, strided rows)."""

    name = "split-qkv"

    def program(self, preset, dtype=torch.bfloat16, **options):
        return preset_program(preset, dtype, **options)

    def draw(
        self,
        preset,
        tokens,
        dtype,
        generator,
        *,
        max_position,
        positions_dtype=torch.int64,
        bias=False,
    ):
        spec = preset.spec
        qkv = random_qkv(spec, tokens, dtype, generator)
        positions = random_positions(
            tokens, max_position, generator, dtype=positions_dtype, cover_ends=True
        )
        names = ("q_weight", "k_weight", "q_bias", "k_bias")
        norm = random_norm_params(spec, dtype, generator, bias=bias)
        drawn = {"qkv": qkv, "positions": positions}
        drawn.update((n, x) for n, x in zip(names, norm) if x is not None)
        return drawn

    def expected(self, preset, inputs, cos_sin_cache):
        q, k, v = reference.prologue(
            inputs["qkv"],
            inputs["positions"],
            cos_sin_cache,
            inputs.get("q_weight"),
            inputs.get("k_weight"),
            **preset.spec.kwargs(q_bias=inputs.get("q_bias"), k_bias=inputs.get("k_bias")),
        )
        return {"q": q, "k": k, "v": v}

    def run(self, preset, inputs, cos_sin_cache, *, numerics="fused", backend="auto"):
        return split_qkv_rmsnorm_rope(
            inputs["qkv"],
            inputs["positions"],
            cos_sin_cache,
            inputs.get("q_weight"),
            inputs.get("k_weight"),
            **preset.spec.kwargs(
                q_bias=inputs.get("q_bias"),
                k_bias=inputs.get("k_bias"),
                numerics=numerics,
                backend=backend,
            ),
        )

    def eager(self, preset, cos_sin_cache, dtype):
        spec, cache = preset.spec, cos_sin_cache.to(dtype)  # vLLM holds the table in the dtype

        def run(inputs):
            return vllm_prologue(
                inputs["qkv"],
                inputs["positions"],
                cache,
                inputs.get("q_weight"),
                inputs.get("k_weight"),
                spec,
            )

        return run


SPLIT_QKV = register_variant(SplitQKV())


# ------------------------------------------------------------------------------- mrope


class MRoPE(Variant):
    """:func:`fqr.split_qkv_rmsnorm_mrope` without the gate (Qwen3-VL): split ``[q | k | v]``,
    per-head RMSNorm of q and k, multimodal RoPE from ``positions [3, T]``
    (:func:`fqr.reference.mrope_prologue`). Fields: ``mrope_section`` (t, h, w) and
    ``mrope_interleaved``, as the model's ``rope_scaling`` / ``rope_parameters`` name them."""

    name = "mrope"
    params = ("mrope_section", "mrope_interleaved")
    output_gate: ClassVar[bool] = False

    def check(self, preset):
        super().check(preset)
        from .validate import check_mrope_section

        fields = preset.params
        try:
            check_mrope_section(
                list(fields["mrope_section"]), fields["mrope_interleaved"], preset.rotary_dim
            )
        except (TypeError, ValueError) as e:
            raise ValueError(f"preset {preset.name}: {e}") from None
        if preset.norm != "head":
            raise ValueError(f"preset {preset.name}: variant {self.name!r} needs norm='head'")

    def _kwargs(self, preset, **extra) -> dict:
        spec, fields = preset.spec, preset.params
        return dict(
            num_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            mrope_section=tuple(fields["mrope_section"]),
            mrope_interleaved=bool(fields["mrope_interleaved"]),
            eps=spec.eps,
            is_neox=spec.is_neox,
            weight_offset=spec.weight_offset,
            output_gate=self.output_gate,
            **extra,
        )

    def program(self, preset, dtype=torch.bfloat16, *, sharded_full_norm=False, **options):
        return mrope_preset_program(preset, dtype, output_gate=self.output_gate, **options)

    def program_args(
        self, inputs: dict[str, torch.Tensor], cos_sin_cache: torch.Tensor
    ) -> list[torch.Tensor]:
        """The arguments of :meth:`program`'s program, in its input order: the packed row, the
        three position planes (the rows of ``positions [3, T]``; ``[T]`` positions on all
        three), the table, the norm weights and biases."""
        positions = inputs["positions"]
        planes = positions.unbind(0) if positions.dim() == 2 else (positions,) * 3
        vectors = [inputs[n] for n in ("q_weight", "k_weight", "q_bias", "k_bias") if n in inputs]
        return [inputs["qkv"], *planes, cos_sin_cache, *vectors]

    def draw(
        self,
        preset,
        tokens,
        dtype,
        generator,
        *,
        max_position,
        positions_dtype=torch.int64,
        bias=False,
    ):
        """The packed row (with the gate heads when the variant has them), positions
        ``[3, T]`` where every third token is text (three equal planes) and the others image
        tokens (three planes drawn apart; token 0 reads the table's last row), the norm
        weights (and biases)."""
        spec = preset.spec
        heads = replace(spec, num_heads=2 * spec.num_heads) if self.output_gate else spec
        qkv = random_qkv(heads, tokens, dtype, generator)
        planes = [
            random_positions(
                tokens, max_position, generator, dtype=positions_dtype, cover_ends=p == 0
            )
            for p in range(3)
        ]
        positions = torch.stack(planes)
        positions[1:, ::3] = positions[0, ::3]  # text tokens
        names = ("q_weight", "k_weight", "q_bias", "k_bias")
        norm = random_norm_params(spec, dtype, generator, bias=bias)
        drawn = {"qkv": qkv, "positions": positions}
        drawn.update((n, x) for n, x in zip(names, norm) if x is not None)
        return drawn

    def expected(self, preset, inputs, cos_sin_cache):
        outs = reference.mrope_prologue(
            inputs["qkv"],
            inputs["positions"],
            cos_sin_cache,
            inputs["q_weight"],
            inputs["k_weight"],
            **self._kwargs(preset, q_bias=inputs.get("q_bias"), k_bias=inputs.get("k_bias")),
        )
        return dict(zip(self.outputs, outs))

    def run(self, preset, inputs, cos_sin_cache, *, numerics="fused", backend="auto"):
        return split_qkv_rmsnorm_mrope(
            inputs["qkv"],
            inputs["positions"],
            cos_sin_cache,
            inputs["q_weight"],
            inputs["k_weight"],
            **self._kwargs(
                preset,
                q_bias=inputs.get("q_bias"),
                k_bias=inputs.get("k_bias"),
                numerics=numerics,
                backend=backend,
            ),
        )

    def eager(
        self, preset, cos_sin_cache: torch.Tensor, dtype: torch.dtype
    ) -> Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, ...]]:
        """The model's own unfused chain, as vLLM's Qwen3-VL / Qwen3.5 attention writes it
        (written from vLLM's code, independently of :mod:`fqr.ops`): ``qkv.split`` (and for
        the gate ``q_gate.view(T, H, 2*D)`` chunked in two), ``q_norm`` / ``k_norm`` per head
        (``RMSNorm.forward_static``, or ``GemmaRMSNorm``'s ``(1 + w)`` in fp32), then
        ``MRotaryEmbedding.forward_native``: the table cast to the model dtype,
        ``cos_sin_cache[positions]`` per plane, the sections joined (``torch.cat`` or
        ``apply_interleaved_rope``), ``apply_rotary_emb`` on the first R features."""
        kw = self._kwargs(preset)
        hq, hkv, d = kw["num_heads"], kw["num_kv_heads"], kw["head_dim"]
        section, interleaved, eps = kw["mrope_section"], kw["mrope_interleaved"], kw["eps"]
        gemma, neox, gated = kw["weight_offset"] == 1.0, kw["is_neox"], self.output_gate
        if kw["weight_offset"] not in (0.0, 1.0):
            raise ValueError(f"weight_offset {kw['weight_offset']}: vLLM's norms have 0 or 1")
        table = cos_sin_cache.to(dtype)
        rotary_dim = table.shape[-1]

        def norm(x, weight):
            shape, x = x.shape, x.reshape(x.shape[0], -1, d)
            orig = x.dtype
            x = x.float()
            x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
            x = (x * (1.0 + weight.float())).to(orig) if gemma else x.to(orig) * weight
            return x.reshape(shape)

        def join(x):  # [3, T, R/2] -> [T, R/2]
            if interleaved:
                out = x[0].clone()
                out[..., 1 : section[1] * 3 : 3] = x[1, ..., 1 : section[1] * 3 : 3]
                out[..., 2 : section[2] * 3 : 3] = x[2, ..., 2 : section[2] * 3 : 3]
                return out
            return torch.cat([m[i] for i, m in enumerate(x.split(list(section), dim=-1))], -1)

        def rotate(x, cos, sin):
            shape, x = x.shape, x.view(x.shape[0], -1, d)
            rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
            cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
            x1, x2 = torch.chunk(rot, 2, dim=-1) if neox else (rot[..., ::2], rot[..., 1::2])
            o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
            rot = torch.cat((o1, o2), -1) if neox else torch.stack((o1, o2), -1).flatten(-2)
            return torch.cat((rot, rest), dim=-1).reshape(shape)

        def chain(inputs):
            qkv, positions = inputs["qkv"], inputs["positions"]
            t = qkv.shape[0]
            if gated:
                q_gate, k, v = qkv.split([2 * hq * d, hkv * d, hkv * d], dim=-1)
                q, gate = torch.chunk(q_gate.view(t, hq, 2 * d), 2, dim=-1)
                q, gate = q.reshape(t, -1), gate.reshape(t, -1)
            else:
                q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            q, k = norm(q, inputs["q_weight"]), norm(k, inputs["k_weight"])
            cos, sin = table[positions if positions.dim() == 2 else positions.expand(3, -1)].chunk(
                2, dim=-1
            )
            cos, sin = join(cos), join(sin)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            return (q, k, v, gate) if gated else (q, k, v)

        return chain


class MRoPEGate(MRoPE):
    """:func:`fqr.split_qkv_rmsnorm_mrope` with ``output_gate`` (Qwen3.5 / Qwen3-Next gated
    attention): each q head followed by its gate head in the row, the gate a fourth output
    copied bit for bit."""

    name = "mrope-gate"
    outputs = ("q", "k", "v", "gate")
    copies = frozenset({"v", "gate"})
    output_gate = True


MROPE = register_variant(MRoPE())
MROPE_GATE = register_variant(MRoPEGate())


# ------------------------------------------------------------------ Gemma 4: the v norm


def _no_bias(variant: Variant, bias: bool) -> None:
    if bias:
        raise ValueError(f"variant {variant.name!r} has no norm bias")


def _draw_row(preset, tokens, dtype, generator, max_position, positions_dtype) -> dict:
    qkv = random_qkv(preset.spec, tokens, dtype, generator)
    positions = random_positions(
        tokens, max_position, generator, dtype=positions_dtype, cover_ends=True
    )
    return {"qkv": qkv, "positions": positions}


class VNorm(Variant):
    """:func:`fqr.split_qkv_rmsnorm_rope_vnorm` (Gemma 4): q and k normalised with their
    weights and rotated, v normalised per head without weight (:func:`fqr.reference.
    vnorm_prologue`); every output is computed (no copies)."""

    name = "split-qkv-vnorm"
    copies = frozenset()
    has_bias = False

    def program(
        self,
        preset,
        dtype=torch.bfloat16,
        *,
        numerics="fused",
        bias=False,
        positions_dtype=torch.int64,
        sharded_full_norm=False,
    ):
        _no_bias(self, bias)
        spec = preset.spec
        avals = (
            Aval(("T", spec.qkv_width), dtype),
            Aval(("T",), positions_dtype),
            Aval(("P", spec.rotary_dim), torch.float32),
            Aval((spec.head_dim,), dtype),
            Aval((spec.head_dim,), dtype),
        )
        static = dict(
            num_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            eps=spec.eps,
            is_neox=spec.is_neox,
            weight_offset=spec.weight_offset,
            numerics=numerics,
        )
        return vnorm_program((avals, tuple(sorted(static.items()))))

    def draw(
        self,
        preset,
        tokens,
        dtype,
        generator,
        *,
        max_position,
        positions_dtype=torch.int64,
        bias=False,
    ):
        _no_bias(self, bias)
        drawn = _draw_row(preset, tokens, dtype, generator, max_position, positions_dtype)
        q_weight, k_weight, _, _ = random_norm_params(preset.spec, dtype, generator)
        return drawn | {"q_weight": q_weight, "k_weight": k_weight}

    def _args(self, inputs, cos_sin_cache):
        return (
            inputs["qkv"],
            inputs["positions"],
            cos_sin_cache,
            inputs["q_weight"],
            inputs["k_weight"],
        )

    def _kwargs(self, preset) -> dict:
        spec = preset.spec
        return dict(
            num_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            eps=spec.eps,
            is_neox=spec.is_neox,
            weight_offset=spec.weight_offset,
        )

    def expected(self, preset, inputs, cos_sin_cache):
        q, k, v = reference.vnorm_prologue(
            *self._args(inputs, cos_sin_cache), **self._kwargs(preset)
        )
        return {"q": q, "k": k, "v": v}

    def run(self, preset, inputs, cos_sin_cache, *, numerics="fused", backend="auto"):
        return split_qkv_rmsnorm_rope_vnorm(
            *self._args(inputs, cos_sin_cache),
            **self._kwargs(preset),
            numerics=numerics,
            backend=backend,
        )

    def eager(self, preset, cos_sin_cache, dtype):
        spec, cache = preset.spec, cos_sin_cache.to(dtype)

        def run(inputs):
            return gemma4_prologue(*self._args(inputs, cache), spec)

        return run


VNORM = register_variant(VNorm())


# ------------------------------------------------------- Llama 4: rope, then the L2 norm


class RopeL2Norm(Variant):
    """:func:`fqr.split_qkv_rope_l2norm` on Llama 4's RoPE layers: q and k rotated, then each
    head L2-normalised without weight; v copied (:func:`fqr.reference.rope_l2norm_prologue`)."""

    name = "rope-l2norm"
    rotates = True  # False: a NoPE layer (no rotation, no norm)
    has_bias = False

    @property
    def reads_table(self) -> bool:  # type: ignore[override]
        return self.rotates

    def _layer(self, preset) -> dict:
        """The keyword arguments of the layer kind besides the spec (NoPE: the temperature)."""
        return {}

    def program(
        self,
        preset,
        dtype=torch.bfloat16,
        *,
        numerics="fused",
        bias=False,
        positions_dtype=torch.int64,
        sharded_full_norm=False,
    ):
        _no_bias(self, bias)
        spec = preset.spec
        layer = self._layer(preset)
        avals = (
            Aval(("T", spec.qkv_width), dtype),
            Aval(("T",), positions_dtype) if self.rotates or layer else None,
            Aval(("P", spec.rotary_dim), torch.float32) if self.rotates else None,
        )
        static = dict(self._kwargs(preset), numerics=numerics, **layer)
        return rope_l2norm_program((avals, tuple(sorted(static.items()))))

    def draw(
        self,
        preset,
        tokens,
        dtype,
        generator,
        *,
        max_position,
        positions_dtype=torch.int64,
        bias=False,
    ):
        _no_bias(self, bias)
        return _draw_row(preset, tokens, dtype, generator, max_position, positions_dtype)

    def _kwargs(self, preset) -> dict:
        spec = preset.spec
        return dict(
            num_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            eps=spec.eps,
            is_neox=spec.is_neox,
        )

    def _table(self, cos_sin_cache):
        return cos_sin_cache if self.rotates else None

    def expected(self, preset, inputs, cos_sin_cache):
        q, k, v = reference.rope_l2norm_prologue(
            inputs["qkv"],
            inputs["positions"],
            self._table(cos_sin_cache),
            **self._kwargs(preset),
            **self._layer(preset),
        )
        return {"q": q, "k": k, "v": v}

    def run(self, preset, inputs, cos_sin_cache, *, numerics="fused", backend="auto"):
        return split_qkv_rope_l2norm(
            inputs["qkv"],
            inputs["positions"],
            self._table(cos_sin_cache),
            **self._kwargs(preset),
            **self._layer(preset),
            numerics=numerics,
            backend=backend,
        )

    def eager(self, preset, cos_sin_cache, dtype):
        spec, cache = preset.spec, self._table(cos_sin_cache.to(dtype))
        layer = self._layer(preset)

        def run(inputs):
            return llama4_prologue(inputs["qkv"], inputs["positions"], cache, spec, **layer)

        return run


class NopeTemperature(RopeL2Norm):
    """:func:`fqr.split_qkv_rope_l2norm` on Llama 4's NoPE layers (``cos_sin_cache=None``):
    no rotation, no norm, q scaled by the attention temperature of its position (preset fields
    ``floor_scale``, ``attn_scale``: the config's); k and v copied."""

    name = "nope-temperature"
    copies = frozenset({"k", "v"})
    params = ("floor_scale", "attn_scale")
    rotates = False

    def _layer(self, preset) -> dict:
        p = preset.params
        return {"floor_scale": float(p["floor_scale"]), "attn_scale": float(p["attn_scale"])}


ROPE_L2NORM = register_variant(RopeL2Norm())
NOPE_TEMPERATURE = register_variant(NopeTemperature())
