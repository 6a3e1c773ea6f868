"""TP shards of the layer, the full-width norm's all-reduce, and the verifier, in one process.

Each TP rank's :class:`StepRunner` runs in a thread; the TP all-reduce is a barrier-based sum
across the threads (the semantics of ``dist.all_reduce``). The gathered outputs must equal the
unsharded float64 expectation (``fqr.reference.prologue``) within the numerics contract, and
the verifier must catch a missing all-reduce, a corrupted shard and DP replicas that differ.
"""

from __future__ import annotations

import threading

import pytest
import torch

from fqr.presets import get_preset
from fqr.runtime.config import RunConfig
from fqr.runtime.layer import PrologueLayer
from fqr.runtime.scheduler import StepPlan
from fqr.runtime.verify import Verifier
from fqr.runtime.worker import StepRunner
from fqr.runtime.workload import Segment


class ThreadRunner(StepRunner):
    """A StepRunner whose TP all-reduce sums over threads (``reduce=False``: no reduction)."""

    def __init__(self, cfg, rank, shared, reduce=True):
        super().__init__(cfg, rank, torch.device("cpu"), groups=None)
        self.shared, self.reduce = shared, reduce

    def _all_reduce(self, t):
        if not self.reduce:
            return
        barrier, slots = self.shared
        slots[self.tp_rank] = t.clone()
        barrier.wait()
        total = torch.stack(slots).sum(0)
        barrier.wait()
        t.copy_(total)


def run_step(cfg: RunConfig, plan: StepPlan, reduce=True) -> dict:
    replies = {}
    shared = {d: (threading.Barrier(cfg.tp), [None] * cfg.tp) for d in range(cfg.dp)}
    runners = [
        ThreadRunner(cfg, r, shared[cfg.layout.coords(r)[0]], reduce)
        for r in range(cfg.layout.world_size)
    ]
    errors = []

    def go(runner):
        try:
            replies[runner.rank] = runner.run(plan)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=go, args=(r,)) for r in runners]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return replies


def _seed(gen: torch.Generator) -> int:
    """The workload seed, drawn from the suite's fresh (printed, replayable) generator."""
    return int(torch.randint(0, 2**31, (1,), generator=gen))


def _plan(step=0):
    batches = ((Segment(0, 0, 5), Segment(1, 300, 1)), (Segment(2, 2000, 4),))
    return StepPlan(step, batches, verify=True)


@pytest.mark.parametrize(
    "preset, tp, dtype",
    [
        ("qwen3-8b", 2, "bf16"),  # per-head norm, kv heads split
        ("gemma3-1b", 2, "fp16"),  # one kv head replicated on both ranks, (1 + w) weights
        ("glm4-9b", 4, "bf16"),  # no QK norm, GPT-J rotary on half the head, kv replicated
        ("olmo2-7b", 2, "bf16"),  # full-width norm: TP all-reduce of the sums of squares
        ("olmo2-7b", 4, "fp32"),
    ],
)
def test_tp_shards_match_the_unsharded_float64_expectation(preset, tp, dtype, gen):
    seed = _seed(gen)
    cfg = RunConfig.build(preset=preset, dp=2, tp=tp, dtype=dtype, seed=seed)
    plan = _plan(step=3)
    replies = run_step(cfg, plan)
    v = Verifier(preset, cfg.layout, dtype=cfg.torch_dtype, numerics="fused", seed=seed)
    assert v.check_step(plan, replies), v.failures
    for stats in v.ranks.values():
        assert stats.checks == 2 and stats.passed == 2  # its batch and the probe
        # err/tol, the contract's own measure (fqr run's column beside the raw ULP count, which
        # also counts elements below the fp32 compute floor): inside the bound
        assert 0 <= stats.max_err_ratio <= 1, stats
    assert all(v.ranks[r].probe_identical == 1 for r in range(tp, 2 * tp))
    # Every q head of the model is covered exactly once by the shards.
    widths = sum(replies[r]["outputs"][0].shape[1] for r in range(tp))
    assert widths == get_preset(preset).spec.q_size


def test_full_width_norm_without_the_all_reduce_fails_verification(gen):
    cfg = RunConfig.build(preset="olmo2-7b", dp=1, tp=2, seed=_seed(gen))
    plan = StepPlan(0, ((Segment(0, 10, 6),),), verify=True)
    replies = run_step(cfg, plan, reduce=False)
    v = Verifier("olmo2-7b", cfg.layout, dtype=cfg.torch_dtype, numerics="fused", seed=cfg.seed)
    assert not v.check_step(plan, replies)
    assert any(
        f.startswith("step 0: rank 0 (dp 0, tp 0): q:") and "max ulp" in f for f in v.failures
    ), v.failures


def test_verifier_names_a_corrupted_rank_and_a_dp_replica_that_differs(gen):
    cfg = RunConfig.build(preset="qwen3-0.6b", dp=2, tp=2, seed=_seed(gen))
    plan = _plan()
    replies = run_step(cfg, plan)
    q, k, v_ = replies[3]["outputs"]
    k = k.clone()
    k[1, 7] = k[1, 7] + 4  # far outside 1 ULP for any value (an affine map can have a fixed point)
    v_ = v_.clone()
    v_[0, 0] = v_[0, 0] + 1
    replies[3]["outputs"] = (q, k, v_)
    pq, pk, pv = replies[2]["probe"]
    pq = pq.clone()
    pq.view(torch.int16)[0, 0] += 1  # one ULP: still correct, but not bit-identical
    replies[2]["probe"] = (pq, pk, pv)
    ver = Verifier("qwen3-0.6b", cfg.layout, dtype=cfg.torch_dtype, numerics="fused", seed=cfg.seed)
    assert not ver.check_step(plan, replies)
    text = "\n".join(ver.failures)
    assert "step 0: rank 3 (dp 1, tp 1): k: 1 elements outside <=1 ulp" in text
    assert "v is not a bit-exact copy" in text
    assert "step 0 probe: rank 2 (dp 1, tp 0) differs bitwise from rank 0 (dp 0, tp 0)" in text
    assert ver.ranks[0].passed == ver.ranks[0].checks == 2
    assert ver.ranks[3].max_err_ratio > 1 >= ver.ranks[0].max_err_ratio


def test_shard_columns_cover_q_k_v_of_the_unsharded_row():
    full = get_preset("gemma3-27b")
    tp = 4
    cols = [
        PrologueLayer(
            "gemma3-27b", tp, r, dtype=torch.bfloat16, device=torch.device("cpu"), seed=0
        ).columns
        for r in range(tp)
    ]
    assert torch.equal(torch.sort(torch.cat(cols)).values, torch.arange(full.spec.qkv_width))
