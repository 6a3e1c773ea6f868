"""``numerics="unfused"`` equals the model families' own code bit for bit (issue 18, item 1).

* Hugging Face transformers: the real ``Qwen3Attention.forward`` and ``Gemma3Attention.forward``
  (their ``q_norm``/``k_norm`` modules, ``apply_rotary_pos_emb`` with the model's rotary
  embedding), bf16, random weights, tiny configs; q and k are captured where the attention
  function receives them (an attention implementation registered by this test), and fqr gets
  the same projections packed as ``[q | k | v]`` with a table built by the model's rotary module.
* vLLM's native path (``RMSNorm`` / ``GemmaRMSNorm.forward_static``,
  ``RotaryEmbedding.forward_static``), as :mod:`fqr.unfused` writes it from vLLM's code:
  NeoX and GPT-J, full and partial rotary, bf16 and fp16, the table in fp32 or in the model dtype.

Both on the reference backend and on the interpreted kernel (the lowering emits the same rounding
points), on real tables; fresh random inputs on the reference backend, fixed ones on the kernel
(:func:`inputs_for` says why).
"""

from __future__ import annotations

import pytest
import torch
from support.hf_models import hf_attention_case
from support.vllm_native import vllm_native_case

import fqr
from fqr.backends import BACKENDS
from fqr.unfused import vllm_rms_norm, vllm_rotary_embedding

transformers = pytest.importorskip("transformers")

BACKENDS_HERE = [
    "reference",
    pytest.param(
        "interpret",
        marks=pytest.mark.skipif(
            not BACKENDS["interpret"].available,
            reason=BACKENDS["interpret"].unavailable_reason() or "",
        ),
    ),
]


def inputs_for(backend: str, gen: torch.Generator) -> torch.Generator:
    """Fresh random inputs on the reference backend (the same torch reductions as the models:
    bitwise by construction); fixed ones for the kernel, whose fp32 sum of squares adds in
    another order: where that moves rstd by an fp32 ulp, an element sitting on a rounding
    boundary of ``x * rstd`` (about 2^-16 of them) may round the other way."""
    return gen if backend == "reference" else torch.Generator().manual_seed(20261201)


def assert_bitwise(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, what
    same = got.view(torch.int16) == want.view(torch.int16)
    assert bool(same.all()), (
        f"{what}: {int((~same).sum())} of {same.numel()} elements differ in bits; first at "
        f"{(~same).nonzero()[0].tolist()}: got {got.flatten()[(~same).flatten()][0].item()} "
        f"want {want.flatten()[(~same).flatten()][0].item()}"
    )


# ----------------------------------------------------------------------------- transformers


@pytest.mark.parametrize("backend", BACKENDS_HERE)
@pytest.mark.parametrize("family", ["qwen3", "gemma3", "olmo2"])
@pytest.mark.parametrize("tokens", [1, 5, 37])
def test_unfused_equals_transformers_attention_bitwise(gen, family, tokens, backend):
    if backend == "interpret" and tokens == 37:
        pytest.skip("the interpreter is slow: 1 and 5 tokens cover its tiles")
    args, kwargs, hf_q, hf_k = hf_attention_case(family, inputs_for(backend, gen), tokens)
    q, k, v = fqr.split_qkv_rmsnorm_rope(*args, **kwargs, backend=backend)
    assert_bitwise(q, hf_q, f"{family} q")
    assert_bitwise(k, hf_k, f"{family} k")
    # and the fused contract is a different rounding, not a coincidence of the data
    fq, _, _ = fqr.split_qkv_rmsnorm_rope(*args, **dict(kwargs, numerics="fused"))
    if tokens > 1:
        assert not torch.equal(fq, hf_q)


# ------------------------------------------------------------------------------------ vLLM


VLLM_CASES = [
    # (dtype, head_dim, rotary_dim, is_neox, gemma, table in the model dtype)
    (torch.bfloat16, 64, 64, True, False, False),
    (torch.bfloat16, 64, 64, False, False, True),
    (torch.bfloat16, 128, 64, True, False, True),  # partial rotary, ratio 0.5
    (torch.bfloat16, 128, 32, False, False, False),  # GPT-J, ratio 0.25
    (torch.bfloat16, 64, 64, True, True, False),  # GemmaRMSNorm
    (torch.float16, 64, 32, True, False, True),
    (torch.float16, 64, 64, False, True, False),
]


@pytest.mark.parametrize("backend", BACKENDS_HERE)
@pytest.mark.parametrize("case", VLLM_CASES, ids=lambda c: str(c))
def test_unfused_equals_vllm_native_bitwise(gen, case, backend):
    dtype, d, r, is_neox, gemma, table_in_dtype = case
    native = vllm_native_case(
        inputs_for(backend, gen),
        dtype,
        d,
        r,
        is_neox=is_neox,
        gemma=gemma,
        table_in_dtype=table_in_dtype,
        base=1e4 if r < d else 1e6,
    )
    want_q, want_k = native.vllm()
    q, k, v = fqr.split_qkv_rmsnorm_rope(*native.args, **native.fqr_kwargs(backend=backend))
    assert_bitwise(q, want_q, "q")
    assert_bitwise(k, want_k, "k")
    assert_bitwise(v, native.v, "v")


def test_olmo2_is_where_hf_and_vllm_round_differently(gen):
    """HF's Olmo2RMSNorm multiplies the weight in fp32 (one rounding), vLLM's OLMo2 uses
    RMSNorm (round, then the weight): ``unfused-hf`` is HF's, ``unfused`` vLLM's; they differ."""
    args, kwargs, hf_q, hf_k = hf_attention_case("olmo2", gen, 37)
    qkv, positions, table, qw, kw = args
    heads, kv_heads, d = kwargs["num_heads"], kwargs["num_kv_heads"], kwargs["head_dim"]
    q, k, _ = fqr.split_qkv_rmsnorm_rope(*args, **dict(kwargs, numerics="unfused"))
    q_size, kv_size = heads * d, kv_heads * d
    # vLLM: RMSNorm over the whole q / k, then its rotary embedding
    vq = vllm_rms_norm(qkv[:, :q_size], qw, 1e-6)
    vk = vllm_rms_norm(qkv[:, q_size : q_size + kv_size], kw, 1e-6)
    vq, vk = vllm_rotary_embedding(positions, vq, vk, d, table.to(torch.bfloat16), True)
    assert_bitwise(q, vq, "olmo2 q (vLLM)")
    assert_bitwise(k, vk, "olmo2 k (vLLM)")
    assert not torch.equal(q, hf_q)  # the two families' roundings are not the same
