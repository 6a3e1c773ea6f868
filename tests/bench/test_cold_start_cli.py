"""``fqr bench --cold-start`` on a machine without a GPU: refused with one line before any
process is started or any bundle built (its measurement runs on the GPU: docs/PERFORMANCE.md,
"Cold start")."""

from __future__ import annotations

import os
import sys

import pytest
import torch


@pytest.mark.parametrize(
    "args, line",
    [
        (["--bundle", "/tmp"], "error: --bundle is the kernel bundle of --cold-start"),
        (["--cold-start", "--from-json", "x.json"], "error: --cold-start measures; it takes no"),
        (["--cold-start", "--preset", "nope"], "error: --preset:"),
        (["--cold-start"], "error: fqr bench needs a CUDA GPU"),
    ],
    ids=["bundle-alone", "from-json", "preset", "no-gpu"],
)
def test_cold_start_misuse_is_one_line(args, line, capsys, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("the no-GPU refusal needs a machine without one")
    from fqr_cli.app import main

    monkeypatch.setattr(sys, "argv", ["fqr", "bench", *args])
    with pytest.raises(SystemExit) as e:
        main()
    _, err = capsys.readouterr()
    assert e.value.code == 2
    assert err.count("\n") == 1 and err.startswith(line), err


def test_the_child_reports_every_part_and_the_table_shows_them():
    """Each part of a first call (fqr.bench.cold_start.PARTS) is a key of the fresh process's
    report and a column of the table, in milliseconds."""
    from rich.console import Console

    from fqr.bench.cold_start import _CHILD, PARTS, cold_start_table

    for part in PARTS:
        assert f'"{part}"' in _CHILD or f"{part}=" in _CHILD or f'parts["{part}"]' in _CHILD, part
    mode = {p: (i + 1) / 1000 for i, p in enumerate(PARTS)}
    mode |= {"to_first_result_s": 3.0, "first_call_s": 0.05, "compiled": 0, "loaded": 1}
    console = Console(width=250, record=True)
    console.print(
        cold_start_table([{"preset": "qwen3-8b", "tokens": 1, "modes": {"bundle": mode}}])
    )
    text = console.export_text()
    assert "fqr's part" in text and "bundle open+checks" in text
    row = next(line for line in text.splitlines() if "qwen3-8b" in line)
    cells = [c.strip() for c in row.split("│") if c.strip()]
    assert cells[4 : 4 + len(PARTS)] == [str(i + 1) for i in range(len(PARTS))]


def test_measured_processes_share_a_bytecode_cache_unless_the_caller_chose_one(
    monkeypatch, tmp_path
):
    """A read-only site-packages without bytecode (the GPU image) made every fresh process
    compile Triton's sources: the measured processes share one bytecode cache, the caller's
    ``PYTHONPYCACHEPREFIX`` kept where given."""
    from fqr.bench.cold_start import _bytecode_env

    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    assert _bytecode_env(tmp_path) == {"PYTHONPYCACHEPREFIX": str(tmp_path)}
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", "/elsewhere")
    assert _bytecode_env(tmp_path) == {}


def test_the_warm_up_writes_the_bytecode_the_measured_processes_read(monkeypatch, tmp_path):
    """Under ``PYTHONDONTWRITEBYTECODE`` (set by some images) the shared cache would stay
    empty: the untimed warm-up writes it; only the warm-up drops the variable."""
    import fqr.bench.cold_start as cold

    seen: list[dict] = []
    monkeypatch.setattr(cold, "_spawn", lambda preset, tp, tokens, env, what: seen.append(env))
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    cold._triton_runtime("qwen3-8b", 1, 1, "bundle-dir", tmp_path)
    (env,) = seen
    assert "PYTHONDONTWRITEBYTECODE" not in env
    assert env["PYTHONPYCACHEPREFIX"] == str(tmp_path / "pycache")
    assert os.environ["PYTHONDONTWRITEBYTECODE"] == "1"  # the caller's own untouched
