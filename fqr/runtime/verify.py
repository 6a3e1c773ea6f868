"""Verification of a run's outputs against the unsharded float64 expectation.

For a verified step, every DP replica's batch is redrawn from its seed (``workload.step_qkv``)
and evaluated by :func:`fqr.reference.prologue` (the prologue's formulas in float64, an
implementation independent of the ops' reference rules) on the **unsharded** model. Each TP
rank's outputs are its heads of that expectation, so comparing every shard with its slice
under the numerics contract (:func:`fqr.numerics.compare`) is comparing the TP-gathered output,
and a mismatch names the rank. ``v`` must match bit for bit. For full-width norm the
expectation normalises over the whole q/k width, so it checks the TP all-reduce as well.

The probe batch runs the same input on every DP replica: replicas holding the same TP shard
must return bit-identical outputs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .. import reference
from ..numerics import compare
from ..presets import get_preset
from .layer import shard_heads
from .parallel_state import Layout
from .scheduler import StepPlan
from .workload import PROBE_STREAM, model_norm_weights, probe_positions, segment_positions, step_qkv


@dataclass
class RankVerification:
    checks: int = 0
    passed: int = 0
    max_ulp: int = 0
    max_rel: float = 0.0
    probe_identical: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


class Verifier:
    def __init__(
        self, preset_name: str, layout: Layout, *, dtype: torch.dtype, numerics: str, seed: int
    ):
        self.full = get_preset(preset_name)
        self.shard = get_preset(preset_name, layout.tp)
        self.layout, self.dtype, self.numerics, self.seed = layout, dtype, numerics, seed
        self.cos_sin_cache = self.full.cos_sin_cache()
        self.q_weight, self.k_weight = model_norm_weights(self.full, seed, dtype)
        self.ranks = {r: RankVerification() for r in range(layout.world_size)}
        self.failures: list[str] = []

    def expected(self, qkv: torch.Tensor, positions: torch.Tensor):
        return reference.prologue(
            qkv,
            positions,
            self.cos_sin_cache,
            self.q_weight,
            self.k_weight,
            **self.full.spec.kwargs(),
        )

    def _slices(self, tp_rank: int, exact):
        d = self.full.head_dim
        qh, kvh = shard_heads(self.shard, tp_rank)
        q, k, v = exact
        return (
            q[:, qh.start * d : qh.stop * d],
            k[:, kvh.start * d : kvh.stop * d],
            v[:, kvh.start * d : kvh.stop * d],
        )

    def _check_rank(self, what: str, rank: int, outputs, exact) -> bool:
        d = self.full.head_dim
        _, tp_rank = self.layout.coords(rank)
        q_exp, k_exp, v_exp = self._slices(tp_rank, exact)
        stats = self.ranks[rank]
        stats.checks += 1
        problems = []
        for name, out, ref in (("q", outputs[0], q_exp), ("k", outputs[1], k_exp)):
            c = compare(out.cpu(), ref, head_dim=d, numerics=self.numerics)
            stats.max_ulp = max(stats.max_ulp, c.max_ulp or 0)
            stats.max_rel = max(stats.max_rel, c.max_rel_head)
            if not c.passed:
                problems.append(
                    f"{name}: {c.bad} elements outside {c.tolerance}, max ulp "
                    f"{c.max_ulp}, max err {c.max_rel_head:.3g} x head max"
                    + (f", {c.nonfinite} non-finite" if c.nonfinite else "")
                )
        if not torch.equal(outputs[2].cpu(), v_exp):
            problems.append("v is not a bit-exact copy")
        if problems:
            self.failures.append(f"{what}: {self.layout.describe(rank)}: " + "; ".join(problems))
            return False
        stats.passed += 1
        return True

    def check_step(self, plan: StepPlan, replies: dict[int, dict]) -> bool:
        """Check every rank's outputs of a verified ``plan``; True when all pass."""
        ok = True
        for dp_rank, batch in enumerate(plan.batches):
            tokens = sum(s.length for s in batch)
            if tokens == 0:
                continue
            positions = segment_positions(list(batch))
            qkv = step_qkv(self.seed, plan.step, dp_rank, tokens, self.full, self.dtype)
            exact = self.expected(qkv, positions)
            for tp_rank in range(self.layout.tp):
                rank = self.layout.rank(dp_rank, tp_rank)
                ok &= self._check_rank(f"step {plan.step}", rank, replies[rank]["outputs"], exact)
        return ok & self.check_probe(plan.step, replies)

    def check_probe(self, step: int, replies: dict[int, dict]) -> bool:
        """The probe batch: correct on every rank, bit-identical across DP replicas."""
        positions = probe_positions(self.seed, step, self.full.max_position)
        qkv = step_qkv(self.seed, step, PROBE_STREAM, len(positions), self.full, self.dtype)
        exact = self.expected(qkv, positions)
        ok = True
        for rank in range(self.layout.world_size):
            ok &= self._check_rank(f"step {step} probe", rank, replies[rank]["probe"], exact)
        for tp_rank in range(self.layout.tp):
            first = self.layout.rank(0, tp_rank)
            for dp_rank in range(1, self.layout.dp):
                rank = self.layout.rank(dp_rank, tp_rank)
                same = all(
                    _bits_equal(a, b)
                    for a, b in zip(replies[first]["probe"], replies[rank]["probe"])
                )
                if same:
                    self.ranks[rank].probe_identical += 1
                else:
                    ok = False
                    self.failures.append(
                        f"step {step} probe: {self.layout.describe(rank)} differs bitwise from "
                        f"{self.layout.describe(first)} on the same input"
                    )
        return ok


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))
