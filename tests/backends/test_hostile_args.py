"""Hostile arguments to ``fqr.split_qkv_rmsnorm_rope`` (issue 14): hypothesis over the op's
whole argument space (shapes, dtypes, strides, devices, scalars, None and non-tensor values),
on ``reference`` and ``interpret``. Every call either raises a ValueError/TypeError naming the
argument before any backend runs, or returns outputs equal to the independent float64
formulation within the numerics contract (outputs poisoned with NaN before the kernel runs).

An example is a valid call drawn from the space (dtypes, strides, token counts, head shapes,
norms, biases, scalars, full-width norm statistics), then at most one hostile change to one
argument that must be refused, naming that argument.

Examples per backend: ``FQR_HYPOTHESIS_EXAMPLES`` (default 60: seconds in CI).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from unittest import mock

import pytest
import torch
from conftest import make_problem, real_table
from hypothesis import HealthCheck, event, find, given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from support.contract import assert_contract

import fqr
from fqr.backends import BACKENDS, Backend

EXAMPLES = int(os.environ.get("FQR_HYPOTHESIS_EXAMPLES", "60"))
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
NAMES = ("qkv", "positions", "cos_sin_cache", "q_weight", "k_weight")


@dataclass
class Call:
    args: dict  # the five positional arguments, by name
    kwargs: dict
    expect_error: tuple[str, ...] = ()  # names one of which the error must mention
    notes: list = field(default_factory=list)


def _meta(t):
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _strided_rows(x: torch.Tensor, pad: int) -> torch.Tensor:
    """``x`` as a view with ``pad`` spare elements after each row (row stride > width)."""
    wide = torch.zeros(x.shape[0], x.shape[1] + pad, dtype=x.dtype)
    wide[:, : x.shape[1]] = x
    return wide[:, : x.shape[1]]


@st.composite
def valid_calls(draw) -> Call:
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    kv = draw(st.sampled_from([1, 2]))
    hq = kv * draw(st.sampled_from([1, 2, 3]))
    d = draw(st.sampled_from([16, 32, 48, 64]))
    rotary = draw(st.sampled_from(sorted({d, d // 2, 2 * (d // 8) or 2, 2})))
    tokens = draw(st.sampled_from([0, 1, 2, 2, 3, 5, 7]))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
    norm = draw(st.sampled_from(["head", "head", "full", "none"]))
    rows = draw(st.sampled_from([8, 64, 4099]))
    width = (hq + 2 * kv) * d
    scale = 0.5 + 2.5 * torch.rand(hq + 2 * kv, 1, generator=g, dtype=torch.float64)
    qkv = torch.randn(tokens, hq + 2 * kv, d, generator=g, dtype=torch.float64) * scale
    qkv = qkv.reshape(tokens, width).to(dtype)
    if draw(st.booleans()):
        qkv = _strided_rows(qkv, draw(st.sampled_from([1, 8, d])))
    positions = torch.randint(0, rows, (tokens,), generator=g)
    if draw(st.booleans()):
        positions = positions.to(torch.int32)
    cache = real_table(rotary, rows, 1e4)
    cache_dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16]))
    cache = cache.to(cache_dtype)
    if draw(st.booleans()):
        cache = _strided_rows(cache, 6)
    kwargs: dict = dict(
        num_heads=hq,
        num_kv_heads=kv,
        head_dim=d,
        eps=draw(st.sampled_from([1e-6, 1e-5]))
        if draw(st.booleans())
        else draw(st.floats(1e-8, 1e-2)),
        is_neox=draw(st.booleans()),
        weight_offset=draw(st.sampled_from([0.0, 1.0])),
        norm=norm,
        numerics=draw(st.sampled_from(["fused", "unfused"])),
    )
    weights: list = [None, None]
    if norm != "none":
        q_len, k_len = (d, d) if norm == "head" else (hq * d, kv * d)
        w_dtype = draw(st.sampled_from([dtype, torch.float32]))
        centre = 0.0 if kwargs["weight_offset"] else 1.0
        weights = [
            (centre + 0.2 * torch.randn(n, generator=g, dtype=torch.float64)).to(w_dtype)
            for n in (q_len, k_len)
        ]
        if draw(st.booleans()):
            kwargs["q_bias"], kwargs["k_bias"] = [
                (0.05 * torch.randn(n, generator=g, dtype=torch.float64)).to(w_dtype)
                for n in (q_len, k_len)
            ]
        if norm == "full" and tokens and draw(st.booleans()):  # statistics over the whole width
            x = qkv.to(torch.float32)
            kwargs["norm_stats"] = fqr.NormStats(
                x[:, : hq * d].square().sum(1),
                x[:, hq * d : (hq + kv) * d].square().sum(1),
                hq * d,
                kv * d,
            )
    args = dict(zip(NAMES, (qkv, positions, cache, *weights)))
    return Call(args, kwargs)


def _with_norm_stats(c: Call, stats) -> None:
    c.kwargs.update(norm="full", norm_stats=stats)
    hq, kv, d = c.kwargs["num_heads"], c.kwargs["num_kv_heads"], c.kwargs["head_dim"]
    c.args["q_weight"] = torch.ones(hq * d)
    c.args["k_weight"] = torch.ones(kv * d)
    c.kwargs.pop("q_bias", None)
    c.kwargs.pop("k_bias", None)


def _set(where: str, name: str, value):
    def change(c: Call) -> None:
        (c.args if where == "a" else c.kwargs)[name] = value(c) if callable(value) else value

    return change


def _every_other(x: torch.Tensor) -> torch.Tensor:
    """The same values as a view with stride 2 (T >= 2), or a 2-row view otherwise."""
    if x.shape[0] < 2:
        x = torch.zeros(2, dtype=x.dtype)
    return torch.stack([x, torch.zeros_like(x)], 1).reshape(-1)[::2]


def _strided_one_long(x: torch.Tensor) -> torch.Tensor:
    """A view at stride 2 of one position more than T: refused for its length (a strided view
    is read through its stride since issue 26.6, test_strided_positions_are_read_...)."""
    x = torch.cat([x, torch.zeros(1, dtype=x.dtype)])
    return torch.stack([x, torch.zeros_like(x)], 1).reshape(-1)[::2]


def _strided_stats(c: Call) -> None:
    """Full-width norm statistics of 2+ tokens whose q_sum_sq has stride 2."""
    qkv = c.args["qkv"]
    if qkv.shape[0] < 2:
        c.args["qkv"] = torch.ones(2, qkv.shape[1], dtype=qkv.dtype)
        c.args["positions"] = torch.zeros(2, dtype=torch.long)
    t = c.args["qkv"].shape[0]
    _with_norm_stats(c, fqr.NormStats(_every_other(torch.ones(t)), torch.ones(t), 1, 1))


def _stats_of(q_count, k_count=1, kind=fqr.NormStats):
    def change(c: Call) -> None:
        t = c.args["qkv"].shape[0]
        _with_norm_stats(c, kind(torch.ones(t), torch.ones(t), q_count, k_count))

    return change


# (argument names the error may mention, the change); every change must be refused.
HOSTILE = [
    (("qkv",), _set("a", "qkv", None)),
    (("qkv",), _set("a", "qkv", lambda c: c.args["qkv"].tolist())),
    (("qkv",), _set("a", "qkv", lambda c: c.args["qkv"].reshape(-1))),
    (("qkv",), _set("a", "qkv", lambda c: c.args["qkv"][None])),
    (("qkv",), _set("a", "qkv", lambda c: c.args["qkv"].to(torch.int32))),
    (("qkv",), _set("a", "qkv", lambda c: c.args["qkv"].to(torch.float64))),
    (("qkv",), _set("a", "qkv", lambda c: c.args["qkv"][:, 1:])),
    (("qkv",), _set("a", "qkv", lambda c: torch.zeros(2, c.args["qkv"].shape[1] * 2)[:, ::2])),
    (
        ("qkv", "positions", "q_weight", "cos_sin_cache"),
        _set("a", "qkv", lambda c: _meta(c.args["qkv"])),
    ),
    (("positions",), _set("a", "positions", None)),
    (("positions",), _set("a", "positions", lambda c: c.args["positions"].float())),
    (("positions",), _set("a", "positions", lambda c: c.args["positions"].to(torch.int16))),
    (("positions",), _set("a", "positions", lambda c: c.args["positions"][None])),
    (
        ("positions",),
        _set("a", "positions", lambda c: torch.zeros(c.args["qkv"].shape[0] + 1, dtype=torch.long)),
    ),
    (("positions",), _set("a", "positions", lambda c: c.args["positions"].tolist())),
    (
        ("positions",),
        _set(
            "a",
            "positions",
            lambda c: (
                torch.full((c.args["qkv"].shape[0] or 1,), -1) if c.args["qkv"].shape[0] else None
            ),
        ),
    ),
    (
        ("positions",),
        _set(
            "a",
            "positions",
            lambda c: (
                torch.full((c.args["qkv"].shape[0],), c.args["cos_sin_cache"].shape[0])
                if c.args["qkv"].shape[0]
                else None
            ),
        ),
    ),
    (("positions",), _set("a", "positions", lambda c: _meta(c.args["positions"]))),
    (("positions",), _set("a", "positions", lambda c: _strided_one_long(c.args["positions"]))),
    # cos_sin_cache=None is a layer without RoPE (valid); positions None with a table is not
    (("positions",), _set("a", "positions", None)),
    (
        ("cos_sin_cache",),
        _set("a", "cos_sin_cache", lambda c: c.args["cos_sin_cache"].to(torch.int32)),
    ),
    (("cos_sin_cache",), _set("a", "cos_sin_cache", lambda c: c.args["cos_sin_cache"][:, 0])),
    (("cos_sin_cache", "rotary_dim"), _set("a", "cos_sin_cache", lambda c: torch.ones(8, 3))),
    (
        ("cos_sin_cache", "rotary_dim"),
        _set("a", "cos_sin_cache", lambda c: torch.ones(8, c.kwargs["head_dim"] + 2)),
    ),
    (("cos_sin_cache",), _set("a", "cos_sin_cache", lambda c: torch.ones(4, 8).t())),
    (("cos_sin_cache",), _set("a", "cos_sin_cache", lambda c: _meta(c.args["cos_sin_cache"]))),
    (("num_heads",), _set("k", "num_heads", 0)),
    (("num_heads",), _set("k", "num_heads", 2.0)),
    (("num_heads",), _set("k", "num_heads", True)),
    (("num_heads",), _set("k", "num_heads", None)),
    (("num_kv_heads",), _set("k", "num_kv_heads", -1)),
    (("head_dim",), _set("k", "head_dim", 0)),
    (("head_dim",), _set("k", "head_dim", "64")),
    (("eps",), _set("k", "eps", 0.0)),
    (("eps",), _set("k", "eps", -1e-6)),
    (("eps",), _set("k", "eps", float("inf"))),
    (("eps",), _set("k", "eps", float("nan"))),
    (("eps",), _set("k", "eps", 1e39)),
    (("eps",), _set("k", "eps", 1e-50)),
    (("eps",), _set("k", "eps", "1e-6")),
    (("eps",), _set("k", "eps", None)),
    (("eps",), _set("k", "eps", torch.tensor(1e-6))),
    (("weight_offset",), _set("k", "weight_offset", float("nan"))),
    (("weight_offset",), _set("k", "weight_offset", float("inf"))),
    (("weight_offset",), _set("k", "weight_offset", -float("inf"))),
    (("weight_offset",), _set("k", "weight_offset", 1e39)),
    (("weight_offset",), _set("k", "weight_offset", 10**400)),
    (("eps",), _set("k", "eps", 10**400)),
    (("weight_offset",), _set("k", "weight_offset", "1")),
    (("weight_offset",), _set("k", "weight_offset", None)),
    (("is_neox",), _set("k", "is_neox", 1)),
    (("is_neox",), _set("k", "is_neox", None)),
    (("norm",), _set("k", "norm", "layer")),
    (("norm",), _set("k", "norm", None)),
    (("numerics",), _set("k", "numerics", "fast")),
    (("numerics",), _set("k", "numerics", None)),
    (("backend",), _set("k", "backend", 3)),
    (("backend",), _set("k", "backend", "cuda-graph")),
    (
        ("q_weight",),
        _set(
            "a",
            "q_weight",
            lambda c: (
                torch.ones(3) if c.kwargs["norm"] != "none" else torch.ones(c.kwargs["head_dim"])
            ),
        ),
    ),
    (
        ("q_weight",),
        _set(
            "a",
            "q_weight",
            lambda c: [1.0] * c.kwargs["head_dim"] if c.kwargs["norm"] != "none" else torch.ones(1),
        ),
    ),
    (
        ("k_weight",),
        _set("a", "k_weight", lambda c: None if c.kwargs["norm"] != "none" else torch.ones(2)),
    ),
    (
        ("k_weight",),
        _set(
            "a",
            "k_weight",
            lambda c: (
                torch.ones(2 * c.kwargs["head_dim"])[::2]
                if c.kwargs["norm"] == "head"
                else torch.ones(1, 1)
            ),
        ),
    ),
    (
        ("k_weight",),
        _set(
            "a",
            "k_weight",
            lambda c: (
                torch.ones(c.kwargs["head_dim"], dtype=torch.int64)
                if c.kwargs["norm"] == "head"
                else torch.ones(1)
            ),
        ),
    ),
    (
        ("q_bias", "k_bias"),
        _set(
            "k",
            "k_bias",
            lambda c: torch.zeros(c.kwargs["head_dim"]) if c.kwargs.get("q_bias") is None else None,
        ),
    ),
    (("norm_stats",), _stats_of(1, kind=lambda *f: tuple(f))),
    (
        ("norm_stats",),
        _stats_of(1, kind=lambda *f: dict(zip(("q_sum_sq", "k_sum_sq", "q_count", "k_count"), f))),
    ),
    (("norm_stats",), _stats_of(None)),
    (("norm_stats",), _stats_of(0)),
    (("norm_stats",), _stats_of(2.5)),
    (("norm_stats",), _strided_stats),
    (
        ("norm_stats",),
        _set(
            "k",
            "norm_stats",
            lambda c: (
                fqr.NormStats(torch.ones(1), torch.ones(1), 1, 1)
                if c.kwargs["norm"] != "full"
                else "stats"
            ),
        ),
    ),
]


@st.composite
def calls(draw) -> Call:
    c = draw(valid_calls())
    if draw(st.integers(0, 2)) > 0:  # two in three examples are hostile
        names, change = draw(st.sampled_from(HOSTILE))
        change(c)
        c.expect_error = names
    return c


@contextmanager
def poisoned_outputs_and_counted_launches():
    """Every float ``torch.empty`` is NaN-filled (an output a kernel leaves unwritten shows),
    and backend launches are counted (a refused call must launch none)."""
    empty, launch = torch.empty, Backend.launch
    count = [0]

    def poisoned(*a, **k):
        t = empty(*a, **k)
        if t.is_floating_point() and t.device.type == "cpu":
            t.fill_(float("nan"))
        return t

    def counted(self, program, args):
        count[0] += 1
        return launch(self, program, args)

    with mock.patch.object(torch, "empty", poisoned), mock.patch.object(Backend, "launch", counted):
        yield count


def _event(text: str) -> None:
    try:
        event(text)
    except InvalidArgument:  # outside a hypothesis test (the table test)
        pass


def _check(c: Call, backend: str) -> None:
    kwargs = dict(c.kwargs)
    kwargs.setdefault("backend", backend)
    with poisoned_outputs_and_counted_launches() as launches:
        try:
            outs = fqr.split_qkv_rmsnorm_rope(*c.args.values(), **kwargs)
        except (ValueError, TypeError) as e:
            assert c.expect_error, f"a valid call was refused: {type(e).__name__}: {e}"
            assert any(n in str(e) for n in c.expect_error), f"{e!r} names none of {c.expect_error}"
            assert launches[0] == 0, "refused after a backend launched"
            _event(f"refused: {c.expect_error[0]}")
            return
    assert not c.expect_error, f"accepted a hostile {c.expect_error[0]}"
    tokens = c.args["qkv"].shape[0]
    _event(f"ran: T={tokens} norm={c.kwargs['norm']}")
    assert [o.shape[0] for o in outs] == [tokens] * 3
    assert all(o.dtype == c.args["qkv"].dtype and o.is_contiguous() for o in outs)
    static = {k: v for k, v in kwargs.items() if k != "backend"}
    assert_contract(outs, tuple(c.args.values()), static, static["numerics"])


@pytest.mark.parametrize("backend", ["reference", "interpret"])
@SETTINGS
@given(c=calls())
def test_any_call_is_refused_clearly_or_meets_the_contract(backend, c):
    if not BACKENDS[backend].available:
        pytest.skip(BACKENDS[backend].unavailable_reason())
    _check(c, backend)


@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_the_hostile_table_is_refused_on_a_plain_call(backend):
    """Every hostile change, once, on one valid call: refused, naming the argument, before
    any launch (the property test samples this table; here each row runs at least once)."""
    if not BACKENDS[backend].available:
        pytest.skip(BACKENDS[backend].unavailable_reason())
    base = find(valid_calls(), lambda c: c.args["qkv"].shape[0] == 3 and c.kwargs["norm"] == "head")
    for names, change in HOSTILE:
        c = Call(dict(base.args), dict(base.kwargs))
        change(c)
        c.expect_error = names
        _check(c, backend)


NON_FINITE = [
    ("eps", float("inf")),
    ("eps", float("nan")),
    ("eps", 1e39),  # inf in float32, the compute dtype
    ("eps", 1e-50),  # 0 in float32
    ("weight_offset", float("nan")),
    ("weight_offset", float("inf")),
    ("weight_offset", -float("inf")),
    ("weight_offset", -1e39),
    ("eps", 10**400),  # issue 41: past float's range, an OverflowError before
    ("weight_offset", 10**400),
    ("weight_offset", -(10**400)),
]


def _id(name, value) -> str:
    return f"{name}={value}" if isinstance(value, float) else f"{name}={len(str(value))}-digit-int"


@pytest.mark.parametrize("backend", ["reference", "interpret"])
@pytest.mark.parametrize("name,value", NON_FINITE, ids=[_id(n, v) for n, v in NON_FINITE])
def test_non_finite_scalars_are_refused_naming_them(problem, backend, name, value):
    """Finding 4: they used to pass; the emitter wrote a bare ``inf``/``nan`` into the kernel
    (NameError when it ran) and the reference returned zeros."""
    if not BACKENDS[backend].available:
        pytest.skip(BACKENDS[backend].unavailable_reason())
    with pytest.raises(ValueError, match=f"^{name} must be"):
        fqr.split_qkv_rmsnorm_rope(
            *problem.args(), **problem.kwargs(**{name: value}, backend=backend)
        )


BAD_NORM_STATS = [
    ("tuple", lambda t, q, k: (torch.ones(t), torch.ones(t), q, k), TypeError),
    ("dict", lambda t, q, k: dict(q_sum_sq=torch.ones(t), k_sum_sq=torch.ones(t)), TypeError),
    ("count-none", lambda t, q, k: fqr.NormStats(torch.ones(t), torch.ones(t), None, k), TypeError),
    (
        "count-float",
        lambda t, q, k: fqr.NormStats(torch.ones(t), torch.ones(t), float(q), k),
        TypeError,
    ),
    ("sum-sq-list", lambda t, q, k: fqr.NormStats([1.0] * t, torch.ones(t), q, k), TypeError),
]


@pytest.mark.parametrize("kind,make,error", BAD_NORM_STATS, ids=[b[0] for b in BAD_NORM_STATS])
def test_norm_stats_of_the_wrong_type_is_refused_naming_it(gen, kind, make, error):
    """Finding 11: AttributeError, or a TypeError that named nothing."""
    pb = make_problem(gen, tokens=3, norm="full", head_dim=64)
    hq, kv, d = (pb.kwargs()[k] for k in ("num_heads", "num_kv_heads", "head_dim"))
    stats = make(pb.qkv.shape[0], hq * d, kv * d)
    with pytest.raises(error, match="^norm_stats"):
        fqr.split_qkv_rmsnorm_rope(*pb.args(), **pb.kwargs(norm_stats=stats, backend="reference"))


@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_strided_positions_are_read_through_their_stride(problem, backend):
    """Found by the property test: the kernel read positions at ``ptr + t``, so a strided
    view rotated tokens by other tokens' angles on the interpreter (then refused); issue 26.6:
    the kernel reads them through their stride (``positions[:, 0]`` of a ``[T, 2]`` buffer),
    bit for bit what the contiguous positions give."""
    pos = problem.positions
    strided = torch.stack([pos, torch.zeros_like(pos)], 1)[:, 0]
    assert strided.stride(0) == 2
    args = list(problem.args())
    want = fqr.split_qkv_rmsnorm_rope(*args, **problem.kwargs(backend=backend))
    args[1] = strided
    got = fqr.split_qkv_rmsnorm_rope(*args, **problem.kwargs(backend=backend))
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_a_bad_backend_is_refused_with_no_tokens_too(gen):
    """Found by the property test: with T = 0 the op returned before looking at ``backend``."""
    pb = make_problem(gen, tokens=0)
    with pytest.raises(ValueError, match="^backend must be one of"):
        fqr.split_qkv_rmsnorm_rope(*pb.args(), **pb.kwargs(backend="cuda-graph"))


@pytest.mark.parametrize("is_neox", [True, False])
def test_the_float64_formulation_takes_no_tokens(is_neox):
    """Found by the property test: GPT-J RoPE of 0 tokens could not reshape (``-1`` over 0
    elements) in the float64 formulation every check compares against."""
    from fqr.reference import prologue

    w = torch.ones(16)
    q, k, v = prologue(
        torch.zeros(0, 64),
        torch.zeros(0, dtype=torch.long),
        real_table(8, 16, 1e4),
        w,
        w,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        is_neox=is_neox,
    )
    assert (q.shape, k.shape, v.shape) == ((0, 32), (0, 16), (0, 16))
