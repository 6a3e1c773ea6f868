"""The Ascend compile check of every preset: ``fqr lower --target ascend --check``.

For each preset (or one) at each TP size its head counts allow (:data:`CHECK_TP_SIZES`), the
prologue is traced, lowered for the ``ascend`` target and compiled through Triton-Ascend's own
stages by :func:`fqr.lowering.ascend_compile.check_kernel` (TTIR, then ``triton-adapter-opt``
to Ascend linalg/HIVM; the NPU binary step needs CANN). Needs the Ascend environment
(``make ascend-env``).

A preset whose op has a projected form (``<op>_proj``, :mod:`fqr.prologue.projected`: the QKV
GEMM with the prologue as its epilogue) is checked in that form too (:func:`check_projected`:
the cube-unit kernel, :func:`fqr.lowering.ascend.ascend_product_tiling`), at the model's
hidden size: at its smallest and largest TP size, or at the one asked for
(:func:`projected_tp_pairs`).

FP8 stores (E4M3 outputs or caches): only the 950 has them (:func:`fqr.lowering.ascend.
check_store_dtypes`). A program that stores FP8 is checked for the 950 unless a chip is named
(``--chip`` / ``$FQR_ASCEND_CHIP``; :func:`fqr.lowering.ascend.default_chip`); named A2 or A3,
the lowering refuses it (:class:`~fqr.lowering.ascend.UnsupportedOnChip`) before any compile.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..backends import BackendUnavailable
from ..core import DTYPE_NAMES, Program
from ..lowering import lower
from ..lowering.ascend import AscendTarget, AscendTiling
from ..lowering.ascend_compile import CheckReport, check_kernel, triton_ascend_missing
from ..lowering.targets import get_target
from ..presets import PRESETS, get_preset
from ..prologue import DECLARATIONS, program_of, variant_of
from ..prologue.declare import Declaration
from ..prologue.projected import SUFFIX


class AscendToolchainMissing(BackendUnavailable):
    """triton-ascend is not importable here (use the Ascend environment)."""


def require_triton_ascend() -> None:
    missing = triton_ascend_missing()
    if missing is not None:
        raise AscendToolchainMissing(
            f"the ascend compile check needs triton-ascend ({missing}); run it in the Ascend "
            f"environment: make ascend-env, then .venv-ascend/bin/fqr lower --target ascend --check"
        )


CHECK_TP_SIZES = (1, 2, 4, 8, 16)


@dataclass
class PresetCheck:
    """The compile check of one preset's kernel at one TP size."""

    label: str
    preset: str
    tp: int
    dtype: str
    tiling: AscendTiling
    report: CheckReport
    projected: bool = False  # the projected form (<op>_proj), not the prologue op

    def to_dict(self) -> dict:
        t = self.tiling
        return {
            "preset": self.preset,
            "tp": self.tp,
            "dtype": self.dtype,
            "projected": self.projected,
            "block_t": t.tiling.block_t,
            "head_chunks": list(t.tiling.head_chunks),
            "footprint_bytes": t.footprint,
            "budget_bytes": t.budget,
            "chip": t.chip.name,
            **({"block_k": t.tiling.block_k} if self.projected else {}),
            **self.report.to_dict(),
        }


def preset_tp_pairs(preset: str | None = None, tp: int | None = None) -> list[tuple[str, int]]:
    """Every (preset, TP) to check: all presets (or ``preset``) at ``tp`` or each TP in
    :data:`CHECK_TP_SIZES` that the preset's head counts allow. An explicitly requested
    pair that is impossible raises the preset's ``ValueError``."""
    names = [preset] if preset is not None else list(PRESETS)
    pairs = []
    for name in names:
        for size in [tp] if tp is not None else CHECK_TP_SIZES:
            try:
                get_preset(name, size)
            except ValueError:
                if preset is not None and tp is not None:
                    raise
                continue
            pairs.append((name, size))
    return pairs


def projected_tp_pairs(preset: str | None = None, tp: int | None = None) -> list[tuple[str, int]]:
    """The (preset, TP) pairs whose projected form (``<op>_proj``) the sweep checks: with
    ``tp`` given, each pair of :func:`preset_tp_pairs` whose op has one; else each such
    preset at its smallest and largest TP size (its widest chains and its narrowest, one-head
    ones: the sizes between differ from them only in the count of head groups, a constant of
    the same work loop, and the tiles of one head are the same at every size)."""
    pairs = [(n, t) for n, t in preset_tp_pairs(preset, tp) if projected_declaration(n, t)]
    if tp is not None:
        return pairs
    sizes: dict[str, list[int]] = {}
    for name, size in pairs:
        sizes.setdefault(name, []).append(size)
    return [(n, t) for n, ts in sizes.items() for t in sorted({min(ts), max(ts)})]


def check_preset(
    preset: str,
    tp: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    *,
    numerics: str = "fused",
    bias: bool = False,
    chip: str | None = None,
    ub_bytes: int | None = None,
    num_vectorcore: int | None = None,
    chunk_mode: str | None = None,
) -> PresetCheck:
    """Lower the preset's prologue (its TP view) for ``ascend`` and compile-check it."""
    require_triton_ascend()
    p = get_preset(preset, tp)
    program = program_of(p, dtype, numerics=numerics, bias=bias, sharded_full_norm=tp > 1)
    options = _given(
        chip=chip, ub_bytes=ub_bytes, num_vectorcore=num_vectorcore, chunk_mode=chunk_mode
    )
    tiling, report = _check_program(program, options)
    return PresetCheck(p.label, preset, tp, DTYPE_NAMES[dtype], tiling, report)


def _given(**options: object) -> dict:
    """The lowering options given (those not None)."""
    return {k: v for k, v in options.items() if v is not None}


def _check_program(program: Program, options: dict) -> tuple[AscendTiling, CheckReport]:
    """Lower ``program`` for ``ascend`` and compile-check the kernel."""
    kernel = lower(program, "ascend", **options)
    target = get_target("ascend")
    assert isinstance(target, AscendTarget)
    tiling = target.ascend_tiling(kernel.plan, **options)
    assert tiling.tiling == kernel.tiling, "the kernel was emitted with another tiling"
    return tiling, check_kernel(kernel, chip=tiling.chip)


def projected_declaration(preset: str, tp: int = 1) -> Declaration | None:
    """The projected form of the preset's op (``<op>_proj``), or None where it has none."""
    return DECLARATIONS.get(variant_of(get_preset(preset, tp)).declaration.name + SUFFIX)


def projected_program(
    preset: str, tp: int = 1, dtype: torch.dtype = torch.bfloat16, *, bias: bool = False
) -> Program:
    """The program the projected form of the preset's op traces for one call of its TP view
    (:meth:`fqr.prologue.variant.Variant.projected_form` with the projection's bias, which
    the kernel adds: ``x [T, hidden_size]``, the packed weight ``[N, hidden_size]``, the op's
    other arguments as :meth:`~fqr.prologue.variant.Variant.program` draws them; ``bias``:
    the norms' bias terms)."""
    p = get_preset(preset, tp)
    variant = variant_of(p)
    if projected_declaration(preset, tp) is None:
        raise ValueError(f"preset {p.label}: {variant.declaration.name} has no projected form")
    return variant.projected_form(p.hidden_size, qkv_bias=True).program(p, dtype, bias=bias)


def check_projected(
    preset: str,
    tp: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    *,
    bias: bool = False,
    chip: str | None = None,
    ub_bytes: int | None = None,
    num_aicore: int | None = None,
    heads_per_program: int | None = None,
    block_k: int | None = None,
) -> PresetCheck:
    """Lower the projected form of the preset's op (:func:`projected_program`) for
    ``ascend`` (the cube-unit kernel, :func:`fqr.lowering.ascend.ascend_product_tiling`:
    ``heads_per_program`` and ``block_k`` pin its schedule) and compile-check it."""
    require_triton_ascend()
    program = projected_program(preset, tp, dtype, bias=bias)
    options = _given(
        chip=chip,
        ub_bytes=ub_bytes,
        num_aicore=num_aicore,
        heads_per_program=heads_per_program,
        block_k=block_k,
    )
    tiling, report = _check_program(program, options)
    label = f"{get_preset(preset, tp).label} proj"
    return PresetCheck(label, preset, tp, DTYPE_NAMES[dtype], tiling, report, projected=True)
