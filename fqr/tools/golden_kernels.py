"""Generated kernel sources kept as golden files (``golden/kernels/``).

A change to the emitter shows up as a readable diff of these files in review; ``fqr golden
regen`` rewrites them and ``tests/lowering/test_golden_kernels.py`` checks they are current.
"""

from __future__ import annotations

from pathlib import Path

import torch

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


def regen(golden_dir: Path | str) -> list[Path]:
    out = Path(golden_dir) / "kernels"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for stem, *spec in GOLDEN_KERNELS:
        path = out / f"{stem}.py"
        path.write_text(render(*spec))
        written.append(path)
    return written
