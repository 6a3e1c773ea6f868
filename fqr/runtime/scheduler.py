"""Step scheduling with chunked prefill, and DP load balancing (vLLM's V1 scheduler, small).

Each DP replica has its own :class:`Scheduler` (as each vLLM engine core does). A step gives
every running request its next tokens first (one decode token, or the next prefill chunk),
then admits waiting requests, within ``max_batched_tokens`` and ``max_running``. A request's
tokens sit at positions ``0 .. prompt_len + decode_steps - 1``; a prefill chunk covers a run
of them, a decode step the next one. Progress is committed when a step is scheduled, so the
next step can be scheduled while this one runs (async scheduling; no sampling feeds back).

:class:`DPBalancer` sends each arriving request to the replica with the least
``waiting * 4 + running``, ties to the lowest rank, as vLLM's ``DPLBAsyncMPClient`` does.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .workload import RequestSpec, Segment


@dataclass
class _Running:
    spec: RequestSpec
    computed: int = 0

    @property
    def remaining(self) -> int:
        return self.spec.total_tokens - self.computed

    @property
    def in_prefill(self) -> bool:
        return self.computed < self.spec.prompt_len

    def next_chunk(self, budget: int) -> int:
        if self.in_prefill:
            return min(self.spec.prompt_len - self.computed, budget)
        return min(1, budget)


@dataclass
class Scheduler:
    max_batched_tokens: int = 128
    max_running: int = 32
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    finished: int = 0
    scheduled_tokens: int = 0

    def __post_init__(self):
        if self.max_batched_tokens < 1:
            raise ValueError(f"max_batched_tokens must be >= 1, got {self.max_batched_tokens}")
        if self.max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {self.max_running}")

    def add(self, spec: RequestSpec) -> None:
        self.waiting.append(_Running(spec))

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Segment]:
        """The next step's segments; commits their progress."""
        budget = self.max_batched_tokens
        segments = []
        for req in self.running:
            if budget == 0:
                break
            n = req.next_chunk(budget)
            segments.append(Segment(req.spec.req_id, req.computed, n))
            req.computed += n
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            req = self.waiting.popleft()
            n = req.next_chunk(budget)
            segments.append(Segment(req.spec.req_id, req.computed, n))
            req.computed += n
            budget -= n
            self.running.append(req)
        done = [r for r in self.running if r.remaining == 0]
        self.running = [r for r in self.running if r.remaining > 0]
        self.finished += len(done)
        self.scheduled_tokens += self.max_batched_tokens - budget
        return segments


class DPBalancer:
    """Assigns arriving requests to DP replicas by ``waiting * 4 + running``."""

    def __init__(self, schedulers: list[Scheduler]):
        self.schedulers = schedulers
        self.assigned = [0] * len(schedulers)

    def score(self, rank: int) -> int:
        s = self.schedulers[rank]
        return len(s.waiting) * 4 + len(s.running)

    def add(self, spec: RequestSpec) -> int:
        rank = min(range(len(self.schedulers)), key=lambda r: (self.score(r), r))
        self.schedulers[rank].add(spec)
        self.assigned[rank] += 1
        return rank


@dataclass(frozen=True)
class StepPlan:
    """What every worker gets for one step: one batch per DP replica, and whether the step is
    verified (outputs returned) and runs the probe batch (same input on every DP replica)."""

    step: int
    batches: tuple  # tuple[tuple[Segment, ...], ...], indexed by DP rank
    verify: bool

    @property
    def tokens(self) -> int:
        return sum(s.length for b in self.batches for s in b)


class WorkloadScheduler:
    """Arrivals, DP balancing and the per-replica schedulers: yields :class:`StepPlan` s."""

    def __init__(
        self,
        requests: list[RequestSpec],
        dp: int,
        *,
        max_batched_tokens: int = 128,
        max_running: int = 32,
        verify_every: int = 1,
    ):
        if verify_every < 0:
            raise ValueError(f"--verify-every must be >= 0 (0: never), got {verify_every}")
        self.pending = deque(sorted(requests, key=lambda r: (r.arrival_step, r.req_id)))
        self.schedulers = [Scheduler(max_batched_tokens, max_running) for _ in range(dp)]
        self.balancer = DPBalancer(self.schedulers)
        self.verify_every = verify_every
        self.clock = 0
        self.step = 0

    @property
    def done(self) -> bool:
        return not self.pending and not any(s.has_work for s in self.schedulers)

    def next_plan(self) -> StepPlan | None:
        """The next step (arrivals admitted first); None when every request has finished."""
        if self.done:
            return None
        if not any(s.has_work for s in self.schedulers):
            self.clock = max(self.clock, self.pending[0].arrival_step)  # idle: skip ahead
        while self.pending and self.pending[0].arrival_step <= self.clock:
            self.balancer.add(self.pending.popleft())
        batches = tuple(tuple(s.schedule()) for s in self.schedulers)
        verify = self.verify_every > 0 and self.step % self.verify_every == 0
        plan = StepPlan(self.step, batches, verify)
        self.step += 1
        self.clock += 1
        return plan
