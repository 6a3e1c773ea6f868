"""The compile check: generated ``ascend`` kernels through Triton-Ascend's own stages.

TTIR, then ``triton-adapter-opt`` to Ascend linalg/HIVM for ``GPUTarget("npu", arch, 0)``; the
final bishengir step is reported as needing CANN. The full sweep (every preset at TP 1/2/4/8)
is ``fqr lower --target ascend --check`` in ``make test-ascend``; here: representative kernels
(head chunks, full-width norm, GPT-J, partial rotary, fp16/fp32, bias, unfused, the 950 chip),
that a failing stage is reported as a failure, and the CLI's exit codes.

Needs the Ascend environment and a compiling process: ``TRITON_INTERPRET=0 pytest
tests/ascend/test_ascend_compile.py`` (``make test-ascend`` does this); skips otherwise.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from support.compositions import gated_case, indexer_case, narrow_case, padded_case

from fqr.lowering import lower
from fqr.lowering.ascend import get_chip
from fqr.lowering.ascend_compile import NEEDS_CANN, check_kernel, compile_stages
from fqr.lowering.loader import triton_mode
from fqr.tools.ascend_check import check_preset, check_projected

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
HAVE_TRITON_ASCEND = importlib.util.find_spec("triton.backends.ascend") is not None
pytestmark = [
    pytest.mark.skipif(
        not HAVE_TRITON_ASCEND,
        reason="needs triton-ascend: the Ascend environment (make ascend-env)",
    ),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "0" or triton_mode() == "interpreted",
        reason="the compile check needs a process with TRITON_INTERPRET=0",
    ),
]


@pytest.mark.parametrize(
    "preset, tp, dtype, options",
    [
        ("qwen3-32b", 1, torch.bfloat16, {}),  # q row split into head chunks
        ("olmo2-7b", 1, torch.float16, {}),  # chunked full-width norm prepass
        ("olmo2-7b", 4, torch.bfloat16, {}),  # sharded full norm: stats inputs
        ("glm4-9b", 8, torch.float32, {}),  # GPT-J, partial rotary, no norm
        ("qwen3.5-27b", 2, torch.bfloat16, {"bias": True, "numerics": "unfused"}),  # D=256, 1+w
        ("gemma3-27b", 1, torch.bfloat16, {"chip": "950"}),
        ("qwen3-235b-a22b", 1, torch.bfloat16, {"ub_bytes": 85 * 1024}),  # vllm-ascend's budget
        ("qwen3.5-27b", 1, torch.bfloat16, {"ub_bytes": 85 * 1024, "chunk_mode": "loop"}),
        ("qwen3.5-27b", 8, torch.bfloat16, {}),  # gated row, interleaved mRoPE, 3 q heads
        ("qwen3-vl-8b", 1, torch.float16, {"bias": True}),  # mRoPE (24, 20, 20) interleaved
        ("gemma4-31b-full", 1, torch.bfloat16, {}),  # D=512, weightless v norm (issue 15)
        ("llama4-scout-nope", 8, torch.bfloat16, {}),  # positions as numbers: the temperature
    ],
    ids=lambda v: (
        str(v).replace("torch.", "")
        if not isinstance(v, dict)
        else "-".join(f"{k}={x}" for k, x in v.items()) or "default"
    ),
)
def test_preset_kernels_lower_to_ascend_linalg(preset, tp, dtype, options):
    r = check_preset(preset, tp, dtype, **options)
    stages = {s.name: s for s in r.report.stages}
    assert r.report.passed, r.report.to_dict()
    assert stages["ttir"].status == "ok" and stages["linalg"].status == "ok"
    assert "mix_mode=aiv" in stages["linalg"].detail
    assert stages["npubin"].status in ("ok", NEEDS_CANN)
    assert r.report.arch == get_chip(options.get("chip")).arch
    assert r.report.signature["T"] == "i32" and r.report.signature["BLOCK_T"] == "constexpr"
    # DENSE: the launcher found every row stride equal to its width (contiguous meta inputs)
    assert r.report.constants == {"BLOCK_T": r.tiling.tiling.block_t, "DENSE": True}
    assert r.tiling.footprint <= r.tiling.budget


@pytest.mark.parametrize(
    "preset, tp, dtype, options",
    [
        ("glm4-9b", 2, torch.bfloat16, {}),  # GPT-J pairs, a one-head k (the bias as pair tiles)
        ("qwen3-8b", 8, torch.float16, {"heads_per_program": 2}),  # head groups, one masked
        ("qwen3-vl-8b", 4, torch.float32, {}),  # fp32 operands on the cube
        ("gemma4-31b-full", 1, torch.bfloat16, {}),  # D = 512: 8-token tiles (M < 16)
        ("olmo2-7b", 8, torch.bfloat16, {"ub_bytes": 40 * 1024}),  # whole-row norm in chunks
        ("qwen3-8b", 1, torch.bfloat16, {"chip": "950", "block_k": 32}),
    ],
    ids=lambda v: (
        str(v).replace("torch.", "")
        if not isinstance(v, dict)
        else "-".join(f"{k}={x}" for k, x in v.items()) or "default"
    ),
)
def test_projected_kernels_lower_to_ascend_linalg_on_the_cube(preset, tp, dtype, options):
    """The projected form (the QKV GEMM with the prologue as its epilogue): a mix kernel (the
    cube's tl.dot and the vector cores' epilogue), its tiles within the stated budgets."""
    r = check_projected(preset, tp, dtype, **options)
    stages = {s.name: s for s in r.report.stages}
    assert r.report.passed, r.report.to_dict()
    assert "mix_mode=mix" in stages["linalg"].detail
    t = r.tiling
    assert t.footprint <= t.budget and t.cube is not None and not t.cube.over(t.chip.cube)
    assert t.tiling.persistent_blocks and t.tiling.split_k == 1
    if "block_k" in options:
        assert t.tiling.block_k == options["block_k"]
    if preset == "olmo2-7b":
        assert t.tiling.head_chunks[0] < 4, t.describe()  # the row in chunks
    assert r.report.signature["T"] == "i32"
    assert r.report.constants == {"BLOCK_T": t.tiling.block_t, "DENSE": True}


@triton.jit
def shared_row_gather(pos_ptr, cache_ptr, out_ptr, T, BLOCK_T: tl.constexpr):
    """Two gathers through one position-indexed row pointer, as the prologue's cos/sin."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    m = tok < T
    pos = tl.load(pos_ptr + tok, mask=m, other=0)
    row = cache_ptr + pos[:, None] * 64
    c = tl.arange(0, 32)[None, :]
    a = tl.load(row + c, mask=m[:, None], other=0.0)
    b = tl.load(row + 32 + c, mask=m[:, None], other=0.0)
    tl.store(out_ptr + tok[:, None] * 32 + c, a * b, mask=m[:, None])


SHARED_ROW_SIGNATURE = {
    "pos_ptr": "*i64",
    "cache_ptr": "*fp32",
    "out_ptr": "*fp32",
    "T": "i32",
    "BLOCK_T": "constexpr",
}


def test_a_failing_stage_is_reported_with_the_tools_message():
    """triton-adapter-opt 3.2.0 aborts on single-token tiles: the reason for MIN_BLOCK_T = 2."""
    results, linalg = compile_stages(
        shared_row_gather, SHARED_ROW_SIGNATURE, {"BLOCK_T": 1}, get_chip("A2")
    )
    assert [(r.name, r.status) for r in results] == [("ttir", "ok"), ("linalg", "failed")]
    assert (
        "triton-adapter-opt exited" in results[1].detail and "multiple users" in results[1].detail
    )
    assert linalg is None
    results, linalg = compile_stages(
        shared_row_gather, SHARED_ROW_SIGNATURE, {"BLOCK_T": 2}, get_chip("A2")
    )
    assert [r.status for r in results][:2] == [
        "ok",
        "ok",
    ] and "func.func @shared_row_gather" in linalg


def test_npubin_runs_where_a_bishengir_compile_is_found(tmp_path, monkeypatch):
    """With a bishengir-compile on PATH the last stage runs (this fake one fails loudly)."""
    fake = tmp_path / "bishengir-compile"
    fake.write_text("#!/bin/sh\necho 'fake bishengir: no NPU toolchain here' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    results, _ = compile_stages(
        shared_row_gather, SHARED_ROW_SIGNATURE, {"BLOCK_T": 2}, get_chip("A2")
    )
    assert [r.status for r in results] == ["ok", "ok", "failed"]


def _fqr(*args):
    env = dict(os.environ, TRITON_INTERPRET="0")
    return subprocess.run(
        [sys.executable, "-m", "fqr", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_cli_check_json_and_usage_errors():
    r = _fqr(
        "lower",
        "--target",
        "ascend",
        "--check",
        "--preset",
        "qwen3-8b",
        "--tp",
        "8",
        "--num-vectorcore",
        "20",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    # the prologue op, then its projected form (the QKV GEMM with the prologue as epilogue)
    assert report["ok"] and [(c["tp"], c["projected"]) for c in report["checks"]] == [
        (8, False),
        (8, True),
    ]
    assert report["checks"][1]["block_k"] >= 16
    assert (
        "needs the CANN toolkit" in r.stderr or report["checks"][0]["stages"][2]["status"] == "ok"
    )
    bad = _fqr("lower", "--target", "ascend", "--check", "--preset", "qwen3-8b", "--tp", "3")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "tp=3" in bad.stderr


@pytest.mark.parametrize(
    "case",
    [
        # Qwen3.5-27B's real row: each q head followed by its gate head, head stride 2*D
        lambda gen: gated_case(gen, 4, hq=24, hkv=4, d=256, r=64),
        lambda gen: indexer_case(gen, 4, hq=16, hkv=2, d=128, hi=8, di=64, r=64, ri=32),
        lambda gen: padded_case(gen, 4, heads=(8, 2, 4), d=80, stride=96),
        lambda gen: narrow_case(gen, 4, head_dim=512, rotary_dim=2),
        lambda gen: narrow_case(gen, 4, head_dim=769, rotary_dim=2, is_neox=False),
    ],
    ids=["gated-qwen3.5", "indexer-heads", "padded-kv-heads", "rotary2-d512", "rotary2-d769-gptj"],
)
def test_generalised_split_kernels_lower_to_ascend_linalg(gen, case):
    kernel = lower(case(gen).program, "ascend")
    report = check_kernel(kernel)
    stages = {s.name: s.status for s in report.stages}
    assert report.passed, report.to_dict()
    assert stages["ttir"] == "ok" and stages["linalg"] == "ok"


@pytest.mark.parametrize("preset", ["minimax-m3-kvcache-fp8"])  # the sweep compiles every one
def test_fp8_presets_compile_for_the_950_only(preset, monkeypatch):
    """FP8 outputs / an FP8 cache: with no chip named the check compiles for the 950
    (Ascend910_9599, Triton-Ascend's frontend switched to the 950's for that compile and back);
    named A2, the lowering refuses it before any compile."""
    import sys

    from fqr.lowering.ascend import UnsupportedOnChip

    monkeypatch.delenv("FQR_ASCEND_CHIP", raising=False)
    r = check_preset(preset, 8)
    assert r.report.passed, r.report.to_dict()
    assert r.report.arch == get_chip("950").arch and r.tiling.chip.name == "950"
    assert any("fp8" in t for t in r.report.signature.values())
    core = sys.modules["triton.triton_patch.language.core"]
    assert core.is_compile_on_910_95 is False  # restored after the 950 compile
    with pytest.raises(UnsupportedOnChip, match="FP8 stores need an Ascend 950"):
        check_preset(preset, 8, chip="A2")


@pytest.mark.parametrize(
    "flavour, q_lora, chip",
    [
        ("auto", 1536, "A2"),  # DeepSeek-V3: q_c of 1536 in the row
        ("auto", 0, "A2"),  # DeepSeek-V2-Lite: [kv_c | k_pe]
        ("fp8", 1536, "950"),
        ("fp8_ds_mla", 1536, "950"),
        ("fp8_ds_mla", 0, "950"),
    ],
)
def test_mla_kv_kernels_lower_to_ascend_linalg(flavour, q_lora, chip, monkeypatch):
    """The MLA KV prologue (``tests/support/mla.py``, DeepSeek-V3's widths, bf16) through the
    Ascend stages; an FP8 flavour is refused on the A2 before any compile. fp8_ds_mla's
    float32 scales and bf16 rope values go into the uint8 entry byte by byte: the frontend
    refuses ``ptr.to(tl.pointer_type(tl.float32))`` on a uint8 pointer ("Casting pointers with
    unmatched bitwidth"); the E4M3 values keep their same-width pointer cast."""
    from support.mla import mla_program

    from fqr.lowering.ascend import UnsupportedOnChip

    monkeypatch.delenv("FQR_ASCEND_CHIP", raising=False)
    prog = mla_program(flavour, torch.bfloat16, q_lora=q_lora)
    kernel = lower(prog, "ascend", chip=chip)
    assert kernel.tiling.byte_stores == ("bytes" if flavour == "fp8_ds_mla" else "cast")
    report = check_kernel(kernel)
    stages = {s.name: s for s in report.stages}
    assert report.passed, report.to_dict()
    assert stages["ttir"].status == "ok" and stages["linalg"].status == "ok"
    assert report.arch == get_chip(chip).arch
    cache = "f_ptr" if q_lora else "e_ptr"  # the cache input (after a q_c weight, if any)
    assert report.signature[cache] == {"auto": "*bf16", "fp8": "*fp8e4nv"}.get(flavour, "*u8")
    if flavour != "auto":
        with pytest.raises(UnsupportedOnChip, match="FP8 stores need an Ascend 950"):
            lower(prog, "ascend", chip="A2")


def test_byte_entry_pointer_casts_the_frontend_refuses():
    """What Triton-Ascend 3.2's frontend does with typed stores into a byte entry: the
    widening pointer cast fails in ``triton-adapter-opt`` (the reason for the
    ``byte_stores="bytes"`` tiling), the byte-by-byte store and an 8-bit cast pass."""
    from fqr.lowering.ascend_compile import compile_stages

    @triton.jit
    def typed(x_ptr, c_ptr, T, WIDE: tl.constexpr, BLOCK_T: tl.constexpr):
        tok = tl.arange(0, BLOCK_T)
        m = tok < T
        x = tl.load(x_ptr + tok, mask=m, other=0.0)
        row = c_ptr + tok * 16
        if WIDE:
            tl.store((row + 4).to(tl.pointer_type(tl.float32)), x, mask=m)
        else:
            bits = x.to(tl.uint32, bitcast=True)
            for k in tl.static_range(4):
                tl.store(row + 4 + k, ((bits >> (8 * k)) & 255).to(tl.uint8), mask=m)

    signature = {"x_ptr": "*fp32", "c_ptr": "*u8", "T": "i32"}
    for wide, linalg in ((1, "failed"), (0, "ok")):
        sig = {**signature, "WIDE": "constexpr", "BLOCK_T": "constexpr"}
        results, _ = compile_stages(typed, sig, {"WIDE": wide, "BLOCK_T": 8}, get_chip("950"))
        assert [r.status for r in results][:2] == ["ok", linalg], [r.to_dict() for r in results]
        if wide:
            assert "Casting pointers with unmatched bitwidth" in results[1].detail
