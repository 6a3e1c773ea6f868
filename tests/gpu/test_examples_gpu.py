"""The drop-in examples run on the GPU as a user runs them there (issue 13; formerly
``scripts/gpu_dropin.py``; skipped without a GPU, and in the bundle build: ``torch.compile``
and Inductor need real CUDA tensors). ``tests/fusion/test_fusion_examples.py`` runs the same
two examples on the CPU: ``examples/hf_qwen3_compile.py`` (a transformers Qwen3 from a tiny
config compiled with ``fqr.fusion.backend()``: every layer's prologue fused, logits against
eager within the example's tolerance) and ``examples/vllm_attention_layer.py`` (its custom
attention layer in the ``out=`` and ``inplace=True`` forms against float64, and fqr's pass in a
vLLM-style post-grad pass manager)."""

from __future__ import annotations

import pytest
import torch
from fusion.test_fusion_examples import load_example
from support.devices import BUILDING, GPU_DEVICE
from support.peer_ports import ON_TRITON

import fqr
from fqr.fusion.hf_models import transformers_missing

pytestmark = ON_TRITON
COMPILES = pytest.mark.skipif(
    BUILDING, reason="torch.compile runs the compiled model on a real GPU (stand-ins below)"
)


@COMPILES
@pytest.mark.skipif(transformers_missing() is not None, reason=str(transformers_missing()))
def test_hf_qwen3_example_on_the_gpu(capsys):
    result = load_example("hf_qwen3_compile").run(
        layers=2, tokens=64, dtype="bf16", device=GPU_DEVICE
    )
    assert result["sites_fused"] == result["layers"] == 2
    assert 0 <= result["logits_rel_err"] <= result["tolerance"] and result["ok"]
    assert "fused 2/2 attention prologues" in capsys.readouterr().out


@COMPILES
def test_vllm_attention_layer_example_on_the_gpu(capsys):
    argv = ["--device", GPU_DEVICE, "--dtype", "bf16", "--tokens", "64"]
    assert load_example("vllm_attention_layer").main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("within the contract: yes") == 2 and "fused 1/1 prologues" in out


# The build run's stand-ins: the examples and the CUDA-graph comparison compile their models,
# which Inductor cannot do on meta tensors. Here each fqr launch they make on the GPU is made
# eagerly on meta with the same program and specialisation (the same kernel ids), so the
# bundle holds them: the examples' layers as they call fqr, and the fusion pass's replacements
# (fqr.fusion.patterns) as the compiled graphs call them, at the token counts they run.
TOKEN_COUNTS = (1, 4, 64, 300)  # the examples' 64; the graph comparison's prefill and decode


def _as_the_vllm_pass_calls(layer, tokens: int) -> None:
    s = layer.shape.spec
    qkv = torch.empty(tokens, s.qkv_width, dtype=layer.q_weight.dtype, device=GPU_DEVICE)
    positions = torch.empty(tokens, dtype=torch.int64, device=GPU_DEVICE)
    fqr.split_qkv_rmsnorm_rope(  # what torch.ops.fqr runs on CUDA (meta: its fake, no launch)
        qkv, positions, layer.cos_sin_cache, layer.q_weight, layer.k_weight, q_bias=layer.q_bias,
        k_bias=layer.k_bias, num_heads=s.num_heads, num_kv_heads=s.num_kv_heads,
        head_dim=s.head_dim, eps=s.eps, is_neox=s.is_neox, weight_offset=s.weight_offset,
        norm="head", numerics="unfused", backend="triton",
    )  # fmt: skip


@pytest.mark.skipif(not BUILDING, reason="the build run's stand-in for the compiled models")
def test_vllm_example_kernels_are_built_ahead():
    """examples/vllm_attention_layer.py: its layer's ``out=`` and ``inplace=True`` calls, then
    its pass manager's compiled one-layer model; and fqr.fusion.compiled's tiny vLLM model
    (``test_compiled_comparison_under_cuda_graphs``)."""
    from fqr.fusion.models import AttentionShape, VllmStyleModel, preset_model
    from fqr.presets import PrologueSpec

    example = load_example("vllm_attention_layer")
    with torch.no_grad():
        for mode in ("out", "inplace"):
            layer = example.FusedQwen3Attention(
                example.TINY, 64, torch.bfloat16, GPU_DEVICE, mode=mode
            )
            s = layer.spec
            qkv = torch.empty(64, s.qkv_width, dtype=torch.bfloat16, device=GPU_DEVICE)
            layer.prologue(torch.empty(64, dtype=torch.int64, device=GPU_DEVICE), qkv)
        models = [
            preset_model(example.TINY, 1, torch.bfloat16, device=GPU_DEVICE),
            VllmStyleModel(64, [AttentionShape(PrologueSpec(4, 2, 16, 16), max_position=512)],
                           torch.bfloat16).to(GPU_DEVICE),
        ]  # fmt: skip
        for model in models:
            for tokens in TOKEN_COUNTS:
                _as_the_vllm_pass_calls(model.layers[0], tokens)


@pytest.mark.skipif(not BUILDING, reason="the build run's stand-in for the compiled model")
@pytest.mark.skipif(transformers_missing() is not None, reason=str(transformers_missing()))
def test_hf_qwen3_example_kernels_are_built_ahead():
    """examples/hf_qwen3_compile.py at the GPU test's size (bf16, one sequence of 64 tokens):
    the Hugging Face replacement's call (fqr.fusion.patterns: q and k ``[T, H*D]``, positions
    ``arange(T)``, a ``[T, D]`` table of HF's cos / sin halves, the q_norm / k_norm weights,
    ``numerics="unfused"``)."""
    example = load_example("hf_qwen3_compile")
    config = example.tiny_qwen3_config(2)
    d, tokens, dtype = config.head_dim, 64, torch.bfloat16
    q = torch.empty(tokens, config.num_attention_heads * d, dtype=dtype, device=GPU_DEVICE)
    k = torch.empty(tokens, config.num_key_value_heads * d, dtype=dtype, device=GPU_DEVICE)
    cache = torch.empty(tokens, d, dtype=dtype, device=GPU_DEVICE)
    weight = torch.empty(d, dtype=dtype, device=GPU_DEVICE)
    positions = torch.empty(tokens, dtype=torch.int64, device=GPU_DEVICE)
    # q and k in either order: the pattern is symmetric in them, and Inductor's matcher has
    # bound HF's k to its q (seen on the CPU: a [T, Hkv*D] first operand), which computes the
    # same outputs since each gets its own weight
    for first, second in ((q, k), (k, q)):
        fqr.qk_rmsnorm_rope(
            first, second, positions, cache, weight, weight.clone(), head_dim=d,
            eps=config.rms_norm_eps, is_neox=True, weight_offset=0.0, numerics="unfused",
            backend="triton",
        )  # fmt: skip
