"""The ``ascend-on-cuda`` test backend on a CPU machine: it runs exactly the ``ascend`` source,
its grid is sized like an Ascend chip, and that source compiles with upstream Triton for a
CUDA GPU (the GPU run itself is tests/gpu/test_ascend_on_cuda_gpu.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fqr
from fqr.ascend_on_cuda import DEFAULT_PROGRAMS, NAME, generated_body, register_target
from fqr.backends import BACKENDS
from fqr.lowering import kernel_source, tiling_of
from fqr.prologue import program_of

REPO = Path(__file__).resolve().parents[2]
# One preset per kind of kernel the ascend profile emits: whole rows, head chunks (Qwen3.5:
# 24 heads of 256, with its gate and interleaved mRoPE), Gemma's (1 + w) norm, GPT-J partial
# rotary, the full-width norm, no norm.
COMPILE_PRESETS = ["qwen3-8b", "qwen3.5-27b", "gemma3-27b", "glm4-9b", "olmo2-7b", "llama3-8b"]


@pytest.mark.parametrize("name", COMPILE_PRESETS)
def test_runs_the_ascend_source_itself(name):
    program = program_of(fqr.get_preset(name), torch.bfloat16)
    register_target()
    ours, ascend = kernel_source(program, NAME), kernel_source(program, "ascend")
    assert "fqr_ascend_on_cuda_" in ours and "fqr_ascend_on_cuda_" not in ascend
    assert generated_body(ours) == generated_body(ascend)
    assert tiling_of(program, NAME) == tiling_of(program, "ascend")


def test_grid_is_sized_like_an_ascend_chip():
    target = register_target()
    cuda = torch.device("cuda")
    assert target.grid(10_000, 2, cuda) == DEFAULT_PROGRAMS
    for cores in (20, 48):
        assert target.grid(10_000, 16, cuda, num_vectorcore=cores) == cores
    assert target.grid(20, 16, cuda) == 2  # never more programs than token tiles
    assert not target.interpret and target.flavour == "upstream"


def test_backend_is_listed_and_says_why_it_is_unavailable():
    backend = BACKENDS[NAME]
    assert backend.device_types == ("cuda",)
    if not torch.cuda.is_available():
        assert "CUDA" in backend.unavailable_reason()


@pytest.mark.slow
def test_ascend_source_compiles_with_upstream_triton_for_sm90():
    """Every kind of ascend kernel through TTIR -> TTGIR -> LLVM IR -> PTX -> cubin (sm_90), in
    a process of its own: this suite's process runs Triton interpreted."""
    code = (
        "import json, torch, fqr\n"
        "from fqr.ascend_on_cuda import compile_offline\n"
        "from fqr.prologue import program_of\n"
        "out = {}\n"
        f"for name in {COMPILE_PRESETS!r}:\n"
        "    r = compile_offline(program_of(fqr.get_preset(name), torch.bfloat16))\n"
        "    out[name] = [r.stages, r.block_t, r.grid]\n"
        "print(json.dumps(out))\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="0")
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    done = json.loads(r.stdout.strip().splitlines()[-1])
    assert sorted(done) == sorted(COMPILE_PRESETS)
    for name, (stages, block_t, grid) in done.items():
        assert stages[-2:] == ["ptx", "cubin"], name
        assert block_t >= 2 and grid[0] == DEFAULT_PROGRAMS, (name, block_t, grid)
