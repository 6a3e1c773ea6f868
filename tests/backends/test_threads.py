"""Threads calling the op at once (issue 14, finding 2): Triton's interpreter patches
``triton.language`` and the kernel's globals during a launch, so fqr serialises interpreted
launches; every thread's outputs must match the float64 reference. The reference backend is
race-free by construction (no shared state) and is checked the same way."""

from __future__ import annotations

import threading

import pytest
from conftest import make_problem
from support.contract import assert_contract

import fqr
from fqr.backends import BACKENDS


@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_four_threads_each_get_their_own_correct_outputs(gen, backend):
    if not BACKENDS[backend].available:
        pytest.skip(BACKENDS[backend].unavailable_reason())
    problems = [make_problem(gen, tokens=3 + i, head_dim=64) for i in range(4)]
    for pb in problems:  # trace and load once, so the threads race on launches
        fqr.split_qkv_rmsnorm_rope(*pb.args(), **pb.kwargs(backend=backend))
    results: list = [None] * len(problems)
    errors: list = []
    start = threading.Barrier(len(problems))

    def work(i):
        pb = problems[i]
        try:
            start.wait()
            for _ in range(3):
                results[i] = fqr.split_qkv_rmsnorm_rope(*pb.args(), **pb.kwargs(backend=backend))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"thread {i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(problems))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    for pb, outs in zip(problems, results):
        assert outs[0].shape[0] == pb.qkv.shape[0]
        assert_contract(outs, pb.args(), pb.kwargs())


def test_interpreted_launches_hold_the_interpreter_lock(gen):
    """The lock is what serialises them: a launch waits while another thread holds it."""
    if not BACKENDS["interpret"].available:
        pytest.skip(BACKENDS["interpret"].unavailable_reason())
    from fqr.lowering.loader import INTERPRETER_LOCK

    pb = make_problem(gen, tokens=2, head_dim=64)
    fqr.split_qkv_rmsnorm_rope(*pb.args(), **pb.kwargs(backend="interpret"))
    done = threading.Event()

    def call():
        fqr.split_qkv_rmsnorm_rope(*pb.args(), **pb.kwargs(backend="interpret"))
        done.set()

    with INTERPRETER_LOCK:
        t = threading.Thread(target=call)
        t.start()
        assert not done.wait(1.0), "an interpreted launch ran without the interpreter lock"
    t.join(60)
    assert done.is_set()
