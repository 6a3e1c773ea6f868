"""``fqr run``'s host memory model (issue 14, finding 12b): the per-element coefficients that
:class:`fqr.runtime.config.RunConfig` uses to refuse a run that cannot fit are upper bounds of
what a worker's step and the engine's verification really take (peak resident set, ``VmHWM``
reset through ``/proc/self/clear_refs``), and a run whose largest step cannot fit is refused
with a message naming ``--max-batched-tokens`` before any worker starts. Issue 23 (finding 8):
the engine's requests and the worker processes are in the model too, and a run they do not
fit is refused naming ``--requests`` or ``--dp``."""

from __future__ import annotations

import pickle

import pytest
import torch
from support.memory import in_fresh_process, peak_bytes

from fqr.presets import get_preset
from fqr.runtime import config, verify
from fqr.runtime.config import RunConfig
from fqr.runtime.layer import PrologueLayer
from fqr.runtime.parallel_state import Layout
from fqr.runtime.scheduler import StepPlan, WorkloadScheduler
from fqr.runtime.verify import Verifier
from fqr.runtime.worker import SUCCESS
from fqr.runtime.workload import (
    PROBE_STREAM,
    Segment,
    probe_positions,
    segment_positions,
    step_qkv,
    synthetic_requests,
)

PRESET, TOKENS = "qwen3-0.6b", 4096  # 32 MiB of bf16 rows per step


def _width(preset) -> int:
    """Elements of one unsharded qkv row."""
    return (preset.num_heads + 2 * preset.num_kv_heads) * preset.head_dim


def _layer(tp, tp_rank, dtype):
    return PrologueLayer(PRESET, tp, tp_rank, dtype=dtype, device=torch.device("cpu"), seed=3)


def _reply(layer, step, positions, dtype) -> bytes:
    """A worker's verified step: draw, slice, forward, the probe, and the pickled reply."""
    full = layer.full
    outs = layer.forward(
        layer.local_rows(step_qkv(3, step, 0, len(positions), full, dtype)), positions
    )
    pp = probe_positions(3, step, full.max_position)
    probe = layer.forward(
        layer.local_rows(step_qkv(3, step, PROBE_STREAM, len(pp), full, dtype)), pp
    )
    payload = {"tokens": len(positions), "outputs": tuple(outs), "probe": tuple(probe)}
    return pickle.dumps((SUCCESS, payload), protocol=pickle.HIGHEST_PROTOCOL)


def _worker_step_peak(dtype_name: str) -> tuple[int, int]:
    """(peak bytes of one verified 4,096-token step of a worker, the step's elements)."""
    dtype = getattr(torch, dtype_name)
    layer = _layer(1, 0, dtype)
    positions = segment_positions([Segment(0, 0, TOKENS)])
    _reply(layer, 1, positions[:8], dtype)  # warm: tracing, tables
    peak = peak_bytes(lambda: _reply(layer, 1, positions, dtype))
    return peak, TOKENS * _width(layer.full)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_worker_step_fits_the_model(dtype):
    """Measured in a fresh process: in the main suite's one process the heap other tests left
    behind moved the peak by up to 7% (25.7 B/element against the bound's 24 under load)."""
    peak, elements = in_fresh_process(_worker_step_peak, str(dtype).removeprefix("torch."))
    bound = elements * config.worker_bytes_per_element(dtype.itemsize)
    print(f"worker {dtype}: {peak / elements:.2f} B/element")
    assert peak <= bound, f"{peak / elements:.2f} bytes per element"


@pytest.mark.parametrize("tp", [1, 2])
def test_engine_verification_fits_the_model(tp, monkeypatch):
    """At 512 tokens with chunks of 8 tokens (the ULP comparison is slow: a smaller problem,
    and a chunk scaled down with it so that the per-element terms dominate)."""
    monkeypatch.setattr(verify, "VERIFY_CHUNK_ELEMENTS", 1 << 15)
    dtype, tokens = torch.bfloat16, 512
    batch = (Segment(0, 0, tokens),)
    positions = segment_positions(list(batch))
    replies = {r: _reply(_layer(tp, r, dtype), 1, positions, dtype) for r in range(tp)}
    verifier = Verifier(PRESET, Layout(1, tp), dtype=dtype, numerics="fused", seed=3)
    plan = StepPlan(step=1, batches=(batch,), verify=True)
    results = []

    def check():
        received = {r: pickle.loads(data)[1] for r, data in replies.items()}
        results.append(verifier.check_step(plan, received))

    peak = peak_bytes(check)
    assert results == [True], verifier.failures
    elements = tokens * _width(get_preset(PRESET))
    working = config.verifier_working_bytes()
    bound = elements * config.engine_bytes_per_element(2, 1, 1) + working
    print(f"engine tp={tp}: {peak / elements:.2f} B/element")
    assert peak <= bound, f"{peak / elements:.2f} B/element, working set bound {working >> 20} MiB"


def test_verification_still_catches_a_wrong_element():
    """Chunked verification names the rank and the output when one element is off."""
    dtype = torch.bfloat16
    batch = (Segment(0, 0, 130),)
    positions = segment_positions(list(batch))
    layer = _layer(1, 0, dtype)
    reply = pickle.loads(_reply(layer, 2, positions, dtype))[1]
    q = reply["outputs"][0].clone()
    q[100, 5] = q[100, 5] * 2 + 1  # in the second chunk of rows (64 tokens each)
    reply["outputs"] = (q, *reply["outputs"][1:])
    verifier = Verifier(PRESET, Layout(1, 1), dtype=dtype, numerics="fused", seed=3)
    assert not verifier.check_step(StepPlan(step=2, batches=(batch,), verify=True), {0: reply})
    assert len(verifier.failures) == 1
    assert "rank 0" in verifier.failures[0] and "q: 1 elements outside" in verifier.failures[0]
    assert verifier.ranks[0].checks == 2 and verifier.ranks[0].passed == 1  # step, probe


def test_a_run_that_cannot_fit_is_refused_naming_the_budget(monkeypatch):
    monkeypatch.setattr(config, "host_memory_available", lambda: 8 << 30)
    kw = dict(preset=PRESET, requests=32, prompt_len="30000..40000", decode_steps=4)
    with pytest.raises(ValueError, match=r"^--max-batched-tokens 2000000: steps of up to"):
        RunConfig.build(max_batched_tokens=2_000_000, **kw)
    cfg = RunConfig.build(max_batched_tokens=8192, **kw)  # the same workload, a smaller budget
    assert cfg.max_step_tokens == 8192 and cfg.host_bytes_estimate() < 8 << 30
    # A huge budget that the workload cannot fill is not refused: steps stay small.
    small = RunConfig.build(preset=PRESET, max_batched_tokens=10**12)
    assert small.max_step_tokens == 8 * (64 + 4)


def test_the_engines_requests_fit_the_model():
    """Every request drawn, queued and admitted to a replica's waiting queue (the most the
    engine ever holds of them) within ``REQUEST_BYTES`` each (about 300 measured)."""
    n = 100_000

    def hold_them_all():
        scheduler = WorkloadScheduler(synthetic_requests(n, (16, 64), 4, 0), 2)
        while scheduler.pending:
            scheduler.balancer.add(scheduler.pending.popleft())
        return scheduler

    peak = peak_bytes(hold_them_all)
    print(f"requests: {peak / n:.0f} B each")
    assert peak <= n * config.REQUEST_BYTES, f"{peak / n:.0f} bytes per request"


@pytest.mark.parametrize(
    "kw, message",
    [
        # issue 23: a billion requests started the workers, then died drawing them
        (dict(requests=10**9), r"^--requests 1000000000: the engine holds every request"),
        # ... and 100000 replicas were told to lower --max-batched-tokens
        (dict(dp=100_000), r"^--dp 100000: 100,000 worker processes \(--dp 100000 x --tp 1\)"),
        (dict(tp=16, preset="qwen3-8b"), r"^--tp 16: 16 worker processes"),
    ],
    ids=["requests", "dp", "tp"],
)
def test_a_run_is_refused_naming_the_option_that_does_not_fit(monkeypatch, kw, message):
    monkeypatch.setattr(config, "host_memory_available", lambda: 4 << 30)
    with pytest.raises(ValueError, match=message) as e:
        RunConfig.build(**{"preset": PRESET, **kw})
    assert "lower " + message[1:].split()[0] in str(e.value)
    RunConfig.build(preset=PRESET, requests=10**6)  # a million requests: 0.5 GiB, fine
