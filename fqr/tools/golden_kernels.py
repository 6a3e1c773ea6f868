"""Generated kernel sources kept as golden files (``golden/kernels/``).

A change to the emitter shows up as a readable diff of these files in review; ``fqr golden
regen`` rewrites them and ``tests/lowering/test_golden_kernels.py`` checks they are current.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..files import check_destination, check_directory, make_directory, write_file
from ..lowering import kernel_source
from ..presets import get_preset
from ..prologue import program_of

# (file stem, preset, tp, dtype, numerics, target)
GOLDEN_KERNELS = [
    ("qwen3-8b.bf16.cuda", "qwen3-8b", 1, torch.bfloat16, "fused", "cuda"),
    ("qwen3-8b.bf16.unfused.interpret", "qwen3-8b", 1, torch.bfloat16, "unfused", "interpret"),
    ("qwen3.5-27b.bf16.cuda", "qwen3.5-27b", 1, torch.bfloat16, "fused", "cuda"),
    ("glm4-9b.fp16.cuda", "glm4-9b", 1, torch.float16, "fused", "cuda"),
    ("olmo2-7b.tp2.bf16.cuda", "olmo2-7b", 2, torch.bfloat16, "fused", "cuda"),
]


def render(preset: str, tp: int, dtype: torch.dtype, numerics: str, target: str) -> str:
    p = get_preset(preset, tp)
    return kernel_source(program_of(p, dtype, numerics=numerics, sharded_full_norm=tp > 1), target)


def _paths(golden_dir: Path | str) -> tuple[Path, list[Path]]:
    out = Path(golden_dir) / "kernels"
    return out, [out / f"{stem}.py" for stem, *_ in GOLDEN_KERNELS]


def check_destinations(golden_dir: Path | str) -> None:
    """OSError naming the path when :func:`regen` would refuse to write one of its files (a
    symlink, a directory: :func:`fqr.files.write_file`), the ``kernels/`` directory included."""
    out, paths = _paths(golden_dir)
    check_directory(out)
    for path in paths:
        check_destination(path)


def regen(golden_dir: Path | str) -> list[Path]:
    out, paths = _paths(golden_dir)
    make_directory(out)
    for path, (_, *spec) in zip(paths, GOLDEN_KERNELS):
        write_file(path, render(*spec))
    return paths
