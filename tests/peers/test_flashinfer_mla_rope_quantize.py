"""FlashInfer's MLA rope-quantize tests, ported (``tests/attention/test_rope.py``:
``test_generalized_rope_quantize`` and ``test_generalized_rope_quantize_append_kv_cache``, their
``"mla"`` rows): q heads ``[rope | nope]`` rotated (GPT-J pairs, base 10000) and quantized to
``quant_dtype`` (E4M3 or E5M2, ``quant_scale_q=1``), k's rotated rope part and its latent
appended to FlashInfer's paged ``ckv_cache`` / ``kpe_cache`` of that dtype. fqr's calls:
``fqr.mla_q_rope(q, ..., quant_scale_q=1, quantize_dtype=quant_dtype)`` (q held as fqr's
``[nope | rope]`` heads) and ``fqr.mla_cache_insert(k_nope, k_pe, ckv_cache, slots,
"fp8_e4m3" | "fp8_e5m2", 1, kpe_cache=kpe_cache)`` (k_pe rotated by vLLM's native rotary
embedding, as FlashInfer's reference rotates it; the pages addressed by slot = page *
page_size + offset). Each is held to FlashInfer's own assertions (its torch reference: the
rotation in the input dtype, then ``.to(quant_dtype)``; rtol 0.2 / atol 0.01 for q, rtol 0.25 /
atol 0.5 (E4M3) or 1.0 (E5M2) for the caches) and to fqr's contract against float64. The grid
keeps FlashInfer's MLA rows, dtypes and page sizes; its token counts are cut to two (the
reference backend) and one small case (the interpreter); ``enable_pdl`` and ``kv_layout`` do
not apply to these calls. The latent-96 E5M2 rows are those issue 41 found failing."""

from __future__ import annotations

import pytest
import torch

import fqr
from fqr.backends import BACKENDS
from fqr.numerics import compare
from fqr.prologue.mla_q_rope import mla_q_rope_reference
from fqr.reference import mla_cache_entry
from fqr.rope_cache import rope_cos_sin_cache
from fqr.unfused import vllm_rotary_embedding

MLA_ROWS = [(128, 64, 512), (32, 32, 96)]  # (num_qo_heads, rope_dim, no_rope_dim)
QUANT = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
INPUT = {"fp16": torch.float16, "bf16": torch.bfloat16}
CACHE_DTYPE = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}
CACHE_TOL = {torch.float8_e4m3fn: 0.5, torch.float8_e5m2: 1.0}


def _cases():
    cases = []
    for heads, rope, nope in MLA_ROWS:
        for q_name in QUANT:
            for in_name in INPUT:
                for page_size in (16, 32):
                    for tokens in (1, 19) if nope < 512 else (19,):  # bounded CPU time
                        row = (heads, rope, nope, tokens, in_name, q_name, page_size, "reference")
                        cases.append(row)
                if BACKENDS["interpret"].available:
                    cases.append((heads // 8, rope, nope, 3, in_name, q_name, 16, "interpret"))
    return cases


CASES = _cases()
IDS = [f"mla-{h}-{r}-{n}-T{t}-{i}-{q}-ps{p}-{b}" for h, r, n, t, i, q, p, b in CASES]


def _flashinfer_close(ref: torch.Tensor, out: torch.Tensor, *, rtol: float, atol: float) -> None:
    """FlashInfer's ``assert_close(ref.float(), out.float(), rtol, atol)``, where an element
    outside it must be one FP8 code from FlashInfer's reference: that reference rounds twice
    (the rotation in the input dtype, then to FP8) and fqr once (fp32 to FP8, the contract
    checked against float64 below), so where the first rounding crosses an FP8 midpoint the
    two sit one FP8 ULP apart (up to 25% at the bottom of an E5M2 binade; bf16 inputs, whose
    rounding is coarse, give dozens of such elements per case)."""
    a, b = ref.float(), out.float()
    outside = (a - b).abs() > atol + rtol * a.abs()
    if bool(outside.any()):
        codes = [x.view(torch.uint8)[outside].to(torch.int16) for x in (ref, out)]
        assert int((codes[0] - codes[1]).abs().max()) <= 1, (a[outside], b[outside])


def _slots(tokens: int, page_size: int) -> torch.Tensor:
    """FlashInfer's paged append for one request of ``tokens`` new tokens: page indices
    ``arange``, ``kv_page_indptr = [0, pages]``, positions ``0..T-1`` (batch index 0): the
    entry of token i is page ``kv_page_indices[(indptr[0] * ps + pos) // ps]``, offset
    ``(indptr[0] * ps + pos) % ps``, i.e. slot = page * page_size + offset."""
    pages = -(-tokens // page_size)
    kv_page_indices = torch.arange(pages)
    indptr0 = 0
    pos = torch.arange(tokens)
    page = kv_page_indices[(indptr0 * page_size + pos) // page_size]
    return page * page_size + (indptr0 * page_size + pos) % page_size


@pytest.mark.parametrize("heads,rope,nope,tokens,in_name,q_name,page_size,backend", CASES, ids=IDS)
def test_generalized_rope_quantize_append_kv_cache_mla(
    heads, rope, nope, tokens, in_name, q_name, page_size, backend
):
    input_dtype, quant_dtype = INPUT[in_name], QUANT[q_name]
    gen = torch.Generator().manual_seed(0)  # FlashInfer's fixed seed
    q_rope = torch.randn(tokens, heads, rope, generator=gen).to(input_dtype)
    q_nope = torch.randn(tokens, heads, nope, generator=gen).to(input_dtype)
    k_rope = torch.randn(tokens, rope, generator=gen).to(input_dtype)
    k_nope = torch.randn(tokens, nope, generator=gen).to(input_dtype)
    pos_ids = torch.arange(tokens, dtype=torch.int32)
    table = rope_cos_sin_cache(rope, 4096, 10000.0)

    # FlashInfer's reference: vLLM's RotaryEmbedding.forward_native in the input dtype
    ref_table = table.to(input_dtype)
    q_pe_ref, k_pe_ref = vllm_rotary_embedding(
        pos_ids.long(), q_rope.reshape(tokens, -1), k_rope, rope, ref_table, False
    )
    q_pe_f8_ref = q_pe_ref.reshape(tokens, heads, rope).to(quant_dtype)
    q_nope_f8_ref = q_nope.to(quant_dtype)

    # q: fqr's [nope | rope] heads, quantized with quant_scale_q = 1
    q = torch.cat([q_nope, q_rope], dim=-1).reshape(tokens, -1)
    scale = torch.tensor(1.0)
    q_nope_out, q_pe_out = fqr.mla_q_rope(
        q, pos_ids, table, num_heads=heads, qk_nope_head_dim=nope, quant_scale_q=scale,
        quantize_dtype=quant_dtype, backend=backend,
    )  # fmt: skip
    assert q_nope_out.dtype == quant_dtype and q_pe_out.dtype == quant_dtype
    _flashinfer_close(q_pe_f8_ref, q_pe_out.view(tokens, heads, rope), rtol=2e-1, atol=1e-2)
    _flashinfer_close(q_nope_f8_ref, q_nope_out.view(tokens, heads, nope), rtol=2e-1, atol=1e-2)
    exact = mla_q_rope_reference(q, pos_ids, table, num_heads=heads, qk_nope_head_dim=nope,
                                 quant_scale_q=scale, quantize_dtype=quant_dtype)  # fmt: skip
    for out, want, head in zip((q_nope_out, q_pe_out), exact, (nope, rope)):
        c = compare(out, want, head_dim=head)
        assert c.passed, c

    # k: the latent and the rotated rope part into FlashInfer's two paged caches
    pages = -(-tokens // page_size)
    ckv_cache = torch.zeros(pages, page_size, nope, dtype=quant_dtype)
    kpe_cache = torch.zeros(pages, page_size, rope, dtype=quant_dtype)
    slots = _slots(tokens, page_size)
    fqr.mla_cache_insert(k_nope, k_pe_ref, ckv_cache, slots, CACHE_DTYPE[quant_dtype], scale,
                         kpe_cache=kpe_cache, backend=backend)  # fmt: skip
    ckv_ref = torch.zeros_like(ckv_cache)
    kpe_ref = torch.zeros_like(kpe_cache)
    for i in range(tokens):
        ckv_ref[slots[i] // page_size, slots[i] % page_size] = k_nope[i].to(quant_dtype)
        kpe_ref[slots[i] // page_size, slots[i] % page_size] = k_pe_ref[i].to(quant_dtype)
    tol = CACHE_TOL[quant_dtype]
    torch.testing.assert_close(ckv_cache.float(), ckv_ref.float(), rtol=0.25, atol=tol)
    torch.testing.assert_close(kpe_cache.float(), kpe_ref.float(), rtol=0.25, atol=tol)
    both = torch.cat([ckv_cache, kpe_cache], dim=-1).view(-1, nope + rope)
    want, _ = mla_cache_entry(torch.zeros_like(both).view(pages, page_size, -1), k_nope,
                              k_pe_ref, slots)  # fmt: skip
    want = want.view(-1, nope + rope)[slots]
    for cols, head in ((slice(0, nope), nope), (slice(nope, None), rope)):
        c = compare(both[slots][:, cols], want[:, cols], head_dim=head)
        assert c.passed, c
