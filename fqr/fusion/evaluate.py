"""Compile a small vLLM-style model with and without the fusion pass and compare the two.

:func:`evaluate_fusion` is what ``fqr fuse`` prints: the fused-site count, the ops the pass
left unfused, the max differences between the two compiled models (final hidden states and
each layer's q, k, v), each layer's fused q/k against the float64 formulation
(:func:`fqr.reference.prologue`) under the ``unfused`` numerics contract (:mod:`fqr.numerics`),
and compile / run times of both.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from ..core import dtype_name
from ..presets import Preset
from .fusion_pass import FusionBackend, fusion_patterns
from .models import VllmStyleModel, preset_model


@dataclass
class Timing:
    compile_s: float
    run_ms: float


@dataclass
class FuseReport:
    preset: str
    layers: int
    tokens: int
    dtype: str
    device: str
    sites: int
    unfused_ops_left: dict
    max_abs_diff: dict  # fused vs unfused compiled: hidden, q, k, v (max over layers)
    contract: dict  # worst layer: max_rel_head, v_exact, passed, tolerance
    pattern_setup_s: float
    unfused: Timing
    fused: Timing
    layer_checks: list = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.sites == self.layers and not self.unfused_ops_left and self.contract["passed"]

    def to_dict(self) -> dict:
        return dict(asdict(self), passed=self.passed)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device, runs: int):
    _sync(device)
    start = time.perf_counter()
    first = fn()
    _sync(device)
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return first, Timing(compile_s, 1e3 * statistics.median(times))


def _inductor(gm, example_inputs):
    """Plain Inductor with the same cache settings as :class:`FusionBackend` (off)."""
    from torch._inductor.compile_fx import compile_fx

    with torch._functorch.config.patch(enable_autograd_cache=False):
        return compile_fx(gm, example_inputs, config_patches={"fx_graph_cache": False})


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def evaluate_fusion(
    preset: Preset,
    *,
    layers: int = 2,
    tokens: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    seed: int = 0,
    runs: int = 5,
    log=lambda msg: None,
) -> FuseReport:
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    dev = torch.device(device)
    model: VllmStyleModel = preset_model(preset, layers, dtype, seed=seed, device=dev)
    shape = model.layers[0].shape
    gen = torch.Generator().manual_seed(seed + 1)
    hidden = torch.randn(tokens, model.hidden_size, generator=gen).to(dtype).to(dev)
    positions = torch.randint(0, shape.max_position, (tokens,), generator=gen).to(dev)

    log("tracing the fusion patterns")
    start = time.perf_counter()
    fusion_patterns()
    setup_s = time.perf_counter() - start

    # The token count is dynamic as in vLLM (mark_dynamic, not dynamic=True: that would also
    # lift float attributes such as eps into graph inputs, which no pattern can read).
    if tokens > 1:
        torch._dynamo.mark_dynamic(hidden, 0)
        torch._dynamo.mark_dynamic(positions, 0)
    with torch.no_grad():
        torch._dynamo.reset()
        log("compiling without the pass")
        plain = torch.compile(model, backend=_inductor)
        ref, t_plain = _timed(lambda: plain(positions, hidden), dev, runs)
        torch._dynamo.reset()
        log("compiling with the fusion pass")
        fusion = FusionBackend()
        fused_model = torch.compile(model, backend=fusion)
        out, t_fused = _timed(lambda: fused_model(positions, hidden), dev, runs)
        torch._dynamo.reset()

    diff = {"hidden": _max_diff(out[0], ref[0])}
    for i, name in ((1, "q"), (2, "k"), (3, "v")):
        diff[name] = max(_max_diff(o[i], r[i]) for o, r in zip(out[1], ref[1]))

    checks = [
        layer.check_prologue(positions, qkv, q, k, v)
        for layer, (qkv, q, k, v) in zip(model.layers, out[1])
    ]
    worst = max(checks, key=lambda c: (not c["passed"], c["max_rel_head"]))
    unfused_left: dict = {}
    for g in fusion.stats.graphs:
        for op, n in g.unfused_ops.items():
            unfused_left[op] = unfused_left.get(op, 0) + n
    return FuseReport(
        preset=preset.label,
        layers=layers,
        tokens=tokens,
        dtype=dtype_name(dtype),
        device=str(dev),
        sites=fusion.stats.sites,
        unfused_ops_left=unfused_left,
        max_abs_diff=diff,
        contract=dict(worst),
        pattern_setup_s=setup_s,
        unfused=t_plain,
        fused=t_fused,
        layer_checks=checks,
    )
