"""``fqr run --launcher torchrun``: one rank per torchrun process, on one node or many.

torchrun (torch.distributed's elastic launcher) starts the processes and sets ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``; fqr
joins with ``env://``, lays the world out as DP x TP (:class:`.parallel_state.Layout`) and binds
``LOCAL_RANK``'s device, as vLLM's ``external_launcher`` does. Rank 0 is the engine *and* a
worker: per step it broadcasts the plan over the world's gloo group, runs its own shard, and
gathers every rank's reply. Before the gather a ``monitored_barrier`` (gloo) names any rank that
did not finish the step within the collective timeout (dead or hung); rank 0 then exits 1 with
that message and torchrun ends the other ranks, so the run never hangs in a collective.

One node::

    torchrun --standalone --nproc-per-node 4 -m fqr run --launcher torchrun --dp 2 --tp 2

N nodes (run on each, ``--node-rank`` 0..N-1)::

    torchrun --nnodes N --node-rank K --nproc-per-node G --master-addr HOST --master-port PORT \\
        -m fqr run --launcher torchrun --tp G
"""

from __future__ import annotations

import datetime
import os
from concurrent.futures import Future

import torch.distributed as dist

from .config import RunConfig
from .device import bind_device, memory_snapshot
from .engine import Engine, RunResult
from .executor import RunFailed
from .parallel_state import ParallelGroups, destroy_distributed, init_distributed
from .worker import FAILURE, SUCCESS, StepRunner, error_text

TORCHRUN_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def torchrun_env() -> dict[str, str]:
    """The variables torchrun sets; ValueError when not under torchrun."""
    missing = [k for k in TORCHRUN_ENV if k not in os.environ]
    if missing:
        raise ValueError(
            f"--launcher torchrun: {', '.join(missing)} not set "
            f"(start fqr with torchrun ... -m fqr run --launcher torchrun)"
        )
    return {k: os.environ[k] for k in TORCHRUN_ENV}


def world_size_from_env() -> int:
    return int(torchrun_env()["WORLD_SIZE"])


class _RankZeroExecutor:
    """Rank 0's side of a step: broadcast the plan, run the own shard, gather the replies."""

    def __init__(self, cfg: RunConfig, runner: StepRunner, groups: ParallelGroups):
        self.cfg, self.runner, self.groups = cfg, runner, groups
        self.timeout = datetime.timedelta(seconds=cfg.collective_timeout_s)

    def submit(self, plan) -> Future:
        future: Future = Future()
        try:
            future.set_result(self._step(plan))
        except RunFailed as e:
            future.set_exception(e)
        except RuntimeError as e:  # a collective failed: a peer died or the group broke
            future.set_exception(
                RunFailed(f"step {plan.step}: collective failed: {_first_line(e)}")
            )
        return future

    def _step(self, plan) -> dict:
        cpu = self.groups.world.cpu_group
        what = f"step {plan.step}"
        dist.broadcast_object_list([("STEP", plan)], src=0, group=cpu)
        reply = _run_own(self.runner, plan)
        try:
            dist.monitored_barrier(group=cpu, timeout=self.timeout, wait_all_ranks=True)
        except RuntimeError as e:
            raise RunFailed(
                f"{what}: {_first_line(e)} (dead or hung; "
                f"--collective-timeout {self.cfg.collective_timeout_s:g} s)"
            ) from None
        gathered = [None] * self.cfg.layout.world_size
        dist.gather_object(reply, gathered, dst=0, group=cpu)
        replies = {}
        for rank, (status, payload) in enumerate(gathered):
            if status == FAILURE:
                raise RunFailed(f"{self.cfg.layout.describe(rank)} failed at {what}: {payload}")
            replies[rank] = payload
        return replies

    def queue_depths(self) -> list[int]:
        return []  # no queue under torchrun: calls are collectives


def _run_own(runner: StepRunner, plan):
    try:
        return (SUCCESS, runner.run(plan))
    except Exception as e:  # noqa: BLE001 - reported to rank 0 as a reply
        return (FAILURE, error_text(e))


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def run_torchrun(cfg: RunConfig, on_progress=None):
    """Run this rank. Rank 0 returns ``(RunResult, ready_info, totals)``, others None.

    Raises :class:`RunFailed` with a message naming the rank when this rank cannot go on."""
    env = torchrun_env()
    rank, local_rank = int(env["RANK"]), int(env["LOCAL_RANK"])
    layout = cfg.layout
    if layout.world_size != int(env["WORLD_SIZE"]):
        raise ValueError(f"--dp {cfg.dp} x --tp {cfg.tp} != WORLD_SIZE {env['WORLD_SIZE']}")
    what = layout.describe(rank)
    try:
        device = bind_device(cfg.device, local_rank, what)
        groups = init_distributed(
            layout, rank, device, timeout_s=cfg.collective_timeout_s, init_method="env://"
        )
        info = {
            "pid": os.getpid(),
            "device": str(device),
            "host": os.uname().nodename,
            "memory": memory_snapshot(device).to_dict(),
        }
        runner = StepRunner(cfg, rank, device, groups)
        runner.warm_up()
        if cfg.fault is not None and cfg.fault.fires(rank, "init"):
            cfg.fault.trigger(what)
    except Exception as e:  # noqa: BLE001
        raise RunFailed(f"{what} failed during startup: {error_text(e)}") from None
    cpu = groups.world.cpu_group
    infos = [None] * layout.world_size if rank == 0 else None
    try:
        dist.gather_object(info, infos, dst=0, group=cpu)
    except RuntimeError as e:
        raise RunFailed(f"{what}: a rank did not finish startup: {_first_line(e)}") from None
    if rank != 0:
        _follow(runner, groups, what)
        return None
    result: RunResult = Engine(cfg, _RankZeroExecutor(cfg, runner, groups)).run(on_progress)
    totals = [None] * layout.world_size
    try:
        dist.broadcast_object_list([("STOP", None)], src=0, group=cpu)
        dist.gather_object(runner.totals(), totals, dst=0, group=cpu)
    except RuntimeError as e:
        raise RunFailed(f"{what}: stopping the ranks failed: {_first_line(e)}") from None
    destroy_distributed()
    return result, dict(enumerate(infos)), dict(enumerate(totals))


def _follow(runner: StepRunner, groups: ParallelGroups, what: str) -> None:
    """Ranks > 0: take plans from rank 0 until STOP."""
    cpu = groups.world.cpu_group
    timeout = datetime.timedelta(seconds=runner.cfg.collective_timeout_s)
    try:
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=cpu)
            kind, plan = box[0]
            if kind == "STOP":
                dist.gather_object(runner.totals(), None, dst=0, group=cpu)
                break
            reply = _run_own(runner, plan)
            dist.monitored_barrier(group=cpu, timeout=timeout, wait_all_ranks=True)
            dist.gather_object(reply, None, dst=0, group=cpu)
    except RuntimeError as e:
        raise RunFailed(
            f"{what}: lost contact with the engine (rank 0) or a peer: {_first_line(e)}"
        ) from None
    destroy_distributed()
