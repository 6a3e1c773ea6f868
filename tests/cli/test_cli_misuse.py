"""The CLI under misuse (issue 14, findings 5, 9 and 12b): every bad usage or bad input file is
one line on stderr and exit 2, never a traceback; a malformed golden case is a ``corrupt`` row
(exit 1) and ``--json`` still prints one parseable document; ``fqr run`` refuses before any
worker starts. In-process through ``fqr_cli.app.main`` (what ``fqr`` runs), so exit codes and
both streams are what a user sees; one subprocess row checks the real entry point."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.cli import fqr_in_process

from fqr.golden import GOLDEN_DIR, list_cases

REPO = Path(__file__).resolve().parents[2]
CASE = "qwen3-0.6b-bf16-t7-fused"
TINY_RUN = ["run", "--preset", "qwen3-0.6b", "--requests", "2", "--prompt-len", "4..8"]


def fqr(args: list[str], capsys, monkeypatch) -> tuple[int, str, str]:
    return fqr_in_process(args, capsys, monkeypatch)


def _golden_copy(d: Path, mutate=None, manifest: bytes | None = None) -> Path:
    (entry,) = list_cases(pattern=CASE)
    d.mkdir(exist_ok=True)
    shutil.copy(GOLDEN_DIR / entry["file"], d / entry["file"])
    doc = {"format": "fqr-golden/1", "cases": [mutate(dict(entry)) if mutate else entry]}
    (d / "manifest.json").write_bytes(
        manifest if manifest is not None else json.dumps(doc).encode()
    )
    return d


def _bench_doc(d: Path, drop: str | None = None, **change) -> Path:
    doc = {
        "schema": "fqr-bench/1",
        "environment": {"device": "H200"},
        "settings": {},
        "ceiling": {"gbps": 4000.0},
        "rows": [],
        "skipped": {},
        "passed": True,
    }
    doc.update(change)
    doc.pop(drop, None)
    path = d / "bench.json"
    path.write_text(json.dumps(doc))
    return path


def _file(d: Path) -> Path:
    (d / "a-file").write_text("x")
    return d / "a-file"


def _fifo(d: Path) -> Path:
    os.mkfifo(d / "fifo")
    return d / "fifo"


def _planted(d: Path, name: str) -> Path:
    """``d/name``, a symlink to a file that must stay as it is (checked by the test)."""
    victim = d / "victim"
    victim.write_bytes(b"precious")
    (d / name).symlink_to(victim)
    return d / name


# (row id, arguments built in tmp_path, text the one error line must contain)
MISUSE = [
    (
        "run a variant preset",
        lambda d: ["run", "--preset", "qwen3-vl-8b", "--requests", "2", "--prompt-len", "4..8"],
        "runs the 'mrope' variant",
    ),
    ("lower -o a directory", lambda d: ["lower", "--preset", "qwen3-8b", "-o", str(d)], "-o"),
    (
        "lower -o in a missing directory",
        lambda d: ["lower", "--preset", "qwen3-8b", "-o", str(d / "no" / "k.py")],
        "No such file",
    ),
    ("lower -o /dev/full", lambda d: ["lower", "--preset", "qwen3-8b", "-o", "/dev/full"], "space"),
    (
        "golden regen --dir a file",
        lambda d: ["golden", "regen", "--dir", str(_file(d))],
        "not a directory",
    ),
    (
        "golden regen --case nothing",
        lambda d: ["golden", "regen", "--case", "zzz", "--dir", str(d / "new")],
        "zzz",
    ),
    (
        "golden list: manifest not JSON",
        lambda d: ["golden", "list", "--dir", str(_golden_copy(d, manifest=b"{oops"))],
        "manifest.json: not valid JSON",
    ),
    (
        "verify: manifest not JSON",
        lambda d: [
            "verify",
            "--backend",
            "reference",
            "--golden-dir",
            str(_golden_copy(d, manifest=b"{oops")),
        ],
        "manifest.json: not valid JSON",
    ),
    (
        "verify: manifest a list",
        lambda d: ["verify", "--golden-dir", str(_golden_copy(d, manifest=b"[]"))],
        "not a golden manifest",
    ),
    ("verify: no manifest", lambda d: ["verify", "--golden-dir", str(d)], "manifest"),
    (
        "bench --from-json: no rows",
        lambda d: ["bench", "--from-json", str(_bench_doc(d, drop="rows"))],
        "no 'rows'",
    ),
    (
        "bench --from-json: no environment",
        lambda d: ["bench", "--from-json", str(_bench_doc(d, drop="environment"))],
        "no 'environment'",
    ),
    (
        "bench --from-json: a row without impls",
        lambda d: [
            "bench",
            "--from-json",
            str(_bench_doc(d, rows=[{"preset": "x", "dtype": "bf16", "tokens": 1}])),
        ],
        "rows[0]",
    ),
    ("bench --from-json: not JSON", lambda d: ["bench", "--from-json", str(_file(d))], "not JSON"),
    (
        "golden regen into a symlinked case file",
        lambda d: [
            "golden",
            "regen",
            "--case",
            CASE,
            "--dir",
            str(_planted(d, f"{CASE}.safetensors").parent),
        ],
        f"{CASE}.safetensors: a symlink",
    ),
    (
        "lower -o a FIFO",  # a write to it blocked until someone read it
        lambda d: ["lower", "--preset", "qwen3-8b", "-o", str(_fifo(d))],
        "cannot write the kernel source: not a regular file",
    ),
    (
        "lower -o a symlink",
        lambda d: ["lower", "--preset", "qwen3-8b", "-o", str(_planted(d, "k.py"))],
        "cannot write the kernel source: a symlink",
    ),
    ("run --decode-steps -1", lambda d: [*TINY_RUN, "--decode-steps", "-1"], "--decode-steps"),
    # issue 23, finding 8: refused before any worker starts, naming the option that does not fit
    (
        "run --requests 10**12",
        lambda d: [*TINY_RUN[:-4], "--requests", "1000000000000", "--prompt-len", "4..8"],
        "--requests 1000000000000: the engine holds every request",
    ),
    ("run --dp 100000", lambda d: [*TINY_RUN, "--dp", "100000"], "--dp 100000: 100,000 worker"),
    ("run --step-timeout inf", lambda d: [*TINY_RUN, "--step-timeout", "inf"], "--step-timeout"),
    ("run --init-timeout nan", lambda d: [*TINY_RUN, "--init-timeout", "nan"], "--init-timeout"),
    (
        "run: a budget that cannot fit",
        lambda d: [
            "run",
            "--preset",
            "qwen3-8b",
            "--requests",
            "64",
            "--prompt-len",
            "40000",
            "--max-batched-tokens",
            "100000000",
            "--dp",
            "4",
        ],
        "--max-batched-tokens 100000000",
    ),
]

# issue 41: each mode of fqr bench honours or refuses every option (it ignored these), and
# the timing budgets are checked in every mode that times
BENCH_IGNORED = [
    ("--cold-start", "--save", "s.json"),
    ("--cold-start", "--plot", "p.png"),
    ("--cold-start", "--dtype", "fp16"),
    ("--cold-start", "--compare", "eager"),
    ("--cold-start", "--pdl", None),
    ("--cold-start", "--numerics", "unfused"),
    ("--cold-start", "--seed", "3"),
    ("--cold-start", "--rep-ms", "5"),
    ("--copy-probe", "--numerics", "unfused"),
    ("--copy-probe", "--seed", "3"),
    ("--copy-probe", "--check-rows", "0"),
    ("--copy-probe", "--backend", "triton"),  # its default, given: still not taken
    ("--from-json", "--seed", "3"),
    ("--from-json", "--rep-ms", "5"),
    ("--from-json", "--check-rows", "0"),
    ("--from-json", "--numerics", "unfused"),
    # issue 40: --projection times the projected kernel beside cuBLAS + fqr's op
    ("--projection", "--compare", "eager"),
    ("--projection", "--save", "s.json"),
    ("--projection", "--numerics", "unfused"),
    ("--projection", "--pdl", None),
    ("--copy-probe", "--write-dispatch", "d.json"),  # the dispatch table is --projection's
]
MODE_WORDS = {
    "--cold-start": "--cold-start measures",
    "--copy-probe": "--copy-probe measures copies",
    "--projection": "--projection measures the projection and its prologue",
}


def _bench_mode(d: Path, mode: str) -> list[str]:
    return ["bench", mode] if mode != "--from-json" else ["bench", mode, str(_bench_doc(d))]


for _mode, _option, _value in BENCH_IGNORED:
    MISUSE.append(
        (
            f"bench {_mode} {_option}",
            lambda d, m=_mode, o=_option, v=_value: [*_bench_mode(d, m), o, *([v] if v else [])],
            f"{MODE_WORDS.get(_mode, '--from-json renders saved results')}; it takes no {_option}",
        )
    )
for _args, _needle in [
    (["--copy-probe", "--rep-ms", "-5"], "--rep-ms must be a finite number of milliseconds > 0"),
    (["--copy-probe", "--rep-ms", "nan"], "--rep-ms must be a finite number of milliseconds"),
    (["--copy-probe", "--warmup-ms", "0"], "--warmup-ms must be a finite number"),
    (["--copy-probe", "--warmup-ms", "inf"], "--warmup-ms must be a finite number"),
    (["--rep-ms", "inf"], "--rep-ms must be a finite number of milliseconds > 0, got inf"),
    (["--warmup-ms", "nan"], "--warmup-ms must be a finite number of milliseconds > 0"),
    (["--tp", "8"], "the bench table measures; it takes no --tp"),
    (["--projection", "--tp", "3"], "--tp: tp=3 does not divide qwen3-8b's 32 q heads"),
    (["--projection", "--tp", "0"], "--tp: tensor-parallel sizes must be >= 1"),
    (["--projection", "--schedules", "[1]"], "--schedules must be a JSON object of name"),
    (["--projection", "--schedules", "{"], "--schedules: not JSON"),
    (["--projection", "--write-dispatch", "/no/such/dir/d.json"], "--write-dispatch: no such"),
]:
    MISUSE.append((f"bench {' '.join(_args)}", lambda d, a=_args: ["bench", *a], _needle))


@pytest.mark.parametrize("name,make_args,needle", MISUSE, ids=[m[0] for m in MISUSE])
def test_misuse_is_one_line_and_exit_2(name, make_args, needle, tmp_path, capsys, monkeypatch):
    if "/dev/full" in name and not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    code, out, err = fqr(make_args(tmp_path), capsys, monkeypatch)
    assert code == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and needle in lines[0], lines[0]
    assert "Traceback" not in out + err
    victim = tmp_path / "victim"
    assert not victim.exists() or victim.read_bytes() == b"precious"


def test_regen_with_a_pattern_matching_nothing_creates_nothing(tmp_path, capsys, monkeypatch):
    code, _, _ = fqr(
        ["golden", "regen", "--case", "zzz", "--dir", str(tmp_path / "new")], capsys, monkeypatch
    )
    assert code == 2 and not (tmp_path / "new").exists()


def test_a_usage_error_under_json_still_prints_one_document(tmp_path, capsys, monkeypatch):
    code, out, err = fqr(["verify", "--json", "--golden-dir", str(tmp_path)], capsys, monkeypatch)
    assert code == 2
    doc = json.loads(out)
    assert doc["ok"] is False and doc["exit_code"] == 2 and "manifest" in doc["error"]


MALFORMED = [
    ("entry without sha256", lambda e: {k: v for k, v in e.items() if k != "sha256"}),
    ("entry without name", lambda e: {k: v for k, v in e.items() if k != "name"}),
    ("row_stride too small", lambda e: dict(e, row_stride=5)),
    ("file outside the directory", lambda e: dict(e, file="../../../../etc/passwd")),
    ("file absolute", lambda e: dict(e, file="/etc/passwd")),
    ("entry a string", lambda e: "str"),
]


@pytest.mark.parametrize("name,mutate", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_verify_reports_a_malformed_case_as_corrupt_in_one_json_document(
    name, mutate, tmp_path, capsys, monkeypatch
):
    d = _golden_copy(tmp_path / "g", mutate)
    code, out, err = fqr(
        ["verify", "--backend", "reference", "--golden-dir", str(d), "--json"], capsys, monkeypatch
    )
    assert code == 1, err
    doc = json.loads(out)
    (row,) = doc["results"]
    assert row["status"] == "corrupt" and row["detail"]
    assert doc["ok"] is False and doc["counts"]["corrupt"] == 1
    assert "Traceback" not in err and "root:" not in out  # /etc/passwd never read


@pytest.mark.parametrize("name,mutate", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_golden_list_flags_a_malformed_entry(name, mutate, tmp_path, capsys, monkeypatch):
    d = _golden_copy(tmp_path / "g", mutate)
    code, out, err = fqr(["golden", "list", "--dir", str(d), "--json"], capsys, monkeypatch)
    assert code == 1, err
    doc = json.loads(out)
    assert doc["ok"] is False and doc["cases"] == [] and len(doc["corrupt"]) == 1
    assert "corrupt: " in err
    code, out, err = fqr(["golden", "list", "--dir", str(d)], capsys, monkeypatch)
    assert code == 1 and "1 corrupt" in err


def test_the_entry_point_prints_one_line_for_an_os_error(tmp_path):
    """The real ``python -m fqr`` (subprocess), for one row of the table."""
    r = subprocess.run(
        [sys.executable, "-m", "fqr", "lower", "--preset", "qwen3-8b", "-o", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        f"error: -o {tmp_path}: cannot write the kernel source: Is a directory"
    ]


# --------------------------------------- names from files reach no terminal (issue 23, 8)

ESCAPES = "\x1b[2J\x1b]0;pwned\x07\x9b31m"


def _no_control_characters(*texts: str) -> None:
    for text in texts:
        assert not any(c in text for c in "\x1b\x07\x9b"), repr(text)


@pytest.mark.parametrize("json_out", [False, True], ids=["table", "json"])
def test_golden_list_and_verify_never_print_a_case_names_escape_sequences(
    json_out, tmp_path, capsys, monkeypatch
):
    """A case named with terminal escape sequences is corrupt (listed under its place in the
    manifest, the reason quoting the name escaped), the good case beside it still listed and
    verified."""
    (entry,) = list_cases(pattern=CASE)
    d = _golden_copy(tmp_path / "g")
    doc = {"format": "fqr-golden/1", "cases": [dict(entry, name=f"x{ESCAPES}"), entry]}
    (d / "manifest.json").write_text(json.dumps(doc))
    flag = ["--json"] if json_out else []
    code, out, err = fqr(["golden", "list", "--dir", str(d), *flag], capsys, monkeypatch)
    assert code == 1, err
    _no_control_characters(out, err)
    assert "<manifest entry 0>" in err and "control character" in err and "\\x1b[2J" in err
    assert CASE in out
    code, out, err = fqr(
        ["verify", "--backend", "reference", "--golden-dir", str(d), *flag], capsys, monkeypatch
    )
    assert code == 1, err
    _no_control_characters(out, err)
    assert "1 pass" in err and "1 corrupt" in err


def test_an_error_line_never_prints_escape_sequences(tmp_path, capsys, monkeypatch):
    """The one error line quotes what it was given (here a directory name) escaped."""
    code, out, err = fqr(
        ["verify", "--golden-dir", str(tmp_path / f"d{ESCAPES}")], capsys, monkeypatch
    )
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    _no_control_characters(out, err)
    assert "d\\x1b[2J" in err
