"""The fusion pass on a CUDA GPU: the compiled model calls the generated Triton kernel.

Skips without a GPU. Same mixed-shape vLLM-style model as ``test_fusion_graph.py``.
"""

from __future__ import annotations

import pytest
import torch
from support.vllm_model import SEED, VLLM_LAYERS, VllmModel, inputs, vllm_exact

import fqr.fusion
from fqr.numerics import compare

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _torch_too_old() -> bool:
    from fqr.fusion.fusion_pass import MIN_TORCH

    return tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < MIN_TORCH


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fused_model_on_gpu(dtype):
    if _torch_too_old():
        with pytest.raises(RuntimeError, match="fqr.fusion needs torch"):
            from fqr.fusion.fusion_pass import check_torch_version

            check_torch_version()
        pytest.skip(f"torch {torch.__version__} is older than the fusion pass supports")
    print(f"FQR_TEST_SEED={SEED}")
    model = VllmModel(VLLM_LAYERS, dtype, seed=SEED).eval().cuda()
    fusion = fqr.fusion.backend()
    compiled = torch.compile(model, backend=fusion)
    with torch.no_grad():
        for tokens, seed in ((37, SEED + 1), (300, SEED + 2)):
            positions, hidden = (t.cuda() for t in inputs(tokens, dtype, seed))
            torch._dynamo.mark_dynamic(positions, 0)
            torch._dynamo.mark_dynamic(hidden, 0)
            _, per_layer = compiled(positions, hidden)
            for layer, (qkv, q, k, v) in zip(model.layers, per_layer):
                exact_q, exact_k = vllm_exact(layer, qkv, positions)
                for out, exact in ((q, exact_q), (k, exact_k)):
                    c = compare(out, exact, head_dim=layer.spec.d, numerics="unfused")
                    assert c.passed, (layer.spec, c)
                assert torch.equal(v, qkv[:, layer.q_size + layer.kv_size :])
    torch._dynamo.reset()
    assert fusion.stats.sites == len(VLLM_LAYERS) and len(fusion.stats.graphs) == 1
