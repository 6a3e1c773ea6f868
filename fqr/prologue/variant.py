"""A preset bound to a declaration: what fqr needs to prove one member of the family right.

A :class:`Variant` names a member of the family as presets name it (``Preset.variant``:
``split-qkv``, ``mrope-gate``, ...), the :class:`~fqr.prologue.declare.Declaration` it runs,
the preset fields it reads (``Preset.variant_params``) and three things of its own: how a
preset gives the op's static arguments (``kwargs``), how one call's inputs are drawn (``draw``,
from :mod:`fqr.inputs`), and the model's own unfused chain (``eager``, :mod:`fqr.peers`). The
rest is derived from the declaration:

==================  =========================================================================
``program``         the program the public op traces for the preset (its TP view): what the
                    golden kernels snapshot, ``fqr lower`` and the Ascend sweep compile, the
                    bench lowers
``expected``        the declaration's float64 reference on the inputs, by output name
``run``             the public op on the inputs (donated caches copied first: ``run_in_place``
                    updates them, as a serving engine calls the op)
``program_args``    the program's operands of those inputs (the bench's bare launcher)
``torch_op``        ``torch.ops.fqr.<op>`` and its arguments (the bench's dispatch table)
``bytes_written``   what one call stores (the bench's traffic)
``golden``          the variant's golden cases (:mod:`fqr.golden` collects them)
==================  =========================================================================
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from ..core import TOKENS, Program, lookup
from ..inputs import random_norm_inputs, random_projection, random_row
from ..presets import Preset, get_preset
from .declare import DECLARATIONS, Cache, Declaration, torch_op_params
from .projected import SUFFIX


@dataclass(frozen=True)
class CaseSpec:
    """One golden case: a preset (at TP size ``tp``), an input dtype and a token count, plus
    the variations it exercises. ``is_neox=None`` keeps the preset's RoPE style;
    ``max_position=None`` the preset's table length; ``row_pad`` extra (NaN) elements per qkv
    row (row stride > width); ``peer`` a layout or form of the split op (:data:`fqr.golden.
    PEER_FORMS`). The case runs its preset's variant; with ``hidden``, that variant's projected
    form (:meth:`Variant.projected_form`: ``x`` of ``hidden`` features and the packed weight in
    place of ``qkv``, ``qkv_bias`` with the projection's bias)."""

    preset: str
    dtype: str
    tokens: int
    numerics: str = "fused"
    tp: int = 1
    bias: bool = False
    is_neox: bool | None = None
    max_position: int | None = None
    positions_dtype: str = "int64"
    row_pad: int = 0
    peer: str | None = None
    hidden: int | None = None
    qkv_bias: bool = False

    def __post_init__(self):
        if self.qkv_bias and self.hidden is None:
            raise ValueError("CaseSpec: qkv_bias is an option of a projected case (hidden)")

    @property
    def variant_name(self) -> str:
        return get_preset(self.preset).variant

    @property
    def name(self) -> str:
        parts = [
            self.preset if self.tp == 1 else f"{self.preset}-tp{self.tp}",
            self.dtype,
            f"t{self.tokens}",
            self.numerics,
        ]
        if self.bias:
            parts.append("bias")
        if self.is_neox is False:
            parts.append("gptj")
        if self.max_position:
            parts.append(f"pos{self.max_position.bit_length() - 1}")
        if self.positions_dtype == "int32":
            parts.append("i32")
        if self.row_pad:
            parts.append("strided")
        if self.peer:
            parts.append(self.peer)
        if self.hidden is not None:
            parts.append(f"proj{self.hidden}")
        if self.qkv_bias:
            parts.append("qkvbias")
        return "-".join(parts)

    @property
    def seed(self) -> int:
        """Deterministic per case, independent of the case's position in the list."""
        return int.from_bytes(hashlib.sha256(self.name.encode()).digest()[:4], "little")


@dataclass(eq=False)
class Variant:
    """One member of the prologue family as presets name it (module docstring).

    ``kwargs(preset)``: the public op's static arguments for the preset (not ``numerics`` /
    ``backend``); ``draw(variant, preset, tokens, dtype, generator, *, max_position,
    positions_dtype, bias)``: one call's tensor arguments by parameter name (``positions``
    among them; not the table); ``eager(variant, preset, cos_sin_cache, dtype)``: the model's
    unfused chain over those inputs; ``params``: the preset fields it reads (all required);
    ``check_preset``: more checks of a preset's fields; ``copies``: outputs compared bit for
    bit besides the declaration's copies; ``pins``: static arguments that decide which
    outputs it has (``output_gate``)."""

    name: str
    declaration: Declaration
    kwargs: Callable[[Preset], dict]
    draw_inputs: Callable[..., dict]
    eager_chain: Callable[..., Callable]
    params: tuple[str, ...] = ()
    check_preset: Callable[[Variant, Preset], None] | None = None
    copies_too: frozenset[str] = frozenset()
    pins: dict | Callable[[Preset], dict] = field(default_factory=dict)
    golden: tuple[CaseSpec, ...] = ()
    has_bias: bool = False
    reads_table: bool = True
    sharded_stats: Callable[[Preset, dict], dict] | None = None  # a TP shard's norm statistics
    tolerances: Callable[[Preset], dict[str, str]] | None = None  # kinds a preset decides
    # in_features of the projection whose output is the op's first input (None: the model's
    # hidden_size; MLA's q rope reads q_b_proj's output, of q_lora_rank features)
    projection_in: Callable[[Preset], int] | None = None

    # -------------------------------------------------------------- what it is
    @property
    def projected(self) -> Declaration | None:
        """The projected form of the variant's op (:mod:`.projected`: ``<op>_proj``), or None
        where it has none."""
        return DECLARATIONS.get(self.declaration.name + SUFFIX)

    def projected_form(self, hidden: int, qkv_bias: bool = False) -> Variant:
        """This variant run by its op's projected form: the same presets, static arguments and
        other inputs; ``x [T, hidden]``, ``w_qkv`` and (with ``qkv_bias``) the projection's
        bias drawn in place of ``qkv`` (:func:`fqr.inputs.random_projection`, after the rest);
        every output held to the contract (none is a copy of a stored row: v is the product,
        rounded once). Not registered: presets name the variant, a case its form."""
        decl = self.projected
        if decl is None:
            raise ValueError(
                f"variant {self.name!r}: {self.declaration.name} has no projected form"
            )
        base = self

        def draw_inputs(variant, preset, tokens, dtype, generator, **options):
            drawn = base.draw_inputs(base, preset, tokens, dtype, generator, **options)
            width = drawn.pop("qkv").shape[1]
            x = random_projection(tokens, hidden, width, dtype, generator, bias=qkv_bias)
            return x | drawn

        return replace(
            self,
            declaration=decl,
            draw_inputs=draw_inputs,
            copies_too=frozenset(),
            sharded_stats=None,
            golden=(),
        )

    def outputs_of(self, preset: Preset | None = None) -> tuple[str, ...]:
        """The outputs a call of this variant (for ``preset``, where the preset decides: MLA
        without ``q_lora_rank`` has no ``q_c``) has, in order."""
        pins = self.pins(preset) if callable(self.pins) else self.pins
        pinned, decl = _Pinned(pins), self.declaration
        return tuple(o.name for o in decl.outputs if o.present is None or o.present(pinned))

    def projection_in_features(self, preset: Preset) -> int:
        """The in_features of the linear layer whose output the op's first input is (the QKV
        projection: the model's ``hidden_size``); 0 where the preset does not record it. The
        bench's "after GEMM" floor runs that GEMM before the op."""
        return self.projection_in(preset) if self.projection_in else preset.hidden_size

    @property
    def outputs(self) -> tuple[str, ...]:
        """The outputs a call of this variant has, in order (where no preset decides them)."""
        if callable(self.pins):
            raise TypeError(f"variant {self.name!r}: its presets decide its outputs (outputs_of)")
        return self.outputs_of()

    @property
    def copies(self) -> frozenset[str]:
        own = {o.name for o in self.declaration.outputs if o.copy}
        return frozenset(own | self.copies_too)

    @property
    def donated(self) -> frozenset[str]:
        """The arguments a call updates in place (a paged cache, q rotated in place)."""
        return frozenset(p.name for p in self.declaration.tensor_params if p.donated)

    def tolerance(self, output: str, preset: Preset | None = None) -> str:
        """The tolerance kind of ``output`` (:data:`fqr.numerics.TOLERANCE_KINDS`) for
        ``preset`` (a byte-layout cache's kind depends on the preset's cache)."""
        if preset is not None and self.tolerances is not None:
            kind = self.tolerances(preset).get(output)
            if kind is not None:
                return kind
        return "bitwise" if output in self.copies else "contract"

    def head_dim(self, preset: Preset, output: str) -> int:
        """The head width ``output`` is compared head by head with."""
        (spec,) = [o for o in self.declaration.outputs if o.name == output]
        if spec.head_dim is None:
            return preset.head_dim
        return spec.head_dim(self.kwargs(preset) | {"rotary_dim": preset.rotary_dim})

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
        if self.check_preset is not None:
            self.check_preset(self, preset)

    # -------------------------------------------------------------- one call
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
        """The tensor arguments of one call, by parameter name, in the order drawn."""
        if bias and not self.has_bias:
            raise ValueError(f"variant {self.name!r} has no norm bias")
        return self.draw_inputs(
            self,
            preset,
            tokens,
            dtype,
            generator,
            max_position=max_position,
            positions_dtype=positions_dtype,
            bias=bias,
        )

    def arguments(
        self, preset: Preset, inputs: dict, cos_sin_cache: torch.Tensor | None, **extra
    ) -> dict:
        """The public op's keyword arguments for ``inputs`` of ``preset``."""
        table = cos_sin_cache if self.reads_table else None
        absent = {p.name: None for p in self.declaration.tensor_params if p.optional}
        # an op with no table (a stand-alone cache insert) takes none
        has_table = "cos_sin_cache" in self.declaration.index
        tables = {"cos_sin_cache": table} if has_table else {}
        return {**absent, **inputs, **tables, **self.kwargs(preset), **extra}

    def run(self, preset: Preset, inputs: dict, cos_sin_cache, **options) -> tuple:
        """The public op on ``inputs`` (the donated ones copied first; ``options``:
        ``numerics=``, ``backend=``): every output in :meth:`outputs_of` order, a donated
        cache as its updated copy."""
        copies = {n: inputs[n].clone() for n in self.donated if n in inputs}
        return self.run_in_place(preset, dict(inputs, **copies), cos_sin_cache, **options)

    def run_in_place(self, preset: Preset, inputs: dict, cos_sin_cache, **options) -> tuple:
        """:meth:`run` with the donated inputs updated in place (what ``fqr bench`` times)."""
        result = self.declaration.function(
            **self.arguments(preset, inputs, cos_sin_cache, **options)
        )
        returned = result if isinstance(result, tuple) else (result,)
        returned = tuple(r for r in returned if r is not None)
        written_into = {o.into for o in self.declaration.outputs if o.into is not None}
        outputs = self.outputs_of(preset)
        donated = [inputs[n] for n in outputs if n in self.donated - written_into]
        return (*returned, *donated)

    def expected(
        self, preset: Preset, inputs: dict, cos_sin_cache: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """float64 expectation of every output by name (copies in the input dtype): the
        declaration's reference on the same arguments."""
        decl = self.declaration
        values = self.arguments(preset, inputs, cos_sin_cache)
        outs = decl.reference(**decl.reference_kwargs(values))
        outs = tuple(o for o in outs if o is not None)
        return dict(zip(self.outputs_of(preset), outs))

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
        """The program the public op traces for ``preset`` (its TP view) with ``dtype``
        activations: the declaration traced on a one-token call drawn for it."""
        inputs = self.example(
            preset, dtype, positions_dtype=positions_dtype, bias=bias, stats=sharded_full_norm
        )
        table = torch.zeros(1, preset.rotary_dim) if self.reads_table else None
        decl = self.declaration
        values = decl.bind((), self.arguments(preset, inputs, table, numerics=numerics))
        call = decl.bound(values)
        decl.validate(call)
        return decl.program(call)

    def example(self, preset, dtype, *, positions_dtype, bias, stats=False) -> dict:
        """A one-token call's inputs (positions 0), for tracing; ``stats``: with a TP shard's
        norm statistics where the variant has them."""
        inputs = self.draw(
            preset,
            1,
            dtype,
            torch.Generator().manual_seed(0),
            max_position=1,
            positions_dtype=positions_dtype,
            bias=bias,
        )
        if stats and self.sharded_stats is not None:
            inputs = self.sharded_stats(preset, inputs)
        return inputs

    def program_args(self, preset: Preset, inputs: dict, cos_sin_cache) -> list[torch.Tensor]:
        """The operands of :meth:`program`'s program for ``inputs``, in its input order (a
        donated cache is updated by a kernel launched on them: pass copies to keep it)."""
        decl = self.declaration
        values = decl.bind((), self.arguments(preset, inputs, cos_sin_cache))
        return decl.operands(decl.bound(values))

    def torch_op(self, preset: Preset, inputs: dict, cos_sin_cache, numerics: str = "fused"):
        """``(torch.ops.fqr.<op>.default, its positional arguments)`` for ``inputs``."""
        decl = self.declaration
        values = self.arguments(preset, inputs, cos_sin_cache, numerics=numerics)
        bound = decl.bind((), values)
        args = [bound[decl.index[p.name]] for p in torch_op_params(decl)]
        return getattr(torch.ops.fqr, decl.name).default, args

    def bytes_written(self, program: Program, inputs: dict[str, torch.Tensor]) -> int:
        """Bytes one call on ``inputs`` stores: every ``[T, width]`` output once, and for a
        donated paged cache one entry per stored slot of its own slot mapping (``slot >= 0``,
        ``Cache.slots``; an optional cache the call is not given: none): its other rows are not
        touched."""
        tokens = next(iter(inputs.values())).shape[0]
        total = sum(
            tokens * v.aval.shape[1] * v.aval.dtype.itemsize
            for v in program.outputs
            if v.aval.shape[0] == TOKENS
        )
        for p in self.declaration.tensor_params:
            if p.donated and isinstance(p.kind, Cache) and inputs.get(p.name) is not None:
                cache, stored = inputs[p.name], int((inputs[p.kind.slots] >= 0).sum())
                total += stored * cache[0, 0].numel() * cache.element_size()
        return total

    def eager(self, preset: Preset, cos_sin_cache: torch.Tensor, dtype: torch.dtype):
        """The model's own unfused torch chain over the inputs :meth:`draw` returns (vLLM's /
        Hugging Face's model code, :mod:`fqr.peers`), the outputs in :attr:`outputs` order;
        ``cos_sin_cache`` the fp32 table (the chain holds it as the model does)."""
        return self.eager_chain(self, preset, cos_sin_cache, dtype)


class _Pinned:
    """The static arguments a variant pins, read as a call is (anything else is absent)."""

    def __init__(self, pins: dict):
        self._pins = pins

    def __getattr__(self, name: str):
        return self._pins.get(name)


# ----------------------------------------------------------------------------- registry

VARIANTS: dict[str, Variant] = {}


def register_variant(variant: Variant) -> Variant:
    """Add ``variant`` to :data:`VARIANTS` under its name (once)."""
    if not variant.name or variant.name in VARIANTS:
        raise ValueError(f"variant name {variant.name!r} is empty or already registered")
    VARIANTS[variant.name] = variant
    return variant


def get_variant(name: str) -> Variant:
    return lookup(VARIANTS, name, "variant")


def variant_of(preset: Preset) -> Variant:
    """The preset's variant, the preset's fields checked against it."""
    variant = get_variant(preset.variant)
    variant.check(preset)
    return variant


def presets_of(name: str) -> list[str]:
    """The presets of variant ``name`` (an op a model's layer calls beside its own prologue
    is a preset of its own, as ``qwen3-vl-8b-qk-mrope``: :mod:`fqr.presets`)."""
    from ..presets import PRESETS

    get_variant(name)  # an unknown name is refused, naming the variants
    return [p.name for p in PRESETS.values() if p.variant == name]


def program_of(preset: Preset, dtype: torch.dtype = torch.bfloat16, **options) -> Program:
    """The traced prologue of ``preset`` (any variant; options as :meth:`Variant.program`)."""
    return variant_of(preset).program(preset, dtype, **options)


def golden_cases() -> tuple[CaseSpec, ...]:
    """Every variant's golden cases, in registration order."""
    return tuple(c for v in VARIANTS.values() for c in v.golden)


# ------------------------------------------------------------ hooks several variants share


def head_kwargs(preset) -> dict:
    """The ``kwargs`` of a per-head op: the preset's :meth:`fqr.presets.PrologueSpec.head_kwargs`
    (heads, head_dim, eps, rotary pairing, weight offset)."""
    return preset.spec.head_kwargs()


def preset_layout(preset) -> str:
    """The ``qkv_layout`` of a preset's TP view (its ``qkv_layout`` variant field, ``"qkv"``
    without one), CodeGen's ``N`` shards divided by the TP size (a rank's slice of the row
    holds ``N / tp`` whole shards)."""
    layout = preset.params.get("qkv_layout", "qkv")
    if layout.startswith("codegen-mp"):
        return f"codegen-mp{int(layout.removeprefix('codegen-mp')) // preset.tp}"
    return layout


def draw_row(variant, preset, tokens, dtype, generator, *, max_position, positions_dtype, bias):
    """The ``draw_inputs`` of an op of vLLM's packed row: ``qkv`` and ``positions``
    (:func:`fqr.inputs.random_row`), then the preset's :func:`fqr.inputs.random_norm_inputs`."""
    row = dict(max_position=max_position, positions_dtype=positions_dtype)
    drawn = random_row(preset.spec, tokens, dtype, generator, **row)
    return drawn | random_norm_inputs(preset.spec, dtype, generator, bias=bias)


def row_chain(peer: Callable) -> Callable:
    """The ``eager_chain`` of a peer written ``peer(qkv, positions, table, q_weight, k_weight,
    spec)`` (:mod:`fqr.peers`: the model's unfused chain), the table in the model dtype (as
    vLLM holds it)."""

    def eager(variant, preset, cos_sin_cache, dtype):
        spec, table = preset.spec, cos_sin_cache.to(dtype)

        def run(inputs):
            qkv, positions = inputs["qkv"], inputs["positions"]
            return peer(qkv, positions, table, inputs.get("q_weight"), inputs.get("k_weight"), spec)

        return run

    return eager


def spec_chain(peer: Callable, kwargs: Callable[[Preset], dict] = lambda preset: {}) -> Callable:
    """The ``eager_chain`` of a peer written ``peer(inputs, table, spec, **kwargs(preset))``
    (:mod:`fqr.peers`: the model's unfused chain over a call's inputs by name), the table in
    the model dtype (as vLLM holds it)."""

    def eager(variant, preset, cos_sin_cache, dtype):
        table, kw = cos_sin_cache.to(dtype), kwargs(preset)
        return lambda inputs: peer(inputs, table, preset.spec, **kw)

    return eager
