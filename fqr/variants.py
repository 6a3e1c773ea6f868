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
from .core import TOKENS, Aval, Program
from .inputs import random_norm_params, random_positions, random_qkv
from .peers import gemma4_prologue, llama4_prologue, vllm_prologue
from .presets import Preset
from .prologue import (
    cache_program,
    index_heads_program,
    mrope_preset_program,
    preset_program,
    rope_l2norm_program,
    split_qkv_index_rmsnorm_rope,
    split_qkv_rmsnorm_mrope,
    split_qkv_rmsnorm_rope,
    split_qkv_rmsnorm_rope_cache,
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

    # Inputs the op updates in place (a paged cache): :meth:`run` works on copies of them,
    # :meth:`run_in_place` on them, as a serving engine calls the op.
    donated: ClassVar[frozenset[str]] = frozenset()

    def run_in_place(
        self,
        preset: Preset,
        inputs: dict[str, torch.Tensor],
        cos_sin_cache: torch.Tensor,
        *,
        numerics: str = "fused",
        backend: str = "auto",
    ) -> tuple[torch.Tensor, ...]:
        """:meth:`run` with the :attr:`donated` inputs updated in place instead of copied
        first (what ``fqr bench`` times); the same as :meth:`run` where nothing is donated."""
        return self.run(preset, inputs, cos_sin_cache, numerics=numerics, backend=backend)

    def bytes_written(self, program: Program, inputs: dict[str, torch.Tensor]) -> int:
        """Bytes one call on ``inputs`` stores: every ``[T, width]`` output of ``program``
        (this variant's :meth:`program`) once; a donated output (not ``[T, ...]`` rows) is
        the overriding variant's to count."""
        tokens = inputs["qkv"].shape[0]
        return sum(
            tokens * v.aval.shape[1] * v.aval.dtype.itemsize
            for v in program.outputs
            if v.aval.shape[0] == TOKENS
        )

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
        fields = preset.params
        return preset.spec.head_kwargs(
            mrope_section=tuple(fields["mrope_section"]),
            mrope_interleaved=bool(fields["mrope_interleaved"]),
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
        static = spec.head_kwargs(numerics=numerics)
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
        return preset.spec.head_kwargs()

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


# ------------------------------------------- MiniMax-M3: indexer heads, KV-cache insert

FP8_E4M3 = torch.float8_e4m3fn
CACHE_DTYPE_NAMES = {"auto": None, "fp8e4m3": FP8_E4M3}  # auto: the model dtype (vLLM's)
OUTLIERS = (-1000.0, 600.0, 449.0, -448.5)  # v entries past E4M3's +-448: the clamp is exercised


def _with_outliers(x: torch.Tensor, columns: slice, generator: torch.Generator) -> torch.Tensor:
    """``x`` with :data:`OUTLIERS` written at random tokens of ``columns`` (a v section):
    activations real models produce now and then, and what an FP8 store must saturate."""
    if not x.shape[0]:
        return x
    x = x.clone()
    width = columns.stop - columns.start
    for value in OUTLIERS:
        t = int(torch.randint(0, x.shape[0], (1,), generator=generator, device=generator.device))
        c = columns.start + int(
            torch.randint(0, width, (1,), generator=generator, device=generator.device)
        )
        x[t, c] = value
    return x


def _random_heads(tokens, heads, head_dim, dtype, generator) -> torch.Tensor:
    """``[tokens, heads*head_dim]`` drawn as :func:`fqr.inputs.random_qkv` draws its heads."""
    f64, device = torch.float64, generator.device
    scale = 0.5 + 2.5 * torch.rand(heads, generator=generator, dtype=f64, device=device)
    x = torch.randn(tokens, heads, head_dim, generator=generator, dtype=f64, device=device)
    return (x * scale[:, None]).reshape(tokens, heads * head_dim).to(dtype)


def _gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float):
    """vLLM's per-head norms: ``GemmaRMSNorm.forward_static`` (offset 1: ``(1 + w)`` in fp32,
    one rounding) or ``RMSNorm.forward_native`` (offset 0: rounded, then ``* w`` in x's
    dtype)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)
    if offset == 0.0:
        return h.to(dtype) * weight
    return (h * (offset + weight.float())).to(dtype)


def _rotary_native(positions, x, head_dim, cos_sin_cache, is_neox):
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


def _norm_rope_eager(x, weight, positions, cos_sin_cache, head_dim, spec):
    t = x.shape[0]
    normed = _gemma_rms_norm(
        x.reshape(t, -1, head_dim), weight, spec.eps, spec.weight_offset
    ).reshape(t, -1)
    return _rotary_native(positions, normed, head_dim, cos_sin_cache, spec.is_neox)


def _fp8_eager(x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """vllm-ascend's ``clamp(y, -448, 448).to(float8_e4m3fn)`` (with vLLM's ``x / scale``)."""
    if scale is not None:
        x = x.float() / scale
    return x.clamp(-448.0, 448.0).to(FP8_E4M3)


class IndexHeads(Variant):
    """:func:`fqr.split_qkv_index_rmsnorm_rope`: MiniMax-M3's row ``[q | k | v | index_q |
    index_k]``, four ``(1 + w)`` norms, one RoPE table, FP8 E4M3 outputs when the preset says
    (:func:`fqr.reference.index_prologue`, then :func:`fqr.reference.saturate_fp8`). The
    indexer q heads number the kv heads of the view: MiniMax-M3 has ``sparse_num_index_heads
    == num_key_value_heads`` and shards them alike (vllm-ascend ``MiniMaxM3SparseAttention``);
    the one index_k head is on every rank."""

    name = "index-heads"
    outputs = ("q", "k", "v", "index_q", "index_k")
    copies = frozenset()  # v is a copy, but an FP8 one saturates: compared like the others
    params = ("index_head_dim", "attn_fp8", "index_fp8")
    has_bias = False  # MiniMax-M3 has no attention bias (config attention_bias: false)

    def check(self, preset):
        super().check(preset)
        p = preset.params
        if not isinstance(p["index_head_dim"], int) or p["index_head_dim"] < preset.rotary_dim:
            raise ValueError(
                f"preset {preset.name}: index_head_dim must be an int >= rotary_dim "
                f"{preset.rotary_dim}, got {p['index_head_dim']!r}"
            )
        for flag in ("attn_fp8", "index_fp8"):
            if not isinstance(p[flag], bool):
                raise ValueError(f"preset {preset.name}: {flag} must be a bool")

    def _kwargs(self, preset) -> dict:
        spec = preset.spec
        return spec.head_kwargs(
            num_index_heads=spec.num_kv_heads, index_head_dim=preset.params["index_head_dim"]
        )

    def head_dim(self, preset, output):
        return preset.params["index_head_dim"] if output.startswith("index") else preset.head_dim

    def program_args(self, inputs, cos_sin_cache):
        """The arguments of :meth:`program`'s program, in its input order."""
        names = ("q_weight", "k_weight", "index_q_weight", "index_k_weight")
        return [inputs["qkv"], inputs["positions"], cos_sin_cache, *(inputs[n] for n in names)]

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
        kw, p = self._kwargs(preset), preset.params
        d, di = kw["head_dim"], kw["index_head_dim"]
        width = (kw["num_heads"] + 2 * kw["num_kv_heads"]) * d + (kw["num_index_heads"] + 1) * di
        avals = (
            Aval(("T", width), dtype),
            Aval(("T",), positions_dtype),
            Aval(("P", preset.rotary_dim), torch.float32),
            Aval((d,), dtype),
            Aval((d,), dtype),
            Aval((di,), dtype),
            Aval((di,), dtype),
        )
        static = dict(kw, attn_fp8=p["attn_fp8"], index_fp8=p["index_fp8"], numerics=numerics)
        return index_heads_program((avals, tuple(sorted(static.items()))))

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
        kw = self._kwargs(preset)
        spec, di = preset.spec, kw["index_head_dim"]
        main = random_qkv(spec, tokens, dtype, generator)
        index = _random_heads(tokens, kw["num_index_heads"] + 1, di, dtype, generator)
        v_at = spec.q_size + spec.kv_size
        qkv = _with_outliers(
            torch.cat([main, index], dim=1), slice(v_at, v_at + spec.kv_size), generator
        )
        positions = random_positions(
            tokens, max_position, generator, dtype=positions_dtype, cover_ends=True
        )
        q_weight, k_weight, _, _ = random_norm_params(spec, dtype, generator)
        index_spec = replace(spec, num_heads=1, num_kv_heads=1, head_dim=di, rotary_dim=di)
        iq_weight, ik_weight, _, _ = random_norm_params(index_spec, dtype, generator)
        return {
            "qkv": qkv,
            "positions": positions,
            "q_weight": q_weight,
            "k_weight": k_weight,
            "index_q_weight": iq_weight,
            "index_k_weight": ik_weight,
        }

    def expected(self, preset, inputs, cos_sin_cache):
        kw, p = self._kwargs(preset), preset.params
        weights = [inputs[n] for n in ("q_weight", "k_weight", "index_q_weight", "index_k_weight")]
        outs = list(
            reference.index_prologue(
                inputs["qkv"], inputs["positions"], cos_sin_cache, weights, **kw
            )
        )
        for i, fp8 in ((0, p["attn_fp8"]), (1, p["attn_fp8"]), (2, p["attn_fp8"])):
            if fp8:
                outs[i] = reference.saturate_fp8(outs[i])
        if p["index_fp8"]:
            outs[3], outs[4] = reference.saturate_fp8(outs[3]), reference.saturate_fp8(outs[4])
        return dict(zip(self.outputs, outs))

    def run(self, preset, inputs, cos_sin_cache, *, numerics="fused", backend="auto"):
        p = preset.params
        return split_qkv_index_rmsnorm_rope(
            inputs["qkv"],
            inputs["positions"],
            cos_sin_cache,
            inputs["q_weight"],
            inputs["k_weight"],
            inputs["index_q_weight"],
            inputs["index_k_weight"],
            attn_fp8=p["attn_fp8"],
            index_fp8=p["index_fp8"],
            numerics=numerics,
            backend=backend,
            **self._kwargs(preset),
        )

    def eager(self, preset, cos_sin_cache: torch.Tensor, dtype: torch.dtype):
        """MiniMax-M3's own unfused chain (vllm-ascend ``MiniMaxM3SparseAttention.
        _sparse_prepare`` fallback: ``narrow`` x 5, ``GemmaRMSNorm`` x 4, ``rotary_emb`` x 2,
        ``clamp`` + cast for FP8), in ``dtype`` with the table held in ``dtype``."""
        kw, p, spec = self._kwargs(preset), preset.params, preset.spec
        d, di, hi = kw["head_dim"], kw["index_head_dim"], kw["num_index_heads"]
        sizes = [spec.q_size, spec.kv_size, spec.kv_size, hi * di, di]
        table = cos_sin_cache.to(dtype)

        def run(inputs):
            pos = inputs["positions"]
            q, k, v, iq, ik = inputs["qkv"].split(sizes, dim=-1)
            q = _norm_rope_eager(q, inputs["q_weight"], pos, table, d, spec)
            k = _norm_rope_eager(k, inputs["k_weight"], pos, table, d, spec)
            iq = _norm_rope_eager(iq, inputs["index_q_weight"], pos, table, di, spec)
            ik = _norm_rope_eager(ik, inputs["index_k_weight"], pos, table, di, spec)
            v = v.contiguous()
            attn = [_fp8_eager(x) for x in (q, k, v)] if p["attn_fp8"] else [q, k, v]
            index = [_fp8_eager(x) for x in (iq, ik)] if p["index_fp8"] else [iq, ik]
            return (*attn, *index)

        return run


INDEX_HEADS = register_variant(IndexHeads())


class KVCacheInsert(Variant):
    """:func:`fqr.split_qkv_rmsnorm_rope_cache`: norm + RoPE of q and k, k and v written into
    paged caches ``[num_blocks, block_size, Hkv, D]`` by slot (some slots negative: padding),
    q returned with the new caches (:func:`fqr.reference.prologue` and
    :func:`fqr.reference.cache_insert`). The caches drawn hold random values, so a row written
    where no slot names it shows; an FP8 cache takes random per-tensor scales."""

    name = "kv-cache"
    outputs = ("q", "key_cache", "value_cache")
    copies = frozenset()
    params = ("block_size", "cache_dtype")
    has_bias = False
    donated = frozenset({"key_cache", "value_cache"})

    def bytes_written(self, program, inputs):
        """q's rows, then one k row and one v row per stored slot (``slot >= 0``) in the
        cache's dtype: the caches' other rows are not touched."""
        _, key_cache, _ = program.outputs
        stored = int((inputs["slot_mapping"] >= 0).sum())
        _, _, heads, head_dim = key_cache.aval.shape
        cache_rows = 2 * stored * heads * head_dim * key_cache.aval.dtype.itemsize
        return super().bytes_written(program, inputs) + cache_rows

    def check(self, preset):
        super().check(preset)
        p = preset.params
        if not isinstance(p["block_size"], int) or p["block_size"] < 1:
            raise ValueError(f"preset {preset.name}: block_size must be an int >= 1")
        if p["cache_dtype"] not in CACHE_DTYPE_NAMES:
            raise ValueError(
                f"preset {preset.name}: cache_dtype must be one of "
                f"{', '.join(CACHE_DTYPE_NAMES)}, got {p['cache_dtype']!r}"
            )

    def cache_dtype(self, preset, dtype: torch.dtype) -> torch.dtype:
        return CACHE_DTYPE_NAMES[preset.params["cache_dtype"]] or dtype

    def program_args(self, inputs, cache_table):
        """The arguments of :meth:`program`'s program, in its input order (the caches are
        donated to a kernel launched on them: pass copies to keep the drawn ones)."""
        names = ("q_weight", "k_weight", "key_cache", "value_cache", "slot_mapping")
        scales = [inputs[n] for n in ("k_scale", "v_scale") if n in inputs]
        return [
            inputs["qkv"],
            inputs["positions"],
            cache_table,
            *(inputs[n] for n in names),
        ] + scales

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
        spec, cache_dtype = preset.spec, self.cache_dtype(preset, dtype)
        cache = Aval(
            ("B", preset.params["block_size"], spec.num_kv_heads, spec.head_dim), cache_dtype
        )
        scale = Aval((1,), torch.float32) if cache_dtype == FP8_E4M3 else None
        avals = (
            Aval(("T", spec.qkv_width), dtype),
            Aval(("T",), positions_dtype),
            Aval(("P", spec.rotary_dim), torch.float32),
            Aval((spec.head_dim,), dtype),
            Aval((spec.head_dim,), dtype),
            cache,
            cache,
            Aval(("T",), torch.int64),
            scale,
            scale,
        )
        static = spec.head_kwargs(numerics=numerics)
        return cache_program((avals, tuple(sorted(static.items()))))

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
        spec, bs = preset.spec, preset.params["block_size"]
        cache_dtype = self.cache_dtype(preset, dtype)
        v_at = spec.q_size + spec.kv_size
        qkv = _with_outliers(
            random_qkv(spec, tokens, dtype, generator), slice(v_at, v_at + spec.kv_size), generator
        )
        positions = random_positions(
            tokens, max_position, generator, dtype=positions_dtype, cover_ends=True
        )
        q_weight, k_weight, _, _ = random_norm_params(spec, dtype, generator)
        blocks = -(-2 * tokens // bs) + 1  # twice the rows the tokens need, plus a block
        shape = (blocks, bs, spec.num_kv_heads, spec.head_dim)
        caches = [
            torch.randn(
                shape, generator=generator, dtype=torch.float64, device=generator.device
            ).to(cache_dtype)
            for _ in range(2)
        ]
        slots = torch.randperm(blocks * bs, generator=generator, device=generator.device)[:tokens]
        if tokens > 1:
            slots[1::3] = -1  # padding tokens: nothing stored
        drawn = {
            "qkv": qkv,
            "positions": positions,
            "q_weight": q_weight,
            "k_weight": k_weight,
            "key_cache": caches[0],
            "value_cache": caches[1],
            "slot_mapping": slots,
        }
        if cache_dtype == FP8_E4M3:
            scales = 0.25 + 0.75 * torch.rand(
                2, generator=generator, dtype=torch.float64, device=generator.device
            )
            drawn["k_scale"] = scales[:1].float()
            drawn["v_scale"] = scales[1:].float()
        return drawn

    def expected(self, preset, inputs, cos_sin_cache):
        spec = preset.spec
        q, k, v = reference.prologue(
            inputs["qkv"],
            inputs["positions"],
            cos_sin_cache,
            inputs["q_weight"],
            inputs["k_weight"],
            **spec.kwargs(),
        )
        slots = inputs["slot_mapping"]
        key_cache, _ = reference.cache_insert(
            inputs["key_cache"], k, slots, scale=inputs.get("k_scale")
        )
        value_cache, _ = reference.cache_insert(
            inputs["value_cache"], v, slots, scale=inputs.get("v_scale")
        )
        return {"q": q, "key_cache": key_cache, "value_cache": value_cache}

    def run(self, preset, inputs, cos_sin_cache, *, numerics="fused", backend="auto"):
        """The op on copies of the drawn caches (it updates them in place): ``(q, key_cache,
        value_cache)``."""
        copies = {n: inputs[n].clone() for n in self.donated}
        return self.run_in_place(
            preset, dict(inputs, **copies), cos_sin_cache, numerics=numerics, backend=backend
        )

    def run_in_place(self, preset, inputs, cos_sin_cache, *, numerics="fused", backend="auto"):
        """The op storing into the given caches (a second call on the same inputs stores the
        same rows again): ``(q, key_cache, value_cache)``."""
        key_cache, value_cache = inputs["key_cache"], inputs["value_cache"]
        q = split_qkv_rmsnorm_rope_cache(
            inputs["qkv"],
            inputs["positions"],
            cos_sin_cache,
            inputs["q_weight"],
            inputs["k_weight"],
            key_cache,
            value_cache,
            inputs["slot_mapping"],
            k_scale=inputs.get("k_scale"),
            v_scale=inputs.get("v_scale"),
            numerics=numerics,
            backend=backend,
            **{k: v for k, v in preset.spec.kwargs().items() if k != "norm"},
        )
        return q, key_cache, value_cache

    def eager(self, preset, cos_sin_cache: torch.Tensor, dtype: torch.dtype):
        """The model's unfused chain: split, ``GemmaRMSNorm`` on q and k, ``rotary_emb``, then
        vLLM's ``reshape_and_cache_flash`` as an ``index_put`` on the valid slots (FP8: ``x /
        scale`` clamped and cast); updates the given caches in place, returns ``(q, key_cache,
        value_cache)``."""
        spec = preset.spec
        d, table = spec.head_dim, cos_sin_cache.to(dtype)

        def store(cache, x, slots, scale):
            rows = cache.view(-1, spec.num_kv_heads, d)
            keep = slots >= 0
            x = x.view(-1, spec.num_kv_heads, d)[keep]
            rows[slots[keep]] = _fp8_eager(x, scale) if cache.dtype == FP8_E4M3 else x
            return cache

        def run(inputs):
            pos, slots = inputs["positions"], inputs["slot_mapping"]
            q, k, v = inputs["qkv"].split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
            q = _norm_rope_eager(q, inputs["q_weight"], pos, table, d, spec)
            k = _norm_rope_eager(k, inputs["k_weight"], pos, table, d, spec)
            key_cache = store(inputs["key_cache"], k, slots, inputs.get("k_scale"))
            value_cache = store(inputs["value_cache"], v, slots, inputs.get("v_scale"))
            return q, key_cache, value_cache

        return run


KV_CACHE = register_variant(KVCacheInsert())
