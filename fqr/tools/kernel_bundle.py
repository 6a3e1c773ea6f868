"""``fqr build``: a kernel bundle (:mod:`fqr.lowering.bundle`) for model presets.

For each preset, TP size, activation dtype and numerics mode, the preset's public op is called
as a serving engine calls it, on ``meta`` tensors (shapes, dtypes and alignments, no values),
once per token bucket of the target's tuning table (the decode, middle and large-T kernels),
while a :class:`~fqr.lowering.bundle.BundleWriter` is open: every kernel those calls launch is
compiled for the bundle's GPU, on a machine that needs none. The RoPE table has the preset's
``max_position`` rows, as the model's own table does (its row count is part of a kernel's
specialisation).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from ..lowering import lower_by_tokens
from ..lowering.bundle import BundleTarget, building
from ..presets import get_preset
from ..prologue import program_of, variant_of


@dataclass
class BuildReport:
    """What one build wrote: per (preset, TP, dtype, numerics) the token counts called (first
    and last of each bucket) and the specialisations compiled; the total, the bundle's
    directory and the seconds it took."""

    directory: str
    target: str
    rows: list[dict] = field(default_factory=list)
    written: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {
            "directory": self.directory,
            "target": self.target,
            "written": self.written,
            "seconds": round(self.seconds, 1),
            "rows": self.rows,
        }


# Token counts a bucket is built at: its first eight, so that an argument whose offset grows
# with T (mRoPE's position planes: ``positions[i]`` of a ``[3, T]`` int64 tensor starts at
# ``8 * T * i`` bytes) is met at every 16-byte alignment a call can give it.
ALIGNMENT_CLASSES = 8


def bucket_tokens(program, target: str = "cuda") -> list[range]:
    """The token counts a build calls ``program`` with, per token bucket of its kernels on
    ``target``: the bucket's first :data:`ALIGNMENT_CLASSES` counts (1.., then above each
    bucket's upper limit)."""
    buckets = lower_by_tokens(program, target).buckets
    ranges, low = [], 1
    for limit, _ in buckets:
        high = low + ALIGNMENT_CLASSES - 1
        ranges.append(range(low, high + 1 if limit is None else min(limit, high) + 1))
        if limit is not None:
            low = limit + 1
    return ranges


def _to_meta(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.to("meta") if isinstance(t, torch.Tensor) else t for name, t in tensors.items()}


def build_bundle(
    directory: str | os.PathLike,
    pairs: Iterable[tuple[str, int]],
    *,
    dtypes: Iterable[torch.dtype] = (torch.bfloat16,),
    numerics: Iterable[str] = ("fused",),
    target: str = "cuda:90",
) -> BuildReport:
    """Compile every kernel the calls of each (preset, TP) in ``pairs`` launch, for each of
    ``dtypes`` and ``numerics``, at every token bucket, into the bundle ``directory``."""
    bundle_target = BundleTarget.parse(target)
    report = BuildReport(str(directory), str(bundle_target))
    start = time.perf_counter()
    with building(directory, bundle_target) as writer:
        for name, tp in pairs:
            preset = get_preset(name, tp)
            variant = variant_of(preset)
            for dtype in dtypes:
                for mode in numerics:
                    before = writer.written
                    program = program_of(preset, dtype, numerics=mode, sharded_full_norm=tp > 1)
                    buckets = bucket_tokens(program, bundle_target.backend)
                    for t in (t for bucket in buckets for t in bucket):
                        inputs = variant.draw(
                            preset,
                            t,
                            dtype,
                            torch.Generator().manual_seed(0),
                            max_position=preset.max_position,
                        )
                        if tp > 1 and variant.sharded_stats is not None:
                            inputs = variant.sharded_stats(preset, inputs)
                        table = torch.empty(
                            (preset.max_position, preset.rotary_dim),
                            dtype=torch.float32,
                            device="meta",
                        )
                        variant.run_in_place(
                            preset, _to_meta(inputs), table, backend="triton", numerics=mode
                        )
                    report.rows.append(
                        {
                            "preset": name,
                            "tp": tp,
                            "dtype": str(dtype).removeprefix("torch."),
                            "numerics": mode,
                            "tokens": [[b.start, b.stop - 1] for b in buckets],
                            "compiled": writer.written - before,
                        }
                    )
        report.written = writer.written
    report.seconds = time.perf_counter() - start
    return report
