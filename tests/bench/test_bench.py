"""``fqr bench`` on a CPU machine: argument handling, the no-GPU error, the traffic model,
the check-before-timing bookkeeping, and the JSON -> table/plot path.

The measuring itself needs a CUDA GPU; here :func:`fqr.bench.run_bench` is driven on CPU with
the ``reference`` backend and a clock that returns fixed times, so that the bookkeeping
(bytes, GB/s, % of ceiling, speed-ups, wrong implementations not timed) is checked exactly.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import fqr_cli.bench as cli_bench  # noqa: F401  (registers the command)
import pytest
import torch
from fqr_cli.app import main

import fqr
import fqr.bench as fb
import fqr.bench.run as bench_run
from fqr import reference
from fqr.bench import report
from fqr.inputs import random_inputs
from fqr.presets import get_preset

REPO = Path(__file__).resolve().parents[2]


def run_cli(monkeypatch, capsys, *args):
    monkeypatch.setattr(sys, "argv", ["fqr", "bench", *args])
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ------------------------------------------------------------------------ argument handling


@pytest.mark.parametrize(
    "args, names",
    [
        (["--preset", "qwen3-9000b"], ["--preset", "qwen3-9000b"]),
        (["--preset", "qwen3-8b,nope"], ["--preset", "nope"]),
        (["--dtype", "bf8"], ["--dtype", "bf8"]),
        (["--dtype", "bf16,int8"], ["--dtype", "int8"]),
        (["--tokens", "1,x,3"], ["--tokens"]),
        (["--tokens", "0,16"], ["--tokens", "0"]),
        (["--tokens", "-4"], ["--tokens"]),
        (["--tokens", ","], ["--tokens"]),
        (["--compare", "eager,tensorrt"], ["--compare", "tensorrt"]),
        (["--numerics", "approx"], ["--numerics"]),
        (["--backend", "nope"], ["backend"]),
        (["--backend", "interpret"], ["--backend", "interpret"]),
        (["--from-json", "/nonexistent/b.json"], ["--from-json"]),
        (["--save", "/nonexistent/dir/b.json"], ["--save"]),
    ],
)
def test_bad_arguments_exit_2_with_one_line(monkeypatch, capsys, args, names):
    monkeypatch.setattr(cli_bench, "run_bench", _must_not_run)
    code, out, err = run_cli(monkeypatch, capsys, *args)
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    for n in names:
        assert n in lines[0]
    assert "Traceback" not in err


def _must_not_run(*a, **k):
    raise AssertionError("the bench started despite bad usage")


def test_no_gpu_is_one_line_and_exit_2_before_any_work(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cli_bench, "run_bench", _must_not_run)
    code, out, err = run_cli(monkeypatch, capsys, "--preset", "qwen3-8b", "--tokens", "1,16")
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "needs a CUDA GPU" in lines[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_no_gpu_from_the_console_entry_point():
    """The real process: ``python -m fqr bench`` on a machine without a GPU."""
    proc = subprocess.run(
        [sys.executable, "-m", "fqr", "bench", "--preset", "qwen3-8b"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and "GPU" in proc.stderr


def test_run_bench_itself_refuses_without_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = fb.BenchConfig([get_preset("qwen3-8b")], [1], [torch.bfloat16])
    with pytest.raises(fb.NoGPU):
        fb.run_bench(cfg)


def test_from_json_does_not_take_measuring_options(monkeypatch, capsys, tmp_path):
    path = tmp_path / "b.json"
    path.write_text(json.dumps(_document(tmp_path, tokens=[2])))
    code, _, err = run_cli(monkeypatch, capsys, "--from-json", str(path), "--preset", "qwen3-8b")
    assert code == 2 and "--preset" in err


# ------------------------------------------------------------------------------ the model


def test_traffic_model_per_head_norm():
    p = get_preset("qwen3-8b")  # 32 q heads, 8 kv heads, D = R = 128
    t = fb.traffic_bytes(p.spec, torch.bfloat16, 1024)
    width = (32 + 2 * 8) * 128
    assert t.qkv_read == t.qkv_written == 1024 * width * 2
    assert t.positions == 1024 * 8
    assert t.cos_sin == 1024 * 128 * 4  # one fp32 table row per token
    assert t.weights == 2 * 128 * 2  # q_norm and k_norm weights, once per call
    assert t.total == 2 * 1024 * width * 2 + 1024 * 8 + 1024 * 128 * 4 + 512


@pytest.mark.parametrize(
    "name, dtype, weight_values, rotary",
    [
        ("olmo2-7b", torch.float16, (32 + 32) * 128, 128),  # full-width norm weights
        ("llama3-8b", torch.float32, 0, 128),  # no QK norm
        ("gemma3-1b", torch.bfloat16, 2 * 256, 256),  # head_dim 256, (1 + w)
        ("glm4-9b", torch.bfloat16, 0, 64),
    ],
)
def test_traffic_model_other_shapes(name, dtype, weight_values, rotary):
    p = get_preset(name)
    elt = {torch.float16: 2, torch.bfloat16: 2, torch.float32: 4}[dtype]
    one, many = fb.traffic_bytes(p.spec, dtype, 1), fb.traffic_bytes(p.spec, dtype, 4096)
    assert one.weights == many.weights == weight_values * elt
    assert one.cos_sin == rotary * 4
    assert one.qkv_read == (p.num_heads + 2 * p.num_kv_heads) * p.head_dim * elt
    # Everything but the weights is per token.
    assert many.total - many.weights == 4096 * (one.total - one.weights)


def test_rotation_sets_overflow_l2():
    l2 = 50 << 20
    for set_bytes in (17_000, 3 << 20, 30 << 20, 60 << 20, 1 << 30):
        n = fb.rotation_sets(set_bytes, l2)
        assert 1 <= n <= fb.MAX_ROTATION_SETS
        assert n * set_bytes >= 2 * l2 or n == fb.MAX_ROTATION_SETS
    assert fb.rotation_sets(1 << 30, l2) == 1
    with pytest.raises(ValueError):
        fb.rotation_sets(0, l2)


def test_check_rows_cover_both_ends():
    g = torch.Generator().manual_seed(0)
    rows = fb.check_row_index(65536, 1024, g, "cpu")
    assert rows.numel() == 1024 and torch.equal(rows, rows.unique())
    assert rows[:64].tolist() == list(range(64))
    assert rows[-64:].tolist() == list(range(65536 - 64, 65536))
    assert torch.equal(fb.check_row_index(100, 1024, g, "cpu"), torch.arange(100))
    assert torch.equal(fb.check_row_index(100, 0, g, "cpu"), torch.arange(100))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tokens=[]), "tokens"),
        (dict(tokens=[0]), "tokens"),
        (dict(dtypes=[torch.int8]), "dtype"),
        (dict(compare=["vllm-cuda"]), "compare"),
        (dict(check_rows=-1), "check_rows"),
        (dict(rep_ms=0), "rep_ms"),
    ],
)
def test_config_validation(kwargs, match):
    base = dict(presets=[get_preset("qwen3-8b")], tokens=[1], dtypes=[torch.bfloat16])
    with pytest.raises(ValueError, match=match):
        fb.BenchConfig(**{**base, **kwargs})


# ------------------------------------------------------- bookkeeping, driven on CPU


class FixedClock:
    """Returns preset times in call order; records what it was asked to time."""

    def __init__(self, kernel_times):
        self.kernel_times = list(kernel_times)
        self.timed = 0

    def kernel_us(self, call, warmup_ms, rep_ms):
        call()
        self.timed += 1
        return self.kernel_times[(self.timed - 1) % len(self.kernel_times)]

    def graph_us(self, call, rep_ms):
        call()
        return 2.5

    def wall_us(self, call, rep_ms):
        call()
        return 12.5

    def dispatch_us(self, call):
        call()
        return 9.0

    def copy_ceiling(self):
        return {"bytes": 4 << 30, "us": 1000.0, "gbps": 4294.967296}


def _config(**kw):
    base = dict(
        presets=[get_preset("qwen3-0.6b")],
        tokens=[1, 300],
        dtypes=[torch.bfloat16],
        compare=["eager"],
        backend="reference",
        check_rows=40,
    )
    return fb.BenchConfig(**{**base, **kw})


def test_bookkeeping_of_a_cpu_run():
    clock = FixedClock([10.0, 30.0])  # fqr, then eager, each cell
    doc = fb.run_bench(_config(), device="cpu", timers=clock)
    assert doc["schema"] == fb.SCHEMA and doc["ok"] is True
    assert [r["tokens"] for r in doc["rows"]] == [1, 300]
    for row in doc["rows"]:
        p = get_preset(row["preset"])
        assert row["bytes"] == fb.traffic_bytes(p.spec, torch.bfloat16, row["tokens"]).total
        fqr, eager = row["impls"]["fqr"], row["impls"]["eager"]
        assert fqr["check"]["passed"] and eager["check"]["passed"]
        assert fqr["check"]["q"]["tolerance"] == "<=1 ulp"  # fused contract for fqr
        assert eager["check"]["numerics"] == "unfused"
        assert fqr["us"] == 10.0 and eager["us"] == 30.0
        assert fqr["gbps"] == pytest.approx(row["bytes"] / 10.0 / 1e3)
        assert fqr["pct_ceiling"] == pytest.approx(100 * fqr["gbps"] / 4294.967296)
        assert row["speedup"] == {"eager": pytest.approx(3.0)}
        small = row["tokens"] <= fb.GRAPH_MAX_TOKENS
        assert fqr["dispatch_us"] == (9.0 if small else None)
        # device and wall time at every T, each with its own % of the ceiling (fqr only)
        assert (fqr["graph_us"], fqr["wall_us"]) == (2.5, 12.5)
        assert fqr["device_pct"] == pytest.approx(100 * row["bytes"] / 2.5 / 1e3 / 4294.967296)
        assert fqr["wall_pct"] == pytest.approx(100 * row["bytes"] / 12.5 / 1e3 / 4294.967296)
        assert eager["graph_us"] is None and eager["wall_us"] is None
        assert "timing_errors" not in fqr
    assert doc["rows"][0]["input_sets"] == fb.MAX_ROTATION_SETS  # tiny sets rotate
    json.dumps(doc)  # the document is plain JSON


def test_a_wrong_implementation_is_reported_not_timed(monkeypatch):
    """An fqr kernel whose q misses the norm fails its check; only the peer gets timed."""
    real = bench_run.fqr_callable

    def broken(preset, cache, backend, numerics):
        run = real(preset, cache, backend, numerics)

        def wrong(x):
            q, k, v = run(x)
            return q * 1.01, k, v

        return wrong

    monkeypatch.setattr(bench_run, "fqr_callable", broken)
    clock = FixedClock([20.0])
    doc = fb.run_bench(_config(tokens=[5]), device="cpu", timers=clock)
    fqr = doc["rows"][0]["impls"]["fqr"]
    assert doc["ok"] is False
    assert fqr["check"]["passed"] is False and fqr["check"]["q"]["bad"] > 0
    assert fqr["check"]["k"]["passed"] and fqr["check"]["v"]["passed"]
    assert fqr["us"] is None and fqr["gbps"] is None
    assert clock.timed == 1  # the eager peer only
    assert doc["rows"][0]["speedup"] == {}
    lines = report.failure_lines(doc)
    assert len(lines) == 1 and lines[0].startswith("fqr qwen3-0.6b bf16 T=5 is wrong")


def test_a_raising_implementation_is_reported(monkeypatch):
    def raising(preset, cache, backend, numerics):
        def run(x):
            raise RuntimeError("kernel launch failed\nsecond line")

        return run

    monkeypatch.setattr(bench_run, "fqr_callable", raising)
    doc = fb.run_bench(_config(tokens=[3]), device="cpu", timers=FixedClock([1.0]))
    fqr = doc["rows"][0]["impls"]["fqr"]
    assert fqr["error"] == "RuntimeError: kernel launch failed" and fqr["us"] is None
    assert doc["ok"] is False


# ------------------------------------------------------------------ JSON -> table / plot


def _document(tmp_path, **kw):
    return fb.run_bench(_config(**kw), device="cpu", timers=FixedClock([10.0, 30.0]))


def test_json_round_trip_table_and_plot(monkeypatch, capsys, tmp_path):
    doc = _document(tmp_path, tokens=[1, 2])  # small cells: the CPU run of 300 tokens is above
    path = tmp_path / "b.json"
    path.write_text(json.dumps(doc))
    png = tmp_path / "b.png"
    code, out, err = run_cli(monkeypatch, capsys, "--from-json", str(path), "--plot", str(png))
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "plot written" in err
    lines = [ln for ln in out.splitlines() if "qwen3-0.6b" in ln]
    assert len(lines) == 4  # one row per cell in the results table, then in the floors table
    gbps = doc["rows"][1]["impls"]["fqr"]["gbps"]
    assert f"{gbps:.0f}" in lines[1] and "3.00" in lines[1]  # GB/s and x eager

    code, out, _ = run_cli(monkeypatch, capsys, "--from-json", str(path), "--json")
    assert code == 0 and json.loads(out) == doc


def test_failed_document_exits_1(monkeypatch, capsys, tmp_path):
    doc = _document(tmp_path, tokens=[2])
    doc["rows"][0]["impls"]["fqr"].update(
        us=None, check=dict(doc["rows"][0]["impls"]["fqr"]["check"], passed=False)
    )
    doc["ok"] = False
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    code, out, err = run_cli(monkeypatch, capsys, "--from-json", str(path))
    assert code == 1
    assert "WRONG" in out and "check failed" in err


def test_merged_runs_keep_their_ceilings(monkeypatch, capsys, tmp_path):
    a, b = _document(tmp_path, tokens=[4]), _document(tmp_path, tokens=[8])
    b["ceiling"] = dict(b["ceiling"], gbps=4000.0)
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    merged = fb.merge_documents([fb.load_document(pa), fb.load_document(pb)])
    assert [r["tokens"] for r in merged["rows"]] == [4, 8]
    assert [r["ceiling_gbps"] for r in merged["rows"]] == [a["ceiling"]["gbps"], 4000.0]
    png = tmp_path / "m.png"
    code, _, err = run_cli(
        monkeypatch, capsys, "--from-json", str(pa), "--from-json", str(pb), "--plot", str(png)
    )
    assert code == 0 and png.exists(), err


def test_plot_without_matplotlib_is_a_clear_message(monkeypatch, capsys, tmp_path):
    path = tmp_path / "b.json"
    path.write_text(json.dumps(_document(tmp_path, tokens=[2])))
    monkeypatch.setattr(
        report, "matplotlib_missing", lambda: "matplotlib is not installed here, so no plot"
    )
    code, _, err = run_cli(
        monkeypatch, capsys, "--from-json", str(path), "--plot", str(tmp_path / "x.png")
    )
    assert code == 2
    assert err.strip().splitlines()[-1] == "error: matplotlib is not installed here, so no plot"
    assert not (tmp_path / "x.png").exists()


def test_not_a_bench_document(monkeypatch, capsys, tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"schema": "fqr-golden/1"}))
    code, _, err = run_cli(monkeypatch, capsys, "--from-json", str(path))
    assert code == 2 and f"not an {fb.SCHEMA} document" in err


# ------------------------------------------- crafted documents and outputs (issue 23: 3, 5)


@pytest.fixture(scope="module")
def saved():
    """A valid document (one cell, the eager peer, a dispatch entry) to craft others from."""
    doc = fb.run_bench(_config(tokens=[2]), device="cpu", timers=FixedClock([10.0, 30.0]))
    doc["dispatch"] = [
        {
            "preset": "qwen3-0.6b",
            "dtype": "bf16",
            "tokens": 1,
            "host_us": {"public op": 20.0, "F.rms_norm": 10.0},
            "x_rms_norm": {"public op": 2.0, "F.rms_norm": 1.0},
        }
    ]
    return doc


def _fqr(doc) -> dict:
    return doc["rows"][0]["impls"]["fqr"]


def _failed(**change):
    """fqr's q check failed, with ``change`` applied to it (None: the key removed)."""

    def craft(doc):
        check = _fqr(doc)["check"]
        q = {**check["q"], "passed": False, "bad": 3, **change}
        check.update(passed=False, q={k: v for k, v in q.items() if v is not None})
        doc["ok"] = False

    return craft


def _set(getter, key, value):
    return lambda doc: getter(doc).__setitem__(key, value)


def _dispatch(**change):
    return lambda doc: doc["dispatch"][0].update(change)


CRAFTED = [
    ("an impl without error", lambda d: _fqr(d).pop("error"), "impls['fqr'] has no 'error'"),
    ("an impl without check", lambda d: _fqr(d).pop("check"), "impls['fqr'] has no 'check'"),
    ("check without passed", lambda d: _fqr(d)["check"].pop("passed"), "check has no 'passed'"),
    (
        "an output's check without passed",
        lambda d: _fqr(d)["check"]["q"].pop("passed"),
        "check['q'] has no 'passed'",
    ),
    ("a failed check without bad", _failed(bad=None), "check['q'] has no 'bad'"),
    ("a failed check's ratio as text", _failed(max_rel_head="big"), "max_rel_head must be"),
    ("a check's error not text", _set(lambda d: _fqr(d)["check"], "error", 5), "check.error"),
    ("timing_errors a list", _set(_fqr, "timing_errors", ["boom"]), "timing_errors must be a"),
    ("timing_errors not text", _set(_fqr, "timing_errors", {"us": 5}), "timing_errors['us']"),
    ("a time of Infinity", _set(_fqr, "us", float("inf")), "impls['fqr'].us must be a number"),
    ("a negative time", _set(_fqr, "graph_us", -1.0), "impls['fqr'].graph_us must be a number"),
    ("speedup as text", _set(lambda d: d["rows"][0], "speedup", {"eager": "3x"}), "speedup["),
    ("tokens zero", _set(lambda d: d["rows"][0], "tokens", 0), "rows[0].tokens must be >= 1"),
    ("dispatch an object", _set(lambda d: d, "dispatch", {"a": 1}), "'dispatch' must be a JSON"),
    ("dispatch entry text", _set(lambda d: d, "dispatch", ["x"]), "dispatch[0] must be a JSON"),
    ("dispatch without host_us", lambda d: d["dispatch"][0].pop("host_us"), "no 'host_us'"),
    ("dispatch without tokens", lambda d: d["dispatch"][0].pop("tokens"), "no 'tokens'"),
    ("dispatch time as text", _dispatch(host_us={"public op": "fast"}), "host_us['public op']"),
    ("dispatch ratios a list", _dispatch(x_rms_norm=[1.0]), "x_rms_norm must be a JSON object"),
    ("schema a list", _set(lambda d: d, "schema", [fb.SCHEMA]), f"not an {fb.SCHEMA} document"),
    ("complete as text", _set(lambda d: d, "complete", "yes"), "'complete' must be true or"),
]


@pytest.mark.parametrize("label,craft,needle", CRAFTED, ids=[c[0] for c in CRAFTED])
def test_a_crafted_document_is_one_error_naming_the_field(
    monkeypatch, capsys, tmp_path, saved, label, craft, needle
):
    """Each ended in a traceback (KeyError, AttributeError, TypeError) or rendered nonsense."""
    doc = json.loads(json.dumps(saved))
    craft(doc)
    path = tmp_path / "crafted.json"
    path.write_text(json.dumps(doc))
    code, out, err = run_cli(monkeypatch, capsys, "--from-json", str(path))
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1, err
    assert lines[0].startswith(f"error: --from-json {path}: ") and needle in lines[0], lines[0]


@pytest.mark.parametrize(
    "data,needle",
    [(b"[" * 100_000, "nested too deeply"), (b'{"schema": "\xff\xfe"}', "not UTF-8")],
    ids=["nested 100000 deep", "not UTF-8"],
)
def test_a_document_that_is_not_json_text_is_one_error(monkeypatch, capsys, tmp_path, data, needle):
    path = tmp_path / "crafted.json"
    path.write_bytes(data)
    code, _, err = run_cli(monkeypatch, capsys, "--from-json", str(path))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and str(path) in lines[0] and needle in lines[0], err


def test_the_shipped_documents_still_load():
    for path in sorted((REPO / "docs" / "results").glob("bench-*.json")):
        assert fb.load_document(path)["rows"], path


def test_document_text_is_shown_as_written(monkeypatch, capsys, tmp_path, saved):
    """Text from a document is never Rich markup (``[/bogus]`` raised MarkupError), never a
    terminal escape sequence, never matplotlib mathtext (``$`` failed to parse)."""
    doc = json.loads(json.dumps(saved))
    doc["environment"]["gpu"] = "[/bogus] $\\frac{ \x1b[2J"
    doc["settings"]["backend"] = "[bold]b"
    doc["rows"][0]["preset"] = "[red]p\x1b]0;pwned\x07"
    _fqr(doc)["timing_errors"] = {"graph_us": "boom [/x] \x1b[31m"}
    eager = doc["rows"][0]["impls"]["eager"]
    eager.update(error="[/red]\x9b31m wrong", us=None)
    doc["ok"] = False
    path, png = tmp_path / "b.json", tmp_path / "b.png"
    path.write_text(json.dumps(doc))
    code, out, err = run_cli(monkeypatch, capsys, "--from-json", str(path), "--plot", str(png))
    assert code == 1, err  # the eager error is a failed check, shown
    assert "[/bogus]" in out and "[bold]b" in out and "[red]p" in out
    assert "boom [/x]" in err and "[/red]" in err
    assert not any(c in out + err for c in "\x1b\x07\x9b")
    assert "\\x1b[2J" in out and "\\x1b[31m" in err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _victim(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    return victim


def test_save_never_writes_through_a_planted_tmp_symlink(tmp_path, saved):
    """``--save P`` wrote a predictable ``P.tmp``: a symlink planted there had its target
    overwritten, then became P. The temporary file is now a fresh random name."""
    victim, path = _victim(tmp_path), tmp_path / "b.json"
    (tmp_path / "b.json.tmp").symlink_to(victim)
    fb.save_document(saved, path)
    assert victim.read_bytes() == b"precious"
    assert not path.is_symlink() and fb.load_document(path) == saved
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.json", "b.json.tmp", "victim"]


@pytest.mark.parametrize("option", ["--save", "--plot"])
def test_a_symlinked_output_is_refused_before_the_bench_runs(monkeypatch, capsys, tmp_path, option):
    victim, link = _victim(tmp_path), tmp_path / "out"
    link.symlink_to(victim)
    monkeypatch.setattr(cli_bench, "run_bench", _must_not_run)
    code, out, err = run_cli(monkeypatch, capsys, "--preset", "qwen3-8b", option, str(link))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"error: {option} {link}: a symlink"), lines[0]
    assert victim.read_bytes() == b"precious" and link.is_symlink()


def test_a_plot_is_never_written_through_a_symlink(monkeypatch, capsys, tmp_path, saved):
    victim, link, path = _victim(tmp_path), tmp_path / "plot.png", tmp_path / "b.json"
    link.symlink_to(victim)
    path.write_text(json.dumps(saved))
    code, _, err = run_cli(monkeypatch, capsys, "--from-json", str(path), "--plot", str(link))
    assert code == 2 and f"--plot {link}: a symlink" in err, err
    assert victim.read_bytes() == b"precious"


def test_check_outputs_catches_dtype_and_nonfinite_outside_the_sample():
    p = get_preset("qwen3-0.6b")
    g = torch.Generator().manual_seed(7)
    x = random_inputs(p.spec, 300, torch.bfloat16, g, p.cos_sin_cache())
    q, k, v = fqr.split_qkv_rmsnorm_rope(*x.args(), **x.kwargs(backend="reference"))
    rows = fb.check_row_index(300, 50, g, "cpu")
    exact = reference.prologue(x.qkv[rows], x.positions[rows], *x.args()[2:], **x.kwargs())
    bf16 = torch.bfloat16
    good = fb.check_outputs((q, k, v), exact, rows, p.spec, "fused", 300, bf16)
    assert good["passed"] and good["rows"] == 50

    wide = fb.check_outputs((q.float(), k, v), exact, rows, p.spec, "fused", 300, bf16)
    assert not wide["passed"] and "expected" in wide["q"]["error"]

    missed = int(next(r for r in range(300) if r not in set(rows.tolist())))
    k_bad = k.clone()
    k_bad[missed, 5] = float("nan")  # a row the sample does not compare
    bad = fb.check_outputs((q, k_bad, v), exact, rows, p.spec, "fused", 300, bf16)
    assert not bad["passed"] and bad["k"]["nonfinite_all_rows"] == 1 and bad["k"]["bad"] == 0


def test_rows_are_saved_as_they_come(tmp_path):
    path = tmp_path / "partial.json"
    seen = []

    def checkpoint(doc):
        fb.save_document(doc, path)
        saved = fb.load_document(path)
        seen.append((len(saved["rows"]), saved["complete"]))

    doc = fb.run_bench(
        _config(tokens=[2, 3]), device="cpu", timers=FixedClock([1.0]), on_row=checkpoint
    )
    assert seen == [(1, False), (2, False)] and doc["complete"] is True
    assert not list(tmp_path.glob("*.tmp"))


# ------------------------------------------------------------------------------ on a GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bench_end_to_end_on_gpu(monkeypatch, capsys, tmp_path):
    """The real thing, small: two presets, decode and prefill sizes, the eager peer."""
    saved = tmp_path / "gpu.json"
    code, out, err = run_cli(
        monkeypatch,
        capsys,
        "--preset",
        "qwen3-0.6b,glm4-9b",
        "--tokens",
        "1,4096",
        "--compare",
        "eager",
        "--rep-ms",
        "20",
        "--json",
        "--save",
        str(saved),
    )
    assert code == 0, err
    doc = json.loads(out)
    assert doc == fb.load_document(saved) and doc["complete"] and doc["ok"]
    assert 500 < doc["ceiling"]["gbps"] < 20_000
    for row in doc["rows"]:
        fqr = row["impls"]["fqr"]
        assert fqr["check"]["passed"] and fqr["us"] > 0 and 0 < fqr["pct_ceiling"] < 150
        assert row["speedup"]["eager"] > 0
        assert fqr["graph_us"] > 0 and 0 < fqr["device_pct"] < 150
        assert fqr["wall_us"] >= fqr["graph_us"] * 0.5 and 0 < fqr["wall_pct"] < 150
        if row["tokens"] == 1:
            assert (
                fqr["graph_us"] > 0 and fqr["dispatch_us"] > 0 and fqr["launcher_dispatch_us"] > 0
            )
    names = {"public op", "torch.ops.fqr", "F.rms_norm", "triton launch"}
    assert [(d["preset"], d["tokens"]) for d in doc["dispatch"]] == [
        (p, t) for p in ("qwen3-0.6b", "glm4-9b") for t in (1, 16, 1024)
    ]
    assert all(
        set(d["host_us"]) == names and min(d["host_us"].values()) > 0 for d in doc["dispatch"]
    )


def test_a_new_measurement_kind_is_one_entry(monkeypatch, capsys, tmp_path):
    """A measurement defined in one place shows up in the document and as a table column."""
    wall = fb.Measurement("sync_us", "sync us", ".1f", lambda timers, call, cfg: call() and 7.0)
    kinds = fb.MEASUREMENTS + (wall,)
    monkeypatch.setattr(bench_run, "MEASUREMENTS", kinds)
    monkeypatch.setattr(report, "MEASUREMENTS", kinds)
    calls = []

    def counted(preset, cache, backend, numerics):
        run = real(preset, cache, backend, numerics)
        return lambda x: calls.append(1) or run(x)

    real = bench_run.fqr_callable
    monkeypatch.setattr(bench_run, "fqr_callable", counted)
    doc = fb.run_bench(_config(tokens=[3]), device="cpu", timers=FixedClock([10.0, 30.0]))
    assert doc["rows"][0]["impls"]["fqr"]["sync_us"] == 7.0
    assert doc["rows"][0]["impls"]["eager"]["sync_us"] == 7.0
    # check + kernel + graph + dispatch + the new one each called fqr at least once
    assert len(calls) >= 5
    table = report.results_table(doc)
    assert ("sync us", "right") in table.columns
    assert table.rows[0][[c for c, _ in table.columns].index("sync us")] == "7.0"


def test_dispatch_table_renders_ratios_and_survives_a_merge(tmp_path):
    """``doc["dispatch"]`` (host µs per call of each entry) renders with each entry's ratio to
    ``F.rms_norm``, and merged runs keep every run's rows."""
    doc = fb.run_bench(_config(tokens=[3]), device="cpu", timers=FixedClock([10.0, 30.0]))
    assert report.dispatch_table(doc) is None  # reference backend: no dispatch table
    host = {"public op": 15.0, "torch.ops.fqr": 20.0, "F.rms_norm": 10.0, "triton launch": 30.0}
    doc["dispatch"] = [
        {
            "preset": "qwen3-0.6b",
            "dtype": "bf16",
            "tokens": 1,
            "host_us": host,
            "x_rms_norm": {k: v / 10.0 for k, v in host.items()},
        }
    ]
    table = report.dispatch_table(doc)
    headers = [c for c, _ in table.columns]
    row = dict(zip(headers[3::2], zip(table.rows[0][3::2], table.rows[0][4::2])))
    assert row["public op us"] == ("15.0", "1.50") and row["torch.ops.fqr us"] == ("20.0", "2.00")
    merged = fb.merge_documents([doc, doc])
    assert len(merged["dispatch"]) == 2


# ------------------------------------------------------------------ floors


class SequenceClock(FixedClock):
    """FixedClock whose graph replays return ``graph_times`` in call order."""

    def __init__(self, graph_times):
        super().__init__([10.0])
        self.graph_times = list(graph_times)
        self.graphed = []

    def graph_us(self, call, rep_ms):
        self.graphed.append(call())
        return self.graph_times.pop(0)


def test_floors_are_measured_beside_the_device_time():
    """fqr's device time, then the same-size copy, the GEMM and GEMM + op, in that order;
    the ratios are taken from those four numbers."""
    clock = SequenceClock([4.0, 3.0, 10.0, 15.0])
    doc = fb.run_bench(_config(tokens=[3], compare=[]), device="cpu", timers=clock)
    row = doc["rows"][0]
    fqr = row["impls"]["fqr"]
    assert row["floors"] == {
        "copy_us": 3.0,
        "copy_by": "copy_",
        "copy_candidates": {"copy_": 3.0},  # on the CPU copy_ is the only candidate
        "gemm_us": 10.0,
        "gemm_op_us": 15.0,
    }
    assert fqr["pct_copy"] == pytest.approx(75.0)
    assert fqr["after_gemm_us"] == pytest.approx(5.0)
    assert fqr["after_gemm_x"] == pytest.approx(1.25)
    assert "floors" not in doc  # the empty kernel is timed on CUDA only
    table = report.floors_table(doc)
    assert table is not None and table.rows[0][3:] == [
        "3.00", "copy_", "4.00", "75.0", "10.00", "15.00", "5.00", "1.25"
    ]  # fmt: skip


def test_the_copy_floor_moves_the_call_bytes_and_the_gemm_feeds_the_op():
    """The copy reads and writes half the call's bytes each, over one buffer pair per input
    set; GEMM + op runs the op on the GEMM's output (as serving runs it): its q is the op's
    q of ``hidden @ weight``."""
    from fqr.bench.floors import copy_calls, copy_pairs, gemm_calls

    pairs = copy_pairs(1 << 20, 3, torch.device("cpu"))
    assert len(pairs) == 3 and all(s.nbytes == d.nbytes == (1 << 20) // 2 for s, d in pairs)
    calls = copy_calls(pairs, torch.device("cpu"))
    assert list(calls) == ["copy_"]  # the SM kernel is a CUDA device's candidate
    seen = {id(calls["copy_"]()) for _ in range(6)}
    assert seen == {id(d) for _, d in pairs}

    preset = get_preset("qwen3-0.6b")
    cfg = _config(tokens=[5], compare=[])
    cache = preset.cos_sin_cache()
    cell = bench_run.make_cell(cfg, preset, torch.bfloat16, 5, cache, {"l2_bytes": 1 << 20},
                               1000.0, torch.device("cpu"))  # fmt: skip
    fqr = bench_run.implementations(cfg, preset, torch.bfloat16, cache, {})[0]
    gemm, gemm_then_op = gemm_calls(cell, fqr, preset.hidden_size, seed=1)
    rows = gemm()
    assert rows.shape == cell.sets[0].qkv.shape and rows.dtype == torch.bfloat16
    assert 0.5 < rows.float().std().item() < 2.0  # unit scale, not zeros
    q, k, v = gemm_then_op()
    x = cell.sets[0]
    want = fqr.call(dataclasses.replace(x, qkv=rows))
    assert torch.equal(q, want[0]) and torch.equal(v, rows[:, -v.shape[1] :])


def test_a_preset_without_hidden_size_names_the_missing_floor():
    preset = dataclasses.replace(get_preset("qwen3-0.6b"), name="custom", hidden_size=0)
    cfg = fb.BenchConfig(presets=[preset], tokens=[2], dtypes=[torch.bfloat16], compare=[],
                         backend="reference", check_rows=0)  # fmt: skip
    doc = fb.run_bench(cfg, device="cpu", timers=FixedClock([10.0]))
    floors = doc["rows"][0]["floors"]
    assert floors["gemm_us"] is None and "hidden_size" in floors["errors"]["gemm_us"]
    assert floors["copy_us"] == 2.5
