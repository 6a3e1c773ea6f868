"""The multiprocess executor: starts the workers, broadcasts calls, collects replies
(vLLM's ``MultiprocExecutor``).

* **Start**: stale shared memory of killed runs is swept
  (:func:`.message_queue.sweep_stale_segments`); a ``TCPStore`` for the rendezvous is hosted
  here (a fresh port is tried when the address is in use), then all ``dp x tp`` workers are
  spawned before waiting on any; each answers on its ready pipe. A startup failure or timeout
  names the rank and the cause. Workers are spawned with SIGINT blocked, so Ctrl-C reaches only
  this process until they ignore it (vLLM's workers leave Ctrl-C to the engine too).
* **Calls**: :meth:`submit` writes the plan to the broadcast ring and returns a ``Future``; a
  collector thread reads every worker's response queue in FIFO order and resolves it. Two calls
  may be in flight (async scheduling).
* **Monitor**: a thread waits on the workers' process sentinels; a worker that dies ends the
  run (its futures fail with a message naming the rank and exit code).
* **Death pipe**: the workers watch its read end; if this process dies, they exit.
* **Shutdown** (idempotent): ``SHUTDOWN`` to the workers and a grace period, then SIGTERM, then
  SIGKILL; queues cancelled, shared memory unlinked.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import multiprocessing as mp
import signal
import socket
import threading
import time
from collections import deque
from concurrent.futures import Future
from multiprocessing.connection import wait as wait_objects

import torch.distributed as dist

from .config import RunConfig
from .message_queue import MessageQueue, QueueCancelled, QueueTimeout, sweep_stale_segments
from .scheduler import StepPlan
from .worker import FAILURE, READY, SHUTDOWN, worker_main


class RunFailed(RuntimeError):
    """The run could not complete (a worker failed, died, hung or timed out)."""


@contextlib.contextmanager
def sigint_blocked():
    """Block SIGINT in this thread for the duration (a Ctrl-C stays pending, not lost). A
    process spawned meanwhile inherits the blocked mask, so Ctrl-C cannot raise
    KeyboardInterrupt in it while it starts and imports; :func:`.worker.worker_main` then
    ignores SIGINT and unblocks it (Ctrl-C is the engine's to handle)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def host_store(world_size: int, timeout_s: float, attempts: int = 5):
    """A master ``TCPStore`` on a free loopback port; a fresh port when it is taken."""
    for attempt in range(attempts):
        port = _free_port()
        try:
            store = dist.TCPStore(
                "127.0.0.1",
                port,
                world_size,
                is_master=True,
                timeout=datetime.timedelta(seconds=timeout_s),
                wait_for_workers=False,
            )
            return store, port
        except (RuntimeError, OSError) as e:
            in_use = getattr(e, "errno", None) == errno.EADDRINUSE or "in use" in str(e).lower()
            if not in_use or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


class MultiprocExecutor:
    def __init__(self, cfg: RunConfig, *, n_slots: int = 8, chunk_bytes: int = 1 << 18):
        self.cfg = cfg
        self.layout = cfg.layout
        self.world_size = self.layout.world_size
        self._ctx = mp.get_context("spawn")
        self._n_slots, self._chunk_bytes = n_slots, chunk_bytes
        self.procs: list = []
        self.ready_info: dict[int, dict] = {}
        self.totals: dict[int, dict] = {}
        self.failure: str | None = None
        self._pending: deque = deque()
        self._pending_cv = threading.Condition()
        self._shutdown_lock = threading.Lock()
        self._stopping = False
        self._closed = False
        self.broadcast = None
        self.responses: list[MessageQueue] = []

    # -- startup ---------------------------------------------------------------------------
    def start(self) -> None:
        cfg = self.cfg
        sweep_stale_segments()  # segments of runs killed by SIGKILL (no cleanup could run)
        self.store, port = host_store(self.world_size, cfg.init_timeout_s)
        self.broadcast = MessageQueue.create(
            self.world_size,
            n_slots=self._n_slots,
            chunk_bytes=self._chunk_bytes,
            tag="calls",
        ).as_writer()
        self.responses = [
            MessageQueue.create(
                1,
                n_slots=self._n_slots,
                chunk_bytes=self._chunk_bytes,
                tag=f"replies{r}",
            ).as_reader(0)
            for r in range(self.world_size)
        ]
        death_read, self._death_write = self._ctx.Pipe(duplex=False)
        ready = []
        try:
            for rank in range(self.world_size):
                ready_read, ready_write = self._ctx.Pipe(duplex=False)
                p = self._ctx.Process(
                    target=worker_main,
                    name=f"fqr-worker-{rank}",
                    daemon=True,
                    args=(
                        cfg,
                        rank,
                        "127.0.0.1",
                        port,
                        self.broadcast,
                        self.responses[rank],
                        ready_write,
                        death_read,
                    ),
                )
                ready.append(ready_read)
                with sigint_blocked():  # inherited: the worker cannot be interrupted before
                    p.start()  # worker_main's first line ignores SIGINT (imports included)
                ready_write.close()
                self.procs.append(p)
            death_read.close()
            self._wait_ready(ready)
        except BaseException as e:  # Ctrl-C included: the workers started so far are ended
            self._fail(str(e) or type(e).__name__)
            self.shutdown()
            raise
        finally:
            for conn in ready:
                conn.close()
        threading.Thread(target=self._monitor, name="fqr-monitor", daemon=True).start()
        threading.Thread(target=self._collect, name="fqr-collector", daemon=True).start()

    def _wait_ready(self, conns) -> None:
        deadline = time.monotonic() + self.cfg.init_timeout_s
        waiting = dict(enumerate(conns))
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                names = ", ".join(self.layout.describe(r) for r in sorted(waiting))
                raise RunFailed(
                    f"{names}: no READY within {self.cfg.init_timeout_s:g} s (--init-timeout)"
                )
            for conn in wait_objects(list(waiting.values()), timeout=left):
                rank = next(r for r, c in waiting.items() if c is conn)
                what = self.layout.describe(rank)
                try:
                    status, info = conn.recv()
                except EOFError:
                    p = self.procs[rank]
                    p.join(timeout=1)
                    raise RunFailed(
                        f"{what} died during startup (exit code {p.exitcode})"
                    ) from None
                if status != READY:
                    raise RunFailed(f"{what} failed during startup: {info}")
                self.ready_info[rank] = info
                del waiting[rank]

    # -- monitor and collector ---------------------------------------------------------------
    def _fail(self, message: str) -> None:
        if self.failure is None:
            self.failure = message
        self._cancel_queues()

    def _cancel_queues(self) -> None:
        for q in [self.broadcast, *self.responses]:
            if q is not None and q.buf is not None:
                q.cancel()

    def _monitor(self) -> None:
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.procs)}
        while sentinels and not self._closed:
            for s in wait_objects(list(sentinels), timeout=0.5):
                rank = sentinels.pop(s)
                if self._closed:  # shutting down: workers are meant to exit
                    return
                p = self.procs[rank]
                p.join(timeout=1)
                self._fail(
                    f"{self.layout.describe(rank)} died unexpectedly (exit code {p.exitcode})"
                )
                with self._pending_cv:
                    self._pending_cv.notify_all()
                return

    def _collect(self) -> None:
        while True:
            with self._pending_cv:
                while not self._pending and not self._stopping and self.failure is None:
                    self._pending_cv.wait(0.5)
                if not self._pending:
                    if self._stopping or self.failure is not None:
                        return
                    continue
                plan, future = self._pending[0]
            try:
                future.set_result(self._gather(plan))
            except BaseException as e:  # noqa: BLE001 - delivered to the waiting engine
                future.set_exception(e)
            with self._pending_cv:
                self._pending.popleft()

    def _gather(self, plan: StepPlan | str) -> dict[int, object]:
        step = "shutdown" if plan == SHUTDOWN else f"step {plan.step}"
        deadline = time.monotonic() + self.cfg.step_timeout_s
        replies, missing = {}, list(range(self.world_size))
        while missing:
            for rank in list(missing):
                try:
                    status, payload = self.responses[rank].dequeue(timeout=0.05)
                except QueueTimeout:
                    continue
                except QueueCancelled:
                    raise RunFailed(self.failure or f"{step}: cancelled") from None
                if status == FAILURE:
                    self._fail(f"{self.layout.describe(rank)} failed at {step}: {payload}")
                    raise RunFailed(self.failure)
                replies[rank] = payload
                missing.remove(rank)
            if missing and time.monotonic() > deadline:
                names = ", ".join(self.layout.describe(r) for r in missing)
                self._fail(
                    f"{names}: no reply to {step} within {self.cfg.step_timeout_s:g} s "
                    f"(--step-timeout; hung?)"
                )
                raise RunFailed(self.failure)
        return replies

    # -- calls -----------------------------------------------------------------------------
    def submit(self, plan: StepPlan) -> Future:
        """Broadcast ``plan``; the future resolves to ``{rank: payload}``."""
        future: Future = Future()
        if self.failure is not None:
            future.set_exception(RunFailed(self.failure))
            return future
        with self._pending_cv:
            self._pending.append((plan, future))
            self._pending_cv.notify_all()
        try:
            self.broadcast.enqueue(plan, timeout=self.cfg.step_timeout_s)
        except (QueueCancelled, QueueTimeout) as e:
            self._fail(self.failure or f"could not send step {plan.step}: {e}")
        return future

    def queue_depths(self) -> list[int]:
        """Calls written to the broadcast ring and not yet taken, per rank."""
        if self.broadcast is None or self.broadcast.buf is None:
            return [0] * self.world_size
        return [self.broadcast.depth(r) for r in range(self.world_size)]

    # -- shutdown --------------------------------------------------------------------------
    def shutdown(self, grace_s: float = 5.0) -> None:
        """Graceful (SHUTDOWN call), then SIGTERM, then SIGKILL. Safe to call twice."""
        with self._shutdown_lock:
            if self._closed:
                return
            self._closed = True
            alive = [p for p in self.procs if p.is_alive()]
            if alive and self.failure is None and self.broadcast is not None:
                future = self.submit(SHUTDOWN)  # type: ignore[arg-type]
                try:
                    self.totals = future.result(timeout=grace_s)
                except Exception:  # noqa: BLE001 - escalate below
                    pass
            self._stopping = True
            if self.failure is not None:
                self._cancel_queues()  # idle workers see it and exit at once
            deadline = time.monotonic() + (grace_s if self.failure is None else 1.0)
            for p in self.procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
            self._cancel_queues()
            for signal_name in ("terminate", "kill"):
                alive = [p for p in self.procs if p.is_alive()]
                for p in alive:
                    getattr(p, signal_name)()
                for p in alive:
                    p.join(timeout=2.0)
            with self._pending_cv:
                self._pending_cv.notify_all()
            if hasattr(self, "_death_write"):
                self._death_write.close()
            for q in [self.broadcast, *self.responses]:
                if q is not None:
                    q.close()
            self.store = None
