"""Helpers for tests that start ``python -m fqr`` processes: run them in their own session,
and check that nothing (process or /dev/shm segment) is left behind."""

from __future__ import annotations

import glob
import os
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = [
    "--requests",
    "3",
    "--prompt-len",
    "4..20",
    "--decode-steps",
    "2",
    "--max-batched-tokens",
    "24",
]


def session_processes(sid: int) -> list[int]:
    """PIDs of live (non-zombie) processes in session ``sid``."""
    pids = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            text = Path(stat).read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(stat.split("/")[2]))
    return pids


def assert_clean(sid: int, shm_pids: list[int], within_s: float = 15.0) -> None:
    """No process of the run's session and no ``fqr_<pid>_*`` segment is left."""
    deadline = time.monotonic() + within_s
    while session_processes(sid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert session_processes(sid) == [], "leftover processes"
    for pid in shm_pids:
        assert glob.glob(f"/dev/shm/fqr_{pid}_*") == [], "leftover shared memory"


def spawn(cmd: list[str]) -> subprocess.Popen:
    """``cmd`` in the repo, in its own session (so that its processes can be found and ended),
    text stdout and stderr piped."""
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def run_command(cmd: list[str], timeout: float) -> tuple[subprocess.Popen, str, str, float]:
    t0 = time.monotonic()
    p = spawn(cmd)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        p.communicate()
        pytest.fail(f"{' '.join(cmd)} did not end within {timeout} s")
    return p, out, err, time.monotonic() - t0


def check_verified(summary: dict, world: int) -> None:
    assert summary["ok"] is True and summary["failure"] is None
    assert summary["verification_failures"] == []
    assert len(summary["ranks"]) == world
    for r in summary["ranks"]:
        v = r["verification"]
        assert r["steps"] == summary["steps"] > 0
        assert v["checks"] > 0 and v["passed"] == v["checks"]
