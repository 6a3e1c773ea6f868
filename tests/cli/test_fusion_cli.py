"""``fqr fuse`` as a user runs it (subprocess: real exit codes, real streams)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.cli import fqr_in_process

pytestmark = pytest.mark.slow  # fqr fuse compiles models in subprocesses

REPO = Path(__file__).resolve().parents[2]


def fqr(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fqr", *args], cwd=REPO, capture_output=True, text=True, timeout=400
    )


@pytest.mark.parametrize(
    "args,message",
    [
        (("--preset", "llama3-8b"), "norm='none'"),
        (("--preset", "qwen3.5-27b"), "variant 'mrope-gate'"),
        (("--preset", "nope"), "Invalid value for '--preset': 'nope' is not one of"),
        (("--layers", "0"), "--layers"),
        (("--dtype", "int8"), "--dtype"),
        (("--device", "cuda", "--model", "gpt2"), "Invalid value for '--model'"),
        (("--device", "cuda", "--decode", "1,x"), "--decode: cannot parse"),
        (("--device", "cuda", "--model", "hf-qwen3", "--preset", "qwen3-32b"), "Qwen3-8B"),
        (("--device", "tpu"), "Invalid value for '--device': 'tpu' is not one of 'cpu', 'cuda'"),
    ],
)
def test_fuse_bad_usage_is_one_line_exit_2(args, message, capsys, monkeypatch):
    """In this process (:mod:`support.cli`); the row below runs the real entry point."""
    code, out, err = fqr_in_process(["fuse", *args], capsys, monkeypatch)
    assert code == 2, err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and out == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_fuse_on_cuda_without_a_gpu_is_one_line_exit_2():
    r = fqr("fuse", "--device", "cuda")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == "error: --device cuda: no CUDA GPU is visible to torch"


def test_fuse_json_reports_every_layer_fused():
    r = fqr(
        "fuse",
        "--preset",
        "qwen3-0.6b",
        "--layers",
        "2",
        "--tokens",
        "4",
        "--dtype",
        "fp32",
        "--runs",
        "1",
        "--json",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert doc["schema"] == "fqr.fuse/1" and doc["ok"] is True and doc["dtype"] == "fp32"
    assert doc["sites"] == 2 and doc["layers"] == 2
    assert doc["unfused_ops_left"] == {}
    assert doc["contract"]["passed"] and all(c["v_exact"] for c in doc["layer_checks"])
    for side in ("unfused", "fused"):
        assert doc[side]["compile_s"] > 0 and doc[side]["run_ms"] > 0
    assert "compiling with the fusion pass" in r.stderr
