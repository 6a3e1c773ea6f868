"""Scheduling (chunked prefill, decode positions, token budget), DP load balancing, the workload
and the run configuration's checks. In-process, fast."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from fqr.presets import get_preset
from fqr.runtime.config import RunConfig
from fqr.runtime.faults import FaultSpec, parse_fault
from fqr.runtime.parallel_state import Layout
from fqr.runtime.scheduler import DPBalancer, Scheduler, WorkloadScheduler
from fqr.runtime.workload import (
    RequestSpec,
    parse_range,
    segment_positions,
    step_qkv,
    synthetic_requests,
)


def _drain(ws: WorkloadScheduler):
    plans = []
    while (plan := ws.next_plan()) is not None:
        plans.append(plan)
        assert len(plans) < 10_000
    return plans


def test_every_request_gets_each_position_once_in_order_within_the_budget():
    reqs = synthetic_requests(23, (5, 70), 6, seed=3)
    ws = WorkloadScheduler(reqs, dp=3, max_batched_tokens=40, max_running=5, verify_every=3)
    plans = _drain(ws)
    seen = defaultdict(list)
    owner = {}
    for plan in plans:
        assert plan.verify == (plan.step % 3 == 0)
        for dp_rank, batch in enumerate(plan.batches):
            assert sum(s.length for s in batch) <= 40
            assert len({s.req_id for s in batch}) == len(batch) <= 5
            for s in batch:
                assert owner.setdefault(s.req_id, dp_rank) == dp_rank  # a request stays put
                seen[s.req_id].extend(range(s.start, s.start + s.length))
    for r in reqs:
        assert seen[r.req_id] == list(range(r.total_tokens))
    assert sum(s.finished for s in ws.schedulers) == len(reqs)
    assert sum(ws.balancer.assigned) == len(reqs)


def test_decode_tokens_are_single_after_prefill_chunks():
    s = Scheduler(max_batched_tokens=8, max_running=4)
    s.add(RequestSpec(0, prompt_len=19, decode_steps=3, arrival_step=0))
    lengths = []
    while s.has_work:
        (seg,) = s.schedule()
        lengths.append((seg.start, seg.length))
    assert lengths == [(0, 8), (8, 8), (16, 3), (19, 1), (20, 1), (21, 1)]


def test_dp_balancer_uses_waiting_times_four_plus_running():
    scheds = [Scheduler(), Scheduler(), Scheduler()]
    bal = DPBalancer(scheds)
    scheds[0].running = [object()] * 3  # score 3
    scheds[1].waiting.extend([object()])  # score 4
    scheds[2].running = [object()] * 2  # score 2
    assert bal.add(RequestSpec(0, 4, 1, 0)) == 2  # 2 is least; it becomes 1*4 + 2 = 6
    assert bal.score(2) == 6
    assert bal.add(RequestSpec(1, 4, 1, 0)) == 0  # 3 < 4 < 6; rank 0 becomes 7
    assert bal.add(RequestSpec(2, 4, 1, 0)) == 1  # 7, 4, 6
    assert bal.assigned == [1, 1, 1]


def test_balanced_run_splits_a_uniform_load():
    reqs = synthetic_requests(40, (16, 16), 4, seed=1)
    ws = WorkloadScheduler(reqs, dp=2, max_batched_tokens=64)
    plans = _drain(ws)
    a, b = ws.balancer.assigned
    assert abs(a - b) <= 2
    tokens = [sum(s.length for p in plans for s in p.batches[d]) for d in range(2)]
    assert sum(tokens) == sum(r.total_tokens for r in reqs)


def test_workload_is_deterministic_and_seeded():
    a = synthetic_requests(10, (4, 9), 2, seed=7)
    assert a == synthetic_requests(10, (4, 9), 2, seed=7)
    assert a != synthetic_requests(10, (4, 9), 2, seed=8)
    assert all(4 <= r.prompt_len <= 9 for r in a) and a[0].arrival_step == 0
    assert [r.arrival_step for r in a] == sorted(r.arrival_step for r in a)
    full = get_preset("qwen3-0.6b")
    x = step_qkv(0, 5, 1, 6, full, torch.bfloat16)
    assert torch.equal(x, step_qkv(0, 5, 1, 6, full, torch.bfloat16))
    assert not torch.equal(x, step_qkv(0, 5, 0, 6, full, torch.bfloat16))
    assert x.shape == (6, full.spec.qkv_width) and x.std() > 0.5
    with pytest.raises(ValueError, match="unsharded"):
        step_qkv(0, 0, 0, 1, get_preset("qwen3-0.6b", 2), torch.bfloat16)


def test_segment_positions():
    from fqr.runtime.workload import Segment

    pos = segment_positions([Segment(0, 5, 3), Segment(1, 0, 1)])
    assert pos.tolist() == [5, 6, 7, 0]
    assert segment_positions([]).numel() == 0


def test_layout_is_vllms():
    lay = Layout(dp=2, tp=3)
    assert lay.tp_groups() == [[0, 1, 2], [3, 4, 5]]
    assert lay.dp_groups() == [[0, 3], [1, 4], [2, 5]]
    assert lay.coords(4) == (1, 1) and lay.rank(1, 1) == 4
    assert Layout.from_world(8, tp=4) == Layout(2, 4)
    with pytest.raises(ValueError, match="--tp 3 does not divide"):
        Layout.from_world(8, tp=3)


@pytest.mark.parametrize(
    "text, message",
    [
        ("8..4", "prompt-len"),
        ("x", "prompt-len"),
        ("0..3", "prompt-len"),
    ],
)
def test_parse_range_rejects(text, message):
    with pytest.raises(ValueError, match=message):
        parse_range(text)


def test_parse_range_accepts():
    assert parse_range("16..96") == (16, 96) and parse_range("7") == (7, 7)


def test_parse_fault():
    assert parse_fault("rank=1,at=step:3,kind=hang", 2) == FaultSpec(1, "step", 3, "hang")
    assert parse_fault("rank=0,at=init,kind=kill-parent", 1) == FaultSpec(
        0, "init", None, "kill-parent"
    )
    for bad, msg in [
        ("rank=2,at=init,kind=raise", "not in"),
        ("rank=0,at=boot,kind=raise", "at "),
        ("rank=0,at=init,kind=segv", "kind"),
        ("rank=0,at=init", "exactly"),
        ("rank=x,at=init,kind=exit", "int"),
        ("rank=0,at=step:x,kind=exit", "int N"),
    ]:
        with pytest.raises(ValueError, match="--inject-fault"):
            parse_fault(bad, 2)
        with pytest.raises(ValueError, match=msg):
            parse_fault(bad, 2)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(preset="nope"), "preset must be one of .*, got .nope."),
        (dict(tp=3), "does not divide"),
        (dict(dp=0), "--dp"),
        (dict(device="tpu"), "--device"),
        (dict(backend="triton", device="cpu"), "--backend triton runs on cuda"),
        (dict(backend="magic"), "backend must be one of"),
        (dict(dtype="fp8"), "--dtype"),
        (dict(launcher="slurm"), "--launcher"),
        (dict(prompt_len="40000..40960"), "RoPE positions"),
        (dict(verify_every=-1), "--verify-every"),
        (dict(step_timeout_s=0), "--step-timeout"),
        (dict(launcher="torchrun", async_scheduling=True), "--async-scheduling"),
        (dict(launcher="torchrun", fault="rank=0,at=init,kind=kill-parent"), "kill-parent"),
    ],
)
def test_run_config_rejects_bad_options(kw, message):
    with pytest.raises(ValueError, match=message):
        RunConfig.build(**kw)
