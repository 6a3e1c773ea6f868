"""Issue 12, second pass, on the GPU: the generated host function, then the tuning sweep.

    FQR_CACHE_DIR=$(mktemp -d) PYTHONPATH=. python3 scripts/launch_floor_host.py

1. checks: the public op through the generated host function (``fqr.lowering.host``) against
   float64 (``fqr.reference``) for bf16 / fp16, T in every token bucket, contiguous and strided
   qkv, in place; the host function covers the call, and new T generate and compile nothing;
2. host µs per call (T = 1, 16, 1024), all in this run: the public op through the host
   function, the same op through the general path (host function off: the first pass's path),
   ``torch.ops.fqr``, ``F.rms_norm`` and a bare Triton launch;
3. cProfile of 3,000 calls of the public op at T = 1 (Qwen3-8B bf16);
4. device µs (CUDA-graph replays over rotating input sets) of tiling option sets where the
   first pass missed: 1,024 / 4,096 tokens on six presets, fp16 and bf16 at 16,384 / 65,536 on
   the 1-warp presets, Qwen3.5-27B at 16,384 / 65,536.

``MODE=bench``: instead, the final measurement with the chosen tuning: every (preset, dtype)
kernel variant compiled in parallel first, then one ``fqr bench`` run (device, wall and
dispatch tables; bf16 and fp16; the issue's presets and token counts) and the host table above
(host function against the general path, and against the third pass's parts switched off:
the ``call_metadata`` key instead of the call guard, then also Triton's
``CudaLauncher.__call__`` instead of the inner C launch, i.e. the second pass's path) for
every preset:

    MODE=bench FQR_CACHE_DIR=$(mktemp -d) PYTHONPATH=. python3 scripts/launch_floor_host.py

Logs and ``host-sweep.json`` (``bench.json``, ``host-dispatch.json`` in bench mode) under
``$OUT`` (default a temp dir); short tables last. Without CUDA it says so and exits 0 (the CPU
tests cover the host function under the interpreter).
"""

from __future__ import annotations

import cProfile
import io
import itertools
import json
import multiprocessing
import os
import pstats
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

OUT = os.environ.get("OUT") or tempfile.mkdtemp(prefix="fqr-host-")
MIDDLE = ["qwen3-0.6b", "qwen3-8b", "qwen3-32b", "qwen3-235b-a22b", "gemma3-27b", "qwen3.5-27b"]
MIDDLE_CONFIGS = [
    dict(num_warps=w, block_t=b, tile_elems=2048, chunk_mode=m)
    for m, w, b in itertools.product(("grid", "unroll"), (1, 2, 4), (1, 2, 4))
]
LARGE = ["qwen3-0.6b", "qwen3-8b", "qwen3-235b-a22b", "qwen3.5-27b"]
LARGE_CONFIGS = [
    dict(num_warps=w, block_t=b, tile_elems=e, chunk_mode="unroll")
    for w, b, e in itertools.product((1, 2, 4), (1, 2), (2048, 4096))
]
JSON: dict = {}


def log(*a):
    print(*a, flush=True)


def save():
    with open(f"{OUT}/host-sweep.json", "w") as f:
        json.dump(JSON, f, indent=1, default=str)


# --------------------------------------------------------------------------- 1. checks
def checks() -> bool:
    from launch_floor_sweep import setup

    import fqr
    import fqr.lowering.host as host
    import fqr.prologue as prologue
    from fqr.numerics import compare
    from fqr.reference import prologue as exact_prologue

    ok_all = True
    rows = []
    for name, dtype in (("qwen3-8b", torch.bfloat16), ("qwen3.5-27b", torch.float16)):
        for strided, inplace in ((False, False), (True, False), (False, True)):
            prologue._CALLS.clear()
            for tokens in (1, 7, 300, 9000, 5):
                preset, (inp,) = setup(name, tokens, dtype=dtype)
                qkv = inp.qkv
                if strided:
                    wide = torch.randn(tokens, qkv.shape[1] + 64, device="cuda").to(dtype)
                    wide[:, : qkv.shape[1]] = qkv
                    qkv = wide[:, : qkv.shape[1]]
                args = (qkv,) + inp.args()[1:]
                exact = exact_prologue(*args, **inp.kwargs())
                kw = dict(inp.kwargs(), inplace=inplace)
                first = qkv.clone() if inplace else qkv  # same metadata as qkv
                fqr.split_qkv_rmsnorm_rope(first, *args[1:], **kw)
                builds = host.BUILDS
                work = qkv.clone() if inplace else qkv
                outs = fqr.split_qkv_rmsnorm_rope(work, *args[1:], **kw)
                torch.cuda.synchronize()
                covered = all(
                    c.host[1 if inplace else 0] is not None for c in prologue._CALLS.values()
                )
                ok = all(
                    compare(o, e, head_dim=preset.spec.head_dim, bitwise=i == 2).passed
                    for i, (o, e) in enumerate(zip(outs, exact))
                )
                rows.append(
                    dict(
                        preset=name,
                        dtype=str(dtype),
                        T=tokens,
                        strided=strided,
                        inplace=inplace,
                        numerics=ok,
                        host_covers=covered,
                        builds_on_repeat=host.BUILDS - builds,
                    )
                )
                ok_all &= ok and covered and host.BUILDS == builds
                log("check", rows[-1])
    JSON["checks"] = rows
    return ok_all


# --------------------------------------------------------------------------- 2. dispatch
def host_us(call, calls=1000, rounds=7):
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    per = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            call()
        per.append((time.perf_counter() - t) / calls * 1e6)
        torch.cuda.synchronize()
    return sorted(per)[len(per) // 2]


def dispatch(presets=(("qwen3-8b", "bf16"), ("qwen3-32b", "fp16"))) -> list[dict]:
    from launch_floor_sweep import setup

    import fqr.prologue as prologue
    from fqr.bench.run import dispatch_callables
    from fqr.core import dtype_of
    from fqr.presets import get_preset

    rows = []
    for name, dtype_name in presets:
        dtype = dtype_of(dtype_name)
        calls = dispatch_callables(get_preset(name), dtype, "fused")
        for tokens in (1, 16, 1024):
            _, (inp,) = setup(name, tokens, dtype=dtype)
            r = dict(preset=name, dtype=str(dtype), T=tokens)
            with torch.inference_mode():
                for label, fn in calls.items():
                    r[label] = host_us(lambda fn=fn, x=inp: fn(x))
                # the third pass's parts switched off one by one, same run
                r.update(previous_paths(calls["public op"], inp))
                # the general path: the same op with its checked calls' host functions off
                saved = prologue.CheckedCall.MAX_HOST_BUILDS
                prologue.CheckedCall.MAX_HOST_BUILDS = 0
                for c in prologue._CALLS.values():
                    c.host[0] = c.host[1] = None
                r["public op, general path"] = host_us(lambda fn=calls["public op"], x=inp: fn(x))
                prologue.CheckedCall.MAX_HOST_BUILDS = saved
                for c in prologue._CALLS.values():
                    c._host_builds = 0
            base = r["F.rms_norm"]
            r["public / aten"] = r["public op"] / base
            r["custom op / aten"] = r["torch.ops.fqr"] / base
            r["general / aten"] = r["public op, general path"] / base
            r["second pass / aten"] = r[SECOND_PASS] / base
            rows.append(r)
            log("dispatch", {k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()})
    JSON["dispatch"] = rows
    return rows


NO_GUARD = "public op, key instead of guard"
SECOND_PASS = "public op, key + CudaLauncher.__call__ (second pass)"


def previous_paths(public_op, inp) -> dict[str, float]:
    """Host µs of the public op without the third pass's call guard (the ``call_metadata``
    key built and hashed on every call), then also without the inner C launch (the host
    functions regenerated to call Triton's bound ``CudaLauncher``, as the second pass did;
    the outputs still ``as_strided`` views)."""
    import fqr.lowering.host as host
    import fqr.prologue as prologue
    import fqr.validate as validate

    def regenerate():
        for c in prologue._CALLS.values():
            c.host[0] = c.host[1] = None
            c._host_builds = 0

    out = {}
    guards, guard_of, limit = validate._GUARDS, dict(validate._GUARD_OF), validate.MAX_GUARDS
    validate.MAX_GUARDS = 0
    validate.forget_checked_keys()
    out[NO_GUARD] = host_us(lambda: public_op(inp))
    inner = host.inner_c_launch
    host.inner_c_launch = lambda run: None
    regenerate()
    out[SECOND_PASS] = host_us(lambda: public_op(inp))
    host.inner_c_launch = inner
    regenerate()
    validate.MAX_GUARDS = limit
    validate._GUARDS = guards
    validate._GUARD_OF.update(guard_of)
    return out


def profile() -> str:
    from launch_floor_sweep import setup

    import fqr

    _, (inp,) = setup("qwen3-8b", 1)
    args, kw = inp.args(), inp.kwargs()
    with torch.inference_mode():
        for _ in range(200):
            fqr.split_qkv_rmsnorm_rope(*args, **kw)
        torch.cuda.synchronize()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(3000):
            fqr.split_qkv_rmsnorm_rope(*args, **kw)
        pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    st = pstats.Stats(pr, stream=s)
    st.sort_stats("tottime").print_stats(20)
    st.sort_stats("cumulative").print_stats(20)
    path = f"{OUT}/profile-host-function.txt"
    with open(path, "w") as f:
        f.write(s.getvalue())
    return path


# --------------------------------------------------------------------------- 4. sweep
def jobs() -> list[tuple[str, str, dict]]:
    out = [(n, "bf16", c) for n in MIDDLE for c in MIDDLE_CONFIGS]
    out += [(n, d, c) for n in LARGE for d in ("bf16", "fp16") for c in LARGE_CONFIGS]
    seen, unique = set(), []
    for j in out:
        key = (j[0], j[1], tuple(sorted(j[2].items())))
        if key not in seen:
            seen.add(key)
            unique.append(j)
    return unique


def _warm(job):
    name, dtype_name, cfg = job
    try:
        from launch_floor_sweep import setup

        import fqr.lowering as L
        from fqr.core import dtype_of
        from fqr.presets import get_preset
        from fqr.prologue import preset_program

        dtype = dtype_of(dtype_name)
        k = L.lower(preset_program(get_preset(name), dtype), "cuda", **cfg)
        _, (inp,) = setup(name, 64, dtype=dtype)
        k.launch(inp.operands())
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001  (reported, the sweep goes on)
        return f"{name} {dtype_name} {cfg}: {type(e).__name__}: {str(e)[:200]}"


def sweep(ceil: float) -> list[dict]:
    from launch_floor_sweep import graph_us, n_sets, setup, traffic

    import fqr.lowering as L
    from fqr.core import dtype_of
    from fqr.presets import get_preset
    from fqr.prologue import preset_program

    todo = jobs()
    t0 = time.time()
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(15, mp_context=spawn) as ex:
        errors = [e for e in ex.map(_warm, todo) if e]
    log(f"compiled {len(todo)} kernels in {time.time() - t0:.0f}s; {len(errors)} errors")
    for e in errors[:10]:
        log("  ", e)
    plan = [(n, "bf16", t, MIDDLE_CONFIGS) for n in MIDDLE for t in (1024, 4096)]
    plan += [
        (n, d, t, LARGE_CONFIGS) for n in LARGE for d in ("bf16", "fp16") for t in (16384, 65536)
    ]
    results = []
    for name, dtype_name, tokens, configs in plan:
        dtype = dtype_of(dtype_name)
        preset = get_preset(name)
        program = preset_program(preset, dtype)
        esize = torch.empty(0, dtype=dtype).element_size()
        sets = n_sets(preset, tokens, esize)
        _, inps = setup(name, tokens, dtype=dtype, sets=sets)
        widths = [int(v.aval.shape[1]) for v in program.outputs]
        outs = [[torch.empty(tokens, w, dtype=dtype, device="cuda") for w in widths] for _ in inps]
        nbytes = traffic(preset, tokens, esize)
        here = []
        for cfg in configs:
            try:
                k = L.lower(program, "cuda", **cfg)
                calls = [
                    (lambda k=k, a=a.operands(), o=o: k.launch(a, o)) for a, o in zip(inps, outs)
                ]
                us = graph_us(calls)
            except Exception as e:  # noqa: BLE001
                log("measure failed", name, tokens, cfg, str(e)[:200])
                continue
            pct = nbytes / us / 1e3 / ceil * 100
            here.append(dict(preset=name, dtype=dtype_name, T=tokens, cfg=cfg, us=us, pct=pct))
        results += here
        best = max(here, key=lambda r: r["pct"], default=None)
        if best:
            log(f"{name:16s} {dtype_name} T={tokens:6d} best {best['pct']:.1f}% {best['cfg']}")
        del inps, outs
        torch.cuda.empty_cache()
        JSON["sweep"] = results
        save()
    return results


BENCH_PRESETS = [*MIDDLE, "glm4-9b"]
BENCH_TOKENS = [1, 16, 1024, 4096, 16384, 65536]


def print_host_table(rows) -> None:
    for r in rows:
        log(
            f"{r['preset']:16s} {r['dtype'][6:]:9s} T={r['T']:5d} public {r['public op']:6.1f} "
            f"general {r['public op, general path']:6.1f} custom {r['torch.ops.fqr']:6.1f} "
            f"rms_norm {r['F.rms_norm']:5.1f} triton {r['triton launch']:5.1f} | "
            f"public/aten {r['public / aten']:.2f} custom/aten {r['custom op / aten']:.2f} "
            f"general/aten {r['general / aten']:.2f} | no guard {r[NO_GUARD]:6.1f} "
            f"second pass {r[SECOND_PASS]:6.1f} second/aten {r['second pass / aten']:.2f}"
        )


def bench_main() -> int:
    from launch_floor_gpu import print_report, warm

    from fqr import bench
    from fqr.bench.report import dispatch_table, results_table
    from fqr.presets import get_preset

    t0 = time.time()
    errors = warm([(n, d, {}) for n in BENCH_PRESETS for d in ("bf16", "fp16")])
    for e in errors:
        log("compile failed:", e)
    log(f"compiled in {time.time() - t0:.0f}s")
    cfg = bench.BenchConfig(
        presets=[get_preset(n) for n in BENCH_PRESETS],
        tokens=BENCH_TOKENS,
        dtypes=[torch.bfloat16, torch.float16],
        compare=[],
        rep_ms=20.0,
        warmup_ms=5.0,
    )
    doc = bench.run_bench(cfg, progress=lambda text: print(text, file=sys.stderr, flush=True))
    bench.save_document(doc, f"{OUT}/bench.json")
    log(f"bench done in {time.time() - t0:.0f}s")
    rows = dispatch([(n, d) for n in BENCH_PRESETS[:4] for d in ("bf16", "fp16")])
    with open(f"{OUT}/host-dispatch.json", "w") as f:
        json.dump(rows, f, indent=1)
    print_report(results_table(doc))
    table = dispatch_table(doc)
    if table is not None:
        print_report(table)
    log("\nhost us per call: host function against the general path (median of 7 x 1000)")
    print_host_table(rows)
    log(f"done in {time.time() - t0:.0f}s, numerics {'passed' if doc['passed'] else 'FAILED'}")
    return 0 if doc["passed"] else 1


def main() -> int:
    os.makedirs(OUT, exist_ok=True)
    if not torch.cuda.is_available():
        log("no CUDA device: skipped (the CPU tests cover the host function)")
        return 0
    if os.environ.get("MODE") == "bench":
        return bench_main()
    import triton

    from fqr.bench.timers import CudaTimers

    log("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())
    t0 = time.time()
    ok = checks()
    log(f"checks {'passed' if ok else 'FAILED'} ({time.time() - t0:.0f}s)")
    rows = dispatch()
    log("profile:", profile())
    ceil = CudaTimers().copy_ceiling()["gbps"]
    JSON["ceiling_gbps"] = ceil
    save()
    log(f"ceiling {ceil:.0f} GB/s; {time.time() - t0:.0f}s so far")
    sweep(ceil)
    save()
    log(f"\nhost us per call (median of 7 x 1000), ceiling {ceil:.0f} GB/s")
    print_host_table(rows)
    log(open(profile_path()).read()[:3000] if os.path.exists(profile_path()) else "")
    log(f"done in {time.time() - t0:.0f}s; checks {'passed' if ok else 'FAILED'}")
    return 0 if ok else 1


def profile_path() -> str:
    return f"{OUT}/profile-host-function.txt"


if __name__ == "__main__":
    sys.exit(main())
