"""The engine loop: schedule, submit, collect, verify (vLLM's ``EngineCore.step``).

Synchronous: schedule step N, run it, verify it, repeat. With async scheduling (vLLM's
``step_with_batch_queue``) up to two batches are in flight: while the workers run step N the
engine verifies step N-1 and schedules and submits step N+1, so the workers find their next
call already waiting. ``host_overlapped_s`` in the summary is the engine's host work (schedule,
submit, verify) done while a batch was in flight, i.e. hidden behind the workers.

Works with any executor offering ``submit(plan) -> Future[{rank: payload}]`` and
``queue_depths()``: :class:`.executor.MultiprocExecutor` or the torchrun rank-0 executor.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .config import RunConfig
from .scheduler import WorkloadScheduler
from .verify import Verifier
from .workload import synthetic_requests


@dataclass
class Progress:
    step: int
    tokens: int
    elapsed_s: float
    queue_depths: list
    verified_steps: int
    in_flight: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


@dataclass
class RunResult:
    ok: bool = False
    failure: str | None = None
    verification_failures: list = field(default_factory=list)
    steps: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    verified_steps: int = 0
    host_s: float = 0.0
    host_overlapped_s: float = 0.0
    wait_s: float = 0.0
    requests_per_dp: list = field(default_factory=list)
    per_rank: dict = field(default_factory=dict)  # rank -> {steps, tokens, compute_s}
    verification: dict = field(default_factory=dict)  # rank -> RankVerification.to_dict()


class Engine:
    def __init__(self, cfg: RunConfig, executor):
        self.cfg, self.executor = cfg, executor
        requests = synthetic_requests(cfg.requests, cfg.prompt_len, cfg.decode_steps, cfg.seed)
        self.scheduler = WorkloadScheduler(
            requests,
            cfg.dp,
            max_batched_tokens=cfg.max_batched_tokens,
            max_running=cfg.max_running,
            verify_every=cfg.verify_every,
        )
        self.verifier = Verifier(
            cfg.preset, cfg.layout, dtype=cfg.torch_dtype, numerics=cfg.numerics, seed=cfg.seed
        )

    def run(self, on_progress: Callable[[Progress], None] | None = None) -> RunResult:
        """Run the workload to the end; raises ``RunFailed`` when a worker fails."""
        res = RunResult(
            per_rank={
                r: {"steps": 0, "tokens": 0, "compute_s": 0.0}
                for r in range(self.cfg.layout.world_size)
            }
        )
        depth = 2 if self.cfg.async_scheduling else 1
        in_flight: deque = deque()
        start = time.perf_counter()

        def host(fn, *args):
            t0 = time.perf_counter()
            value = fn(*args)
            dt = time.perf_counter() - t0
            res.host_s += dt
            if in_flight:
                res.host_overlapped_s += dt
            return value

        while True:
            while len(in_flight) < depth:
                plan = host(self.scheduler.next_plan)
                if plan is None:
                    break
                future = host(self.executor.submit, plan)
                in_flight.append((plan, future))
            if not in_flight:
                break
            plan, future = in_flight[0]
            t0 = time.perf_counter()
            replies = future.result()
            res.wait_s += time.perf_counter() - t0
            in_flight.popleft()
            for rank, payload in replies.items():
                stats = res.per_rank[rank]
                stats["steps"] += 1
                stats["tokens"] += payload["tokens"]
                stats["compute_s"] += payload["compute_s"]
            res.steps += 1
            res.tokens += plan.tokens
            if plan.verify:
                host(self.verifier.check_step, plan, replies)
                res.verified_steps += 1
            if on_progress is not None:
                on_progress(
                    Progress(
                        plan.step,
                        res.tokens,
                        time.perf_counter() - start,
                        self.executor.queue_depths(),
                        res.verified_steps,
                        len(in_flight),
                    )
                )
        res.wall_s = time.perf_counter() - start
        res.verification_failures = list(self.verifier.failures)
        res.verification = {r: v.to_dict() for r, v in self.verifier.ranks.items()}
        res.requests_per_dp = list(self.scheduler.balancer.assigned)
        verified_enough = res.verified_steps > 0 or self.cfg.verify_every == 0
        res.ok = not res.verification_failures and verified_enough
        return res
