"""What the ports of the peers' own kernel tests share (``tests/peers/test_<peer>_<file>.py``,
issue 26): the backends they run on, the peers' tables with real RoPE values, the peers'
float32 reference formulas (re-written from their tests), their check, and fqr's own check of
the same outputs against the independent float64 formulation.

A port keeps the peer's grid, reference and tolerances. It draws fresh inputs the way the peer
draws them (``randn`` rows and weights, its biases, its positions) from the test's ``gen``; the
one change is the RoPE table: the peers fill theirs with uniform noise, a port takes a real
table (:func:`fqr.rope_cache.rope_cos_sin_cache`) in the peer's dtype. The peers' tables have
2^18 rows; :func:`peer_table` computes only the rows the tokens read and fills the others with
NaN, so a kernel that reads a wrong row fails.

Where a peer's reference rounds to bf16/fp16 between its steps (vLLM's ``forward_native``
modules), a fused result can sit outside the peer's tolerance while being nearer the exact
value. :func:`assert_peer_or_nearer` then says so: it measures both errors against float64 and
checks fqr's ``numerics="unfused"`` result bit for bit against the peer's reference.
"""

from __future__ import annotations

import importlib.util
import itertools
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType

import pytest
import torch

from fqr.backends import BACKENDS
from fqr.numerics import compare, ordered_bits
from fqr.rope_cache import rope_cos_sin_cache
from support.devices import gpu_marks, has_values

# The CPU backends: fqr.ops run eagerly, and the generated kernel under the Triton interpreter.
INTERPRET = pytest.param(
    "interpret",
    marks=pytest.mark.skipif(
        not BACKENDS["interpret"].available,
        reason=BACKENDS["interpret"].unavailable_reason() or "",
    ),
)

# The GPU files' marks (``pytestmark``): the full grids on the compiled kernel, skipped where
# no CUDA GPU is visible (never in the build run on ``meta``: support.devices).
ON_TRITON = gpu_marks("triton")


def cpu_backend_tests(check_case: Callable, cpu_grid: list, interpret_grid: list) -> tuple:
    """The two CPU tests of a port whose ``check_case(case, backend, gen)`` checks one case:
    ``cpu_grid`` on the reference backend and ``interpret_grid`` (a spread of it) through the
    interpreted kernel, as ``(test_reference_backend, test_interpreted_kernel)`` to bind at
    module level, where pytest collects them."""

    @pytest.mark.parametrize("case", cpu_grid, ids=case_id)
    def test_reference_backend(gen, case):
        check_case(case, "reference", gen)

    @pytest.mark.parametrize("backend", [INTERPRET])
    @pytest.mark.parametrize("case", interpret_grid, ids=case_id)
    def test_interpreted_kernel(gen, case, backend):
        check_case(case, backend, gen)

    return test_reference_backend, test_interpreted_kernel


# vllm-ascend's tests hold their tables in bf16 with max_position_embeddings 262144 rows; their
# noise tables have no theta: the ports take Qwen3's / MiniMax-M3's 1e6.
ASCEND_MAX_POSITION = 262144
ASCEND_THETA = 1e6


PORTS = Path(__file__).resolve().parent.parent / "peers"


def load_port(name: str) -> ModuleType:
    """The port module ``tests/peers/<name>.py`` (its grid and ``check_case``), for the GPU
    file that runs the full grids (``tests/peers`` is no package and not on the path there)."""
    spec = importlib.util.spec_from_file_location(f"fqr_peer_port_{name}", PORTS / f"{name}.py")
    assert spec is not None and spec.loader is not None, name
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def grid(**axes: Iterable) -> list[dict]:
    """The peer's ``pytest.mark.parametrize`` product as a list of cases (dicts)."""
    names = list(axes)
    return [dict(zip(names, values)) for values in itertools.product(*axes.values())]


def case_id(case: dict) -> str:
    return "-".join(f"{k}={_short(v)}" for k, v in case.items())


def _short(v) -> str:
    if isinstance(v, torch.dtype):
        return str(v).removeprefix("torch.")
    if isinstance(v, tuple):
        return "x".join(map(str, v))
    return str(v)


def spread(cases: list[dict], count: int) -> list[dict]:
    """``count`` cases spread evenly over ``cases`` (the first and the last among them): the
    interpreter's sample of a peer grid."""
    if count >= len(cases):
        return list(cases)
    step = (len(cases) - 1) / (count - 1)
    return [cases[round(i * step)] for i in range(count)]


def peer_positions(tokens: int, high: int, gen: torch.Generator) -> torch.Tensor:
    """``torch.randint(0, high, (tokens,))`` int64, as vllm-ascend's tests draw positions."""
    return torch.randint(0, high, (tokens,), generator=gen, device=gen.device, dtype=torch.int64)


def peer_table(
    rotary_dim: int,
    positions: torch.Tensor,
    dtype: torch.dtype,
    *,
    max_position: int = ASCEND_MAX_POSITION,
    theta: float = ASCEND_THETA,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """A ``[max_position, rotary_dim]`` RoPE table in ``dtype`` (the peer's) on ``device``
    (default: the positions'), built there: the rows at ``positions`` (any shape) are the real
    cos | sin rows, the rows no token reads are NaN (a kernel that reads a wrong row fails;
    building all 2^18 rows would cost seconds on a CPU). A position read twice is written
    twice, with the same row (no ``unique``: it needs the values, which ``meta`` has not)."""
    device = positions.device if device is None else torch.device(device)
    rows = positions.to(device=device, dtype=torch.int64).flatten()
    table = torch.full((max_position, rotary_dim), float("nan"), dtype=dtype, device=device)
    table[rows] = rope_cos_sin_cache(rotary_dim, max_position, theta, rows=rows).to(dtype)
    return table


# ------------------------------------------------------ the peers' float32 references


def peer_rms_norm(x, weight, eps: float, bias=None):
    """vllm-ascend's test ``rms_norm`` per head of ``x [..., D]``: in float32, ``x / sqrt(
    mean(x^2) + eps) * w`` (``+ b``), unrounded (``weight`` None: scale 1)."""
    x = x.to(torch.float32)
    y = x / torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(torch.float32)
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y


def peer_neox_rope(x, rows, rotary_dim: int):
    """vllm-ascend's test ``custom_rope`` / ``_apply_rope_neox`` of ``x [T, H, D]`` (float32):
    ``cos = rows[:, :R/2]``, ``sin = rows[:, W/2 : W/2 + R/2]`` of the gathered table rows
    ``[T, W]`` (W the table width), ``[x1 cos - x2 sin, x2 cos + x1 sin]`` over the first R
    features, the rest passed through; float32, unrounded."""
    half, table_half = rotary_dim // 2, rows.shape[-1] // 2
    cos = rows[:, None, :half].to(torch.float32)
    sin = rows[:, None, table_half : table_half + half].to(torch.float32)
    x = x.to(torch.float32)
    x1, x2 = x[..., :half], x[..., half:rotary_dim]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rotary_dim:]], dim=-1)


def peer_norm_rope(x, weight, rows, *, head_dim: int, rotary_dim: int, eps: float, bias=None):
    """vllm-ascend's reference of one of q, k ``[T, H*D]``: :func:`peer_rms_norm` per head,
    then :func:`peer_neox_rope`; float32 ``[T, H*D]``."""
    t = x.shape[0]
    normed = peer_rms_norm(x.reshape(t, -1, head_dim), weight, eps, bias)
    return peer_neox_rope(normed, rows, rotary_dim).reshape(t, -1)


# ------------------------------------------------------------------------ the checks


def assert_peer_close(name: str, actual, expected, *, atol: float, rtol: float) -> None:
    """The peers' check: ``torch.testing.assert_close(actual.float(), expected.float())``
    (nothing to check on ``meta``: :func:`support.devices.has_values`)."""
    if not has_values(actual, expected):
        return
    try:
        torch.testing.assert_close(  # where the outputs are
            actual.to(torch.float32),
            expected.to(actual.device, torch.float32),
            atol=atol,
            rtol=rtol,
        )
    except AssertionError as e:
        raise AssertionError(f"{name} against the peer's reference: {e}") from None


def assert_exact(name: str, out, exact, *, head_dim: int, bitwise: bool = False) -> None:
    """fqr's own check: ``out`` against the float64 formulation under the numerics contract
    (``fqr.numerics.compare``, fused numerics; nothing to check on ``meta``)."""
    if not has_values(out, exact):
        return
    c = compare(out, exact, head_dim=head_dim, bitwise=bitwise)
    assert c.passed, f"{name} against the float64 reference: {c}"


def head_ulps_apart(got: torch.Tensor, want: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``|got - want|`` in ULPs of ``got``'s dtype at the largest ``|want|`` of each head
    (``[..., heads, head_dim]``): how far apart two roundings of one chain are where a head's
    rstd differs in its last bit and RoPE's sums cancel the error down to smaller values."""
    heads = got.to(torch.float64).unflatten(-1, (-1, head_dim))
    want_heads = want.to(torch.float64).unflatten(-1, (-1, head_dim))
    largest = want_heads.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(got.dtype).tiny)
    head_ulp = torch.exp2(torch.frexp(largest).exponent - 1) * torch.finfo(got.dtype).eps
    return (heads - want_heads).abs() / head_ulp


def assert_peer_or_nearer(
    name: str,
    fused,
    peer_reference,
    exact,
    unfused: Callable[[], torch.Tensor] | None,
    *,
    atol: float,
    rtol: float,
    ulps: int = 0,
    head_dim: int | None = None,
) -> bool:
    """The peer's check of a fused output against a peer reference that rounds between its
    steps. Returns True when the peer's tolerance holds; otherwise asserts that the fused
    output is nearer the exact (float64) value than the peer's reference is, and that fqr's
    ``numerics="unfused"`` output (``unfused()``) equals the peer's reference bit for bit
    (``ulps``: within that many ULPs, for a kernel whose fp32 reduction order is not torch's;
    with ``head_dim``, ULPs of each head's largest element, for a norm whose rstd may differ in
    its last bit before RoPE's sums cancel), and returns False; ``unfused`` None: no numerics
    mode rounds as the peer does, so outside the tolerance fails. On ``meta`` (no values) it
    calls ``unfused()`` always, the launch the GPU run makes where the tolerance fails, checks
    its dtype and returns True."""
    if has_values(fused, peer_reference, exact):
        try:
            assert_peer_close(name, fused, peer_reference, atol=atol, rtol=rtol)
            return True
        except AssertionError as outside:
            exact64 = exact.to(fused.device, torch.float64)
            fused_err = float((fused.to(torch.float64) - exact64).abs().max())
            peer_err = float((peer_reference.to(fused.device, torch.float64) - exact64).abs().max())
            assert fused_err <= peer_err, (
                f"{outside}\n{name}: fqr's fused error {fused_err:.3g} is not below the peer "
                f"reference's own error {peer_err:.3g} (against float64)"
            )
            assert unfused is not None, f"{name}: no numerics mode rounds as this peer does"
    if unfused is None:
        return True
    got = unfused()
    assert got.dtype == peer_reference.dtype, (got.dtype, peer_reference.dtype)
    if not has_values(got, peer_reference):
        return True
    if ulps and head_dim:
        apart = float(head_ulps_apart(got, peer_reference.to(got.device), head_dim).max())
        assert apart <= ulps, f"{name}: numerics='unfused' is {apart:g} head ULPs off the peer's"
        return False
    if ulps:
        peer = peer_reference.to(got.device)
        apart = int((ordered_bits(got) - ordered_bits(peer)).abs().max())
        assert apart <= ulps, f"{name}: numerics='unfused' is {apart} ULP off the peer's"
        return False
    peer = peer_reference.to(got.device)
    assert torch.equal(got, peer), (
        f"{name}: numerics='unfused' differs from the peer's rounding reference "
        f"(max {float((got.double() - peer.double()).abs().max()):.3g})"
    )
    return False
