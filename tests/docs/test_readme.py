"""README.md is true as written: what a newcomer reads first, runs, and the figures quoted.

* Every ```` ```python ```` block runs as written, top to bottom in one namespace (a block may use
  what an earlier one defined, as a reader following the page does), on the CPU. A block that
  needs a download is fenced ```` ```python-download ````: the only kind not run.
* Every ```` ```console ```` block is ``$ fqr ...`` followed by the command's stdout, line by
  line (the padding around a line aside).
* The performance table's cells are the figures of the results file it names.
* The page opens with its title, and quotes no hand-written test counts.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```$", re.M | re.S)


def blocks(kind: str) -> list[str]:
    return [body for fence, body in FENCE.findall(README.read_text()) if fence == kind]


def test_readme_opens_with_its_title_and_the_two_commands():
    lines = README.read_text().splitlines()
    assert lines[0].startswith("# fqr"), lines[0]
    first_screen = "\n".join(lines[:40])
    assert "make run" in first_screen and "make test" in first_screen


def test_readme_quotes_no_hand_written_test_counts():
    text = README.read_text()
    stale = re.findall(r"\b\d+ tests (?:pass|skip)|\b\d+ golden cases|\d+-kernel|\d+ min\b", text)
    assert not stale, stale


def test_every_python_block_runs_as_written(capsys):
    code = blocks("python")
    assert len(code) >= 4, "the quickstart's blocks are fenced ```python"
    namespace: dict = {"__name__": "readme"}
    for i, body in enumerate(code):
        try:
            exec(compile(body, f"README.md python block {i + 1}", "exec"), namespace)
        except Exception as e:  # name the block that broke, with its text
            pytest.fail(f"README python block {i + 1} raised {type(e).__name__}: {e}\n{body}")
    printed = capsys.readouterr().out.splitlines()
    # the norm-kind block prints each preset's norm and whether it has weights at all
    assert "olmo2-7b full (3, 4096) False" in printed
    assert "llama3-8b none (3, 4096) True" in printed


def test_only_download_blocks_are_not_run():
    fences = {fence for fence, _ in FENCE.findall(README.read_text())}
    assert fences <= {"python", "python-download", "bash", "console", ""}, fences
    for body in blocks("python"):
        assert "from_pretrained" not in body  # a download: fence it python-download


@pytest.mark.parametrize("index", range(len(blocks("console"))))
def test_console_block_is_the_commands_output(index):
    first, *expected = blocks("console")[index].splitlines()
    assert first.startswith("$ fqr "), first
    env = os.environ | {"COLUMNS": "120", "NO_COLOR": "1", "TERM": "dumb"}
    argv = shlex.split(first[2:])
    r = subprocess.run(
        [sys.executable, "-m", "fqr", *argv[1:]],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    # compared line by line without the padding around them (a table title is centred)
    got = [line.strip() for line in r.stdout.splitlines()]
    assert got == [line.strip() for line in expected], "\n".join(got)


# The README's performance table: its label of each preset, the preset in the results file.
PERF_LABELS = {
    "Qwen3-0.6B": "qwen3-0.6b",
    "Qwen3-8B": "qwen3-8b",
    "Qwen3-32B": "qwen3-32b",
    "Qwen3-235B-A22B": "qwen3-235b-a22b",
    "Gemma 3 27B": "gemma3-27b",
    "GLM-4-9B": "glm4-9b",
    "Qwen3.5-27B (gated mRoPE)": "qwen3.5-27b",
}


def test_performance_table_is_the_results_file():
    text = README.read_text()
    section = text[text.index("## Performance") :]
    section = section[: section.index("\n## ", 1)]
    (source,) = re.findall(r"`(docs/results/[\w.-]+\.json)`", section)
    doc = json.loads((ROOT / source).read_text())
    ceiling = f"{doc['ceiling']['gbps']:,.0f} GB/s"
    assert f"copy ceiling ({ceiling})" in section
    fqr_row = {
        (r["preset"], r["tokens"]): r["impls"]["fqr"] for r in doc["rows"] if r["dtype"] == "bf16"
    }
    rows = [line for line in section.splitlines() if line.startswith("| ") and "µs" not in line]
    assert [row.split(" | ")[0][2:] for row in rows] == list(PERF_LABELS)
    for row in rows:
        label, replay, *pcts = [cell.strip() for cell in row.strip("|").split("|")]
        preset = PERF_LABELS[label]
        decode = [fqr_row[(preset, t)]["graph_us"] for t in (1, 16)]
        assert replay == " / ".join(f"{us:.2f}" for us in decode), label
        want = [f"{fqr_row[(preset, t)]['device_pct']:.1f}%" for t in (1024, 4096, 16384, 65536)]
        assert pcts == want, label
