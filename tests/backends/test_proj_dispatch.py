"""The projection dispatch (``fqr.projection``): per token bucket the fused GEMM + prologue kernel
or the pair (``F.linear`` then the prologue op), as the table measured; the table's lookup and its
fallback to the pair, the shipped table seeded from the H200 logs, hostile table files refused in
one line naming the file, both paths against float64, the torch op, bad input refused before any
kernel."""

from __future__ import annotations

import json

import pytest
import torch

import fqr
from fqr import projection, reference
from fqr.numerics import compare
from fqr.projection import (
    TABLE_FILE,
    DispatchTableError,
    Key,
    bucket_of,
    choose,
    entry_doc,
    load_table,
    table_doc,
    table_text,
    use_table,
)
from fqr.rope_cache import rope_cos_sin_cache

DOCS = TABLE_FILE.parents[1] / "docs"

HQ, HKV, D, HIDDEN, ROWS = 3, 1, 32, 48, 64
WIDTH = (HQ + 2 * HKV) * D
OP = "split_qkv_rmsnorm_rope"
HEADS = dict(num_heads=HQ, num_kv_heads=HKV, head_dim=D)


def _key(dtype=torch.bfloat16, *, bias=False, device="cpu", norm="head") -> Key:
    return Key(device, dtype, OP, WIDTH, HIDDEN, (HQ, HKV, D), norm, bias)


def _table(*keys: Key, measured=((1, 2.0, 1.0), (16, 2.0, 1.5), (1024, 3.0, 4.0))) -> dict:
    """A table where each key picks the fused kernel at T <= 16 (measured faster there)."""
    return table_doc([entry_doc(k, measured, model="test") for k in keys], source="test")


def _call(dtype, seed, *, tokens=5, bias=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g, dtype=torch.float64).to(dtype)
    w = (torch.randn(WIDTH, HIDDEN, generator=g, dtype=torch.float64) / HIDDEN**0.5).to(dtype)
    b = (0.1 * torch.randn(WIDTH, generator=g, dtype=torch.float64)).to(dtype) if bias else None
    qw, kw = ((1 + 0.1 * torch.randn(D, generator=g, dtype=torch.float64)).to(dtype) for _ in "qk")
    positions = torch.randint(0, ROWS, (tokens,), generator=g)
    table = rope_cos_sin_cache(D, ROWS, 1e6)
    return (x, w, positions, table, qw, kw), dict(qkv_bias=b, **HEADS)


# ------------------------------------------------------------------------------ the table


def test_the_shipped_table_is_the_h200_logs():
    """Written by ``fqr bench --projection --write-dispatch`` on the H200: its entries are what
    ``fqr.bench.projection.dispatch_table`` makes of that run's cells, which are committed
    beside its log (docs/results/projection-h200-issue40-d.json): per bucket the fused kernel
    where the public op's schedule beat cuBLAS + fqr's op at every T measured in it."""
    from fqr.bench.projection import dispatch_table

    doc = json.loads(TABLE_FILE.read_text())
    log = DOCS / "results" / "projection-h200-issue40-d.json"
    assert "projection-h200-issue40-d" in doc["source"]
    rows = json.loads(log.read_text())["rows"]
    derived = dispatch_table(rows, "NVIDIA H200", source="the log")

    def measured(entries) -> list[str]:  # every field but the free-text source
        return sorted(json.dumps({k: v for k, v in e.items() if k != "source"}) for e in entries)

    assert measured(derived["entries"]) == measured(doc["entries"])
    table = load_table()
    for e in table.values():
        assert e.key.device == "NVIDIA H200" and e.key.dtype == torch.bfloat16
        for tokens, pair_us, fused_us in e.measured:  # each choice is its bucket's timings
            if e.choices[bucket_of(tokens)] == "fused":
                assert fused_us is not None and fused_us < pair_us
    assert table_text(doc) == TABLE_FILE.read_text()  # written as table_text writes it


@pytest.mark.parametrize(
    "tokens,bucket",
    [(1, 0), (2, 1), (3, 2), (16, 2), (17, 3), (1024, 3), (1025, 4), (65536, 4)],
)
def test_token_buckets(tokens, bucket):
    assert bucket_of(tokens) == bucket


def test_lookup_and_fallback():
    key = _key()
    with use_table(_table(key)):
        assert [choose(key, t) for t in (1, 16, 17, 5000)] == ["fused", "fused", "pair", "pair"]
        assert choose(key, None) == "fused"  # a dynamic T: some bucket picks it
        # another device, dtype, bias or norm: no entry, the pair (today's behaviour)
        for other in (_key(device="NVIDIA H100"), _key(torch.float16), _key(bias=True),
                      _key(norm="none")):  # fmt: skip
            assert choose(other, 1) == "pair" and choose(other, None) == "pair"
    assert choose(key, 1) == "pair"  # the shipped table again: no CPU entry


def test_a_bucket_picks_the_fused_kernel_only_where_it_won_every_measured_t():
    measured = [(1, 5.0, 4.0), (8, 5.0, 6.0), (16, 5.0, 4.0), (100, 5.0, None)]
    doc = entry_doc(_key(), measured)
    # T = 2 unmeasured; T = 8 lost; T = 100 failed; past 1,024 unmeasured
    assert doc["choice"] == ["fused", "pair", "pair", "pair", "pair"]


# Each row: a change to a valid document, and the text the one error line must contain.
HOSTILE = [
    ("schema", lambda d: d.update(schema="fqr.tuning/3"), "'schema' must be"),
    ("buckets", lambda d: d.update(buckets=[1, 16, None]), "'buckets' must be"),
    ("entries", lambda d: d.update(entries={}), "'entries' must be a list"),
    ("entry", lambda d: d["entries"].append(3), "entries[1] must be an object"),
    ("field", lambda d: d["entries"][0].update(speed=1), "unknown field 'speed'"),
    ("op", lambda d: d["entries"][0].update(op="kv_cache_insert"), "entries[0].op must name"),
    ("dtype", lambda d: d["entries"][0].update(dtype="int8"), "entries[0].dtype must be"),
    ("n bool", lambda d: d["entries"][0].update(n=True), "entries[0].n must be a positive"),
    ("k", lambda d: d["entries"][0].update(k=-4), "entries[0].k must be a positive"),
    ("heads", lambda d: d["entries"][0].update(heads=[3, 1]), "entries[0].heads must be"),
    ("bias", lambda d: d["entries"][0].update(bias="no"), "entries[0].bias must be true"),
    ("device", lambda d: d["entries"][0].update(device=""), "entries[0].device must be"),
    ("choice", lambda d: d["entries"][0].update(choice=["fused"] * 5), "disagrees with its"),
    ("choice word", lambda d: d["entries"][0].update(choice=["fast"] * 5), "'fused' or 'pair'"),
    (
        "us nan",
        lambda d: d["entries"][0]["measured"][0].__setitem__(1, float("nan")),
        "measured[0] must be",
    ),  # fmt: skip
    (
        "us negative",
        lambda d: d["entries"][0]["measured"][0].__setitem__(2, -1.0),
        "measured[0] must be",
    ),  # fmt: skip
    ("t twice", lambda d: d["entries"][0]["measured"].append([1, 2.0, 1.0]), "measured twice"),
    ("key twice", lambda d: d["entries"].append(dict(d["entries"][0])), "in the table twice"),
]


@pytest.mark.parametrize("name,change,needle", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_a_hostile_table_is_refused_in_one_line_naming_the_file(name, change, needle, tmp_path):
    doc = _table(_key())
    change(doc)
    path = tmp_path / "dispatch.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(DispatchTableError) as e:
        load_table(path)
    message = str(e.value)
    assert message.startswith(f"{path}: ") and needle in message, message
    assert "\n" not in message
    with pytest.raises(DispatchTableError), use_table(path):
        pass
    assert choose(_key(), 1) == "pair"  # the table in use is unchanged


@pytest.mark.parametrize(
    "content",
    [b"{", b"\xff\xfe not utf-8", b"[" * 100000 + b"]" * 100000, b"\x1b[31m"],
    ids=["truncated", "bytes", "nested", "escape"],
)
def test_an_unreadable_table_is_one_line_naming_the_file(content, tmp_path):
    path = tmp_path / "dispatch.json"
    path.write_bytes(content)
    with pytest.raises(DispatchTableError) as e:
        load_table(path)
    message = str(e.value)
    assert message.startswith(f"{path}: not a readable JSON document") and "\n" not in message
    assert "\x1b" not in message
    with pytest.raises(DispatchTableError, match="not a readable JSON"):
        load_table(tmp_path)  # a directory


# ---------------------------------------------------------------------------- the dispatch


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_both_paths_against_float64(dtype, bias):
    """The pair: the row rounded once by F.linear, then the prologue op's fused contract (v
    the rounded row's columns); the fused kernel: the fused contract of the float64
    composition (v the product rounded once). Each is the op it names, bit for bit."""
    args, kwargs = _call(dtype, 7 + bias, bias=bias)
    x, w, *rest = args
    b = kwargs["qkv_bias"]
    assert projection.choice_for(OP, *args, **kwargs) == "pair"
    pair = fqr.proj_dispatch(OP, *args, **kwargs)
    row = torch.nn.functional.linear(x, w, b)
    for got, want in zip(pair, fqr.split_qkv_rmsnorm_rope(row, *rest, **HEADS)):
        assert torch.equal(got, want)
    for got, exact in zip(pair[:2], reference.prologue(row, *rest, **HEADS)[:2]):
        assert compare(got, exact, head_dim=D).passed
    assert torch.equal(pair[2], row[:, (HQ + HKV) * D :])
    with use_table(_table(_key(dtype, bias=bias))):
        assert projection.choice_for(OP, *args, **kwargs) == "fused"
        fused = fqr.proj_dispatch(OP, *args, **kwargs)
        op = torch.ops.fqr.split_qkv_rmsnorm_rope_proj_dispatch(*args, b, None, None, **HEADS)
    for got, same, want in zip(fused, op, fqr.split_qkv_rmsnorm_rope_proj(*args, **kwargs)):
        assert torch.equal(got, want) and torch.equal(same, want)
    exact = reference.prologue(reference.project(x, w, b), *rest, **HEADS)
    for got, want in zip(fused, exact):
        assert compare(got, want, head_dim=D).passed


def test_the_torch_op_passes_opcheck():
    args, kwargs = _call(torch.float32, 11)
    b = kwargs.pop("qkv_bias")
    op = torch.ops.fqr.split_qkv_rmsnorm_rope_proj_dispatch.default
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")  # no AOT compile
    torch.library.opcheck(op, (*args, b, None, None, HQ, HKV, D), test_utils=checks)


def test_bad_input_is_refused_before_any_kernel(monkeypatch):
    def no_kernel(*a, **k):
        raise AssertionError("a kernel ran before the checks")

    monkeypatch.setattr(torch.nn.functional, "linear", no_kernel)
    args, kwargs = _call(torch.bfloat16, 3)
    x, w, *rest = args
    with pytest.raises(ValueError, match="w_qkv has K = 47 columns but x has 48"):
        fqr.proj_dispatch(OP, x, w[:, :-1].contiguous(), *rest, **kwargs)
    with pytest.raises(TypeError, match="w_qkv must have x's dtype"):
        fqr.proj_dispatch(OP, x, w.float(), *rest, **kwargs)
    with pytest.raises(ValueError, match="qkv_bias must be"):
        fqr.proj_dispatch(OP, *args, **dict(kwargs, qkv_bias=torch.zeros(3, dtype=x.dtype)))
    with pytest.raises(ValueError, match="op must name a prologue with a projected form"):
        fqr.proj_dispatch("kv_cache_insert", *args, **kwargs)


def test_runs_on_meta():
    """fqr.proj_dispatch on meta tensors: no device name in the table, the pair."""
    args, kwargs = _call(torch.bfloat16, 5)
    meta = [a.to("meta") for a in args]
    q, k, v = fqr.proj_dispatch(OP, *meta, **kwargs)
    assert q.device.type == "meta" and q.shape == (5, HQ * D) and v.shape == (5, HKV * D)


def test_the_docstring_example_runs():
    import doctest

    parser, runner = doctest.DocTestParser(), doctest.DocTestRunner()
    test = parser.get_doctest(fqr.proj_dispatch.__doc__, {}, "fqr.proj_dispatch", None, 0)
    runner.run(test, out=lambda text: print(text, end=""))
    result = runner.summarize(verbose=False)
    assert result.attempted > 0 and result.failed == 0
