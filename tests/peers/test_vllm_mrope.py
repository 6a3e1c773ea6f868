"""vLLM ``tests/kernels/core/test_mrope.py`` ported onto :func:`fqr.qk_mrope` (issue 26.7a):
``MRotaryEmbedding.forward_native`` is the peer's reference, atol 1e-2 / rtol 1.6e-2, six
models' text configs at TP 1 and 2, bf16 (:func:`support.peers_mrope.vllm_mrope_case`).

CPU: every model and TP size at 11 tokens on the reference backend; on the interpreter the
smallest head count of each section layout (GLM-4.1V's partial rotary, Qwen2-VL's contiguous
sections, Qwen3-VL's interleaved ones) at TP 2. ``test_mrope_torch_compile_tracing``:
``torch.ops.fqr.qk_mrope`` traced with ``fullgraph=True`` (``aot_eager``: the fake impl and
functionalisation; CPU Inductor would need a compiler toolchain and minutes) for a contiguous
and an interleaved model. The 8192-token cases and Inductor with ``reduce-overhead`` run on
the GPU (``tests/gpu/test_gpu_peers_mrope.py``).
"""

from __future__ import annotations

import pytest
import torch
from support.peers_mrope import VLLM_MROPE_MODELS, vllm_mrope_case, vllm_mrope_compiled_case

MODELS = {m.name: m for m in VLLM_MROPE_MODELS}
REFERENCE_CASES = [(m, tp) for m in MODELS for tp in (1, 2)]
INTERPRET_CASES = [
    ("zai-org/GLM-4.1V-9B-Thinking", 2),
    ("Qwen/Qwen2-VL-7B-Instruct", 2),
    ("Qwen/Qwen3-VL-30B-A3B-Instruct", 2),
]


@pytest.mark.parametrize("model, tp", REFERENCE_CASES)
def test_mrope_reference(gen, model, tp):
    vllm_mrope_case(
        MODELS[model], tp, torch.bfloat16, 11, backend="reference", device="cpu", gen=gen
    )


@pytest.mark.parametrize("model, tp", INTERPRET_CASES)
def test_mrope_interpret(gen, model, tp):
    vllm_mrope_case(
        MODELS[model], tp, torch.bfloat16, 11, backend="interpret", device="cpu", gen=gen
    )


@pytest.mark.parametrize("model", ["Qwen/Qwen2-VL-7B-Instruct", "Qwen/Qwen3-VL-4B-Instruct"])
def test_mrope_torch_compile_tracing(gen, model):
    vllm_mrope_compiled_case(
        MODELS[model], 2, torch.bfloat16, 11, compile_backend="aot_eager", device="cpu", gen=gen
    )
