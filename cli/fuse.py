"""``fqr fuse``: compile a model with and without the fusion pass and compare the two.

::

    fqr fuse --preset qwen3-8b --layers 2 --tokens 16 --dtype bf16 [--json]       # CPU
    fqr fuse --device cuda [--model vllm|hf-qwen3] [--prefill 512,2048,4096,16384]
             [--decode 1,2,4,8,16] [--profile/--no-profile] [--tokens 512] [--json]

On the CPU it builds a randomly initialised vLLM-style model (``fqr.fusion.models``) with the
preset's attention shapes, compiles it with plain Inductor and with ``fqr.fusion.backend()``,
and prints the fused-site count, the max differences of the outputs, the numerics-contract
check of each layer's fused q/k against float64, and compile / run times of both.

With ``--device cuda`` it runs :func:`fqr.fusion.compiled.compare_compiled`: the vLLM-shaped
stack (``--model vllm``, the preset's shapes) or Hugging Face transformers' Qwen3 at Qwen3-8B's
layer shapes (``--model hf-qwen3``), both compiled under CUDA graphs; it prints the sites fused,
the numerics against the uncompiled model (``--tokens`` tokens), the forward latency with and
without the pass per T, and the profile split (prologue kernels vs the rest) at the prefill
sizes >= 4096. Exit 0 when every layer was fused and the checks passed, 1 when not, 2 on bad
usage (a machine without CUDA included).
"""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from fqr.fusion.models import MODELS
from fqr.presets import DEFAULT_PRESET, get_preset

from .common import EXIT_FAILED, UsageError, app, err, example, out, parse_csv, schema
from .options import Dtype, DtypeOption, JsonOption, PresetName, choice_enum, parse_dtype
from .render import add_plain_row

FuseDevice = choice_enum("FuseDevice", ("cpu", "cuda"))
FuseModel = choice_enum("FuseModel", MODELS)

PROFILE_MIN_TOKENS = 4096


def fuse_document(report) -> dict:
    """The ``--json`` document of a fuse report (CPU or CUDA): schema, ``ok``, the report."""
    body = report.to_dict()
    return {"schema": schema("fuse"), "ok": body.pop("passed")} | body


@app.command(
    epilog=example(
        "fqr fuse --preset qwen3-8b --layers 2 --tokens 16 --json",
        "fqr fuse --device cuda --model hf-qwen3 --decode 1,16",
    )
)
def fuse(
    preset: Annotated[
        PresetName, typer.Option(help="model preset (per-head QK-norm)")
    ] = PresetName[DEFAULT_PRESET],
    layers: Annotated[int, typer.Option(help="layers in the model")] = 2,
    tokens: Annotated[
        int | None, typer.Option(help="tokens of the numerics check (default: 16 cpu, 512 cuda)")
    ] = None,
    dtype: DtypeOption = Dtype.bf16,
    device: Annotated[FuseDevice, typer.Option(help="where it runs")] = FuseDevice.cpu,
    model: Annotated[
        FuseModel,
        typer.Option(help="cuda: vllm (the preset's shapes) or hf-qwen3 (transformers' Qwen3)"),
    ] = FuseModel.vllm,
    prefill: Annotated[
        str, typer.Option(help="cuda: prefill token counts")
    ] = "512,2048,4096,16384",
    decode: Annotated[str, typer.Option(help="cuda: decode-sized token counts")] = "1,2,4,8,16",
    profile: Annotated[bool, typer.Option(help="cuda: profile split at prefill T >= 4096")] = True,
    seed: Annotated[int, typer.Option(help="seed of weights and inputs")] = 0,
    runs: Annotated[int, typer.Option(help="cpu: timed runs after the first")] = 5,
    json_out: JsonOption = False,
):
    """Fuse a model's attention prologues; compare with the model compiled without the pass."""
    preset, device, model = preset.value, device.value, model.value
    if layers < 1:
        raise UsageError(f"--layers must be >= 1, got {layers}")
    if tokens is not None and tokens < (2 if device == "cuda" else 1):
        raise UsageError(f"--tokens must be >= {2 if device == 'cuda' else 1}, got {tokens}")
    if runs < 1:
        raise UsageError(f"--runs must be >= 1, got {runs}")
    torch_dtype = parse_dtype(dtype)
    try:
        p = get_preset(preset.lower())
    except ValueError as e:
        raise UsageError(f"--preset: {e}") from None
    if p.norm != "head" or p.variant != "split-qkv":
        raise UsageError(
            f"--preset: {p.name} has norm={p.norm!r}, variant {p.variant!r}; the fusion patterns "
            f"cover the split-qkv per-head QK-norm prologue (norm='head': Qwen3, Gemma 3)"
        )
    if device == "cuda":
        _fuse_cuda(
            p, layers, tokens or 512, torch_dtype, model, prefill, decode, profile, seed, json_out
        )
        return
    from fqr.fusion.evaluate import evaluate_fusion

    report = evaluate_fusion(
        p,
        layers=layers,
        tokens=tokens or 16,
        dtype=torch_dtype,
        device=device,
        seed=seed,
        runs=runs,
        log=lambda msg: err.print(f"{msg}...", style="dim", highlight=False, markup=False),
    )
    if json_out:
        out.print_json(json.dumps(fuse_document(report)))
    else:
        _print_table(report)
    if not report.passed:
        raise typer.Exit(EXIT_FAILED)


def _fuse_cuda(p, layers, tokens, dtype, model, prefill, decode, profile, seed, json_out):
    import torch

    from fqr.fusion.compiled import compare_compiled, comparison_tables

    if model == "hf-qwen3":
        from fqr.fusion.hf_models import QWEN3_8B_PRESET, transformers_missing

        if p.name != QWEN3_8B_PRESET:
            raise UsageError(f"--model hf-qwen3 is built at Qwen3-8B's shapes; got {p.name}")
        if transformers_missing():
            raise UsageError(f"--model hf-qwen3: {transformers_missing()}")
    prefill_t = parse_csv(prefill, "prefill", int)
    decode_t = parse_csv(decode, "decode", int)
    for name, values in (("prefill", prefill_t), ("decode", decode_t)):
        if any(t < 1 for t in values):
            raise UsageError(f"--{name}: token counts must be >= 1, got {values}")
    if not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA GPU is visible to torch")
    result = compare_compiled(
        model,
        layers=layers,
        dtype=dtype,
        device="cuda",
        prefill=tuple(prefill_t),
        decode=tuple(decode_t),
        profile_tokens=tuple(t for t in prefill_t if t >= PROFILE_MIN_TOKENS) if profile else (),
        check_tokens=tokens,
        preset=p.name,
        seed=seed,
        log=lambda msg: err.print(f"{msg}...", style="dim", highlight=False, markup=False),
    )
    if json_out:
        out.print_json(json.dumps(fuse_document(result)))
    else:
        for title, header, rows in comparison_tables(result):
            table = Table(title=title)
            for h in header:
                table.add_column(h)
            for row in rows:
                add_plain_row(table, *row)
            out.print(table)
    if not result.passed:
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
