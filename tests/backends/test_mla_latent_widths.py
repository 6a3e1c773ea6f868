"""MLA caches at every latent width, in every cache dtype (issue 41.1): ``fqr.mla_cache_insert``
and ``fqr.split_mla_rmsnorm_rope_cache`` told the byte-held layouts apart by the cache
tensor's dtype, so an E5M2 cache (held as bytes in the program, as vLLM allocates it) was cut
into ``fp8_ds_mla``'s 128-wide tiles: at width 192 only ``kv_c[:, :128]`` was stored and
``k_pe`` landed at column 128, at width 96 or 64 the calls raised (a 0-head section, a
``ZeroDivisionError``). The layout is now the declared ``kv_cache_dtype``'s. Each case below
stores what the float64 formulation says at latent widths 64, 96, 192, 512 and 576 for every
cache dtype ('fp8_ds_mla' where the width is whole tiles), on the reference backend and the
interpreted kernel (small), plus a property test over widths, rope widths, page sizes and
dtypes, and the issue's own reproducer."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.mla_widths import (
    CACHE_DTYPES,
    WIDTHS,
    check_caches,
    check_outputs,
    ds_mla_fits,
    insert_call,
    prologue_call,
)

import fqr
from fqr.backends import BACKENDS

INTERPRET = BACKENDS["interpret"].available
BACKEND_NAMES = ["reference"] + (["interpret"] if INTERPRET else [])
# the prologue op takes the cache's dtype, not a name: 'fp8' and 'fp8_e4m3' are one call there
PROLOGUE_DTYPES = ("auto", "fp8", "fp8_e5m2", "fp8_ds_mla")


def _grid(names):
    return [(w, n) for w in WIDTHS for n in names if n != "fp8_ds_mla" or w == 512]


def _ids(grid):
    return [f"{w}-{n}" for w, n in grid]


INSERT_GRID = _grid(CACHE_DTYPES)
PROLOGUE_GRID = _grid(PROLOGUE_DTYPES)


def _dtype(name):  # fp8_ds_mla holds its rope part in the 16-bit model dtype
    return torch.float16 if name == "fp8_ds_mla" else torch.bfloat16


def _tokens(backend):
    return 5 if backend == "reference" else 3


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("width,name", INSERT_GRID, ids=_ids(INSERT_GRID))
def test_cache_insert_stores_every_width(gen, width, name, backend):
    call = insert_call(gen, width, 64, 16, name, dtype=_dtype(name), tokens=_tokens(backend),
                       backend=backend)  # fmt: skip
    result, caches = call.run()
    assert result is None
    check_caches(call, caches)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("width,name", PROLOGUE_GRID, ids=_ids(PROLOGUE_GRID))
def test_prologue_stores_every_width(gen, width, name, backend):
    q_lora = 0 if width == 576 else 24  # one without q_c (DeepSeek-V2-Lite's form)
    call = prologue_call(gen, width, 64, 16, name, dtype=_dtype(name), tokens=_tokens(backend),
                         q_lora=q_lora, backend=backend)  # fmt: skip
    result, caches = call.run()
    check_outputs(call, result)
    check_caches(call, caches)


TWO = [(w, n) for w, n in INSERT_GRID if n in ("fp8", "fp8_e5m2") and w in (96, 192)]


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("width,name", TWO, ids=_ids(TWO))
def test_two_caches_store_every_width(gen, width, name, backend):
    """FlashInfer's ``ckv_cache`` / ``kpe_cache`` in FP8 (its test grid's latent 96, rope 32)."""
    for make in (insert_call, prologue_call):
        call = make(gen, width, 32, 16, name, tokens=_tokens(backend), two_caches=True,
                    backend=backend)  # fmt: skip
        _, caches = call.run()
        assert set(caches) == {"kv_cache", "kpe_cache"}
        check_caches(call, caches)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("width", [192, 96])
def test_the_issues_reproducer_stores_exactly_the_e5m2_bytes(width, backend):
    """Issue 41's snippet: an E5M2 cache (a float8_e5m2 tensor) at width 192 stored only
    ``kv_c[:, :128]`` and put k_pe at column 128; width 96 raised. Now exactly torch's
    conversion of ``[kv_c | k_pe]``, everywhere."""
    kv_c = torch.randn(2, width, dtype=torch.bfloat16)
    k_pe = torch.randn(2, 64, dtype=torch.bfloat16)
    cache = torch.zeros(1, 16, width + 64, dtype=torch.float8_e5m2)
    fqr.mla_cache_insert(
        kv_c, k_pe, cache, torch.tensor([3, 7]), "fp8_e5m2", torch.tensor(1.0), backend=backend
    )
    want = torch.cat([kv_c, k_pe], -1).float().to(torch.float8_e5m2).view(torch.uint8)
    rows = cache.view(-1, width + 64).view(torch.uint8)
    assert torch.equal(rows[[3, 7]], want)
    others = torch.ones(16, dtype=torch.bool)
    others[[3, 7]] = False
    assert not rows[others].any()


# ------------------------------------------------------------------------ the property test


@st.composite
def _calls(draw):
    """A call of either op: latent width (8 to 640 in steps of 8, whole tiles for
    fp8_ds_mla), rope width (even, 2 to 96), page size, cache dtype, model dtype, tokens,
    one cache or FlashInfer's two."""
    name = draw(st.sampled_from(CACHE_DTYPES))
    if name == "fp8_ds_mla":
        width = 128 * draw(st.integers(1, 5))
    else:
        width = 8 * draw(st.integers(1, 80))
    rope = 2 * draw(st.integers(1, 48))
    block_size = draw(st.sampled_from([1, 3, 16, 64]))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16]))
    tokens = draw(st.integers(1, 6))
    two = name != "fp8_ds_mla" and draw(st.booleans())
    prologue = draw(st.booleans())
    if prologue and name == "fp8_e4m3":
        name = "fp8"  # the prologue op takes the cache's dtype, one name for E4M3
    return prologue, width, rope, block_size, name, dtype, tokens, two


def _run_drawn(drawn, backend, seed):
    prologue, width, rope, block_size, name, dtype, tokens, two = drawn
    gen = torch.Generator().manual_seed(seed)
    if prologue:
        call = prologue_call(gen, width, rope, block_size, name, dtype=dtype, tokens=tokens,
                             q_lora=8 * (seed % 3), two_caches=two, backend=backend)  # fmt: skip
    else:
        call = insert_call(gen, width, rope, block_size, name, dtype=dtype, tokens=tokens,
                           two_caches=two, backend=backend)  # fmt: skip
    result, caches = call.run()
    if prologue:
        check_outputs(call, result)
    check_caches(call, caches)


SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@settings(max_examples=40, **SETTINGS)
@given(drawn=_calls(), seed=st.integers(0, 2**31 - 1))
def test_any_width_rope_page_and_dtype_matches_float64_on_reference(drawn, seed):
    _run_drawn(drawn, "reference", seed)


@pytest.mark.skipif(not INTERPRET, reason="triton's interpreter is not available")
@settings(max_examples=5, **SETTINGS)
@given(drawn=_calls(), seed=st.integers(0, 2**31 - 1))
def test_any_width_rope_page_and_dtype_matches_float64_interpreted(drawn, seed):
    _run_drawn(drawn, "interpret", seed)


def test_ds_mla_needs_whole_tiles():
    """fp8_ds_mla's tiles are 128 wide: another latent width is refused naming it."""
    assert not ds_mla_fits(96)
    gen = torch.Generator().manual_seed(0)
    call = insert_call(gen, 512, 64, 16, "fp8_ds_mla", dtype=torch.float16)
    cache = torch.randint(0, 256, (1, 16, 96 + 2 * 64), dtype=torch.uint8, generator=gen)
    args = dict(call.args, kv_c=call.args["kv_c"][:, :96], kv_cache=cache)
    before = cache.clone()
    with pytest.raises(ValueError, match="kv_c width 96 is not a multiple of the fp8_ds_mla"):
        fqr.mla_cache_insert(**args)
    assert torch.equal(args["kv_cache"], before)
