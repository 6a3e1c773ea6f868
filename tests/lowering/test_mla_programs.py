"""The Multi-head Latent Attention KV prologue as ONE kernel, composed here from fqr's ops (the
public MLA op will compose them the same way): vLLM's ``mla.py`` after the fused ``q_a`` /
``kv_a`` projection, ``[q_c | kv_c | k_pe]`` (DeepSeek-V3: 1536 + 512 + 64; V2-Lite without
q_c), ``q_c`` and ``kv_c`` RMS-normalised over their whole width, ``k_pe`` one 64-wide head
rotated GPT-J style, ``[kv_c | k_pe]`` written into the paged MLA cache through the slot
mapping: in the model dtype, FP8 E4M3 with a per-tensor scale (``concat_and_cache_mla``), or
DeepSeek-V3.2's ``fp8_ds_mla`` byte entry (``concat_and_cache_ds_mla``). The composition is
``tests/support/mla.py`` (shared with ``tests/ascend``).

Each flavour runs on the ``interpret`` and ``reference`` backends against the float64
formulation (``fqr.reference.mla_kv``, ``mla_cache_entry``, ``ds_mla_entry``) with the real
DeepSeek-V3 widths and a few tokens, some slots negative, the cache pre-filled with random
values (unwritten entries must keep their bits). The ``cuda`` source of the same programs is
generated and, where upstream Triton compiles here without a GPU, compiled for sm_90."""

from __future__ import annotations

import dataclasses
import textwrap

import pytest
import torch
from support.cuda_ptx import run_compiling
from support.mla import EPS, FLAVOURS, KV_LORA, Q_LORA, check_cache, draw, mla_program

from fqr import reference
from fqr.backends import BACKENDS
from fqr.lowering import TARGETS, kernel_source, lower, plan_program
from fqr.lowering.targets import InterpretTarget, register_target
from fqr.numerics import compare


@dataclasses.dataclass(frozen=True)
class ByteStoresInterpret(InterpretTarget):
    """The interpret target storing bf16 / fp32 values into byte entries byte by byte (the
    ``byte_stores="bytes"`` source the Ascend target emits)."""

    def tiling(self, plan, **options):
        return dataclasses.replace(super().tiling(plan, **options), byte_stores="bytes")


if "interpret-byte-stores" not in TARGETS:
    register_target(ByteStoresInterpret("interpret-byte-stores", interpret=True))


@pytest.mark.skipif(
    not BACKENDS["interpret"].available, reason=BACKENDS["interpret"].unavailable_reason() or ""
)
@pytest.mark.parametrize("backend", ["interpret", "reference"])
@pytest.mark.parametrize(
    "flavour, q_lora",
    [("auto", Q_LORA), ("fp8", Q_LORA), ("fp8_ds_mla", Q_LORA), ("auto", 0)],
    ids=["auto", "fp8", "fp8_ds_mla", "auto-no-q_c"],
)
def test_mla_kv_program_against_float64(gen, backend, flavour, q_lora):
    dtype = torch.bfloat16
    prog = mla_program(flavour, dtype, q_lora=q_lora)
    cache_index = 5 if q_lora else 4  # (a q_c weight is an input only with q_c)
    assert prog.aliases() == {len(prog.outputs) - 1: cache_index}
    kv_a, positions, table, q_w, kv_w, cache, slots, scale = draw(gen, flavour, dtype, q_lora)
    before = cache.clone()
    args = [a for a in (kv_a, positions, table, q_w, kv_w, cache, slots, scale) if a is not None]
    outs = BACKENDS[backend].launch(prog, args)
    assert outs[-1] is cache  # the caller's cache, updated in place by both stores
    q_c, kv_c, k_pe = reference.mla_kv(
        kv_a, positions, table, q_w, kv_w, q_lora_rank=q_lora, kv_lora_rank=KV_LORA, eps=EPS
    )
    if q_lora:
        c = compare(outs[0], q_c, head_dim=Q_LORA)
        assert c.passed, c
    written = check_cache(flavour, cache, before, kv_c, k_pe, slots, scale, dtype)
    assert written == kv_a.shape[0] - 2


@pytest.mark.skipif(
    not BACKENDS["interpret"].available, reason=BACKENDS["interpret"].unavailable_reason() or ""
)
@pytest.mark.parametrize("rope_dtype", [torch.bfloat16, torch.float16])
def test_fp8_ds_mla_stored_byte_by_byte(gen, rope_dtype):
    """The ``byte_stores="bytes"`` source (what Triton-Ascend compiles): the float32 scales and
    the 16-bit rope values split into bytes, the same cache bytes as the typed stores."""
    prog = mla_program("fp8_ds_mla", rope_dtype, q_lora=0)
    kernel = lower(prog, "interpret-byte-stores")
    assert "pointer_type(tl.float32)" not in kernel.source
    assert ".to(tl.uint16, bitcast=True)" in kernel.source
    assert ".to(tl.uint32, bitcast=True)" in kernel.source
    kv_a, positions, table, _, kv_w, cache, slots, _ = draw(gen, "fp8_ds_mla", rope_dtype, 0)
    before = cache.clone()
    *_, out = kernel(kv_a, positions, table, kv_w, cache, slots, donate=True)
    assert out is cache
    _, kv_c, k_pe = reference.mla_kv(
        kv_a, positions, table, None, kv_w, q_lora_rank=0, kv_lora_rank=KV_LORA, eps=EPS
    )
    check_cache("fp8_ds_mla", cache, before, kv_c, k_pe, slots, None, rope_dtype)


def test_one_kernel_holds_every_part():
    """One plan, one cache buffer, both stores' fields in it; kv_c of fp8_ds_mla held as four
    heads of one tile each, with its norm a reduction over the row of them."""
    for flavour in FLAVOURS:
        prog = mla_program(flavour)
        plan = plan_program(prog)
        cache = prog.inputs[5]
        fields = [str(f) for f in plan.cache_fields[id(cache)]]
        if flavour == "fp8_ds_mla":
            assert fields == ["fp8e4m3[512]@0", "fp32[4]@512", "bf16[64]@528"]
            assert [(c.heads, c.head_dim) for c in plan.chains] == [(1, 1536), (4, 128), (1, 64)]
            assert plan.chains[1].row_reductions
        else:
            name = "fp8e4m3" if flavour == "fp8" else "bf16"
            assert fields == [f"{name}[512]@0", f"{name}[64]@512"]


def test_deepseek_v3_cuda_sources():
    """The cuda-target source of each flavour at DeepSeek-V3's widths (bf16): valid Python,
    one @triton.jit kernel, its stores where the entry's fields are."""
    for flavour in FLAVOURS:
        src = kernel_source(mla_program(flavour), "cuda")
        compile(src, f"<mla {flavour}>", "exec")
        assert src.count("@triton.jit(") == 1
        if flavour == "fp8_ds_mla":
            assert ".to(tl.pointer_type(tl.float8e4nv))" in src
            assert "+ 512).to(tl.pointer_type(tl.float32)) + hh" in src
            assert "+ 528).to(tl.pointer_type(tl.bfloat16)) + hh * 64" in src
            assert "tl.maximum(tl.math.div_rn(amax" in src and ", 448.0), 1.17549435082" in src
        else:
            assert "+ 512) + hh * 64" in src and "pointer_type" not in src


CUDA_COMPILE = textwrap.dedent(
    """
    from support.cuda_ptx import compile_for_sm90
    from support.mla import mla_program
    from fqr.lowering import lower
    for flavour in ("auto", "fp8", "fp8_ds_mla"):
        compiled = compile_for_sm90(lower(mla_program(flavour), "cuda"))
        ptx = compiled.asm["ptx"]
        print(flavour, len(compiled.asm.get("cubin", b"")) > 0,
              "cvt.rn.satfinite.e4m3x2" in ptx, "div.rn.f32" in ptx, "div.full.f32" in ptx)
    """
)


def test_deepseek_v3_cuda_kernels_compile_for_sm90(tmp_path):
    """Upstream Triton compiles the three kernels for sm_90 without a GPU (TTIR -> TTGIR ->
    LLVM -> PTX -> cubin with its bundled ptxas), in a process of its own (this one may run
    Triton interpreted)."""
    stdout = run_compiling(CUDA_COMPILE, tmp_path)
    # flavour, a cubin, E4M3 conversions, IEEE divisions, approximate ones (Triton's fp32 "/")
    found = [line.split() for line in stdout.split("\n") if line]
    assert found == [
        ["auto", "True", "False", "False", "False"],
        # x / scale of the per-tensor FP8 store (cache_insert, as before this op had entries)
        ["fp8", "True", "True", "False", "True"],
        # the tile scales and x / scale_j divide as vLLM's CUDA code: IEEE, round to nearest
        ["fp8_ds_mla", "True", "True", "True", "False"],
    ], stdout


@pytest.mark.skipif(
    not BACKENDS["interpret"].available, reason=BACKENDS["interpret"].unavailable_reason() or ""
)
def test_the_host_function_updates_the_callers_cache(gen):
    """The generated host function (what a public op's later calls run) passes the 3-D byte
    cache's strides and donates it: the caller's cache is updated in place."""
    from fqr.lowering import lower_by_tokens
    from fqr.lowering.host import host_function

    prog = mla_program("fp8_ds_mla")
    variants = lower_by_tokens(prog, "interpret")
    first = draw(gen, "fp8_ds_mla", torch.bfloat16, Q_LORA)
    variants.launch([a for a in first if a is not None], donate=True)
    fast = host_function(variants, [a for a in first if a is not None])
    assert fast is not None
    kv_a, positions, table, q_w, kv_w, cache, slots, _ = draw(
        gen, "fp8_ds_mla", torch.bfloat16, Q_LORA, 7
    )
    before = cache.clone()
    q_c, _, _, out = fast.fn([kv_a, positions, table, q_w, kv_w, cache, slots])
    assert out is cache
    q64, kv_c, k_pe = reference.mla_kv(
        kv_a, positions, table, q_w, kv_w, q_lora_rank=Q_LORA, kv_lora_rank=KV_LORA, eps=EPS
    )
    assert compare(q_c, q64, head_dim=Q_LORA).passed
    check_cache("fp8_ds_mla", cache, before, kv_c, k_pe, slots, None, torch.bfloat16)
