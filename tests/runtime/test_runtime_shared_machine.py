"""The runtime on a shared machine: shared-memory names that cannot collide across PID
namespaces, stale segments of killed runs swept (and live ones kept), no named semaphores left
in /dev/shm, workers deaf to Ctrl-C from their first line."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support.processes import REPO, TINY, assert_clean, session_processes

from fqr.runtime import message_queue
from fqr.runtime.message_queue import MessageQueue

SHM_DIR = Path("/dev/shm")

_CHILD = """
import sys, time
from fqr.runtime.message_queue import MessageQueue
mq = MessageQueue.create(2, n_slots=2, chunk_bytes=256).as_writer()
maps = open("/proc/self/maps").read()
named_sems = sorted({l.split()[5] for l in maps.splitlines() if "/dev/shm/sem." in l})
print(mq.name, *named_sems, flush=True)
time.sleep(600)
"""


def test_same_pid_in_two_namespaces_gets_distinct_segments(monkeypatch):
    """Two runs in different PID namespaces that share /dev/shm (containers with a shared IPC
    namespace) can have the same pid and the same fresh counter: their names must still differ,
    so neither fails with FileExistsError."""
    monkeypatch.setattr(os, "getpid", lambda: 4242)
    queues = []
    try:
        for _ in range(2):  # each "process" starts with fresh module state
            monkeypatch.setattr(message_queue, "_names", itertools.count(), raising=False)
            queues.append(MessageQueue.create(1, n_slots=1, chunk_bytes=64, tag="calls"))
        assert queues[0].name != queues[1].name
    finally:
        for q in queues:
            q.close()


def test_killed_run_leaves_only_a_segment_that_the_next_sweep_removes():
    """SIGKILL of a whole process group leaves its segment (nothing can run at SIGKILL); no
    named semaphore is ever created. A sweep keeps segments of live processes and removes the
    dead one's; it never touches a name that is not fqr's."""
    p = subprocess.Popen(
        [sys.executable, "-c", _CHILD],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    mine = MessageQueue.create(1, n_slots=1, chunk_bytes=64, tag="live")
    foreign = SHM_DIR / f"notfqr_{os.getpid()}_test"
    foreign.write_bytes(b"x")
    try:
        name, *named_sems = p.stdout.readline().split()
        assert named_sems == [], f"named semaphores in /dev/shm: {named_sems}"
        segment = SHM_DIR / name
        assert segment.exists()
        assert name not in message_queue.sweep_stale_segments(min_age_s=0)  # its creator is alive
        assert segment.exists()
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)
        deadline = time.monotonic() + 10
        while session_processes(p.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert segment.exists()  # SIGKILL: left behind
        assert name not in message_queue.sweep_stale_segments(min_age_s=3600)  # too young to judge
        swept = message_queue.sweep_stale_segments(min_age_s=0)
        assert name in swept and not segment.exists()
        assert mine.name not in swept and (SHM_DIR / mine.name).exists()
        assert foreign.exists()
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
        p.stdout.close()
        mine.close()
        foreign.unlink()


def test_queue_works_after_a_sweep_by_another_process():
    """A live queue survives a sweep run by a different process (the lock is per open file,
    not per pid) and still carries messages."""
    mq = MessageQueue.create(1, n_slots=2, chunk_bytes=128, tag="sweepme").as_writer()
    try:
        r = subprocess.run(
            [
                sys.executable,
                "-c",
                "from fqr.runtime.message_queue import sweep_stale_segments as s;"
                "print(' '.join(s(min_age_s=0)))",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr
        assert mq.name not in r.stdout.split()
        reader = MessageQueue(*mq.handle()).as_reader(0)
        mq.enqueue({"x": 1})
        assert reader.dequeue(timeout=5) == {"x": 1}
        reader.close()
    finally:
        mq.close()


def _spawned_workers(parent: int) -> list[int]:
    """PIDs of multiprocessing ``spawn`` children of ``parent`` (the workers, not the resource
    tracker)."""
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        if ppid == parent and "spawn_main" in cmdline:
            pids.append(int(proc.name))
    return pids


def as_from_a_terminal() -> None:
    """The child starts as a shell's foreground command does: SIGINT at its default and not
    blocked, whatever this test process inherited or an earlier test left (an ignored or
    blocked SIGINT passes through exec, and the run would then never see the Ctrl-C)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@pytest.mark.slow
def test_workers_ignore_sigint_while_they_import():
    """Ctrl-C reaches every process of the foreground group; workers importing torch must not
    print KeyboardInterrupt tracebacks: the engine alone handles it and shuts the run down."""
    cmd = [sys.executable, "-m", "fqr", "run", "--preset", "qwen3-0.6b", "--dp", "2", *TINY]
    p = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=as_from_a_terminal,
    )
    try:
        deadline = time.monotonic() + 60
        while len(_spawned_workers(p.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(_spawned_workers(p.pid)) == 2, "workers never started"
        time.sleep(0.3)  # inside their imports
        os.killpg(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert_clean(p.pid, [p.pid])
    assert p.returncode != 0
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


@pytest.mark.slow
def test_workers_sigint_during_startup_is_ignored_and_the_run_completes(capfd):
    """SIGINT sent to the workers alone (not the engine) from the moment they exist: every
    worker still reports READY and the run verifies."""
    from fqr.runtime import Engine, MultiprocExecutor, RunConfig

    cfg = RunConfig.build(preset="qwen3-0.6b", requests=2, prompt_len="4..8", decode_steps=1)
    ex = MultiprocExecutor(cfg)
    stop = threading.Event()
    hit: set[int] = set()

    def interrupt_workers():
        while not stop.is_set():
            for w in _spawned_workers(os.getpid()):
                try:
                    os.kill(w, signal.SIGINT)
                    hit.add(w)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)

    t = threading.Thread(target=interrupt_workers, daemon=True)
    t.start()
    try:
        ex.start()
        stop.set()
        t.join()
        result = Engine(cfg, ex).run()
    finally:
        stop.set()
        ex.shutdown()
    assert hit, "no worker was interrupted"
    assert result.ok and result.verified_steps == result.steps > 0
    err = capfd.readouterr().err
    assert "KeyboardInterrupt" not in err and "Traceback" not in err, err
