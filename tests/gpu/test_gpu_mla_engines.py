"""MLA as the engines call it (issue 32) on the compiled CUDA kernel (skipped without a GPU): the
stand-alone cache insert in every cache flavour (vLLM's uint8 FP8 cache with a 0-dim scale,
fp8_ds_mla from fp16 rows, FlashInfer's two caches), the MLA prologue with a slot mapping
shorter than the rows and into two column views of one buffer, the FP8 q outputs
(``quant_scale_q``) of the query rotation and of the prologue, a preset built from a
DeepseekV3Config with ``rope_interleave=False`` (NeoX halves), FP8 E5M2 caches; each against the
float64 formulation under the numerics contract, new outputs in NaN-poisoned memory. One token
count (257: several token tiles, a ragged last one) and few shapes: each distinct kernel is a
compile. The CPU backends run the same forms in ``tests/backends/test_mla_cache_insert.py``,
``test_mla_kv.py`` and ``test_mla_q_rope.py``."""

from __future__ import annotations

import pytest
import torch
from support.devices import GPU_DEVICE, has_values, launch_copies, rope_table
from support.mla_widths import CACHE_DTYPES, check_caches, check_outputs, insert_call, prologue_call
from support.peer_ports import ON_TRITON

import fqr
from fqr.bench.checks import poison_free_memory
from fqr.numerics import compare, compare_kind
from fqr.prologue import variant_of

pytestmark = ON_TRITON

TOKENS = 257
MAX_POSITION = 1 << 17


def _run_and_check(gen, preset, *, dtype=torch.bfloat16, change=None):
    """Draw ``preset``'s call on the GPU, optionally ``change`` it (inputs -> inputs), run it
    twice on the GPU (the second call takes the kept call's bound launcher), every output
    against float64; returns the inputs and the outputs of the last call."""
    variant = variant_of(preset)
    table = rope_table(preset, min(preset.max_position, MAX_POSITION))
    inputs = variant.draw(preset, TOKENS, dtype, gen, max_position=table.shape[0])
    if change is not None:
        inputs = change(inputs)
    exact = variant.expected(preset, inputs, table) if has_values(table) else None  # meta: none
    on_gpu = launch_copies(inputs)  # the caches are written in place
    gpu_table = table.to(GPU_DEVICE) if variant.reads_table else None
    for call in range(2):
        poison_free_memory(256 << 20, torch.device(GPU_DEVICE))  # unwritten outputs show NaN
        outs = variant.run(preset, on_gpu, gpu_table, backend="triton")
        names = variant.outputs_of(preset)
        assert len(outs) == len(names)
        if exact is None:
            continue
        for n, out in zip(names, outs):
            kind, head_dim = variant.tolerance(n, preset), variant.head_dim(preset, n)
            c = compare_kind(kind, out, exact[n], head_dim=head_dim)
            assert c.passed, f"{preset.name} call {call} {n}: {c}"
    return inputs, outs


@pytest.mark.parametrize(
    "name,dtype",
    [
        ("deepseek-v3-mla-insert", torch.bfloat16),
        ("deepseek-v3-fp8-mla-insert", torch.float16),  # uint8 cache, 0-dim scale
        ("deepseek-v3.2-mla-insert", torch.float16),  # fp8_ds_mla, fp16 rope part
        ("deepseek-v3-fp8-e5m2-mla-insert", torch.bfloat16),  # E5M2 bytes, encoded on the bits
    ],
)
def test_mla_cache_insert(gen, name, dtype):
    """vLLM's concat_and_cache_mla / _ds_mla as fqr.mla_cache_insert, slots [T - 1]."""
    inputs, _ = _run_and_check(gen, fqr.get_preset(name), dtype=dtype)
    assert inputs["slot_mapping"].shape[0] == TOKENS - 1


def test_mla_cache_insert_into_two_caches(gen):
    """FlashInfer's layout: the one-cache call's entry bytes, cut into ckv / kpe caches."""
    preset = fqr.get_preset("deepseek-v3-mla-insert")
    variant = variant_of(preset)
    inputs = variant.draw(preset, TOKENS, torch.bfloat16, gen, max_position=1)
    args = launch_copies(inputs)
    one = args["kv_cache"]
    kv, kpe = one[..., :512].clone(), one[..., 512:].clone()
    call = dict(args, **variant.kwargs(preset), backend="triton")
    fqr.mla_cache_insert(**dict(call, kv_cache=kv, kpe_cache=kpe))
    fqr.mla_cache_insert(**call)
    if has_values(one):
        assert torch.equal(kv, one[..., :512]) and torch.equal(kpe, one[..., 512:])


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v3.2"])
def test_mla_prologue_with_a_shorter_slot_mapping(gen, name):
    """slot_mapping [N < T] (a CUDA-graph pad): only the first N tokens' entries change."""
    n = TOKENS - 57

    def shorter(inputs):
        return dict(inputs, slot_mapping=inputs["slot_mapping"][:n])

    inputs, outs = _run_and_check(gen, fqr.get_preset(name, 8), change=shorter)
    if not has_values(*outs):
        return
    slots = inputs["slot_mapping"]
    after = outs[-1].view(torch.uint8)
    before = inputs["kv_cache"].view(torch.uint8)
    entry_bytes = after.shape[-1]
    changed = (after != before).reshape(-1, entry_bytes).any(dim=1)
    assert set(changed.nonzero().flatten().tolist()) == set(slots[slots >= 0].tolist())


def test_mla_prologue_into_views_of_one_buffer(gen):
    """FlashInfer's two caches as the column views of one [B, bs, 576] buffer."""

    def views(inputs):
        buffer = torch.cat([inputs["kv_cache"], inputs["kpe_cache"]], dim=-1)
        return dict(inputs, kv_cache=buffer[..., :512], kpe_cache=buffer[..., 512:])

    _run_and_check(gen, fqr.get_preset("deepseek-v3-two-caches", 8), change=views)


@pytest.mark.parametrize("name", ["deepseek-v3-q-rope-fp8", "deepseek-v3.2-fp8-q"])
def test_fp8_q_outputs(gen, name):
    """quant_scale_q: FlashInfer's FP8 q (q_nope, q_pe) of the query rotation, and an FP8
    q_c from the MLA prologue, within one E4M3 ULP of float64."""
    _, outs = _run_and_check(gen, fqr.get_preset(name, 8))
    assert outs[0].dtype == torch.float8_e4m3fn


def test_a_preset_from_a_neox_deepseek_v3_config(gen):
    """DeepseekV3Config(rope_interleave=False): transformers rotates NeoX halves, and so does
    the preset fqr builds from it, on the GPU kernel."""
    transformers = pytest.importorskip("transformers")
    config = transformers.DeepseekV3Config(rope_interleave=False, max_position_embeddings=4096)
    preset = fqr.Preset.from_hf_config(config, name="deepseek-v3-neox").shard(8)
    assert preset.is_neox
    _run_and_check(gen, preset)


def test_e5m2_caches(gen):
    """vLLM's fp8_e5m2 caches on the compiled kernel (the byte encoded on the fp32 bits):
    reshape_and_cache_flash (fqr.kv_cache_insert) and the MLA prologue with some values
    saturated, within one E5M2 ULP of float64."""
    _run_and_check(gen, fqr.get_preset("qwen3-8b-kv-insert-fp8-e5m2", 8), dtype=torch.float16)

    def e5m2(inputs):
        cache = inputs["kv_cache"].float().to(torch.float8_e5m2)
        scale = torch.tensor([2e-5], device=cache.device)  # some saturate
        return dict(inputs, kv_cache=cache, k_scale=scale)

    _run_and_check(gen, fqr.get_preset("deepseek-v3-fp8", 16), change=e5m2)


# ------------------------------------------ issue 41: every latent width, every cache dtype

WIDTH_GRID = [
    (w, n) for w in (64, 96, 192, 512, 576) for n in CACHE_DTYPES if n != "fp8_ds_mla" or w == 512
]
PROLOGUE_GRID = [(w, n) for w, n in WIDTH_GRID if n != "fp8_e4m3"]  # one E4M3 name there


@pytest.fixture
def host_gen(gen) -> torch.Generator:
    """The width grid draws on the CPU (a few tokens: its float64 expectation is the CPU
    call's) and moves the call to the GPU: a CPU generator with ``gen``'s seed."""
    return torch.Generator().manual_seed(gen.initial_seed())


def _on_gpu_and_checked(cpu_call, *, outputs=False):
    """Run ``cpu_call`` (drawn on the CPU) with its tensors on the GPU twice (the second call
    takes the kept call's bound launcher); the last call's caches (and the prologue's
    outputs) against the CPU call's float64 expectation."""
    gpu = cpu_call.moved(GPU_DEVICE, "triton")
    for _ in range(2):
        result, caches = gpu.run()
    if not has_values(*caches.values()):
        return  # the build run on meta: the launches are what it needs
    check_caches(cpu_call, {n: c.cpu() for n, c in caches.items()})
    if outputs:
        check_outputs(cpu_call, tuple(None if x is None else x.cpu() for x in result))


@pytest.mark.parametrize("width,name", WIDTH_GRID, ids=[f"{w}-{n}" for w, n in WIDTH_GRID])
def test_mla_cache_insert_every_latent_width(host_gen, width, name):
    """vLLM's call (``scale=layer._k_scale`` with every dtype) at latent widths 64 to 576:
    the E5M2 cache was cut into fp8_ds_mla tiles before (width 192 stored kv_c[:, :128])."""
    dtype = torch.float16 if name == "fp8_ds_mla" else torch.bfloat16
    call = insert_call(host_gen, width, 64, 16, name, dtype=dtype, tokens=TOKENS, scale="vllm")
    _on_gpu_and_checked(call)


@pytest.mark.parametrize("width,name", PROLOGUE_GRID, ids=[f"{w}-{n}" for w, n in PROLOGUE_GRID])
def test_mla_prologue_every_latent_width(host_gen, width, name):
    dtype = torch.float16 if name == "fp8_ds_mla" else torch.bfloat16
    call = prologue_call(host_gen, width, 64, 16, name, dtype=dtype, tokens=TOKENS, q_lora=48)
    _on_gpu_and_checked(call, outputs=True)


@pytest.mark.parametrize("name", ["fp8", "fp8_e5m2"])
def test_flashinfers_latent_96_two_caches(host_gen, name):
    """FlashInfer's test grid row (latent 96, rope 32) into ckv / kpe caches, both ops."""
    _on_gpu_and_checked(insert_call(host_gen, 96, 32, 16, name, tokens=TOKENS, two_caches=True))
    call = prologue_call(host_gen, 96, 32, 16, name, tokens=TOKENS, two_caches=True)
    _on_gpu_and_checked(call, outputs=True)


def test_e5m2_q_outputs(host_gen):
    """FlashInfer's quantize_dtype=torch.float8_e5m2: mla_q_rope's q_nope / q_pe and the
    prologue's q_c as float8_e5m2 (encoded on the fp32 bits), some values saturated."""
    from fqr.prologue.mla_q_rope import mla_q_rope_reference
    from fqr.rope_cache import rope_cos_sin_cache

    table = rope_cos_sin_cache(32, 4096, 1e4)
    q = (torch.randn(TOKENS, 16 * (96 + 32), generator=host_gen) * 3e4).bfloat16()
    positions = torch.randint(0, 4096, (TOKENS,), generator=host_gen)
    kw = dict(num_heads=16, qk_nope_head_dim=96, quant_scale_q=torch.tensor(1.5))
    want = mla_q_rope_reference(q, positions, table, **kw, quantize_dtype=torch.float8_e5m2)
    on = {k: v.to(GPU_DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    for _ in range(2):
        outs = fqr.mla_q_rope(q.to(GPU_DEVICE), positions.to(GPU_DEVICE), table.to(GPU_DEVICE),
                              **on, quantize_dtype=torch.float8_e5m2, backend="triton")  # fmt: skip
    call = prologue_call(host_gen, 512, 64, 16, "auto", tokens=TOKENS, q_lora=1536)
    gpu = call.moved(GPU_DEVICE, "triton")
    scale = torch.tensor(3e4, device=GPU_DEVICE)
    q_c, *_ = gpu.run(quant_scale_q=scale, quantize_dtype=torch.float8_e5m2)[0]
    if not has_values(*outs, q_c):
        return
    for out, exact, head in zip(outs, want, (96, 32)):
        assert out.dtype == torch.float8_e5m2
        c = compare(out.cpu(), exact, head_dim=head)
        assert c.passed, c
    decl = fqr.split_mla_rmsnorm_rope_cache.declaration
    args = dict(call.args, quant_scale_q=scale.cpu(), quantize_dtype=torch.float8_e5m2)
    exact_q_c = decl.reference(**decl.reference_kwargs(args))[0]
    c = compare(q_c.cpu(), exact_q_c, head_dim=1536)
    assert q_c.dtype == torch.float8_e5m2 and c.passed, c
