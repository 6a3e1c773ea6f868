"""The runtime on a shared machine: shared-memory names that cannot collide across PID
namespaces, stale segments of killed runs swept (and live ones kept), no named semaphores left
in /dev/shm, workers deaf to Ctrl-C from their first line."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from support.processes import REPO, session_processes

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
