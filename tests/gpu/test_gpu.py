"""The triton backend on a CUDA GPU (skipped without one): every preset and dtype against the
float64 formulation, poisoned outputs, and no recompilation for a new token count. The device
is :data:`support.devices.GPU_DEVICE` (``meta`` in the bundle build: launches, no values; the
float64 expectations are computed after the launches, only where there are values to check).
Inputs are drawn on the GPU and the float64 expectations computed and compared there."""

import pytest
import torch
from support.devices import (
    BUILDING,
    CUDA_RUNTIME_ONLY,
    GPU_DEVICE,
    gpu_marks,
    has_values,
    launch_copies,
    rope_table,
)

import fqr
from fqr import reference
from fqr.bench.checks import poison_free_memory
from fqr.inputs import random_inputs
from fqr.lowering import lower, lower_by_tokens
from fqr.numerics import compare, compare_kind
from fqr.prologue import program_of, variant_of

pytestmark = gpu_marks("triton")

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def preset_problem(gen, name, tokens, dtype, bias=False):
    p = fqr.get_preset(name)
    cache = rope_table(p, min(p.max_position, 1 << 17))
    return p, random_inputs(p.spec, tokens, dtype, gen, cache, bias=bias)


SPLIT_QKV_PRESETS = [n for n, p in fqr.PRESETS.items() if p.variant == "split-qkv"]
# Every other preset runs its variant (fqr.prologue): its own inputs, public op and float64.
VARIANT_PRESETS = [n for n, p in fqr.PRESETS.items() if p.variant != "split-qkv"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", SPLIT_QKV_PRESETS)
def test_presets_against_float64(gen, name, dtype):
    p, pb = preset_problem(gen, name, 301, dtype, bias=name == "qwen3-8b")
    program = program_of(p, dtype, bias=pb.q_bias is not None)
    kernel = lower(program, "cuda")
    outs = [
        torch.full((301, v.aval.shape[1]), float("nan"), dtype=dtype, device=GPU_DEVICE)
        for v in program.outputs
    ]
    kernel(*pb.to(GPU_DEVICE).operands(), out=outs)
    if not has_values(*outs):
        return
    exact = reference.prologue(*pb.args(), **pb.kwargs())
    for n, o, e in zip("qkv", outs, exact):
        c = compare(o, e, head_dim=p.head_dim, bitwise=n == "v")
        assert c.passed, f"{n}: {c}"


def _largest_shard(name: str, tp: int):
    """The preset at TP ``tp``, or at the largest smaller TP it shards to (CodeGen-2B's four
    qkv shards take TP 1, 2 and 4 only)."""
    for size in range(tp, 0, -1):
        try:
            return fqr.get_preset(name, size)
        except ValueError:
            continue
    raise AssertionError(f"{name} shards to no TP <= {tp}")


@pytest.mark.parametrize("tokens", [1, 257, 4099])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("tp", [1, 8])
@pytest.mark.parametrize("name", VARIANT_PRESETS)
def test_variant_presets_against_float64(gen, name, tp, dtype, tokens):
    p = _largest_shard(name, tp)
    variant = variant_of(p)
    try:
        variant.program(p, dtype)
    except TypeError as e:  # fp8_ds_mla entries hold 16-bit rope values: no fp32 op
        assert "must be bf16 or fp16" in str(e) and dtype == torch.float32, name
        pytest.skip(str(e))
    cache = rope_table(p, min(p.max_position, 1 << 17))
    bias = tp == 8 and variant.has_bias
    inputs = variant.draw(p, tokens, dtype, gen, max_position=cache.shape[0], bias=bias)
    poison_free_memory(256 << 20, torch.device(GPU_DEVICE))  # unwritten outputs would show NaN
    on_gpu = launch_copies(inputs)
    # the second call takes the per-call path's bound launcher
    calls = [variant.run(p, on_gpu, cache.to(GPU_DEVICE), backend="triton") for _ in range(2)]
    names = variant.outputs_of(p)
    assert [len(outs) for outs in calls] == [len(names)] * 2
    if not has_values(*calls[0], *calls[1]):
        return
    exact = variant.expected(p, inputs, cache)
    for call, outs in enumerate(calls):
        for n, o in zip(names, outs):
            kind, d = variant.tolerance(n, p), variant.head_dim(p, n)
            c = compare_kind(kind, o, exact[n], head_dim=d)
            assert c.passed, f"{name} tp={tp} T={tokens} call {call} {n}: {c}"


NORM_VARIANT_PRESETS = [
    "gemma4-31b-sliding",
    "gemma4-31b-full",
    "llama4-scout",
    "llama4-scout-nope",
]


@pytest.mark.parametrize("tokens", [257, 4099])
@pytest.mark.parametrize("tp", [1, 8])
@pytest.mark.parametrize("name", NORM_VARIANT_PRESETS)
def test_norm_variant_presets_unfused(gen, name, tp, tokens):
    """Issue 15's norm variants under the unfused contract (rounding where vLLM's Gemma 4 /
    Llama 4 code rounds) on the CUDA kernel, into poisoned memory."""
    p = fqr.get_preset(name, tp)
    variant = variant_of(p)
    cache = rope_table(p, min(p.max_position, 1 << 17))
    inputs = variant.draw(p, tokens, torch.bfloat16, gen, max_position=cache.shape[0])
    poison_free_memory(256 << 20, torch.device(GPU_DEVICE))
    on_gpu = launch_copies(inputs)
    outs = variant.run(p, on_gpu, cache.to(GPU_DEVICE), numerics="unfused", backend="triton")
    if not has_values(*outs):
        return
    exact = variant.expected(p, inputs, cache)
    for n, o in zip(variant.outputs_of(p), outs):
        kind = variant.tolerance(n, p)
        c = compare_kind(kind, o, exact[n], head_dim=p.head_dim, numerics="unfused")
        assert c.passed, f"{name} tp={tp} T={tokens} unfused {n}: {c}"


@pytest.mark.parametrize("tokens", [1, 257, 4099])
@pytest.mark.parametrize("name", ["qwen3-vl-8b", "qwen3.5-27b"])
def test_text_only_mrope_is_plain_rope_bit_for_bit(gen, name, tokens):
    """Three equal position planes (and 1-D positions) give the rope kernel's bits exactly."""
    p = fqr.get_preset(name)
    gated = p.variant == "mrope-gate"
    variant = variant_of(p)
    cache = rope_table(p, 1 << 17).to(GPU_DEVICE)
    inputs = {
        k: x.to(GPU_DEVICE)
        for k, x in variant.draw(p, tokens, torch.bfloat16, gen, max_position=1 << 17).items()
    }
    text = inputs["positions"][0]
    qkv = inputs["qkv"]
    if gated:  # the plain op on the same q, k, v heads, the gate columns left out
        d, hq = p.head_dim, p.num_heads
        q_cols = qkv[:, : 2 * hq * d].view(tokens, hq, 2, d)[:, :, 0].reshape(tokens, -1)
        qkv_plain = torch.cat([q_cols, qkv[:, 2 * hq * d :]], dim=1)
    else:
        qkv_plain = qkv
    plain = fqr.split_qkv_rmsnorm_rope(
        qkv_plain,
        text,
        cache,
        inputs["q_weight"],
        inputs["k_weight"],
        **p.spec.kwargs(),
        backend="triton",
    )
    for positions in (text, text.expand(3, -1).contiguous()):
        outs = variant.run(p, dict(inputs, positions=positions), cache, backend="triton")
        for n, a, b in zip("qkv", outs, plain):
            if has_values(a, b):
                assert torch.equal(a, b), f"{name} T={tokens} {n}"


def _compiled_variants(fn) -> int:
    caches = getattr(fn, "device_caches", None)
    if caches is not None:
        return sum(len(entry[0]) for entry in caches.values())
    return len(fn.cache[torch.cuda.current_device()])


def test_new_token_counts_do_not_recompile(gen):
    """Every token count runs its bucket's kernel variant (the dispatch table's schedule for
    that bucket); once a variant has run, other token counts of its bucket compile (or load)
    nothing more. (Counted as a difference: an earlier test of this worker may have run the
    same variant with other specialisations, e.g. misaligned views.)"""
    p = fqr.get_preset("qwen3-0.6b")
    kernels = lower_by_tokens(program_of(p, torch.bfloat16), "cuda")
    first_seen: dict[int, int] = {}
    grew = []
    for tokens in (1, 2, 16, 17, 1000, 4096):
        _, pb = preset_problem(gen, "qwen3-0.6b", tokens, torch.bfloat16)
        on_gpu = pb.to(GPU_DEVICE)
        q, k, v = fqr.split_qkv_rmsnorm_rope(*on_gpu.args(), **on_gpu.kwargs(backend="triton"))
        if has_values(q):
            exact = reference.prologue(*pb.args(), **pb.kwargs())
            assert compare(q, exact[0], head_dim=p.head_dim).passed
        if not BUILDING:  # Triton's own per-device cache of compiled variants, a runtime's
            kernel = kernels.kernel_for(tokens)
            count = _compiled_variants(kernel.fn)
            assert count >= 1, f"T={tokens}: the bucket's variant {kernel.tiling} never ran"
            if first_seen.setdefault(id(kernel), count) != count:
                grew.append((tokens, first_seen[id(kernel)], count))
    assert not grew, f"(T, variants before, after) of a bucket that compiled again: {grew}"
    if not BUILDING:
        assert len(first_seen) == len({id(kernels.kernel_for(t)) for t in (1, 4096)})


@pytest.mark.skipif(BUILDING, reason=f"a CUDA generator {CUDA_RUNTIME_ONLY}")
@pytest.mark.parametrize("name", VARIANT_PRESETS)
def test_variant_draws_on_the_generators_device(name):
    """``fqr bench`` draws its inputs with a CUDA generator: every variant's ``draw`` puts each
    input on the generator's device (MiniMax-M3's draws once asked a CUDA generator for CPU
    tensors)."""
    p = fqr.get_preset(name)
    gen = torch.Generator(device=GPU_DEVICE).manual_seed(5)
    drawn = variant_of(p).draw(p, 7, torch.bfloat16, gen, max_position=4096)
    assert {x.device.type for x in drawn.values()} == {gen.device.type}, name
