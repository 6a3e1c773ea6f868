"""The Ascend compile check of every preset: ``fqr lower --target ascend --check``.

For each preset (or one) at each TP size its head counts allow (:data:`CHECK_TP_SIZES`), the
prologue is traced, lowered for the ``ascend`` target and compiled through Triton-Ascend's own
stages by :func:`fqr.lowering.ascend_compile.check_kernel` (TTIR, then ``triton-adapter-opt``
to Ascend linalg/HIVM; the NPU binary step needs CANN). Needs the Ascend environment
(``make ascend-env``).

FP8 stores (E4M3 outputs or caches): only the 950 has them (:func:`fqr.lowering.ascend.
check_store_dtypes`). A program that stores FP8 is checked for the 950 unless a chip is named
(``--chip`` / ``$FQR_ASCEND_CHIP``; :func:`fqr.lowering.ascend.default_chip`); named A2 or A3,
the lowering refuses it (:class:`~fqr.lowering.ascend.UnsupportedOnChip`) before any compile.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..backends import BackendUnavailable
from ..core import DTYPE_NAMES
from ..lowering import lower
from ..lowering.ascend import AscendTarget, AscendTiling
from ..lowering.ascend_compile import CheckReport, check_kernel, triton_ascend_missing
from ..lowering.targets import get_target
from ..presets import PRESETS, get_preset
from ..prologue import program_of


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

    def to_dict(self) -> dict:
        t = self.tiling
        return {
            "preset": self.preset,
            "tp": self.tp,
            "dtype": self.dtype,
            "block_t": t.tiling.block_t,
            "head_chunks": list(t.tiling.head_chunks),
            "footprint_bytes": t.footprint,
            "budget_bytes": t.budget,
            "chip": t.chip.name,
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
    options = {
        k: v
        for k, v in (
            ("chip", chip),
            ("ub_bytes", ub_bytes),
            ("num_vectorcore", num_vectorcore),
            ("chunk_mode", chunk_mode),
        )
        if v is not None
    }
    kernel = lower(program, "ascend", **options)
    target = get_target("ascend")
    assert isinstance(target, AscendTarget)
    tiling = target.ascend_tiling(kernel.plan, **options)
    assert tiling.tiling == kernel.tiling, "the kernel was emitted with another tiling"
    report = check_kernel(kernel, chip=tiling.chip)
    return PresetCheck(p.label, preset, tp, DTYPE_NAMES[dtype], tiling, report)
