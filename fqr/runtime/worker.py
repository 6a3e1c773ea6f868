"""A worker: one process per (DP rank, TP rank), as vLLM's ``WorkerProc``.

Startup (:func:`worker_main`): watch the death pipe, bind the device (TP rank offset by the DP
rank), join the process groups (:mod:`.parallel_state`), take a memory snapshot, build the
layer state (:class:`.layer.PrologueLayer`), then send ``READY`` (or ``FAILURE`` with the cause)
on the ready pipe. Then: read a call from the broadcast queue, run it, reply on this worker's
response queue with ``(SUCCESS, payload)`` or ``(FAILURE, error text)``; until ``SHUTDOWN``.

:class:`StepRunner` is the part both launchers share: it turns a :class:`.scheduler.StepPlan`
into this rank's forward (and the probe batch on verified steps).
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

from .config import RunConfig
from .device import bind_device, local_device_index, memory_snapshot
from .layer import PrologueLayer
from .message_queue import MessageQueue, QueueCancelled
from .parallel_state import ParallelGroups, destroy_distributed, init_distributed
from .scheduler import StepPlan
from .workload import PROBE_STREAM, probe_positions, segment_positions, step_qkv

SUCCESS, FAILURE, READY, SHUTDOWN = "SUCCESS", "FAILURE", "READY", "SHUTDOWN"


def error_text(e: BaseException) -> str:
    """``Type: message (at file:line in function)``: one line, the innermost frame."""
    frames = traceback.extract_tb(e.__traceback__)
    where = ""
    if frames:
        f = frames[-1]
        where = f" (at {os.path.basename(f.filename)}:{f.lineno} in {f.name})"
    return f"{type(e).__name__}: {e}{where}"


class StepRunner:
    """Runs this rank's share of a step: its DP replica's batch on its TP shard."""

    def __init__(self, cfg: RunConfig, rank: int, device: torch.device, groups: ParallelGroups):
        self.cfg, self.rank, self.device, self.groups = cfg, rank, device, groups
        self.dp_rank, self.tp_rank = cfg.layout.coords(rank)
        self.what = cfg.layout.describe(rank)
        self.layer = PrologueLayer(
            cfg.preset,
            cfg.tp,
            self.tp_rank,
            dtype=cfg.torch_dtype,
            device=device,
            seed=cfg.seed,
            numerics=cfg.numerics,
            backend=cfg.backend,
        )
        self.steps = self.tokens = 0
        self.compute_s = 0.0

    def _all_reduce(self, t: torch.Tensor) -> None:
        dist.all_reduce(t, group=self.groups.tp.device_group)

    def _sync(self) -> None:
        if self.device.type != "cpu":
            getattr(torch, self.device.type).synchronize(self.device)

    def _forward(self, step: int, stream: int, positions: torch.Tensor):
        """Draw the batch's rows (not timed), then run the layer: (outputs, seconds)."""
        qkv_full = step_qkv(
            self.cfg.seed, step, stream, len(positions), self.layer.full, self.cfg.torch_dtype
        )
        rows = self.layer.local_rows(qkv_full)
        positions = positions.to(self.device)
        self._sync()
        t0 = time.perf_counter()
        outs = self.layer.forward(rows, positions, self._all_reduce)
        self._sync()
        return outs, time.perf_counter() - t0

    def warm_up(self) -> None:
        """One untimed forward before READY (kernel compilation, allocator, collectives), as
        vLLM warms up before serving; every rank of a TP group must call it."""
        pp = probe_positions(self.cfg.seed, -1, self.layer.full.max_position)
        self._forward(-1, PROBE_STREAM, pp)

    def run(self, plan: StepPlan) -> dict:
        fault = self.cfg.fault
        if fault is not None and fault.fires(self.rank, "step", plan.step):
            fault.trigger(self.what)
        batch = list(plan.batches[self.dp_rank])
        positions = segment_positions(batch)
        outputs, elapsed = self._forward(plan.step, self.dp_rank, positions)
        probe = None
        if plan.verify:  # the probe is verification work: not counted in the rank's time
            pp = probe_positions(self.cfg.seed, plan.step, self.layer.full.max_position)
            probe, _ = self._forward(plan.step, PROBE_STREAM, pp)
        self.steps += 1
        self.tokens += len(positions)
        self.compute_s += elapsed
        payload = {
            "rank": self.rank,
            "step": plan.step,
            "tokens": len(positions),
            "compute_s": elapsed,
        }
        if plan.verify:
            payload["outputs"] = tuple(t.cpu() for t in outputs)
            payload["probe"] = tuple(t.cpu() for t in probe)
        return payload

    def totals(self) -> dict:
        return {
            "rank": self.rank,
            "steps": self.steps,
            "tokens": self.tokens,
            "compute_s": self.compute_s,
            "memory": memory_snapshot(self.device).to_dict(),
        }


def _watch_death_pipe(conn, what: str) -> None:
    """vLLM's death pipe: the parent holds the write end; EOF means the parent is gone."""
    try:
        conn.recv()
    except (EOFError, OSError):
        pass
    print(f"fqr: {what}: engine process died; worker exiting", file=sys.stderr, flush=True)
    os._exit(1)


def worker_main(
    cfg: RunConfig,
    rank: int,
    store_host: str,
    store_port: int,
    broadcast: MessageQueue,
    response: MessageQueue,
    ready_conn,
    death_conn,
) -> None:
    """Entry point of a spawned worker process."""
    # Ctrl-C is the engine's to handle (shutdown). The executor spawned this process with
    # SIGINT blocked (so not even its imports could be interrupted); ignore it, then unblock.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    what = cfg.layout.describe(rank)
    threading.Thread(target=_watch_death_pipe, args=(death_conn, what), daemon=True).start()
    try:
        dp_rank, tp_rank = cfg.layout.coords(rank)
        device = bind_device(cfg.device, local_device_index(tp_rank, dp_rank, cfg.tp), what)
        store = dist.TCPStore(
            store_host,
            store_port,
            cfg.layout.world_size,
            is_master=False,
            timeout=datetime.timedelta(seconds=cfg.init_timeout_s),
        )
        groups = init_distributed(
            cfg.layout, rank, device, timeout_s=cfg.collective_timeout_s, store=store
        )
        at_init = memory_snapshot(device)
        runner = StepRunner(cfg, rank, device, groups)
        runner.warm_up()
        if cfg.fault is not None and cfg.fault.fires(rank, "init"):
            cfg.fault.trigger(what)
        calls = broadcast.as_reader(rank)
        replies = response.as_writer()
        ready_conn.send(
            (READY, {"pid": os.getpid(), "device": str(device), "memory": at_init.to_dict()})
        )
    except BaseException as e:  # noqa: BLE001 - reported to the engine, then exit
        ready_conn.send((FAILURE, error_text(e)))
        ready_conn.close()
        os._exit(1)
    ready_conn.close()
    code = 0
    try:
        while True:
            msg = calls.dequeue()
            if msg == SHUTDOWN:
                replies.enqueue((SUCCESS, runner.totals()))
                break
            try:
                replies.enqueue((SUCCESS, runner.run(msg)))
            except Exception as e:  # noqa: BLE001 - a failed call is a reply, not a crash
                replies.enqueue((FAILURE, error_text(e)))
    except QueueCancelled:
        code = 1
    finally:
        calls.close()
        replies.close()
        if code == 0:
            destroy_distributed()
    os._exit(code)
