"""vLLM's ``tests/kernels/core/test_fused_qk_norm_rope_kvcache.py`` ported onto
:func:`fqr.split_qkv_rmsnorm_rope_cache` (``return_k=True``: vLLM's op writes q and k of every
token into ``q_out`` / ``k_out``), on the reference and interpret backends.

The peer asserts that ``fused_qk_norm_rope_kvcache`` reproduces ``fused_qk_norm_rope`` followed
by ``reshape_and_cache_flash`` bit for bit: same q and k, the same k / v rows in the paged cache
(the FlashAttention backend's strided key / value views of one ``[blocks, Hkv, 16, 2*D]``
buffer), qkv left untouched, rows past a shorter ``slot_mapping`` (CUDA-graph padding) and
padded ``-1`` slots normalised and rotated but never cached. Its reference is vLLM's own CUDA
kernel, fp32 compute rounded once; re-written here from that formula
(:func:`vllm_cache.vllm_fused_qk_norm_rope`), bit for bit is the same up to the order of fp32
operations, so the port holds fqr to the peer's reference at the one-rounding bound (<= 1 ULP,
or within the fp32 compute floor where RoPE cancels), and to the float64 value under fqr's
contract, and checks bit for bit what is exact: the cache holds exactly the returned k and the
v bits, rows not stored keep their bits, qkv is unchanged.

Peer grid: ``test_matches_unfused_pair`` 80 cases (dtype bf16/fp16 x is_neox x 5 head configs x
T 1/5/300/2048), ``test_all_token_heads_per_warp`` 16, ``test_padded_and_short_slot_mapping``
3. Here: the 20 of T 5 and 2 of the padded ones on the reference backend (full head sizes),
a sample at small T on interpret (6 spread over the grid's head configs at T 5, and the three
kinds of padding at T <= 11); the GPU file (``tests/gpu/test_gpu_peers_cache.py``) runs all
83 on triton. Not ported: the 16 ``token_heads_per_warp`` cases
(a launch knob of vLLM's CUDA kernel, which fqr's kernel does not have: the computation they
check is the (32, 8, 128, 128) bf16 case at T 5 and 2048 of the first test).
"""

from __future__ import annotations

import pytest
import torch
from support.devices import has_values
from support.peer_caches import (
    BLOCK_SIZE,
    Draws,
    flash_kv_buffer,
    kvcache_inputs,
    on_device,
    slot_mapping,
    split_kv,
    vllm_fused_qk_norm_rope,
)
from support.peer_ports import INTERPRET, case_id, grid, spread

import fqr
from fqr import reference
from fqr.numerics import compare
from fqr.peers import vllm_reshape_and_cache_flash

EPS = 1e-6
PEER_GRID = grid(
    dtype=[torch.bfloat16, torch.float16],
    is_neox=[True, False],
    # (num_heads, num_kv_heads, head_dim, rotary_dim)
    config=[
        (32, 8, 128, 128),
        (16, 4, 64, 64),
        (8, 2, 256, 256),
        (8, 8, 128, 128),
        (32, 8, 128, 64),
    ],
    tokens=[1, 5, 300, 2048],
)
# CPU: T 5 (the float64 checks of 2048 tokens take minutes on a 2-core machine; T 1 is in the
# GPU file and in the shorter slot mappings' sample below)
CPU_GRID = [c for c in PEER_GRID if c["tokens"] == 5]
INTERPRET_GRID = spread(CPU_GRID, 6)
# (T, slot_mapping length, -1 slots): the peer's test_padded_and_short_slot_mapping (16 q / 4 kv
# heads of 128, bf16, NeoX)
PADDED_GRID = [dict(tokens=t, slot_tokens=n, padded=p) for t, n, p in
               ((64, 64, 7), (64, 40, 0), (300, 290, 5))]  # fmt: skip
CPU_PADDED = PADDED_GRID[:2]  # (300, 290, 5) in the GPU file: 20 s of float64 checks on CPU
INTERPRET_PADDED = [dict(tokens=t, slot_tokens=n, padded=p) for t, n, p in
                    ((9, 9, 2), (9, 5, 0), (11, 9, 1))]  # fmt: skip


def check_case(case: dict, backend: str, gen, device: str = "cpu", peer_errors=False):
    """One case of either of the peer's grids (a padded case: 16/4/128 heads, bf16, NeoX)."""
    if "config" in case:
        shape = (case["dtype"], case["is_neox"], *case["config"], case["tokens"])
        return run_and_check(on_device(gen, device), backend, *shape, peer_errors=peer_errors)
    return run_and_check(
        on_device(gen, device), backend, torch.bfloat16, True, 16, 4, 128, 128, case["tokens"],
        case["slot_tokens"], case["padded"],
    )  # fmt: skip


def run_and_check(draws: Draws, backend, dtype, is_neox, heads, kv_heads, head_dim, rotary_dim,
                  tokens, slot_tokens=None, padded=0, peer_errors=False):  # fmt: skip
    """The peer's ``_run_and_check`` on fqr (inputs as ``draws`` says); ``peer_errors``: also
    return the peer reference's comparisons of q and k with float64. On ``meta`` the op runs
    and nothing is compared (no values)."""
    slot_tokens = tokens if slot_tokens is None else slot_tokens
    qkv, positions, q_weight, k_weight, table = kvcache_inputs(
        tokens, heads, kv_heads, head_dim, rotary_dim, is_neox, dtype, draws
    )
    kv = flash_kv_buffer(tokens, kv_heads, head_dim, dtype, draws)
    slots = slot_mapping(slot_tokens, kv.shape[0] * BLOCK_SIZE, padded, draws)
    statics = dict(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, eps=EPS)

    qkv_in = qkv.clone()
    kv_out = kv.clone()
    key_cache, value_cache = split_kv(kv_out, head_dim)
    q, k = fqr.split_qkv_rmsnorm_rope_cache(
        qkv_in, positions, table, q_weight, k_weight, key_cache, value_cache, slots,
        is_neox=is_neox, return_k=True, backend=backend, **statics,
    )  # fmt: skip
    assert q.shape == (tokens, heads * head_dim) and k.shape == (tokens, kv_heads * head_dim)
    if not has_values(q, k, kv_out):
        return None

    # the peer's reference: fused_qk_norm_rope, then reshape_and_cache_flash of the first N
    q_ref, k_ref, v_ref = vllm_fused_qk_norm_rope(
        qkv, heads, kv_heads, head_dim, EPS, q_weight, k_weight, table, is_neox, positions
    )
    # the float64 formulation on the same inputs (the caches as the op received them: kv)
    exact_q, exact_k, exact_key, exact_value = reference.cache_prologue(
        qkv, positions, table, q_weight, k_weight, *split_kv(kv, head_dim), slots,
        is_neox=is_neox, return_k=True, **statics,
    )  # fmt: skip

    assert torch.equal(qkv_in, qkv), "qkv must be read-only"
    # fqr's contract against float64, q and k of every token (stored or not)
    for name, out, exact in (("q", q, exact_q), ("k", k, exact_k)):
        c = compare(out, exact, head_dim=head_dim)
        assert c.passed, f"{name} vs float64: {c}"
    # the peer's reference (fp32, rounded once): the same up to fp32 operation order
    for name, out, peer in (("q", q, q_ref), ("k", k, k_ref)):
        c = compare(out, peer.reshape(tokens, -1).double(), head_dim=head_dim)
        assert c.passed, f"{name} vs vLLM's fused_qk_norm_rope: {c}"
    # the cache: exactly what reshape_and_cache_flash of the returned k and of v writes
    kv_want = kv.clone()
    vllm_reshape_and_cache_flash(
        k.view(tokens, kv_heads, head_dim), v_ref, *split_kv(kv_want, head_dim), slots
    )
    assert torch.equal(kv_out, kv_want), "cache rows differ from the returned k / v"
    # and the float64 expectation of the caches: the stored key rows under the contract
    # (the returned k is checked above), v's bits, every other row its own bits
    rows = exact_key.reshape(-1, kv_heads * head_dim)
    stored_rows = key_cache.reshape(rows.shape)[slots[slots >= 0]]
    c = compare(stored_rows, rows[slots[slots >= 0]], head_dim=head_dim)
    assert c.passed, f"key_cache vs float64: {c}"
    assert torch.equal(value_cache.double(), exact_value)
    # rows past N and -1 slots are computed but never cached
    stored = slots[slots >= 0]
    untouched = torch.ones(kv.shape[0] * BLOCK_SIZE, dtype=torch.bool, device=kv.device)
    untouched[stored] = False
    before = split_kv(kv, head_dim)[0].reshape(-1, kv_heads, head_dim)
    after = key_cache.reshape(-1, kv_heads, head_dim)
    assert torch.equal(after[untouched], before[untouched])
    if not peer_errors:
        return None
    return [compare(p.reshape(tokens, -1), e, head_dim=head_dim) for p, e in
            ((q_ref, exact_q), (k_ref, exact_k))]  # fmt: skip


@pytest.mark.parametrize("case", CPU_GRID, ids=case_id)
def test_matches_unfused_pair_reference(gen, case):
    """The peer's grid at T 5 on the reference backend (the op's rules run eagerly); the
    peer's reference (fp32, one rounding) meets fqr's fused contract too."""
    peer = check_case(case, "reference", gen, peer_errors=True)
    assert all(e.passed for e in peer), peer


@pytest.mark.parametrize("backend", [INTERPRET])
@pytest.mark.parametrize("case", INTERPRET_GRID, ids=case_id)
def test_matches_unfused_pair_interpret(gen, case, backend):
    """A sample of the peer's grid through the generated kernel (interpreted)."""
    check_case(case, backend, gen)


@pytest.mark.parametrize("case", CPU_PADDED, ids=case_id)
def test_padded_and_short_slot_mapping_reference(gen, case):
    """Rows without a slot are still normalised / rotated but never cached."""
    check_case(case, "reference", gen)


@pytest.mark.parametrize("backend", [INTERPRET])
@pytest.mark.parametrize("case", INTERPRET_PADDED, ids=case_id)
def test_padded_and_short_slot_mapping_interpret(gen, case, backend):
    """The peer's three kinds of padding at interpreter size: trailing -1 slots, a slot
    mapping shorter than T, both (the kernel reads no slot past N: N is a runtime argument)."""
    check_case(case, backend, gen)
