"""``fqr run``: run and verify the fused op across DP x TP worker processes, vLLM-style.

Progress (a live view: steps, tokens/s, per-rank queue depth) and messages go to stderr; the
final per-rank table (or ``--json``) to stdout. Exit 0 when every verified step passed, 1 when
a check failed or a rank failed, died or hung, 2 on bad usage.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from fqr.backends import AUTO_BACKENDS
from fqr.presets import DEFAULT_PRESET
from fqr.runtime.config import LAUNCHERS

from .common import EXIT_FAILED, app, err, example, out, schema
from .options import (
    BackendName,
    DeviceType,
    Dtype,
    DtypeOption,
    JsonOption,
    Numerics,
    NumericsOption,
    PresetName,
    choice_enum,
)

Launcher = choice_enum("Launcher", LAUNCHERS)

_MIB = 1 << 20


def _live_table(p) -> Table:
    t = Table(title="fqr run", show_header=True)
    for col in ("step", "tokens", "tokens/s", "verified", "in flight", "queue depth per rank"):
        t.add_column(col, justify="right")
    depths = " ".join(str(d) for d in p.queue_depths) if p.queue_depths else "-"
    t.add_row(
        str(p.step),
        str(p.tokens),
        f"{p.tokens_per_s:,.0f}",
        str(p.verified_steps),
        str(p.in_flight),
        depths,
    )
    return t


def summary_dict(cfg, result, ready_info: dict, totals: dict, failure: str | None) -> dict:
    layout = cfg.layout
    ranks = []
    for rank in range(layout.world_size):
        dp_rank, tp_rank = layout.coords(rank)
        info = ready_info.get(rank, {})
        stats = result.per_rank.get(rank, {}) if result else {}
        ver = result_verification(result, rank)
        memory = (totals.get(rank) or info or {}).get("memory", {})
        compute_s = stats.get("compute_s", 0.0)
        ranks.append(
            {
                "rank": rank,
                "dp": dp_rank,
                "tp": tp_rank,
                "device": info.get("device"),
                "pid": info.get("pid"),
                "host": info.get("host"),
                "steps": stats.get("steps", 0),
                "tokens": stats.get("tokens", 0),
                "compute_s": compute_s,
                "tokens_per_s": stats.get("tokens", 0) / compute_s if compute_s > 0 else 0.0,
                "memory_bytes": memory.get("used_bytes"),
                "memory_at_init_bytes": info.get("memory", {}).get("used_bytes"),
                "torch_peak_bytes": memory.get("torch_peak_bytes"),
                "verification": ver,
            }
        )
    res = {
        "schema": schema("run"),
        "ok": bool(result and result.ok and failure is None),
        "failure": failure,
        "config": cfg.to_dict(),
        "ranks": ranks,
    }
    if result is not None:
        res.update(
            {
                "steps": result.steps,
                "tokens": result.tokens,
                "wall_s": result.wall_s,
                "tokens_per_s": result.tokens / result.wall_s if result.wall_s > 0 else 0.0,
                "verified_steps": result.verified_steps,
                "verification_failures": result.verification_failures,
                "requests_per_dp": result.requests_per_dp,
                "scheduling": {
                    "async": cfg.async_scheduling,
                    "host_s": result.host_s,
                    "host_overlapped_s": result.host_overlapped_s,
                    "wait_s": result.wait_s,
                },
            }
        )
    return res


def result_verification(result, rank: int) -> dict:
    return {} if result is None else result.verification.get(rank, {})


ULP_NOTE = (
    "max ULP: the worst element against the correctly rounded float64 value, counting elements "
    "below the fp32 compute floor of their head (RoPE cancelling to near zero), which pass on "
    "that absolute bound; err/tol: the worst error as a fraction of the numerics contract's "
    "tolerance (<= 1 passes)"
)


def _print_tables(summary: dict) -> None:
    t = Table(
        title=Text(
            f"fqr run: {summary['config']['preset']} dp={summary['config']['dp']} "
            f"tp={summary['config']['tp']} {summary['config']['device']} "
            f"{summary['config']['backend']}"
        )
    )
    for col in (
        "rank",
        "dp",
        "tp",
        "dev",
        "steps",
        "tok",
        "time_s",
        "tok/s",
        "MiB",
        "verified",
        "max ULP",
        "err/tol",
    ):
        t.add_column(col, justify="right")
    for r in summary["ranks"]:
        v = r["verification"]
        verified = f"{v.get('passed', 0)}/{v.get('checks', 0)}" if v else "-"
        ulp = str(v.get("max_ulp", "-")) if v else "-"
        ratio = f"{v['max_err_ratio']:.2g}" if v and "max_err_ratio" in v else "-"
        mem = f"{r['memory_bytes'] / _MIB:,.0f}" if r["memory_bytes"] else "-"
        t.add_row(
            str(r["rank"]),
            str(r["dp"]),
            str(r["tp"]),
            str(r["device"] or "-"),
            str(r["steps"]),
            str(r["tokens"]),
            f"{r['compute_s']:.3f}",
            f"{r['tokens_per_s']:,.0f}",
            mem,
            verified,
            ulp,
            ratio,
        )
    out.print(t)
    if any(r["verification"] for r in summary["ranks"]):
        out.print(ULP_NOTE, highlight=False, markup=False)
    if "steps" in summary:
        s = summary["scheduling"]
        overlap = (
            f"; async: {s['host_overlapped_s']:.2f} s of {s['host_s']:.2f} s host work "
            f"overlapped with workers"
            if s["async"]
            else f"; sync: host work {s['host_s']:.2f} s, waiting {s['wait_s']:.2f} s"
        )
        out.print(
            f"{summary['steps']} steps, {summary['tokens']} tokens in "
            f"{summary['wall_s']:.2f} s ({summary['tokens_per_s']:,.0f} tokens/s), "
            f"{summary['verified_steps']} steps verified, requests per DP rank "
            f"{summary['requests_per_dp']}{overlap}",
            highlight=False,
            markup=False,
        )


AUTO_HELP = ", ".join(f"{b} on {d}" for d, b in AUTO_BACKENDS.items())


@app.command(
    epilog=example(
        "fqr run --preset qwen3-8b --tp 2 --dp 2 --requests 4",
        "torchrun --standalone --nproc-per-node 4 -m fqr run --launcher torchrun --dp 2 --tp 2",
    )
)
def run(
    preset: Annotated[
        PresetName,
        typer.Option(help="model preset (fqr.presets)"),
    ] = PresetName[DEFAULT_PRESET],
    dp: Annotated[
        int | None, typer.Option(help="data-parallel replicas (default 1; torchrun: world / tp)")
    ] = None,
    tp: Annotated[int, typer.Option(help="tensor-parallel size")] = 1,
    device: Annotated[DeviceType, typer.Option(help="device type of the ranks")] = DeviceType.cpu,
    backend: Annotated[
        BackendName, typer.Option(help=f"fqr backend; auto: {AUTO_HELP}, else reference")
    ] = BackendName.auto,
    dtype: DtypeOption = Dtype.bf16,
    numerics: NumericsOption = Numerics.fused,
    launcher: Annotated[
        Launcher, typer.Option(help="mp: fqr spawns the workers; torchrun: torchrun did")
    ] = Launcher.mp,
    requests: Annotated[int, typer.Option(help="synthetic requests")] = 8,
    prompt_len: Annotated[str, typer.Option(help="prompt length range A..B")] = "16..64",
    decode_steps: Annotated[int, typer.Option(help="decode tokens per request")] = 4,
    max_batched_tokens: Annotated[
        int, typer.Option(help="token budget per step and DP replica")
    ] = 64,
    seed: Annotated[int, typer.Option(help="workload, weights and activations seed")] = 0,
    verify_every: Annotated[int, typer.Option(help="verify every K-th step (0: never)")] = 1,
    async_scheduling: Annotated[
        bool, typer.Option("--async-scheduling", help="two batches in flight")
    ] = False,
    inject_fault: Annotated[
        str | None, typer.Option(help="rank=R,at=init|step:N,kind=raise|exit|hang|kill-parent")
    ] = None,
    init_timeout: Annotated[
        float, typer.Option(help="seconds for every worker to report READY")
    ] = 120.0,
    step_timeout: Annotated[
        float, typer.Option(help="seconds for every rank to answer a step")
    ] = 60.0,
    collective_timeout: Annotated[
        float, typer.Option(help="timeout of every collective (s)")
    ] = 60.0,
    json_out: JsonOption = False,
) -> None:
    """Run the fused op across DP x TP ranks as vLLM's workers do, verifying every step."""
    from fqr.runtime.config import RunConfig

    preset, device, backend = preset.value, device.value, backend.value
    dtype, numerics, launcher = dtype.value, numerics.value, launcher.value
    if launcher == "torchrun" and dp is None:
        from fqr.runtime.torchrun import world_size_from_env

        world = world_size_from_env()
        if tp < 1 or world % tp:
            raise ValueError(f"--tp {tp} does not divide the torchrun world size {world}")
        dp = world // tp
    cfg = RunConfig.build(
        preset=preset,
        dp=1 if dp is None else dp,
        tp=tp,
        device=device,
        backend=backend,
        dtype=dtype,
        numerics=numerics,
        launcher=launcher,
        requests=requests,
        prompt_len=prompt_len,
        decode_steps=decode_steps,
        max_batched_tokens=max_batched_tokens,
        seed=seed,
        verify_every=verify_every,
        async_scheduling=async_scheduling,
        fault=inject_fault,
        init_timeout_s=init_timeout,
        step_timeout_s=step_timeout,
        collective_timeout_s=collective_timeout,
    )
    if launcher == "torchrun":
        summary = _run_torchrun(cfg)
        if summary is None:  # ranks > 0: rank 0 reports
            return
    else:
        summary = _run_mp(cfg)
    _report(summary, json_out)


def _run_mp(cfg) -> dict:
    from fqr.runtime.engine import Engine
    from fqr.runtime.executor import MultiprocExecutor, RunFailed

    executor = MultiprocExecutor(cfg)
    result, failure = None, None
    err.print(
        f"fqr run: starting {cfg.layout.world_size} workers "
        f"(dp={cfg.dp} x tp={cfg.tp}, {cfg.device}, {cfg.backend})",
        highlight=False,
        markup=False,
    )
    try:
        executor.start()
        for rank, info in sorted(executor.ready_info.items()):
            err.print(
                f"  {cfg.layout.describe(rank)}: pid {info['pid']} on {info['device']}",
                highlight=False,
                markup=False,
            )
        with Live(console=err, refresh_per_second=4, transient=True) as live:
            result = Engine(cfg, executor).run(lambda p: live.update(_live_table(p)))
    except RunFailed as e:
        failure = str(e)
    finally:
        executor.shutdown()
    return summary_dict(cfg, result, executor.ready_info, executor.totals, failure)


def _run_torchrun(cfg) -> dict | None:
    from fqr.runtime.executor import RunFailed
    from fqr.runtime.torchrun import run_torchrun

    try:
        with Live(console=err, refresh_per_second=4, transient=True) as live:
            outcome = run_torchrun(cfg, lambda p: live.update(_live_table(p)))
    except RunFailed as e:
        err.print(f"[red]run failed:[/red] {escape(str(e))}", highlight=False)
        sys.exit(EXIT_FAILED)
    if outcome is None:
        return None
    result, infos, totals = outcome
    return summary_dict(cfg, result, infos, totals, None)


def _report(summary: dict, json_out: bool) -> None:
    if summary["failure"]:
        err.print(f"[red]run failed:[/red] {escape(summary['failure'])}", highlight=False)
    failures = summary.get("verification_failures", [])
    for line in failures[:10]:
        err.print(f"[red]verification failed:[/red] {escape(line)}", highlight=False)
    if len(failures) > 10:
        err.print(f"... and {len(failures) - 10} more (see --json)")
    if summary.get("verification_failures"):
        err.print(f"{len(summary['verification_failures'])} verification failure(s)")
    if json_out:
        out.print_json(json.dumps(summary))
    else:
        _print_tables(summary)
    if not summary["ok"]:
        sys.exit(EXIT_FAILED)
