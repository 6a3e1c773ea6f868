"""``fqr run --launcher torchrun``: one node, two nodes on loopback, OLMo2's TP all-reduce, and a
killed or hung rank ending every rank (torchrun exits non-zero, bounded in time).

Tiny workloads; every torchrun runs in its own session and must leave no process behind.
"""

from __future__ import annotations

import json
import socket
import sys

import pytest
import torch
from support.processes import TINY, assert_clean, check_verified, run_command, spawn

pytestmark = pytest.mark.slow  # multi-process torchrun

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


@pytest.fixture
def seed(gen) -> str:
    return str(int(torch.randint(0, 2**31, (1,), generator=gen)))


def standalone(nproc: int, *args: str, timeout: float = 150.0):
    cmd = [
        *TORCHRUN,
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "-m",
        "fqr",
        "run",
        "--launcher",
        "torchrun",
        "--device",
        "cpu",
        *args,
    ]
    p, out, err, elapsed = run_command(cmd, timeout)
    assert_clean(p.pid, [])
    return p.returncode, out, err, elapsed


def test_single_node_dp2_tp2_verifies(seed):
    rc, out, err, _ = standalone(4, "--dp", "2", "--tp", "2", *TINY, "--seed", seed, "--json")
    assert rc == 0, err
    s = json.loads(out)
    check_verified(s, 4)
    assert s["config"]["launcher"] == "torchrun"
    assert all(r["verification"]["probe_identical"] > 0 for r in s["ranks"][2:])


def test_olmo2_tp4_verifies(seed):
    rc, out, err, _ = standalone(
        4, "--preset", "olmo2-7b", "--tp", "4", *TINY, "--seed", seed, "--json"
    )
    assert rc == 0, err
    s = json.loads(out)
    check_verified(s, 4)
    assert s["config"]["dp"] == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_one_box_olmo2_tp2(seed):
    """Two torchrun invocations (node ranks 0 and 1, two local ranks each) rendezvous on
    loopback; world 4 = dp 2 x tp 2, each TP group spanning one node."""
    port = str(_free_port())
    procs = []
    for node in ("0", "1"):
        cmd = [
            *TORCHRUN,
            "--nnodes",
            "2",
            "--node-rank",
            node,
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            port,
            "-m",
            "fqr",
            "run",
            "--launcher",
            "torchrun",
            "--preset",
            "olmo2-7b",
            "--tp",
            "2",
            *TINY,
            "--seed",
            seed,
            "--json",
        ]
        procs.append(spawn(cmd))
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=180))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_out, err) in zip(procs, outputs):
        assert p.returncode == 0, err
        assert_clean(p.pid, [])
    s = json.loads(outputs[0][0])  # rank 0 (the engine) lives on node 0
    check_verified(s, 4)
    assert outputs[1][0].strip() == ""
    assert s["config"]["dp"] == 2 and s["config"]["tp"] == 2


def test_killed_rank_ends_the_run(seed):
    rc, out, err, elapsed = standalone(
        4,
        "--dp",
        "2",
        "--tp",
        "2",
        "--preset",
        "qwen3-0.6b",
        *TINY,
        "--seed",
        seed,
        "--inject-fault",
        "rank=3,at=step:1,kind=exit",
        "--collective-timeout",
        "10",
        timeout=90,
    )
    assert rc != 0
    assert "rank 3 (dp 1, tp 1): injecting fault exit on rank 3 at step 1" in err
    assert "exitcode  : 17" in err and "rank      : 3" in err  # torchrun's failure report


def test_hung_rank_is_named_after_the_collective_timeout(seed):
    rc, out, err, elapsed = standalone(
        2,
        "--tp",
        "2",
        "--preset",
        "qwen3-0.6b",
        *TINY,
        "--seed",
        seed,
        "--inject-fault",
        "rank=1,at=step:1,kind=hang",
        "--collective-timeout",
        "5",
        timeout=90,
    )
    assert rc != 0
    assert "run failed: step 1:" in err and "Ranks 1 failed to pass monitoredBarrier" in err
