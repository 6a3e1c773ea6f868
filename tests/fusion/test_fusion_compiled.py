"""fqr.fusion.compiled: the compiled-model comparison behind ``fqr fuse --device cuda``, at
test size on the CPU (the real sizes run on the GPU)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from fqr.fusion.compiled import attention_backend, classify_kernel, compare_compiled, profile_split
from fqr.fusion.hf_models import transformers_missing

# Kernel names from the first H200 run (docs/results/gpu-fusion-h200-run1.json, torch 2.11,
# Inductor's names), with what each computes, read from the generated graphs of that run.
RUN1_KERNELS = {
    # HF Qwen3, the causal-mask kernel (both graphs; without the pass Inductor inlined scraps
    # of the norm/RoPE ops into its name): run1 counted it as prologue
    "triton_poi_fused__scaled_dot_product_cudnn_attention__to_copy__unsafe_view_add_arange_"
    "bitwise_and_bmm_cat_clone_cos_eq_expand_index_le_mean_mul_new_ones_pow_rsqrt_scalar_"
    "tensor_transpose_unsqueeze_view_where": "attention",
    "triton_poi_fused__scaled_dot_product_cudnn_attention__unsafe_view_add_arange_bitwise_and_"
    "clone_eq_expand_index_le_new_ones_scalar_tensor_transpose_unsqueeze_view_where": "attention",
    # HF Qwen3 without the pass: q/k norm + rotate_half RoPE (+ the angle table), and the
    # reduction half of a q/k norm
    "triton_per_fused__to_copy__unsafe_view_add_bmm_cat_cos_mean_mul_neg_pow_rsqrt_sin_slice_"
    "transpose_unsqueeze_view": "rope",
    "triton_poi_fused__to_copy__unsafe_view_add_bmm_cat_mean_mul_neg_pow_rsqrt_sin_slice_"
    "transpose_unsqueeze_view": "rope",
    "triton_per_fused__to_copy__unsafe_view_mean_pow_view": "norm",
    # HF Qwen3 with the pass: fqr's kernel and the Inductor kernel around the fqr op
    "fqr_cuda_b3ded45bc6ed": "fqr",
    "triton_poi_fused__to_copy__unsafe_view_arange_bmm_cat_cos_mul_qk_rmsnorm_rope_sin_slice_"
    "transpose_view": "fqr",
    # vLLM-shaped module: the fp32 math-SDPA GEMMs (library), its GQA expand copies (other),
    # the unfused norm reduction and norm + neox RoPE, the glue around fqr's op
    "sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize128x128x8_stage3_warpsize2x2x1_ffma_aligna4_"
    "alignc4_execute_kernel__5x_cublas": "library",
    "void cutlass::Kernel2<cutlass_80_simt_sgemm_256x128_8x4_nn_align1>"
    "(cutlass_80_simt_sgemm_256x128_8x4_nn_align1::Params)": "library",
    "triton_poi_fused__to_copy_clone_expand_split_with_sizes_transpose_unsqueeze_view": "other",
    "triton_poi_fused__to_copy_clone_expand_transpose_unsqueeze_view": "other",
    "triton_red_fused__to_copy_mean_pow_split_with_sizes_view": "norm",
    "triton_poi_fused__to_copy_add_index_select_mean_mul_pow_rsqrt_split_split_with_sizes_sub_"
    "unsqueeze_view": "rope",
    "fqr_cuda_6878a5ab866a": "fqr",
    "triton_poi_fused_split_qkv_rmsnorm_rope": "fqr",
}


@pytest.mark.parametrize("name", sorted(RUN1_KERNELS))
def test_classify_kernel_on_the_names_of_the_first_h200_run(name):
    assert classify_kernel(name) == RUN1_KERNELS[name]
    assert classify_kernel(name + "_12") == RUN1_KERNELS[name]  # Inductor's index suffix


@pytest.mark.parametrize(
    "name, backend",
    [
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", "flash"),
        (
            "void pytorch_flash::flash_fwd_splitkv_combine_kernel<Flash_fwd_kernel_traits<>>",
            "flash",
        ),
        ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::Params)", "efficient"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_128x128x128", "cudnn"),
        ("triton_per_fused__softmax_1", "math"),  # Inductor's decomposed math attention
        ("triton_poi_fused_mul_silu_3", "none"),
    ],
)
def test_attention_backend_is_read_from_the_kernels_that_ran(name, backend):
    kernels = [name, "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "fqr_cuda_1"]
    assert attention_backend(kernels) == backend


def test_profile_split_attributes_by_content_not_by_difference():
    # HF-like forward at 4096 tokens. Without the pass: the mask kernel (with norm scraps in
    # its name), a q/k norm + RoPE kernel, a split-off q/k norm reduction, the model's own
    # RMSNorm (input/post-attention: 4 launches on both sides), GEMMs, flash. With it: a
    # differently indexed mask kernel (a kernel that differs, but is not prologue), fqr's
    # kernel, the glue around fqr's op, the same RMSNorms and GEMMs.
    mask_u = "triton_poi_fused__scaled_dot_product_cudnn_attention_mean_pow_rsqrt_cat_where_4"
    mask_f = "triton_poi_fused__scaled_dot_product_cudnn_attention_arange_where_9"
    layer_norm = "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt"
    unfused = (
        Counter(
            {
                "sm90_gemm": 1000.0,
                "void pytorch_flash::flash_fwd_kernel<>": 400.0,
                mask_u: 230.0,
                "triton_per_fused__to_copy_cat_cos_mean_mul_neg_pow_rsqrt_sin_3": 180.0,
                "triton_per_fused__to_copy_mean_pow_view_2": 20.0,
                f"{layer_norm}_0": 40.0,
                f"{layer_norm}_5": 40.0,
                "triton_poi_fused_mul_silu_6": 30.0,
            }
        ),
        Counter(
            {
                "sm90_gemm": 8,
                "void pytorch_flash::flash_fwd_kernel<>": 2,
                mask_u: 1,
                "triton_per_fused__to_copy_cat_cos_mean_mul_neg_pow_rsqrt_sin_3": 2,
                "triton_per_fused__to_copy_mean_pow_view_2": 2,
                f"{layer_norm}_0": 2,
                f"{layer_norm}_5": 2,
                "triton_poi_fused_mul_silu_6": 2,
            }
        ),
    )
    fused = (
        Counter({
            "sm90_gemm": 1001.0, "void pytorch_flash::flash_fwd_kernel<>": 401.0,
            mask_f: 234.0, "fqr_cuda_b3ded45bc6ed": 50.0,
            "triton_poi_fused_arange_cos_qk_rmsnorm_rope_sin_1": 5.0,
            f"{layer_norm}_2": 80.0, "triton_poi_fused_mul_silu_4": 30.0,
        }),
        Counter({
            "sm90_gemm": 8, "void pytorch_flash::flash_fwd_kernel<>": 2, mask_f: 1,
            "fqr_cuda_b3ded45bc6ed": 2, "triton_poi_fused_arange_cos_qk_rmsnorm_rope_sin_1": 1,
            f"{layer_norm}_2": 4, "triton_poi_fused_mul_silu_4": 2,
        }),
    )  # fmt: skip
    split = profile_split(4096, unfused, fused)
    assert split.unfused_prologue_kernels == {
        "triton_per_fused__to_copy_cat_cos_mean_mul_neg_pow_rsqrt_sin": 180.0,
        "triton_per_fused__to_copy_mean_pow_view": 20.0,
    }
    assert split.fused_prologue_kernels == {
        "fqr_cuda_b3ded45bc6ed": 50.0,
        "triton_poi_fused_arange_cos_qk_rmsnorm_rope_sin": 5.0,
    }
    assert split.unfused_prologue_us == 200.0 and split.fused_prologue_us == 55.0
    assert split.unfused_total_us == 1940.0 and split.fused_total_us == 1801.0
    assert split.unfused_share == pytest.approx(200.0 / 1940.0)
    assert split.fused_share == pytest.approx(55.0 / 1801.0)
    assert split.attention == {"unfused": "flash", "fused": "flash"}
    assert split.kernels["unfused"][layer_norm] == {"us": 80.0, "launches": 4, "category": "norm"}
    assert split.kernels["fused"]["sm90_gemm"]["category"] == "library"


def test_a_norm_kernel_the_other_side_lacks_counts_against_that_side():
    # the pass may leave a q/k norm reduction behind: it is prologue with the pass too
    norm = "triton_red_fused__to_copy_mean_pow_split_with_sizes_view"
    unfused = (Counter({f"{norm}_1": 30.0, "gemm": 70.0}), Counter({f"{norm}_1": 2, "gemm": 2}))
    fused = (Counter({f"{norm}_3": 45.0, "gemm": 70.0}), Counter({f"{norm}_3": 3, "gemm": 2}))
    split = profile_split(4096, unfused, fused)
    assert split.unfused_prologue_us == 0.0
    assert split.fused_prologue_kernels == {norm: 15.0}


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


def test_vllm_module_attention_is_4d_bf16_gqa_sdpa_the_flash_backend_takes(monkeypatch):
    # run1 passed [H, T, D] (3-D) tensors, which no fused SDPA backend takes: on the GPU the
    # math backend ran it as fp32 GEMMs. The module must hand SDPA [1, H, T, D] views in the
    # model dtype with k/v heads shared through enable_gqa (not repeated).
    from fqr.fusion.models import AttentionShape, VllmStyleModel
    from fqr.presets import PrologueSpec

    shape = AttentionShape(PrologueSpec(4, 2, 16, 16), max_position=64)
    torch.manual_seed(0)
    model = VllmStyleModel(64, [shape], torch.bfloat16).eval()
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        out = sdpa(q, k, v, **kw)
        calls.append((q, k, v, kw, out))
        return out

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    t = 7
    with torch.no_grad():
        model(torch.randint(0, 64, (t,)), torch.randn(t, 64).to(torch.bfloat16))
    (q, k, v, kw, out), = calls  # fmt: skip
    assert q.shape == (1, 4, t, 16) and k.shape == v.shape == (1, 2, t, 16)
    assert {q.dtype, k.dtype, v.dtype} == {torch.bfloat16}
    assert kw == {"is_causal": True, "enable_gqa": True}
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1  # views of the prologue outputs
    # GQA as vLLM groups heads: q head h attends with kv head h // (Hq / Hkv)
    qd, kd, vd = (x.double()[0] for x in (q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)))
    scores = qd @ kd.transpose(-1, -2) / 16**0.5
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    expected = scores.softmax(-1) @ vd
    assert (out[0].double() - expected).abs().max() <= 2**-7 * expected.abs().max()
    # and SDPA's own choice for these inputs is a fused backend (flash here on the CPU, and
    # on an H200), which 3-D inputs never get
    assert model.layers[0].sdpa_backend(t) == "flash_attention"
    assert model.layers[0].sdpa_backend(1) == "flash_attention"
