"""The fusion pass on a CUDA GPU: the compiled model calls the generated Triton kernel.

Skips without a GPU. Same mixed-shape vLLM-style model as ``test_fusion_graph.py``; and the
compiled-model comparison (fqr.fusion.compiled) at small sizes under CUDA graphs: the profile
must find fqr's kernel on the fused side (the full-size run is ``fqr fuse --device cuda``). The
device is :data:`support.devices.GPU_DEVICE` (``meta`` in the bundle build: launches, no
values).
"""

from __future__ import annotations

import pytest
import torch
from support.devices import BUILDING, CUDA_RUNTIME_ONLY, GPU_DEVICE, gpu_marks, has_values
from support.vllm_model import SEED, VLLM_LAYERS, VllmModel, inputs, vllm_exact

import fqr
import fqr.fusion
from fqr.numerics import compare

pytestmark = gpu_marks("triton")


@pytest.mark.skipif(
    BUILDING,
    reason="Inductor cannot compile this model on meta tensors (torch 2.13, without fqr's pass "
    "too: 'Argument ... of Node split_with_sizes was used before it has been defined')",
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fused_model_on_gpu(dtype):
    print(f"FQR_TEST_SEED={SEED}")
    model = VllmModel(VLLM_LAYERS, dtype, seed=SEED).eval().to(GPU_DEVICE)
    fusion = fqr.fusion.backend()
    compiled = torch.compile(model, backend=fusion)
    with torch.no_grad():
        for tokens, seed in ((37, SEED + 1), (300, SEED + 2)):
            positions, hidden = (t.to(GPU_DEVICE) for t in inputs(tokens, dtype, seed))
            torch._dynamo.mark_dynamic(positions, 0)
            torch._dynamo.mark_dynamic(hidden, 0)
            _, per_layer = compiled(positions, hidden)
            for layer, (qkv, q, k, v) in zip(model.layers, per_layer):
                if not has_values(qkv, q, k, v):
                    continue
                exact_q, exact_k = vllm_exact(layer, qkv, positions)
                for out, exact in ((q, exact_q), (k, exact_k)):
                    c = compare(out, exact, head_dim=layer.spec.d, numerics="unfused")
                    assert c.passed, (layer.spec, c)
                assert torch.equal(v, qkv[:, layer.q_size + layer.kv_size :])
    torch._dynamo.reset()
    assert fusion.stats.sites == len(VLLM_LAYERS) and len(fusion.stats.graphs) == 1


@pytest.mark.skipif(not BUILDING, reason="the build run's stand-in for the compiled model")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fused_model_kernels_are_built_ahead(dtype):
    """Inductor cannot compile the model on meta (above): here, in the build run, each layer's
    fused op is launched eagerly as the fusion pass's replacement calls it
    (``fqr.fusion.patterns``: the packed qkv the projection wrote, ``[T, W]`` contiguous, the
    positions, the layer's table and norm weights, ``numerics="unfused"``), so that the kernels
    the compiled model launches on the GPU are in the bundle (the token count is not
    specialised: one kernel per layer and dtype)."""
    model = VllmModel(VLLM_LAYERS, dtype, seed=SEED).eval().to(GPU_DEVICE)
    positions, _ = (t.to(GPU_DEVICE) for t in inputs(37, dtype, SEED))
    for layer in model.layers:
        s = layer.spec
        width = (s.hq + 2 * s.hkv) * s.d
        qkv = torch.empty(positions.shape[0], width, dtype=dtype, device=GPU_DEVICE)
        outs = fqr.split_qkv_rmsnorm_rope(  # what torch.ops.fqr runs on CUDA (meta: its shapes)
            qkv, positions.flatten(), layer.rotary_emb.cos_sin_cache, layer.q_weight,
            layer.k_weight, q_bias=layer.q_bias, k_bias=layer.k_bias, num_heads=s.hq,
            num_kv_heads=s.hkv, head_dim=s.d, eps=s.eps, is_neox=s.neox,
            weight_offset=1.0 if s.gemma else 0.0, norm="head", numerics="unfused",
            backend="triton",
        )  # fmt: skip
        assert outs[0].shape == (positions.shape[0], s.hq * s.d)


@pytest.mark.skipif(
    BUILDING,
    reason=f"CUDA graphs and the profiler: {CUDA_RUNTIME_ONLY}; its kernels are built by "
    "test_examples_gpu.py::test_vllm_example_kernels_are_built_ahead",
)
def test_compiled_comparison_under_cuda_graphs():
    from fqr.fusion.compiled import compare_compiled

    r = compare_compiled(
        "vllm",
        layers=1,
        tiny=True,
        prefill=(300,),
        decode=(1, 4),
        profile_tokens=(300,),
        check_tokens=64,
        seed=SEED,
    )
    assert r.cudagraphs and r.sites == 1 and r.graphs == 2  # T = 1 compiles once more
    assert r.passed, r.numerics
    assert [(x.phase, x.tokens) for x in r.latency] == [
        ("prefill", 300),
        ("decode", 1),
        ("decode", 4),
    ]
    (split,) = r.profile
    assert any(name.startswith("fqr_") for name in split.fused_prologue_kernels), split
    assert split.unfused_prologue_us > 0 and split.fused_total_us > split.fused_prologue_us
