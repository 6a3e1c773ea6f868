"""Issue 12, GPU session 1: where the host time goes, and a tuning sweep of the cuda target.

Run on the device machine from the fqr checkout (PYTHONPATH=.), with ``FQR_BEFORE`` naming a
checkout of the code before the fast path (profiled the same way). Writes logs and JSON under
``$OUT``; prints short tables last.

1. numerics: the fast path (direct launcher, DENSE strides and strided views) against float64;
2. cProfile of 3,000 calls of the public op at T = 1 (before / after);
3. host µs per call at T = 1, 16, 1024: public op, torch.ops.fqr, F.rms_norm, a bare Triton
   launch (the hand-written kernel);
4. device µs (CUDA-graph replays over rotating input sets) for every preset, T and tiling
   option set, and the hand-written kernel beside it; compiles are warmed in parallel first.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import torch

from fqr.bench.config import DEFAULT_PRESETS

OUT = os.environ.get("OUT", "/tmp/out")
PRESETS = [*DEFAULT_PRESETS, "glm4-9b"]  # the bench's target set and a GPT-J (pairs) model
TOKENS = [1, 16, 1024, 4096, 16384, 65536]
CONFIGS = [
    dict(num_warps=w, block_t=b, tile_elems=e, chunk_mode=m)
    for w, b, e, m in itertools.product((1, 2, 4, 8), (1, 2, 4), (2048, 4096), ("unroll", "grid"))
    if not (b == 4 and e == 4096) and not (w == 8 and b == 1)
]
if os.environ.get("SWEEP") == "glm":  # session 2: GPT-J pairs read as split tiles or rows
    PRESETS = ["glm4-9b"]
    CONFIGS = [
        dict(num_warps=w, block_t=1, tile_elems=2048, chunk_mode=m, pair_access=a)
        for w, m, a in itertools.product((1, 2, 4, 8), ("unroll", "grid"), ("split", "reshape"))
    ]
# Session 2 also compiles these (preset, dtype) kernel variants in the same process pool, for
# the fqr bench run that follows (_warm_bench).
WARM_BENCH = [n for n in os.environ.get("WARM_BENCH", "").split(",") if n]
ROTATE_BYTES = 256 << 20


def log(*a):
    print(*a, flush=True)


def setup(name, tokens, dtype=torch.bfloat16, sets=1, seed=0):
    from fqr.inputs import random_inputs
    from fqr.presets import get_preset

    preset = get_preset(name)
    cache = preset.cos_sin_cache().cuda()
    g = torch.Generator("cuda").manual_seed(seed)
    return preset, [random_inputs(preset.spec, tokens, dtype, g, cache) for _ in range(sets)]


def n_sets(preset, tokens, esize=2):
    per = tokens * preset.spec.qkv_width * esize * 2
    return max(1, min(32, -(-ROTATE_BYTES // max(per, 1))))


def graph_us(calls, reps=20):
    """Device µs per call: one graph launching every call once, replayed ``reps`` times.
    (Session 1 also timed the copy ceiling this way: a copy in a graph is a memcpy node on
    the copy engines, 2770 GB/s, not the 4249 GB/s of the copy kernel; the % printed by this
    script are against that lower figure, docs/PERFORMANCE.md rescales them.)"""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps / len(calls))
    del g
    return sorted(times)[len(times) // 2]


def host_us(call, calls=3000, rounds=5):
    from fqr.bench.timers import CudaTimers

    return CudaTimers().dispatch_us(call, calls=calls, rounds=rounds)


def ceiling():
    """Session 2: the bench's own copy ceiling (copy kernel, do_bench), not a graph memcpy."""
    if os.environ.get("SWEEP") == "glm":
        from fqr.bench.timers import CudaTimers

        return CudaTimers().copy_ceiling()["gbps"]
    src = torch.empty(1 << 29, dtype=torch.float32, device="cuda").normal_()
    dst = torch.empty_like(src)
    us = graph_us([lambda: dst.copy_(src)], reps=10)
    return 2 * src.numel() * 4 / us / 1e3


def traffic(preset, tokens, esize=2):
    s = preset.spec
    w = s.qkv_width
    norm = 2 * s.head_dim * esize if s.norm == "head" else 0
    return 2 * tokens * w * esize + 8 * tokens + 4 * tokens * s.rotary_dim + norm


# --------------------------------------------------------------------------- 1. numerics
def check_numerics():
    """The fast path on the GPU against float64: contiguous (DENSE) and strided qkv views."""
    import fqr
    from fqr.bench import handwritten
    from fqr.numerics import compare
    from fqr.reference import prologue

    names = ("qwen3-8b", "glm4-9b", "qwen3.5-27b")
    cases = [(n, t, s) for n in names for t in (1, 16, 1000) for s in (False, True)]
    if os.environ.get("SWEEP") == "glm":  # fewer compiles: the bench checks every cell
        cases = [("qwen3-8b", 16, False), ("qwen3-8b", 1000, True), ("glm4-9b", 1000, True)]
    rows = []
    for name, tokens, strided in cases:
        preset, (inp,) = setup(name, tokens)
        qkv = inp.qkv
        if strided:
            wide = torch.randn(tokens, qkv.shape[1] + 64, device="cuda").to(qkv.dtype)
            wide[:, : qkv.shape[1]] = qkv
            qkv = wide[:, : qkv.shape[1]]
        args = (qkv,) + inp.args()[1:]
        torch.cuda.empty_cache()
        fqr.split_qkv_rmsnorm_rope(*args, **inp.kwargs())
        outs = fqr.split_qkv_rmsnorm_rope(*args, **inp.kwargs())  # the bound launcher
        exact = prologue(*args, **inp.kwargs())
        ok = all(
            compare(o, e, head_dim=preset.spec.head_dim, bitwise=i == 2).passed
            for i, (o, e) in enumerate(zip(outs, exact))
        )
        rows.append((name, tokens, strided, ok))
    for name in ("qwen3-8b", "gemma3-27b"):
        preset, (inp,) = setup(name, 100)
        outs = handwritten.qwen3_prologue(*inp.args(), spec=preset.spec)
        exact = prologue(*inp.args(), **inp.kwargs())
        ok = all(compare(o, e, head_dim=preset.spec.head_dim).passed for o, e in zip(outs, exact))
        rows.append(("handwritten", name, ok))
    return rows


# --------------------------------------------------------------------------- 2. profile
PROFILE_SNIPPET = r"""
import cProfile, pstats, io, sys, torch, fqr
from fqr.inputs import random_inputs
from fqr.presets import get_preset
p = get_preset("qwen3-8b")
g = torch.Generator("cuda").manual_seed(0)
inp = random_inputs(p.spec, 1, torch.bfloat16, g, p.cos_sin_cache().cuda())
args, kw = inp.args(), inp.kwargs()
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
st.sort_stats("tottime").print_stats(25)
st.sort_stats("cumulative").print_stats(30)
print(s.getvalue())
"""


def profile(root, tag):
    env = dict(os.environ, PYTHONPATH=root)
    r = subprocess.run(
        [sys.executable, "-c", PROFILE_SNIPPET], env=env, cwd=root, capture_output=True, text=True
    )
    path = f"{OUT}/profile-{tag}.txt"
    with open(path, "w") as f:
        f.write(r.stdout + r.stderr)
    return path


# --------------------------------------------------------------------------- 3. dispatch
def dispatch_table():
    import torch.nn.functional as F

    import fqr
    import fqr.fusion  # noqa: F401  (registers torch.ops.fqr)
    from fqr.bench import handwritten

    rows = []
    for tokens in (1, 16, 1024):
        preset, (inp,) = setup("qwen3-8b", tokens)
        args, kw = inp.args(), inp.kwargs()
        s = preset.spec
        op = torch.ops.fqr.split_qkv_rmsnorm_rope
        op_args = args + (None, None, s.num_heads, s.num_kv_heads, s.head_dim, float(s.eps))
        op_args += (s.is_neox, float(s.weight_offset), s.norm, "fused")
        d = s.head_dim
        x = inp.qkv.view(tokens, -1, d)
        w = inp.q_weight
        with torch.inference_mode():
            r = dict(
                T=tokens,
                public=host_us(lambda a=args, k=kw: fqr.split_qkv_rmsnorm_rope(*a, **k)),
                custom_op=host_us(lambda a=op_args, f=op: f(*a)),
                rms_norm=host_us(lambda x=x, d=d, w=w: F.rms_norm(x, (d,), w, 1e-6)),
                triton=host_us(lambda a=args, s=s: handwritten.qwen3_prologue(*a, spec=s)),
            )
        rows.append(r)
        log("dispatch", r)
    return rows


# --------------------------------------------------------------------------- 4. sweep
# One T per kernel variant of the cuda target's token buckets: decode, middle, large.
BUCKET_TOKENS = (1, 300, 9000)


def _warm_bench(name, dtype_name):
    """Compile one preset's kernel variants (one launch per token bucket) in this process, for
    the ``fqr bench`` run that follows (Triton's disk cache)."""
    try:
        from fqr.core import dtype_of
        from fqr.inputs import random_inputs
        from fqr.lowering import lower_by_tokens
        from fqr.presets import get_preset
        from fqr.prologue import program_of

        preset, dtype = get_preset(name), dtype_of(dtype_name)
        variants = lower_by_tokens(program_of(preset, dtype), "cuda")
        cache = preset.cos_sin_cache().cuda()
        g = torch.Generator("cuda").manual_seed(0)
        for tokens in BUCKET_TOKENS:
            variants.launch(random_inputs(preset.spec, tokens, dtype, g, cache).operands())
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001  (reported, the run goes on)
        return f"{name} {dtype_name}: {type(e).__name__}: {str(e)[:300]}"


def _warm(job):
    if len(job) == 3:  # a bench (preset, dtype): every token-bucket variant
        return _warm_bench(job[0], job[1])
    name, cfg = job
    import fqr.lowering as L
    from fqr.presets import get_preset
    from fqr.prologue import program_of

    try:
        preset = get_preset(name)
        k = L.lower(program_of(preset, torch.bfloat16), "cuda", **cfg)
        _, (inp,) = setup(name, 64)
        k.launch(inp.operands())
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001
        return f"{name} {cfg}: {type(e).__name__}: {str(e)[:200]}"


DEFAULT = dict(num_warps=2, block_t=1, tile_elems=2048, chunk_mode="unroll")


def summary(results, name, tokens, sets):
    """One line: the former default, the best option set and the best hand-written kernel."""
    here = [r for r in results if r["preset"] == name and r["T"] == tokens]
    ours = [r for r in here if isinstance(r["cfg"], dict)]
    hand = [r for r in here if isinstance(r["cfg"], str)]
    best = max(ours, key=lambda r: r["pct"], default=None)
    hw = max(hand, key=lambda r: r["pct"], default=None)
    dflt = next((r for r in ours if r["cfg"] == DEFAULT), None)

    def fmt(r):
        return "-" if r is None else f"{r['us']:.2f}us {r['pct']:.1f}% {r['cfg']}"

    return (
        f"{name:16s} T={tokens:6d} sets={sets:2d} default {fmt(dflt)} | best {fmt(best)} "
        f"| hand {fmt(hw)}"
    )


def sweep(ceil):
    import fqr.lowering as L
    from fqr.bench import handwritten
    from fqr.presets import get_preset
    from fqr.prologue import program_of

    jobs = [(n, c) for n in PRESETS for c in CONFIGS]
    jobs += [(n, d, None) for n in WARM_BENCH for d in ("bf16", "fp16")]
    t0 = time.time()
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(15, mp_context=spawn) as ex:
        errors = [e for e in ex.map(_warm, jobs) if e]
    log(f"warmed {len(jobs)} kernels in {time.time() - t0:.0f}s; {len(errors)} errors")
    for e in errors[:20]:
        log("  ", e)
    results = []
    for name in PRESETS:
        preset = get_preset(name)
        program = program_of(preset, torch.bfloat16)
        kernels = {}
        for i, cfg in enumerate(CONFIGS):
            try:
                kernels[i] = L.lower(program, "cuda", **cfg)
            except Exception as e:  # noqa: BLE001
                log("lower failed", name, cfg, e)
        for tokens in TOKENS:
            sets = n_sets(preset, tokens)
            _, inps = setup(name, tokens, sets=sets)
            outs = [
                [
                    torch.empty(tokens, w, dtype=torch.bfloat16, device="cuda")
                    for w in (
                        preset.spec.num_heads * preset.spec.head_dim,
                        preset.spec.num_kv_heads * preset.spec.head_dim,
                        preset.spec.num_kv_heads * preset.spec.head_dim,
                    )
                ]
                for _ in inps
            ]
            nbytes = traffic(preset, tokens)
            for i, k in kernels.items():
                try:
                    calls = [
                        (lambda k=k, a=a.operands(), o=o: k.launch(a, o))
                        for a, o in zip(inps, outs)
                    ]
                    us = graph_us(calls)
                except Exception as e:  # noqa: BLE001
                    log("measure failed", name, tokens, CONFIGS[i], str(e)[:200])
                    continue
                pct = nbytes / us / 1e3 / ceil * 100
                results.append(dict(preset=name, T=tokens, cfg=CONFIGS[i], us=us, pct=pct))
            if handwritten.supports(preset.spec):
                for w in (1, 2, 4, 8):
                    calls = [
                        (
                            lambda a=a, o=o, w=w, spec=preset.spec: handwritten.qwen3_prologue(
                                *a.args(), spec=spec, num_warps=w, out=o
                            )
                        )
                        for a, o in zip(inps, outs)
                    ]
                    us = graph_us(calls)
                    pct = nbytes / us / 1e3 / ceil * 100
                    cfg = f"handwritten-w{w}"
                    results.append(dict(preset=name, T=tokens, cfg=cfg, us=us, pct=pct))
            log(summary(results, name, tokens, sets))
            del inps, outs
            torch.cuda.empty_cache()
        with open(f"{OUT}/sweep.json", "w") as f:
            json.dump(dict(ceiling_gbps=ceil, results=results), f)
    return results


def write_tuning(results):
    """The sweep's tuning table (:func:`fqr.lowering.tuning.table_from_sweep`) as
    ``$OUT/tuning.json``: review it, then copy it over fqr/lowering/tuning.json."""
    from fqr.lowering import plan_program
    from fqr.lowering.targets import UNTUNED, shape_key
    from fqr.lowering.tuning import table_from_sweep
    from fqr.presets import get_preset
    from fqr.prologue import program_of

    presets = {name: get_preset(name) for name in PRESETS}
    shapes = {n: shape_key(plan_program(program_of(p, torch.bfloat16))) for n, p in presets.items()}
    doc = table_from_sweep(
        results,
        shapes,
        UNTUNED,
        source=f"scripts/launch_floor_sweep.py on {torch.cuda.get_device_name()}, bf16, "
        f"T = {TOKENS}, device us of CUDA-graph replays over rotating inputs",
        models={n: p.hf_id for n, p in presets.items()},
    )
    with open(f"{OUT}/tuning.json", "w") as f:
        json.dump(doc, f, indent=1)
    log(f"tuning table: {OUT}/tuning.json ({len(doc['entries'])} shapes)")


def main():
    os.makedirs(OUT, exist_ok=True)
    import triton

    log("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())
    t0 = time.time()
    rows = check_numerics()
    log("numerics", rows)
    before = os.environ.get("FQR_BEFORE")
    if before:
        log("profile before:", profile(before, "before"))
    log("profile after:", profile(os.getcwd(), "after"))
    if os.environ.get("SWEEP") != "glm":  # session 2: the bench's dispatch table instead
        disp = dispatch_table()
        with open(f"{OUT}/dispatch.json", "w") as f:
            json.dump(disp, f)
    ceil = ceiling()
    log(f"ceiling {ceil:.0f} GB/s; {time.time() - t0:.0f}s so far")
    write_tuning(sweep(ceil))
    log(f"done in {time.time() - t0:.0f}s")
    for tag in ("before", "after"):
        p = f"{OUT}/profile-{tag}.txt"
        if os.path.exists(p):
            log(f"--- {tag} (top of tottime)")
            log("\n".join(open(p).read().splitlines()[:45]))


if __name__ == "__main__":
    main()
