"""The check the mRoPE ports share (:func:`support.peers_mrope.check_like_peer`) on real data:
where fqr's fused output misses a peer's tolerance (here a zero tolerance), it passes only
when the peer's reference is the farther from float64 and ``numerics="unfused"`` equals it;
a fused output farther from float64 than the peer's is refused."""

from __future__ import annotations

import pytest
import torch
from support.peers_mrope import check_like_peer, planes_table

import fqr
from fqr import reference
from fqr.unfused import vllm_mrotary_embedding

D, SECTION = 128, (24, 20, 20)


def _case(gen):
    q = torch.randn(9, 4 * D, generator=gen, device=gen.device).bfloat16()
    positions = torch.randint(0, 4096, (3, 9), generator=gen, device=gen.device)
    cache = planes_table(D, positions, torch.bfloat16, max_position=4096, theta=5e6, device="cpu")
    kw = dict(head_dim=D, mrope_section=SECTION, mrope_interleaved=True)
    fused, _ = fqr.qk_mrope(q, None, positions, cache, backend="reference", **kw)
    unfused, _ = fqr.qk_mrope(
        q, None, positions, cache, backend="reference", numerics="unfused", **kw
    )
    exact, _ = reference.qk_mrope(q, None, positions, cache, **kw)
    peer, _ = vllm_mrotary_embedding(positions, q, q, D, cache, True, SECTION, True)
    return fused, peer, exact, unfused


def test_a_peer_reference_farther_from_float64_is_said_and_unfused_matches_it(gen):
    fused, peer, exact, unfused = _case(gen)
    assert not torch.equal(fused, peer)  # vLLM's bf16 steps round where fqr does not
    outcome = check_like_peer(
        "q", fused, peer, exact, unfused, atol=0, rtol=0, head_dim=D, backend="reference"
    )
    assert outcome == "peer farther"
    wrong = unfused.clone()
    wrong.view(torch.int16)[0, 0] += 1
    with pytest.raises(AssertionError, match="differs from the peer's rounding reference"):
        check_like_peer(
            "q", fused, peer, exact, wrong, atol=0, rtol=0, head_dim=D, backend="reference"
        )


def test_fqr_farther_from_float64_than_the_peer_is_refused(gen):
    fused, peer, exact, unfused = _case(gen)
    worse = (exact + (peer.double() - exact) * 3).bfloat16()  # three times the peer's error
    with pytest.raises(AssertionError, match="float64"):
        check_like_peer(
            "q", worse, fused, exact, unfused, atol=0, rtol=0, head_dim=D, backend="reference"
        )
