"""``fqr run`` end to end with the mp launcher: DP x TP runs that verify, async scheduling,
OLMo2's TP all-reduce, usage errors, and every injected fault kind ending bounded in time with
a message naming the rank, a non-zero exit, no process left and no /dev/shm segment left.

Each run is a real ``python -m fqr run`` in its own session, on a tiny workload (CPU is
scarce); the workload seed comes from the suite's fresh generator.
"""

from __future__ import annotations

import json
import os
import socket
import sys

import pytest
import torch
from support.processes import TINY, assert_clean, check_verified, run_command

pytestmark = pytest.mark.slow  # multi-process fqr run


def fqr_run(*args: str, timeout: float = 150.0):
    """``python -m fqr run ARGS``: (returncode, stdout, stderr); checks nothing is left."""
    p, out, err, _ = run_command([sys.executable, "-m", "fqr", "run", *args], timeout)
    assert_clean(p.pid, [p.pid])
    return p.returncode, out, err


@pytest.fixture
def seed(gen) -> str:
    return str(int(torch.randint(0, 2**31, (1,), generator=gen)))


def test_dp2_tp2_runs_and_verifies(seed):
    rc, out, err = fqr_run(
        "--dp", "2", "--tp", "2", "--device", "cpu", *TINY, "--seed", seed, "--json"
    )
    assert rc == 0, err
    s = json.loads(out)
    assert s["schema"] == "fqr.run/1" and s["ok"] is True
    check_verified(s, 4)
    assert sum(s["requests_per_dp"]) == 3 and min(s["requests_per_dp"]) >= 1
    ranks = s["ranks"]
    assert ranks[0]["tokens"] == ranks[1]["tokens"] and ranks[2]["tokens"] == ranks[3]["tokens"]
    assert ranks[0]["tokens"] + ranks[2]["tokens"] == s["tokens"]
    assert all(r["verification"]["probe_identical"] == s["verified_steps"] for r in ranks[2:])
    assert all(r["memory_bytes"] > 0 and r["pid"] for r in ranks)
    assert "rank 3 (dp 1, tp 1): pid" in err


def test_async_scheduling_keeps_two_batches_in_flight(seed):
    rc, out, err = fqr_run(
        "--dp",
        "2",
        "--tp",
        "1",
        "--async-scheduling",
        "--verify-every",
        "2",
        "--requests",
        "4",
        "--prompt-len",
        "4..16",
        "--decode-steps",
        "3",
        "--max-batched-tokens",
        "8",
        "--seed",
        seed,
        "--json",
    )
    assert rc == 0, err
    s = json.loads(out)
    check_verified(s, 2)
    assert s["steps"] >= 4 and s["verified_steps"] == (s["steps"] + 1) // 2
    sched = s["scheduling"]
    assert sched["async"] is True
    assert 0 < sched["host_overlapped_s"] <= sched["host_s"]


@pytest.mark.parametrize("tp", [2, 4])
def test_olmo2_full_width_norm_over_tp_verifies(tp, seed):
    rc, out, err = fqr_run("--preset", "olmo2-7b", "--tp", str(tp), *TINY, "--seed", seed, "--json")
    assert rc == 0, err
    check_verified(json.loads(out), tp)


def test_table_output_and_usage_errors():
    rc, out, err = fqr_run("--tp", "3")
    assert rc == 2 and "tp=3 does not divide" in err and "Traceback" not in err
    assert err.strip().count("\n") == 0
    rc, out, err = fqr_run("--inject-fault", "rank=4,at=init,kind=raise", "--dp", "2")
    assert rc == 2 and "--inject-fault: rank 4 not in [0, 2)" in err


@pytest.mark.parametrize(
    "fault, extra, message",
    [
        (
            "rank=1,at=init,kind=raise",
            [],
            "rank 1 (dp 0, tp 1) failed during startup: InjectedFault",
        ),
        (
            "rank=1,at=init,kind=hang",
            ["--init-timeout", "6"],
            "rank 1 (dp 0, tp 1): no READY within 6 s",
        ),
        (
            "rank=1,at=step:1,kind=raise",
            [],
            "rank 1 (dp 0, tp 1) failed at step 1: InjectedFault: injected fault (raise on rank 1",
        ),
        ("rank=0,at=step:1,kind=exit", [], "rank 0 (dp 0, tp 0) died unexpectedly (exit code 17)"),
        (
            "rank=1,at=step:1,kind=hang",
            ["--step-timeout", "4"],
            "rank 1 (dp 0, tp 1): no reply to step 1 within 4 s",
        ),
    ],
)
def test_fault_ends_the_run_naming_the_rank(fault, extra, message, seed):
    rc, out, err = fqr_run(
        "--preset",
        "qwen3-0.6b",
        "--tp",
        "2",
        *TINY,
        "--seed",
        seed,
        "--inject-fault",
        fault,
        *extra,
        timeout=90,
    )
    assert rc == 1, err
    assert message in " ".join(err.split()), err


def test_killed_engine_takes_its_workers_down(seed):
    """kill-parent: the engine dies by SIGKILL; the death pipe ends every worker and the
    resource tracker unlinks the shared memory."""
    rc, out, err = fqr_run(
        "--preset",
        "qwen3-0.6b",
        "--dp",
        "2",
        *TINY,
        "--seed",
        seed,
        "--inject-fault",
        "rank=1,at=step:1,kind=kill-parent",
        timeout=90,
    )
    assert rc == -9
    assert "rank 1 (dp 1, tp 0): injecting fault kill-parent" in err
    assert "engine process died; worker exiting" in err


def test_rendezvous_store_takes_a_fresh_port_when_the_address_is_in_use(monkeypatch):
    from fqr.runtime import executor

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    taken = busy.getsockname()[1]
    offered = []
    fresh = executor._free_port

    def offer():
        port = taken if not offered else fresh()
        offered.append(port)
        return port

    monkeypatch.setattr(executor, "_free_port", offer)
    try:
        store, port = executor.host_store(1, timeout_s=5)
    finally:
        busy.close()
    assert offered[0] == taken and port == offered[-1] != taken
    store.set("k", "v")
    assert store.get("k") == b"v"


def test_executor_in_process_shutdown_is_idempotent(seed):
    from fqr.runtime import Engine, MultiprocExecutor, RunConfig

    cfg = RunConfig.build(
        preset="qwen3-0.6b",
        dp=1,
        tp=1,
        requests=2,
        prompt_len="4..8",
        decode_steps=1,
        seed=int(seed),
    )
    ex = MultiprocExecutor(cfg)
    ex.start()
    try:
        names = [q.name for q in [ex.broadcast, *ex.responses]]
        assert all(os.path.exists(f"/dev/shm/{n}") for n in names)
        result = Engine(cfg, ex).run()
        assert result.ok and result.verified_steps == result.steps > 0
    finally:
        ex.shutdown()
    ex.shutdown()
    assert all(not p.is_alive() and p.exitcode == 0 for p in ex.procs)  # graceful: exit 0
    assert ex.totals[0]["tokens"] == result.tokens
    assert not any(os.path.exists(f"/dev/shm/{n}") for n in names)
