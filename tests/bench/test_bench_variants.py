"""``fqr bench`` on a variant preset (issue 15, part 4), driven on CPU as tests/bench/test_bench.py
drives split-qkv presets: inputs from the variant's draw, checked against its float64
expectation, fqr = its public op, the eager peer = the model's own unfused chain, traffic = the
bytes of the inputs read and the outputs written."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from test_bench import FixedClock

import fqr.bench as fb
import fqr.bench.variant_cells as variant_cells
from fqr.bench import report
from fqr.presets import get_preset

NAMES = ["gemma4-31b-full", "llama4-scout", "llama4-scout-nope"]


@pytest.fixture(autouse=True)
def small_tables(monkeypatch):
    monkeypatch.setattr(variant_cells, "MAX_TABLE_ROWS", 1 << 12)  # CPU: tables built fast


def _config(preset, **kw):
    base = dict(
        presets=[preset],
        tokens=[1, 6],
        dtypes=[torch.bfloat16],
        compare=["eager", "liger"],
        backend="reference",
        check_rows=4,
    )
    return fb.BenchConfig(**{**base, **kw})


@pytest.mark.parametrize("name", NAMES)
def test_a_variant_preset_runs_through_its_variant(name):
    preset = get_preset(name, 8)
    doc = fb.run_bench(_config(preset), device="cpu", timers=FixedClock([10.0, 40.0]))
    assert doc["ok"] is True, report.failure_lines(doc)
    assert doc["skipped"] == {f"liger/{name}": f"liger has no {preset.variant} chain"}
    for row in doc["rows"]:
        t = row["tokens"]
        s = preset.spec
        ours, eager = row["impls"]["fqr"], row["impls"]["eager"]
        assert set(ours["check"]) >= {"q", "k", "v"} and ours["check"]["passed"]
        assert eager["check"]["numerics"] == "unfused" and eager["check"]["passed"]
        # traffic: the row and positions read, q, k, v written, one table row per token
        # where the variant rotates, the norm weights once
        elt = 2
        rotates = preset.variant != "nope-temperature"
        weights = 2 * s.head_dim * elt if preset.variant == "split-qkv-vnorm" else 0
        want = 2 * t * s.qkv_width * elt + 8 * t + weights
        want += t * s.rotary_dim * 4 if rotates else 0
        assert row["bytes"] == want
        assert row["speedup"] == {"eager": pytest.approx(4.0)}
        assert ours["us"] == 10.0 and ours["graph_us"] == 2.5
    json.dumps(doc)


def test_a_wrong_variant_output_is_reported_not_timed(monkeypatch):
    preset = get_preset("gemma4-31b-sliding", 8)
    real = variant_cells.variant_implementations

    def broken(*args):
        impls = real(*args)
        run = impls[0].call

        def wrong(x):
            q, k, v = run(x)
            return q, k, v * 1.01  # the v norm off by 1%

        impls[0].call = wrong
        return impls

    monkeypatch.setattr(fb.run, "variant_implementations", broken)
    clock = FixedClock([20.0])
    doc = fb.run_bench(_config(preset, tokens=[5]), device="cpu", timers=clock)
    ours = doc["rows"][0]["impls"]["fqr"]
    assert doc["ok"] is False and ours["us"] is None
    assert ours["check"]["v"]["passed"] is False and ours["check"]["q"]["passed"]
    assert clock.timed == 1  # the eager peer only
    (line,) = report.failure_lines(doc)
    assert line.startswith("fqr gemma4-31b-sliding bf16 T=5 is wrong") and "v:" in line


def test_variant_tables_stop_at_max_table_rows():
    assert variant_cells.variant_table(get_preset("llama4-scout")).shape == (1 << 12, 128)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_compile_peer_of_a_variant_on_gpu():
    # torch.compile(fullgraph=True) of the eager chain, token dimension dynamic; the GPU run
    # (on CPU, Inductor's C++ build of the chain alone takes ~30 s of CI time)
    preset = get_preset("llama4-scout", 8)
    cfg = _config(preset, compare=["eager", "compile"], tokens=[3, 300], backend="triton")
    doc = fb.run_bench(cfg, device="cuda", timers=FixedClock([10.0, 30.0, 20.0]))
    assert doc["ok"] is True, report.failure_lines(doc)
    assert all(r["impls"]["compile"]["check"]["passed"] for r in doc["rows"])


@pytest.mark.parametrize("name", ["minimax-m3-fp8", "minimax-m3-kvcache-fp8"])
def test_minimax_presets_bench_and_check_their_caches_whole(name):
    """MiniMax-M3: FP8 outputs (the eager chain's bf16-then-E4M3 under the unfused contract)
    and paged caches, compared whole against the whole call's expectation (the caches are
    not [T, ...] rows)."""
    preset = get_preset(name, 8)
    doc = fb.run_bench(_config(preset, compare=["eager"]), device="cpu", timers=FixedClock([10.0]))
    assert doc["ok"] is True, report.failure_lines(doc)
    if preset.variant != "kv-cache":
        return
    for row in doc["rows"]:
        assert row["impls"]["fqr"]["check"]["key_cache"]["passed"]
    whole = variant_cells.per_call_outputs(variant_cells.variant_of(preset), preset, torch.bfloat16)
    assert whole == {"key_cache", "value_cache"}


@pytest.mark.parametrize("name", ["minimax-m3-kvcache", "minimax-m3-kvcache-fp8"])
def test_a_kv_cache_cell_counts_the_stored_rows_not_the_cache(name, monkeypatch):
    """The paged caches are donated: the op reads none of them and writes one k row and one
    v row per stored slot (padding tokens, slot -1, store nothing), so the bytes of a call
    do not grow with the cache's size. The bench calls the op on the drawn caches in place,
    never through the copying ``run``."""
    preset = get_preset(name, 8)
    s = preset.spec
    cache_elt = 1 if name.endswith("fp8") else 2

    def copying_run(*args, **kwargs):
        raise AssertionError("the bench timed the op on copies of the caches")

    monkeypatch.setattr(type(variant_cells.variant_of(preset)), "run", copying_run)
    doc = fb.run_bench(_config(preset, compare=[]), device="cpu", timers=FixedClock([10.0]))
    assert doc["ok"] is True, report.failure_lines(doc)
    for row in doc["rows"]:
        t = row["tokens"]
        stored = t - len(range(1, t, 3))  # the draw pads every third token from the second
        # the row, int64 positions and slot_mapping, one table row per token, two weights
        read = t * s.qkv_width * 2 + 8 * t + 8 * t + t * s.rotary_dim * 4 + 2 * s.head_dim * 2
        read += 2 * 4 if cache_elt == 1 else 0  # the per-tensor scales of an FP8 cache
        written = t * s.q_size * 2 + 2 * stored * s.kv_size * cache_elt
        assert row["bytes"] == read + written


def test_run_in_place_stores_into_the_given_caches_and_run_into_copies():
    preset = get_preset("minimax-m3-kvcache", 8)
    variant = variant_cells.variant_of(preset)
    table = variant_cells.variant_table(preset)
    inputs = variant.draw(
        preset, 5, torch.bfloat16, torch.Generator().manual_seed(3), max_position=table.shape[0]
    )
    before = inputs["key_cache"].clone()
    _, key_cache, _ = variant.run(preset, inputs, table, backend="reference")
    assert key_cache is not inputs["key_cache"] and torch.equal(inputs["key_cache"], before)
    assert not torch.equal(key_cache, before)
    _, in_place, _ = variant.run_in_place(preset, inputs, table, backend="reference")
    assert in_place is inputs["key_cache"] and torch.equal(in_place, key_cache)


MLA_NAMES = [
    "deepseek-v3",
    "deepseek-v3-fp8",
    "deepseek-v3.2",
    "kimi-k2-q-rope",
    "deepseek-v3-fp8-mla-insert",
    "deepseek-v3.2-mla-insert",
    "deepseek-v3-two-caches",
    "deepseek-v3.2-fp8-q",
    "deepseek-v3-q-rope-fp8",
]


@pytest.mark.parametrize("name", MLA_NAMES)
def test_an_mla_preset_runs_and_checks_its_whole_cache(name):
    """The MLA presets through the bench on CPU: the cache checked whole under its kind (the
    fp8_ds_mla expectation is an entry of another width than the 656-byte cache: it once
    failed as a shape mismatch on the H200) and the eager peer (vLLM's chain) checked too."""
    preset = get_preset(name)
    config = _config(preset, compare=["eager"], tokens=[1, 5])
    doc = fb.run_bench(config, device="cpu", timers=FixedClock([10.0, 40.0]))
    assert doc["ok"] is True, report.failure_lines(doc)
    for row in doc["rows"]:
        for impl in ("fqr", "eager"):
            assert row["impls"][impl]["check"]["passed"]


def _first_preset_of_each_variant() -> list[str]:
    """Each variant's first preset (a variant without one fails as an unknown preset)."""
    from fqr.prologue import VARIANTS, presets_of

    return [(presets_of(v) or [f"<no preset of variant {v}>"])[0] for v in sorted(VARIANTS)]


@pytest.mark.parametrize("name", _first_preset_of_each_variant())
def test_every_variant_has_a_preset_whose_cells_run(name):
    """The bench reaches every member of the family through a preset of its own (issue 22:
    device, wall and dispatch rows for every variant): the cells are drawn, timed and checked
    against float64, whatever the op reads (an op without positions included)."""
    preset = get_preset(name)
    cfg = _config(preset, compare=["eager"], tokens=[3])
    doc = fb.run_bench(cfg, device="cpu", timers=FixedClock([10.0, 40.0]))
    assert doc["ok"] is True, report.failure_lines(doc)
    (row,) = doc["rows"]
    assert row["impls"]["fqr"]["check"]["passed"] and row["bytes"] > 0


@pytest.mark.parametrize("name", _first_preset_of_each_variant())
def test_every_variant_has_dispatch_callables(name, monkeypatch):
    """The dispatch table's four callables are built for every variant (the H200 run refused
    kv-insert's, whose first argument is a ``[T, H, D]`` key); the aten baseline runs here
    and normalises every head of that argument. The CUDA kernel is not loaded on this CPU
    (a process holds Triton compiled or interpreted, not both): a stand-in takes its place."""
    import fqr.lowering

    launched = []
    stand_in = SimpleNamespace(launch=lambda operands, direct: launched.append(operands))
    monkeypatch.setattr(
        fqr.lowering, "lower_by_tokens", lambda program, target: SimpleNamespace(
            kernel_for=lambda tokens: stand_in
        )
    )  # fmt: skip
    preset = get_preset(name)
    variant = variant_cells.variant_of(preset)
    table = variant_cells.variant_table(preset)
    inputs = variant.draw(preset, 3, torch.bfloat16, torch.Generator().manual_seed(0),
                          max_position=table.shape[0])  # fmt: skip
    calls = fb.run.dispatch_callables(preset, torch.bfloat16, "fused", inputs, table)
    assert set(calls) == {"public op", "torch.ops.fqr", "F.rms_norm", "triton launch"}
    first = inputs[variant.declaration.tensor_params[0].name]
    assert calls["F.rms_norm"]().numel() == first.numel()
    calls["triton launch"]()
    assert [len(ops) for ops in launched] == [len(variant.program_args(preset, inputs, table))]


def test_the_gemm_floor_feeds_a_key_of_heads(monkeypatch):
    """kv-insert's first input is a ``[T, H, D]`` key: the GEMM writes ``H * D`` columns per
    token into a buffer of that shape, and GEMM + op inserts that key (the H200 table had
    "too many values to unpack" here)."""
    from fqr.bench.floors import gemm_calls

    monkeypatch.setattr(variant_cells, "MAX_TABLE_ROWS", 1 << 12)
    preset = get_preset("qwen3-8b-kv-insert")
    cfg = fb.BenchConfig(presets=[preset], tokens=[3], dtypes=[torch.bfloat16], compare=[],
                         backend="reference", check_rows=0)  # fmt: skip
    table = variant_cells.variant_table(preset)
    env, cpu = {"l2_bytes": 1 << 20}, torch.device("cpu")
    cell = variant_cells.make_variant_cell(cfg, preset, torch.bfloat16, 3, table, env, 1000.0, cpu)
    fqr = variant_cells.variant_implementations(cfg, preset, torch.bfloat16, table, {})[0]
    key = cell.sets[0]["key"]
    gemm, gemm_then_op = gemm_calls(cell, fqr, preset.hidden_size, seed=3)
    written = gemm()
    assert written.shape == (3, key.shape[1] * key.shape[2])
    assert 0.5 < written.float().std().item() < 2.0  # unit scale, not zeros
    outs = gemm_then_op()
    cache = outs[0]
    slots = cell.sets[0]["slot_mapping"]
    block = cache.shape[1]
    stored = [(t, s) for t, s in enumerate(slots.tolist()) if s >= 0]  # negative: skipped
    assert stored
    for t, slot in stored:
        assert torch.equal(cache[slot // block, slot % block].reshape(-1), written[t]), t
