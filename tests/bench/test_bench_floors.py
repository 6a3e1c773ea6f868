"""The true copy floor (issue 31.1): the SM copy kernel copies exactly (interpreted on the CPU,
compiled on a GPU; its sm_90 PTX moves 16-byte vectors), the floor is the fastest of the
candidate copies with the winner recorded, a copy slower than fqr is refused as a floor, the
document and the report keep all of it, and ``fqr bench --copy-probe``'s pieces that need no
GPU. Timings come from the tests' clocks: nothing here asserts a time."""

from __future__ import annotations

import json
import os
from pathlib import Path

import fqr_cli.bench as cli_bench
import pytest
import torch
from test_bench import FixedClock, _document, _must_not_run, run_cli
from test_bench_pdl import _cell_and_fqr

import fqr.bench as fb
import fqr.bench.floors as floors_mod
from fqr.bench import report
from fqr.bench.copy_kernel import SETTINGS, CopySetting, as_words, sm_copy, sm_copy_call
from fqr.bench.copy_probe import probe_copies, probe_sizes
from fqr.bench.floors import fastest, measure_floors, not_a_floor
from fqr.presets import get_preset

ROOT = Path(__file__).resolve().parents[2]
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernel = pytest.mark.skipif(
    KERNEL_DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs the copy kernel: on a CPU only under TRITON_INTERPRET=1",
)

# ------------------------------------------------------------------ the SM copy kernel


@needs_kernel
@pytest.mark.parametrize(
    "nbytes",
    [4, 12, 60, 64, 68, 4 * 512, 4 * 512 + 4, 4 * (3 * 512 + 11), 4 * 4097, 50_000],
)
def test_the_sm_copy_kernel_copies_every_byte(gen, nbytes):
    """Whole tiles, a tail shorter than a tile and than a 16-byte vector, sizes below one
    tile; a persistent grid smaller than the tiles, one program per tile, a grid of one.
    The destination starts poisoned, so a byte not written shows."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).to(KERNEL_DEVICE)
    for setting in (CopySetting(512, 4, 1), CopySetting(256, 2, None), CopySetting(128, 1, 2)):
        dst = torch.full_like(src, 0xA5)
        assert sm_copy(dst, src, setting, sm_count=3) is dst
        assert torch.equal(dst.cpu(), src.cpu()), (nbytes, setting)


@needs_kernel
def test_the_sm_copy_kernel_leaves_the_bytes_after_the_destination_alone(gen):
    """A destination that is a view into a larger buffer: nothing past it is written."""
    src = torch.randint(0, 256, (4 * 300,), dtype=torch.uint8, generator=gen).to(KERNEL_DEVICE)
    whole = torch.full((4 * 300 + 64,), 0x5A, dtype=torch.uint8, device=KERNEL_DEVICE)
    sm_copy(whole[: 4 * 300], src, CopySetting(128, 1, None), sm_count=1)
    assert torch.equal(whole[: 4 * 300].cpu(), src.cpu())
    assert bool((whole[4 * 300 :] == 0x5A).all())


def test_the_sm_copy_refuses_what_it_cannot_copy_word_for_word():
    with pytest.raises(ValueError, match="whole int32 words"):
        as_words(torch.zeros(6, dtype=torch.uint8))
    with pytest.raises(ValueError, match="whole int32 words"):
        as_words(torch.zeros(4, 4, dtype=torch.int32).t())
    with pytest.raises(ValueError, match="16 bytes into 32"):
        sm_copy_call(torch.zeros(8, dtype=torch.int32), torch.zeros(4, dtype=torch.int32),
                     SETTINGS[0], 132)  # fmt: skip


def test_copy_settings_name_their_grid():
    persistent, tiles = CopySetting(4096, 8, 4), CopySetting(4096, 8, None)
    assert persistent.name == "sm_copy[16KiB,w8,4/SM]" and tiles.name == "sm_copy[16KiB,w8,tiles]"
    assert persistent.grid(10 * 4096, 132) == 10  # never more programs than tiles
    assert persistent.grid(10**9, 132) == 4 * 132
    assert tiles.grid(10 * 4096 + 1, 132) == 11 and tiles.grid(1, 132) == 1
    assert len({s.name for s in SETTINGS}) == len(SETTINGS)
    for s in SETTINGS:  # 16 bytes per thread per access: a tile is a multiple of 4 words a thread
        assert s.block % (4 * 32 * s.num_warps) == 0


SM90_PTX = """
import re
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import triton
from fqr.bench.copy_kernel import SETTINGS, sm_copy_kernel

for s in SETTINGS:
    source = ASTSource(
        sm_copy_kernel,
        {"src": "*i32", "dst": "*i32", "n": "i32", "BLOCK": "constexpr"},
        constexprs={(3,): s.block},
        attrs={(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]},
    )
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": s.num_warps}).asm["ptx"]
    print(s.name, " ".join(sorted(set(re.findall(r"(?:ld|st)\\.global[.\\w]*", ptx)))))
"""


def test_the_sm_copy_kernel_moves_16_byte_vectors_on_sm90(tmp_path):
    """Compiled for sm_90 as a launch on fresh (16-byte aligned) buffers compiles it: the
    tiles load and store ``v4.b32`` (16 bytes a thread); only the tail is scalar."""
    from support.cuda_ptx import run_compiling

    lines = run_compiling(SM90_PTX, tmp_path).strip().splitlines()
    assert len(lines) == len(SETTINGS)
    for line in lines:
        ops = set(line.split()[1:])
        assert {"ld.global.v4.b32", "st.global.v4.b32"} <= ops, line
        assert not any(".v2." in op for op in ops), line


# ------------------------------------------------------------------ the floor of a cell


class NamedClock(FixedClock):
    """Graph replays answer by what is timed: a copy candidate by its name in ``copies``, the
    GEMM 10, GEMM + op 15; a candidate named in ``broken`` raises."""

    def __init__(self, copies: dict[str, float], broken=()):
        super().__init__([10.0])
        self.copies, self.broken = copies, set(broken)
        self.order: list[str] = []

    def graph_us(self, call, rep_ms):
        name = getattr(call, "copy_name", None)
        self.order.append(name or "other")
        if name in self.broken:
            raise RuntimeError(f"{name} failed")
        call()
        if name is not None:
            return self.copies[name]
        return 10.0 if len(self.order) == len(self.copies) + 1 else 15.0


def _candidates(monkeypatch, names):
    """``copy_calls`` returning one stand-in call per name (each still calls ``copy_``)."""
    real = floors_mod.copy_calls

    def copy_calls(pairs, device):
        base = real(pairs, device)["copy_"]
        calls = {}
        for n in names:
            call = lambda b=base: b()  # noqa: E731
            call.copy_name = n
            calls[n] = call
        return calls

    monkeypatch.setattr(floors_mod, "copy_calls", copy_calls)


def test_the_floor_is_the_fastest_candidate_and_names_it(monkeypatch):
    names = ["copy_", "sm_copy[a]", "sm_copy[b]"]
    _candidates(monkeypatch, names)
    clock = NamedClock({"copy_": 9.0, "sm_copy[a]": 6.5, "sm_copy[b]": 7.0})
    _, cell, fqr = _cell_and_fqr()
    result = {"graph_us": 8.0}
    floors = measure_floors(cell, fqr, result, 20.0, clock, seed=1)
    assert clock.order[:3] == names  # every candidate, before the GEMM
    assert floors["copy_us"] == 6.5 and floors["copy_by"] == "sm_copy[a]"
    assert floors["copy_candidates"] == {"copy_": 9.0, "sm_copy[a]": 6.5, "sm_copy[b]": 7.0}
    assert result["pct_copy"] == pytest.approx(100 * 6.5 / 8.0)
    assert "errors" not in floors


def test_a_candidate_that_fails_is_named_and_the_others_make_the_floor(monkeypatch):
    _candidates(monkeypatch, ["copy_", "sm_copy[a]", "sm_copy[b]"])
    clock = NamedClock({"copy_": 9.0, "sm_copy[b]": 7.0}, broken=["sm_copy[a]"])
    _, cell, fqr = _cell_and_fqr()
    result = {"graph_us": 8.0}
    floors = measure_floors(cell, fqr, result, 20.0, clock, seed=1)
    assert floors["copy_us"] == 7.0 and floors["copy_by"] == "sm_copy[b]"
    assert floors["errors"] == {"sm_copy[a]": "RuntimeError: sm_copy[a] failed"}


def test_a_copy_slower_than_fqr_is_refused_as_a_floor(monkeypatch, tmp_path):
    """No copy_us, no winner, no % copy; the candidates stay as data and the error line says
    why; the document loads and the report shows ``-`` and the line."""
    _candidates(monkeypatch, ["copy_", "sm_copy[a]"])
    clock = NamedClock({"copy_": 595.1, "sm_copy[a]": 600.0})
    _, cell, fqr = _cell_and_fqr()
    result = {"graph_us": 395.0}
    floors = measure_floors(cell, fqr, result, 20.0, clock, seed=1)
    assert floors["copy_us"] is None and "copy_by" not in floors and "pct_copy" not in result
    assert floors["copy_candidates"] == {"copy_": 595.1, "sm_copy[a]": 600.0}
    assert floors["errors"]["copy_us"] == (
        "floor 595.1 us (copy_) slower than fqr's 395.0 us: not a floor"
    )
    assert result["after_gemm_us"] == pytest.approx(5.0)  # the other floors stand

    doc = _document(tmp_path, tokens=[3], compare=[])
    row = doc["rows"][0]
    row["floors"], row["impls"]["fqr"] = floors, {**row["impls"]["fqr"], **result}
    row["impls"]["fqr"].pop("pct_copy", None)
    path = tmp_path / "refused.json"
    path.write_text(json.dumps(doc))
    assert fb.load_document(path) == doc
    table = report.floors_table(doc)
    headers = [h for h, _ in table.columns]
    cells = dict(zip(headers, table.rows[0]))
    assert cells["copy us"] == "-" and cells["% copy"] == "-" and cells["fastest copy"] == "-"
    notes = report.timing_notes(doc)
    assert any("copy_us: floor 595.1 us (copy_) slower" in n for n in notes), notes


def test_equal_is_still_a_floor_and_ties_go_to_the_first():
    assert not_a_floor(5.0, "copy_", 5.0) is None
    assert "not a floor" in not_a_floor(5.01, "copy_", 5.0)
    assert fastest({"copy_": 3.0, "sm_copy[a]": 3.0}) == ("copy_", 3.0)
    assert fastest({}) is None


def test_the_fastest_copy_shows_in_the_floors_table_and_the_ceiling_in_the_title(tmp_path):
    doc = _document(tmp_path, tokens=[3], compare=[])
    doc["rows"][0]["floors"]["copy_by"] = "sm_copy[16KiB,w8,4/SM]"
    doc["ceiling"].update(by="sm_copy[32KiB,w8,2/SM]", candidates={"copy_": 1100.0})
    table = report.floors_table(doc)
    cells = dict(zip([h for h, _ in table.columns], table.rows[0]))
    assert cells["fastest copy"] == "sm_copy[16KiB,w8,4/SM]"
    assert "SM copy kernel" in table.caption
    assert report.results_table(doc).title.endswith("(sm_copy[32KiB,w8,2/SM])")
    doc["ceiling"]["errors"] = {"sm_copy[a]": "CompilationError: x"}
    assert "ceiling sm_copy[a]: CompilationError: x" in report.timing_notes(doc)


@pytest.mark.parametrize(
    "where, key, value",
    [
        ("floors", "copy_candidates", {"copy_": "fast"}),
        ("floors", "copy_candidates", [1.0]),
        ("floors", "copy_by", 3),
        ("ceiling", "candidates", {"copy_": -1.0}),
        ("ceiling", "by", None),
        ("ceiling", "errors", {"sm_copy[a]": 1}),
    ],
)
def test_the_document_checks_the_new_fields(tmp_path, where, key, value):
    doc = _document(tmp_path, tokens=[3], compare=[])
    target = doc["rows"][0]["floors"] if where == "floors" else doc["ceiling"]
    target[key] = value
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=key):
        fb.load_document(path)


def test_a_saved_document_with_a_copy_slower_than_fqr_renders_it_refused():
    """bench-h200-every-variant.json predates the refusal: its qwen3-8b copy at 1,024 tokens
    (graph-replayed copy_) was slower than fqr; the report leaves it out and says why, and
    keeps llama4-scout's 16,384-token copy, which was faster."""
    doc = fb.load_document(ROOT / "docs/results/bench-h200-every-variant.json")
    table = report.floors_table(doc)
    headers = [h for h, _ in table.columns]
    rows = {(r[0], r[2]): dict(zip(headers, r)) for r in table.rows}
    assert rows[("qwen3-8b", "1024")]["copy us"] == "-"
    assert rows[("qwen3-8b", "1024")]["% copy"] == "-"
    assert rows[("llama4-scout", "16384")]["copy us"] == "113.21"
    assert any(
        n.startswith("floors qwen3-8b bf16 T=1024 copy_us: floor") and "not a floor" in n
        for n in report.timing_notes(doc)
    )


# ------------------------------------------------------------------ the copy probe


def test_probe_sizes_cover_the_cell_the_qkv_and_the_rounded_cell_once_each():
    presets = [get_preset(n) for n in ("qwen3-8b", "llama3-8b-qk-rope")]
    sizes = probe_sizes(presets, [4096], torch.device("cpu"))
    qkv = 4096 * 6144 * 2  # both have a 6,144-wide bf16 row; 48 MiB, the rounded cell too
    assert sizes[qkv] == [
        "qwen3-8b T=4096 qkv",
        "qwen3-8b T=4096 cell, 2 MiB",
        "llama3-8b-qk-rope T=4096 qkv",
    ]
    cell = 4 * (fb.traffic_bytes(presets[0].spec, torch.bfloat16, 4096).total // 8)
    assert cell // (2 << 20) * (2 << 20) == qkv
    assert sizes[cell] == ["qwen3-8b T=4096 cell"]
    labels = [label for names in sizes.values() for label in names]
    assert len(labels) == 6 and len(set(labels)) == 6  # every label once
    assert all(n % 4 == 0 and n > 0 for n in sizes)


def test_probe_copies_times_every_method_and_copies_for_real():
    class Clock(FixedClock):
        def __init__(self):
            super().__init__([2.0])
            self.calls = []

        def graph_us(self, call, rep_ms):
            self.calls.append(call())
            return 4.0

    clock = Clock()
    rows = probe_copies({64: ["a", "b"]}, clock, torch.device("cpu"))
    assert rows[0]["labels"] == ["a", "b"] and rows[0]["bytes"] == 64
    assert rows[0]["us"] == {
        "copy_ int32 eager": 2.0,
        "copy_ int32 graph": 4.0,
        "copy_ bf16 eager": 2.0,
        "copy_ bf16 graph": 4.0,
    }  # the SM kernel and the profiler are a CUDA device's
    assert rows[0]["errors"] == {} and rows[0]["activities"] == {}
    assert {t.dtype for t in clock.calls} == {torch.int32, torch.bfloat16}
    doc = {"environment": {"gpu": "x"}, "rows": rows}
    times, seen = report.copy_probe_tables(doc)
    assert len(times.rows) == 4 and times.rows[0][:3] == [
        "a (+1 same size)",
        "0.0",
        "copy_ int32 eager",
    ]
    assert times.rows[0][4] == f"{2 * 64 / 2.0 / 1e3:.0f}" and seen.rows == []


def test_copy_probe_is_its_own_mode(monkeypatch, capsys):
    monkeypatch.setattr(cli_bench, "run_bench", _must_not_run)
    code, out, err = run_cli(monkeypatch, capsys, "--copy-probe", "--from-json", "x.json")
    assert code == 2 and "--copy-probe measures copies; it takes no --from-json" in err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, err = run_cli(monkeypatch, capsys, "--copy-probe")
    assert code == 2 and out == "" and "needs a CUDA GPU" in err


def test_copy_probe_prints_its_tables_and_its_json(monkeypatch, capsys, tmp_path):
    """The CLI's glue, with the measuring stood in (it needs a GPU): the presets and tokens
    reach probe_sizes, the rows come out as tables or as one JSON document."""
    import fqr.bench
    import fqr.bench.copy_probe as probe

    seen = {}

    def sizes(presets, tokens, device):
        seen.update(presets=[p.name for p in presets], tokens=tokens, device=device.type)
        return {64: ["qwen3-8b T=16 cell"]}

    row = {"bytes": 64, "us": {"copy_ int32 graph": 2.0}, "errors": {"sm_copy[a] graph": "E: x"},
           "activities": {"graph": {"Memcpy DtoD (Device -> Device)": 1.5}}}  # fmt: skip
    monkeypatch.setattr(probe, "probe_sizes", sizes)
    monkeypatch.setattr(probe, "probe_copies", lambda s, *a, **k: [{"labels": s[64], **row}])
    monkeypatch.setattr(cli_bench, "require_gpu", lambda: None)
    monkeypatch.setattr(fqr.bench, "environment", lambda device: {"gpu": "H-test"})
    code, out, err = run_cli(monkeypatch, capsys, "--copy-probe", "-p", "qwen3-8b", "-t", "16")
    assert code == 0, err
    assert seen == {"presets": ["qwen3-8b"], "tokens": [16], "device": "cuda"}
    assert "copy probe: H-test" in out and "Memcpy DtoD" in out and "sm_copy[a] graph" in out
    saved = tmp_path / "probe.json"
    code, out, err = run_cli(monkeypatch, capsys, "--copy-probe", "--json", "--save", str(saved))
    doc = json.loads(out)
    assert json.loads(saved.read_text()) == doc
    assert code == 0 and doc["schema"] == "fqr.bench.copy-probe/1"
    assert doc["settings"]["presets"] == ["qwen3-8b", "llama4-scout", "llama3-8b-qk-rope"]
    assert doc["settings"]["tokens"] == [65536] and doc["rows"][0]["us"] == row["us"]


# ------------------------------------------------------------------ on a GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_every_candidate_copies_when_graph_replayed_on_gpu():
    """Each candidate of a cell's floor, captured in a CUDA graph over two buffer pairs,
    copies every byte of both (a tail included); the floor is the fastest."""
    from fqr.bench import CudaTimers
    from fqr.bench.floors import copy_calls, copy_pairs, measure_copy_floor

    device = torch.device("cuda")
    moved = 2 * (4 * 70_001)  # 70,001 words each way: not a whole tile
    pairs = copy_pairs(moved, 2, device)
    calls = copy_calls(pairs, device)
    assert list(calls) == ["copy_", *(s.name for s in SETTINGS)]
    for name, call in calls.items():
        for s, d in pairs:
            s.random_(-(2**31), 2**31 - 1)
            d.fill_(-1)
        graph = torch.cuda.CUDAGraph()
        call()  # compile outside the capture
        with torch.cuda.graph(graph):
            call()
            call()
        for _, d in pairs:
            d.fill_(-1)
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(s, d) for s, d in pairs), name
    floors, errors = measure_copy_floor(moved, 2, device, 5.0, CudaTimers())
    assert errors == {} and set(floors["copy_candidates"]) == set(calls)
    assert floors["copy_us"] == min(floors["copy_candidates"].values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_copy_probe_runs_every_method_on_gpu():
    from fqr.bench import CudaTimers
    from fqr.bench.copy_probe import probe_one

    row = probe_one(4 << 20, CudaTimers(), torch.device("cuda"), rep_ms=5.0, warmup_ms=2.0)
    assert row["errors"] == {}, row["errors"]
    assert len(row["us"]) == 4 + len(SETTINGS)
    assert row["activities"]["eager"] and row["activities"]["graph"]
