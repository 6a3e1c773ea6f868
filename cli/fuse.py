"""``fqr fuse``: compile a small model of a preset's attention with and without the fusion pass.

::

    fqr fuse --preset qwen3-8b --layers 2 --tokens 16 --dtype bf16 [--device cpu] [--json]

Builds a randomly initialised vLLM-style model (``fqr.fusion.models``) with the preset's
attention shapes, compiles it with plain Inductor and with ``fqr.fusion.backend()``, and prints
the fused-site count, the max differences of the outputs, the numerics-contract check of each
layer's fused q/k against float64, and compile / run times of both. Exit 0 when every layer
was fused and the check passed, 1 when not, 2 on bad usage.
"""

from __future__ import annotations

import json

import typer
from rich.table import Table

from fqr.presets import get_preset

from .common import EXIT_FAILED, UsageError, app, err, out
from .options import parse_dtype


@app.command()
def fuse(
    preset: str = typer.Option("qwen3-8b", "--preset", help="model preset (per-head QK-norm)"),
    layers: int = typer.Option(2, "--layers", help="attention layers in the model"),
    tokens: int = typer.Option(16, "--tokens", help="tokens in the batch"),
    dtype: str = typer.Option("bf16", "--dtype", help="bf16, fp16 or fp32"),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda"),
    seed: int = typer.Option(0, "--seed", help="seed of weights and inputs"),
    runs: int = typer.Option(5, "--runs", help="timed runs after the compiling one"),
    json_out: bool = typer.Option(False, "--json", help="print JSON"),
):
    """Fuse a small model's attention prologues; compare with the unfused compiled model."""
    from fqr.fusion.evaluate import evaluate_fusion

    if layers < 1:
        raise UsageError(f"--layers must be >= 1, got {layers}")
    if tokens < 1:
        raise UsageError(f"--tokens must be >= 1, got {tokens}")
    if runs < 1:
        raise UsageError(f"--runs must be >= 1, got {runs}")
    if device not in ("cpu", "cuda"):
        raise UsageError(f"--device must be cpu or cuda, got {device!r}")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA GPU is visible to torch")
    try:
        p = get_preset(preset.lower())
    except ValueError as e:
        raise UsageError(f"--preset: {e}") from None
    report = evaluate_fusion(
        p,
        layers=layers,
        tokens=tokens,
        dtype=parse_dtype(dtype),
        device=device,
        seed=seed,
        runs=runs,
        log=lambda msg: err.print(f"[dim]{msg}...[/dim]"),
    )
    if json_out:
        out.print_json(json.dumps(report.to_dict()))
    else:
        _print_table(report)
    if not report.passed:
        raise typer.Exit(EXIT_FAILED)


def _print_table(r) -> None:
    t = Table(
        title=f"fqr fuse {r.preset} layers={r.layers} tokens={r.tokens} {r.dtype} {r.device}",
        show_header=False,
    )
    t.add_row("fused sites", f"{r.sites} / {r.layers}")
    t.add_row(
        "unfused ops left", ", ".join(f"{k} x{v}" for k, v in r.unfused_ops_left.items()) or "none"
    )
    t.add_row("max |fused - unfused|", "  ".join(f"{k} {v:.3g}" for k, v in r.max_abs_diff.items()))
    c = r.contract
    t.add_row(
        "q/k vs float64 (unfused contract)",
        f"{'pass' if c['passed'] else 'FAIL'}: max err {c['max_rel_head']:.3g} x head max "
        f"({c['tolerance']})",
    )
    t.add_row("pattern setup", f"{r.pattern_setup_s:.1f} s")
    t.add_row("compile unfused / fused", f"{r.unfused.compile_s:.1f} s / {r.fused.compile_s:.1f} s")
    t.add_row("run unfused / fused", f"{r.unfused.run_ms:.3f} ms / {r.fused.run_ms:.3f} ms")
    t.add_row("result", "[green]ok[/green]" if r.passed else "[red]FAILED[/red]")
    out.print(t)
