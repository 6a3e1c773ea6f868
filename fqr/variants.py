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
from typing import ClassVar

import torch

from . import reference
from .core import Aval, Program
from .inputs import random_norm_params, random_positions, random_qkv
from .peers import gemma4_prologue, llama4_prologue, vllm_prologue
from .presets import Preset
from .prologue import (
    preset_program,
    rope_l2norm_program,
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
