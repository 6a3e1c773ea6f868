"""fqr.fusion.compiled: the compiled-model comparison behind scripts/gpu_fusion.py and
``fqr fuse --device cuda``, at test size on the CPU (the real sizes run on the GPU)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from fqr.fusion.compiled import compare_compiled, profile_split
from fqr.fusion.hf_models import transformers_missing


def test_profile_split_attributes_what_differs_between_the_two_models():
    # without the pass: a norm+rope kernel (twice per forward: q and k) and a rope kernel;
    # with it: fqr's kernel. GEMMs and attention are on both sides (index suffixes differ).
    unfused = (
        Counter(
            {
                "gemm": 100.0,
                "flash_fwd": 50.0,
                "triton_per_fused_rsqrt_cat_3": 8.0,
                "triton_poi_fused_cat_mul_7": 2.0,
                "triton_poi_fused_clone_2": 4.0,
            }
        ),
        Counter(
            {
                "gemm": 2,
                "flash_fwd": 1,
                "triton_per_fused_rsqrt_cat_3": 2,
                "triton_poi_fused_cat_mul_7": 1,
                "triton_poi_fused_clone_2": 2,
            }
        ),
    )
    fused = (
        Counter({"gemm": 101.0, "flash_fwd": 49.0, "fqr_cuda_ab12cd": 3.0,
                 "triton_poi_fused_clone_5": 1.0}),
        Counter({"gemm": 2, "flash_fwd": 1, "fqr_cuda_ab12cd": 1,
                 "triton_poi_fused_clone_5": 1}),
    )  # fmt: skip
    split = profile_split(4096, unfused, fused)
    assert split.unfused_prologue_kernels == {
        "triton_per_fused_rsqrt_cat": 8.0,
        "triton_poi_fused_cat_mul": 2.0,
        "triton_poi_fused_clone": 2.0,  # one of its two launches is gone
    }
    assert split.fused_prologue_kernels == {"fqr_cuda_ab12cd": 3.0}
    assert split.unfused_total_us == 164.0 and split.fused_total_us == 154.0
    assert split.unfused_share == pytest.approx(12.0 / 164.0)
    assert split.fused_share == pytest.approx(3.0 / 154.0)


def test_bad_arguments_are_refused_before_compiling():
    with pytest.raises(ValueError, match="model must be one of"):
        compare_compiled("gpt2", device="cpu", tiny=True, prefill=(), decode=())
    with pytest.raises(ValueError, match="layers must be >= 1"):
        compare_compiled("vllm", layers=0, device="cpu")
    with pytest.raises(ValueError, match="cudagraphs need a CUDA device"):
        compare_compiled("vllm", device="cpu", cudagraphs=True)


@pytest.mark.slow
@pytest.mark.skipif(transformers_missing() is not None, reason=str(transformers_missing()))
def test_hf_qwen3_every_layer_fused_and_logits_within_the_compile_noise():
    r = compare_compiled(
        "hf-qwen3",
        layers=2,
        dtype=torch.bfloat16,
        device="cpu",
        tiny=True,
        prefill=(9,),
        decode=(2,),
        profile_tokens=(),
        check_tokens=12,
        seed=torch.seed() % 2**31,
    )
    assert r.sites == 2 and r.graphs == 1
    assert set(r.numerics) == {"hidden vs uncompiled", "logits vs uncompiled"}
    for name, n in r.numerics.items():
        assert n["passed"], (name, n)
        assert n["scale"] > 0
    assert r.passed
    assert [(row.phase, row.tokens) for row in r.latency] == [("prefill", 9), ("decode", 2)]
    assert all(row.unfused_ms > 0 and row.fused_ms > 0 for row in r.latency)
    assert r.profile == []  # profiles need CUDA
