"""The shared-memory broadcast ring on its own: ordering, overflow, many readers, slow reader,
timeouts, cancellation, cleanup. Readers run in forked processes (cheap: no re-import)."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
import time

import pytest

from fqr.runtime.message_queue import MessageQueue, QueueCancelled, QueueTimeout

CTX = mp.get_context("fork")


def _reader(mq: MessageQueue, index: int, n: int, out, delay: float = 0.0) -> None:
    r = mq.as_reader(index)
    got = []
    for _ in range(n):
        if delay:
            time.sleep(delay)
        got.append(r.dequeue(timeout=30))
    out.put((index, got))
    r.close()


def _queue(n_readers, **kw) -> MessageQueue:
    return MessageQueue.create(n_readers, **kw).as_writer()


def _run_readers(mq, n_readers, messages, delay=0.0):
    out = CTX.Queue()
    procs = [
        CTX.Process(target=_reader, args=(mq, i, len(messages), out, delay))
        for i in range(n_readers)
    ]
    for p in procs:
        p.start()
    for m in messages:
        mq.enqueue(m, timeout=30)
    results = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(10)
        assert p.exitcode == 0
    return results


def test_ordering_many_readers_wraps_the_ring():
    mq = _queue(3, n_slots=4, chunk_bytes=4096)
    messages = [{"i": i, "data": list(range(i % 7))} for i in range(40)]  # 10 laps of the ring
    try:
        results = _run_readers(mq, 3, messages)
    finally:
        mq.close()
    assert set(results) == {0, 1, 2}
    for got in results.values():
        assert got == messages


def test_overflow_payload_larger_than_the_whole_ring():
    mq = _queue(2, n_slots=3, chunk_bytes=1024)
    big = os.urandom(50_000)  # ~50 chunks through a 3-slot ring
    messages = [b"small", big, b"", big[::-1], {"after": True}]
    try:
        results = _run_readers(mq, 2, messages)
    finally:
        mq.close()
    for got in results.values():
        assert got == messages


def _counting_reader(mq: MessageQueue, index: int, n: int, count, delay: float) -> None:
    r = mq.as_reader(index)
    for i in range(n):
        time.sleep(delay)
        assert r.dequeue(timeout=30) == i
        with count.get_lock():
            count.value += 1
    r.close()


def _writer(mq: MessageQueue, messages) -> None:
    w = mq.as_writer()
    for m in messages:
        w.enqueue_bytes(m, timeout=30)
    w.close()


def test_a_message_started_is_read_whole_by_a_polling_reader():
    """The executor's collector polls with tiny timeouts; a timeout must never split a
    fragmented message (it applies to the first fragment only)."""
    mq = MessageQueue.create(1, n_slots=2, chunk_bytes=512)
    messages = [os.urandom(40_000), b"x", os.urandom(9_000)]
    writer = CTX.Process(target=_writer, args=(mq, messages))
    reader = MessageQueue(*mq.handle()).as_reader(0)
    writer.start()
    got = []
    give_up = time.monotonic() + 60  # a guard against a hang, not a timing assertion
    try:
        while len(got) < len(messages) and time.monotonic() < give_up:
            try:
                got.append(reader.dequeue_bytes(timeout=0.0005))
            except QueueTimeout:
                pass
        mq.cancel()  # frees a writer stuck on a broken stream
        writer.join(10)
    finally:
        reader.close()
        mq.close()
    assert [len(m) for m in got] == [len(m) for m in messages]
    assert got == messages


def test_slow_reader_blocks_the_writer_and_is_warned_about(caplog):
    n_slots, n = 2, 6
    mq = _queue(2, n_slots=n_slots, chunk_bytes=256)
    mq.warn_every_s = 0.1
    counts = [CTX.Value("i", 0), CTX.Value("i", 0)]
    procs = [
        CTX.Process(target=_counting_reader, args=(mq, i, n, counts[i], delay))
        for i, delay in enumerate((0.0, 0.3))
    ]
    with caplog.at_level(logging.WARNING, logger="fqr.runtime"):
        try:
            for p in procs:
                p.start()
            for i in range(n):
                mq.enqueue(i, timeout=30)
                # The writer never runs more than n_slots messages ahead of the slow reader
                # (one more: the reader counts just after it frees a slot).
                assert counts[1].value >= i - n_slots
            for p in procs:
                p.join(30)
                assert p.exitcode == 0
        finally:
            mq.close()
    assert counts[0].value == counts[1].value == n
    assert any("no free slot" in r.getMessage() for r in caplog.records)


def test_timeouts_on_empty_and_full_ring():
    mq = MessageQueue.create(1, n_slots=1, chunk_bytes=64)
    try:
        reader = MessageQueue(*mq.handle()).as_reader(0)
        with pytest.raises(QueueTimeout):
            reader.dequeue(timeout=0.1)
        mq.as_writer().enqueue("one")
        with pytest.raises(QueueTimeout, match="no free slot"):
            mq.enqueue("two", timeout=0.1)
        assert mq.depth(0) == 1
        assert reader.dequeue(timeout=1) == "one"
        assert mq.depth(0) == 0
        reader.close()
    finally:
        mq.close()


def test_cancel_wakes_a_blocked_reader():
    mq = MessageQueue.create(1, n_slots=2, chunk_bytes=64)
    reader = MessageQueue(*mq.handle()).as_reader(0)
    raised = []

    def block():
        try:
            reader.dequeue()  # no timeout: only cancellation ends it
        except QueueCancelled as e:
            raised.append(e)

    t = threading.Thread(target=block)
    t.start()
    time.sleep(0.2)
    mq.cancel()
    t.join(5)
    try:
        assert not t.is_alive() and raised
        with pytest.raises(QueueCancelled):
            mq.as_writer().enqueue("late")
    finally:
        reader.close()
        mq.close()


def test_close_unlinks_the_segment_and_is_idempotent():
    mq = MessageQueue.create(2, n_slots=2, chunk_bytes=128)
    path = f"/dev/shm/{mq.name}"
    assert os.path.exists(path)
    mq.close()
    mq.close()
    assert not os.path.exists(path)


def test_bad_arguments():
    with pytest.raises(ValueError, match="n_readers"):
        MessageQueue.create(0)
    with pytest.raises(ValueError, match="chunk_bytes"):
        MessageQueue.create(1, chunk_bytes=4)
    mq = MessageQueue.create(1, n_slots=1, chunk_bytes=64)
    try:
        with pytest.raises(ValueError, match="reader index"):
            mq.as_reader(1)
        with pytest.raises(RuntimeError, match="writer handle"):
            mq.as_writer().dequeue(timeout=0)
    finally:
        mq.close()
