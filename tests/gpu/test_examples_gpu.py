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
from fusion.test_fusion_examples import load_example
from support.devices import BUILDING, GPU_DEVICE
from support.peer_ports import ON_TRITON

from fqr.fusion.hf_models import transformers_missing

pytestmark = [
    *ON_TRITON,
    pytest.mark.skipif(BUILDING, reason="torch.compile runs the compiled model on a real GPU"),
]


@pytest.mark.skipif(transformers_missing() is not None, reason=str(transformers_missing()))
def test_hf_qwen3_example_on_the_gpu(capsys):
    result = load_example("hf_qwen3_compile").run(
        layers=2, tokens=64, dtype="bf16", device=GPU_DEVICE
    )
    assert result["sites_fused"] == result["layers"] == 2
    assert 0 <= result["logits_rel_err"] <= result["tolerance"] and result["ok"]
    assert "fused 2/2 attention prologues" in capsys.readouterr().out


def test_vllm_attention_layer_example_on_the_gpu(capsys):
    argv = ["--device", GPU_DEVICE, "--dtype", "bf16", "--tokens", "64"]
    assert load_example("vllm_attention_layer").main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("within the contract: yes") == 2 and "fused 1/1 prologues" in out
