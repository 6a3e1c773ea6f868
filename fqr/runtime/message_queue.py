"""A shared-memory ring buffer broadcast queue: one writer, N readers (vLLM's ``MessageQueue``).

Layout of the shared segment (``/dev/shm/<name>``; 2 MiB by default, so many
ranks fit a container's small ``/dev/shm``)::

    [0]                      cancel flag (1 = the queue was cancelled; every wait raises)
    [1]                      writer sleeping flag
    [2 : 2+N]                reader sleeping flags
    then n_slots x (1 + N)   per slot: written flag, then one read flag per reader
    then n_slots x chunk     per slot: 8-byte fragment header (length, last flag) + data

The writer fills slot ``i`` only when it is free (never written, or read by every reader):
it copies the data, clears the read flags, then sets the written flag. Reader ``r`` takes slot
``i`` when it is written and its own read flag is clear, copies it out, and sets its flag.
Writer and readers walk the slots in the same round-robin order, so messages arrive in order.
A payload larger than one chunk takes the **overflow path**: it is split into fragments over
consecutive slots (the last one flagged), so it streams through a ring of any size.

Waiting: spin (``os.sched_yield``) for ``spin_s``, then block on a :class:`Doorbell` that the
other side rings when it sees the sleeping flag (a bounded wait, so a missed ring costs at most
``block_s``). A writer that finds no free slot for ``warn_every_s`` logs a warning (a slow or
dead reader). :meth:`cancel` makes every current and future wait raise :class:`QueueCancelled`
(shutdown). The creator owns the segment and unlinks it in :meth:`close`.

Shared machines: the segment is named ``fqr_<pid>_<random token>_<tag>``; the token (random, as
vLLM's and Python's own segment names) keeps runs in different PID namespaces that share
``/dev/shm`` apart, the pid is only there for a person reading ``/dev/shm``. Every process that
maps the segment holds a shared ``flock`` on it for as long as it does, so "no process uses it"
is a question the kernel answers, across PID namespaces and after SIGKILL;
:func:`sweep_stale_segments` removes this user's ``fqr_`` segments that nobody holds (a run
killed with SIGKILL, where no cleanup can run). The doorbells are pipes: they have no name, so a
killed run leaves nothing else behind.
"""

from __future__ import annotations

import fcntl
import logging
import os
import pickle
import secrets
import select
import stat
import struct
import time
from multiprocessing import reduction, shared_memory
from pathlib import Path

log = logging.getLogger("fqr.runtime")

_FRAG = struct.Struct("<IB3x")  # fragment length, last-fragment flag
SEGMENT_PREFIX = "fqr_"
SHM_DIR = Path("/dev/shm")  # where POSIX shared memory appears as files (Linux)


class QueueCancelled(RuntimeError):
    """The queue was cancelled (the run is shutting down)."""


class QueueTimeout(TimeoutError):
    """A read or write did not complete within its timeout."""


def segment_name(tag: str) -> str:
    """``fqr_<pid>_<token>_<tag>``: a fresh 64-bit random token per segment (a pid alone
    repeats across PID namespaces); the creator still opens it exclusively and retries."""
    return f"{SEGMENT_PREFIX}{os.getpid()}_{secrets.token_hex(8)}_{tag}"


class Doorbell:
    """A wake-up call between processes: a non-blocking pipe, so it has no name to leave in
    ``/dev/shm``. :meth:`ring` never blocks (a full pipe already wakes the sleeper);
    :meth:`wait` returns when rung or at the timeout and clears the rings it found. It travels
    to spawned processes as ``Process`` arguments (the fds are passed, as for ``Pipe``)."""

    def __init__(self, fds: tuple[int, int] | None = None):
        if fds is None:
            fds = os.pipe()
            for fd in fds:
                os.set_blocking(fd, False)
        self._read_fd, self._write_fd = fds

    def ring(self) -> None:
        try:
            os.write(self._write_fd, b"\0")
        except (BlockingIOError, BrokenPipeError):
            pass  # full: the sleeper will wake anyway; broken: nobody is left to wake

    def wait(self, timeout: float) -> bool:
        poller = select.poll()  # per call: a poll object is not shareable between threads
        poller.register(self._read_fd, select.POLLIN)
        rung = bool(poller.poll(max(0, int(timeout * 1000))))
        if rung:
            try:
                while os.read(self._read_fd, 4096):
                    pass
            except BlockingIOError:
                pass
        return rung

    def close(self) -> None:
        for fd in (self._read_fd, self._write_fd):
            try:
                os.close(fd)
            except OSError:
                pass
        self._read_fd = self._write_fd = -1

    def __reduce__(self):
        return _rebuild_doorbell, (reduction.DupFd(self._read_fd), reduction.DupFd(self._write_fd))


def _rebuild_doorbell(read_fd, write_fd) -> Doorbell:
    return Doorbell((read_fd.detach(), write_fd.detach()))


def _hold(name: str) -> int | None:
    """Open ``/dev/shm/<name>`` and take a shared lock on it for this process's lifetime of the
    mapping (released by :func:`os.close` or by the process's death, even SIGKILL)."""
    try:
        fd = os.open(SHM_DIR / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None  # no /dev/shm (not Linux): nothing to sweep there either
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def sweep_stale_segments(min_age_s: float = 60.0) -> list[str]:
    """Unlink this user's ``fqr_`` segments in ``/dev/shm`` that no process holds, and that are
    older than ``min_age_s`` (a segment is locked right after it is created; the age covers
    that instant and segments of older fqr versions, which did not lock). Returns the names.

    Safe on a shared ``/dev/shm``: liveness is the kernel's lock state (no pid is compared,
    so PID namespaces cannot fool it), and only regular files owned by this user are touched.
    """
    swept: list[str] = []
    try:
        entries = list(os.scandir(SHM_DIR))
    except OSError:
        return swept
    now = time.time()
    for entry in entries:
        if not entry.name.startswith(SEGMENT_PREFIX):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            continue
        if now - max(st.st_mtime, st.st_ctime) < min_age_s:
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(entry.path)  # under the lock: nobody can attach to it by name any more
            swept.append(entry.name)
        except OSError:
            pass  # held: a live run (or gone already)
        finally:
            os.close(fd)
    if swept:
        log.warning(
            "removed %d shared-memory segment(s) of dead fqr runs: %s", len(swept), ", ".join(swept)
        )
    return swept


class MessageQueue:
    """Broadcast ring. Build with :meth:`create` in the owning process; pass the object to
    spawned processes as a ``Process`` argument (it pickles to a handle); there call
    :meth:`as_writer` or :meth:`as_reader` once. ``MessageQueue(*q.handle())`` attaches a
    second handle in the same process."""

    def __init__(
        self,
        name: str,
        n_readers: int,
        n_slots: int,
        chunk_bytes: int,
        reader_bells: list[Doorbell],
        writer_bell: Doorbell,
        *,
        create: bool = False,
    ):
        if n_readers < 1 or n_slots < 1:
            raise ValueError(f"n_readers and n_slots must be >= 1, got {n_readers}, {n_slots}")
        if chunk_bytes <= _FRAG.size:
            raise ValueError(f"chunk_bytes must exceed {_FRAG.size}, got {chunk_bytes}")
        self.name, self.n_readers, self.n_slots, self.chunk_bytes = (
            name,
            n_readers,
            n_slots,
            chunk_bytes,
        )
        self.reader_bells, self.writer_bell = reader_bells, writer_bell
        self._meta_off = 2 + n_readers
        self._data_off = self._meta_off + n_slots * (1 + n_readers)
        size = self._data_off + n_slots * chunk_bytes
        self._owner = self._owns_bells = create
        if create:
            self._shm = shared_memory.SharedMemory(name=name, create=True, size=size)
            self._held = _hold(name)
            self._shm.buf[: self._data_off] = bytes(self._data_off)
        else:
            self._shm = shared_memory.SharedMemory(name=name)
            self._held = _hold(name)
        self.buf = self._shm.buf
        self._slot = 0
        self._reader = None
        self.spin_s, self.block_s, self.warn_every_s = 0.002, 0.05, 10.0

    @classmethod
    def create(
        cls, n_readers: int, *, n_slots: int = 8, chunk_bytes: int = 1 << 18, tag: str = "mq"
    ) -> MessageQueue:
        for attempt in range(8):
            try:
                return cls(
                    segment_name(tag),
                    n_readers,
                    n_slots,
                    chunk_bytes,
                    [Doorbell() for _ in range(n_readers)],
                    Doorbell(),
                    create=True,
                )
            except FileExistsError:  # a 1-in-2^64 draw; never reuse someone else's segment
                if attempt == 7:
                    raise
        raise AssertionError("unreachable")

    def handle(self) -> tuple:
        """The constructor arguments that attach another handle to this queue."""
        return (
            self.name,
            self.n_readers,
            self.n_slots,
            self.chunk_bytes,
            self.reader_bells,
            self.writer_bell,
        )

    def __reduce__(self):
        return _unpickle_queue, self.handle()

    # -- roles -----------------------------------------------------------------------------
    def as_writer(self) -> MessageQueue:
        self._reader = None
        return self

    def as_reader(self, index: int) -> MessageQueue:
        if not 0 <= index < self.n_readers:
            raise ValueError(f"reader index must be in [0, {self.n_readers}), got {index}")
        self._reader = index
        return self

    # -- flags -----------------------------------------------------------------------------
    def _written_at(self, slot: int) -> int:
        return self._meta_off + slot * (1 + self.n_readers)

    def _read_at(self, slot: int, reader: int) -> int:
        return self._written_at(slot) + 1 + reader

    @property
    def cancelled(self) -> bool:
        return self.buf[0] == 1

    def cancel(self) -> None:
        """Make every wait on this queue (any process) raise :class:`QueueCancelled`."""
        self.buf[0] = 1
        for bell in self.reader_bells + [self.writer_bell]:
            bell.ring()

    def depth(self, reader: int) -> int:
        """Messages (fragments) written and not yet read by ``reader``."""
        return sum(
            1
            for s in range(self.n_slots)
            if self.buf[self._written_at(s)] == 1 and self.buf[self._read_at(s, reader)] == 0
        )

    def _slot_free(self, slot: int) -> bool:
        if self.buf[self._written_at(slot)] == 0:
            return True
        return all(self.buf[self._read_at(slot, r)] == 1 for r in range(self.n_readers))

    def _slot_ready(self, slot: int) -> bool:
        return (
            self.buf[self._written_at(slot)] == 1
            and self.buf[self._read_at(slot, self._reader)] == 0
        )

    def _wait(
        self,
        ready,
        sleeping_at: int,
        bell: Doorbell,
        timeout: float | None,
        what: str,
        warn: bool = False,
    ) -> None:
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        next_warning = start + self.warn_every_s
        while True:
            if self.cancelled:
                raise QueueCancelled(f"message queue {self.name} was cancelled")
            if ready():
                return
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise QueueTimeout(f"{what} for {timeout:g} s")
            if warn and now >= next_warning:
                log.warning(
                    "%s: no free slot for %.0f s (a reader is slow or gone)", self.name, now - start
                )
                next_warning = now + self.warn_every_s
            if now - start < self.spin_s:
                os.sched_yield()
                continue
            self.buf[sleeping_at] = 1
            try:
                if not ready() and not self.cancelled:
                    wait = (
                        self.block_s
                        if deadline is None
                        else max(0.0, min(self.block_s, deadline - now))
                    )
                    bell.wait(wait)
            finally:
                self.buf[sleeping_at] = 0

    # -- writer ----------------------------------------------------------------------------
    def enqueue(self, obj, timeout: float | None = None) -> None:
        """Broadcast ``obj`` (pickled) to every reader; fragments over slots when large."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self.enqueue_bytes(data, timeout)

    def enqueue_bytes(self, data: bytes, timeout: float | None = None) -> None:
        if self._reader is not None:
            raise RuntimeError("enqueue on a reader handle")
        room = self.chunk_bytes - _FRAG.size
        view = memoryview(data)
        offsets = range(0, max(len(data), 1), room)
        for i, off in enumerate(offsets):
            part = view[off : off + room]
            slot = self._slot
            # The timeout covers the first fragment; a started message is finished (or cancelled).
            self._wait(
                lambda slot=slot: self._slot_free(slot),
                1,
                self.writer_bell,
                timeout if i == 0 else None,
                f"no free slot in {self.name}",
                warn=True,
            )
            base = self._data_off + slot * self.chunk_bytes
            _FRAG.pack_into(self.buf, base, len(part), i == len(offsets) - 1)
            self.buf[base + _FRAG.size : base + _FRAG.size + len(part)] = part
            for r in range(self.n_readers):
                self.buf[self._read_at(slot, r)] = 0
            self.buf[self._written_at(slot)] = 1
            for r in range(self.n_readers):
                if self.buf[2 + r]:
                    self.reader_bells[r].ring()
            self._slot = (slot + 1) % self.n_slots

    # -- reader ----------------------------------------------------------------------------
    def dequeue(self, timeout: float | None = None):
        """The next message, in order. Raises QueueTimeout / QueueCancelled."""
        return pickle.loads(self.dequeue_bytes(timeout))

    def dequeue_bytes(self, timeout: float | None = None) -> bytes:
        if self._reader is None:
            raise RuntimeError("dequeue on a writer handle (call as_reader first)")
        r = self._reader
        deadline = None if timeout is None else time.monotonic() + timeout
        parts = []
        while True:
            slot = self._slot
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if parts:
                left = None  # a started message is read to its end (or cancelled)
            self._wait(
                lambda slot=slot: self._slot_ready(slot),
                2 + r,
                self.reader_bells[r],
                left,
                f"no message in {self.name}",
            )
            base = self._data_off + slot * self.chunk_bytes
            length, last = _FRAG.unpack_from(self.buf, base)
            parts.append(bytes(self.buf[base + _FRAG.size : base + _FRAG.size + length]))
            self.buf[self._read_at(slot, r)] = 1
            if self.buf[1]:
                self.writer_bell.ring()
            self._slot = (slot + 1) % self.n_slots
            if last:
                return b"".join(parts)

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Detach; the creator also unlinks the segment. Safe to call twice. The doorbells close
        with the handle that made or received them (not with a :meth:`handle` attached beside
        it, which shares them)."""
        if self._shm is None:
            return
        self.buf = None
        shm, self._shm = self._shm, None
        try:
            shm.close()
        except BufferError:
            pass  # a view is still alive in this process; the mapping goes with it
        if self._owner:
            try:
                shm.unlink()
            except FileNotFoundError:
                pass
        if self._held is not None:
            os.close(self._held)
            self._held = None
        if self._owns_bells:
            for bell in self.reader_bells + [self.writer_bell]:
                bell.close()


def _unpickle_queue(*handle) -> MessageQueue:
    q = MessageQueue(*handle)
    q._owns_bells = True  # the fds were passed to this process for this handle
    return q
