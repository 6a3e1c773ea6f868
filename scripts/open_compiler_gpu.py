"""GPU check of the open compiler (issue 15, part A): run on the device machine as

    PYTHONPATH=. python3 scripts/open_compiler_gpu.py

1. Checks, compiled for CUDA, against float64 computed independently (``fqr.reference`` on
   index arithmetic): a Qwen3.5-27B-shaped gate-interleaved split (q and gate views of head
   stride 2*D), sections with their own head dims (MiniMax-M3-like indexer heads), k/v with
   different head counts in padded heads, a narrow rotary table (rotary_dim 2) on 512- and
   769-wide heads, and outputs written as rows of a wider buffer. Outputs are NaN-poisoned.
2. Timings at 65,536 tokens (bf16), same run: the kernel as generated (each output's row stride
   a kernel argument, ``outN_stride``) against the same source with the stride written as a
   constant (the emitter's previous text), and a device-to-device copy (the ceiling).

Logs go under $OUT (default /tmp/out); a short table is printed last. Without CUDA it runs the
checks at small sizes under Triton's interpreter and skips the timings (it says so).
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import time
from pathlib import Path

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support import compositions  # noqa: E402  (the compositions the CPU tests run)

from fqr.bench import traffic_bytes  # noqa: E402
from fqr.inputs import random_inputs  # noqa: E402
from fqr.lowering import lower  # noqa: E402
from fqr.lowering.loader import load_kernel  # noqa: E402
from fqr.numerics import compare  # noqa: E402
from fqr.presets import get_preset  # noqa: E402
from fqr.prologue import program_of  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
TARGET = "cuda" if CUDA else "interpret"
OUT = Path(os.environ.get("OUT", "/tmp/out"))
LOG: list[str] = []


def log(line: str) -> None:
    print(line, flush=True)
    LOG.append(line)


def run_checked(name, program, args, expected, head_dims, copies=(), out=None):
    """Launch on the device into poisoned outputs (or ``out``); compare on the host."""
    dev_args = [a.to(DEV) for a in args]
    tokens = args[0].shape[0]
    if out is None:
        out = [
            torch.full((tokens, v.aval.shape[1]), float("nan"), dtype=v.aval.dtype, device=DEV)
            for v in program.outputs
        ]
    t0 = time.perf_counter()
    lower(program, TARGET)(*dev_args, out=out)
    if CUDA:
        torch.cuda.synchronize()
    results = [
        compare(o.cpu(), e, head_dim=d, bitwise=i in copies)
        for i, (o, e, d) in enumerate(zip(out, expected, head_dims))
    ]
    ok = all(r.passed for r in results)
    log(
        f"check {name:34s} T={tokens:5d} ulp={[r.max_ulp for r in results]} "
        f"{'PASS' if ok else 'FAIL'} ({time.perf_counter() - t0:.1f} s incl. compile)"
    )
    for i, r in enumerate(results):
        if not r.passed:
            log(f"    output {i}: {r}")
    return ok, out


def check_case(name, case: compositions.Case, out=None):
    """One composition of tests/support/compositions.py, compiled and checked on the device."""
    args = (case.program, case.args, case.expected, case.head_dims, case.copies, out)
    return run_checked(name, *args)


def check_compositions(gen, big, small) -> bool:
    """The compositions the CPU tests run small, here at model sizes: gate interleaved (Qwen3.5
    shapes), indexer sections (MiniMax-M3-like), padded heads, narrow rotary, strided out=."""
    sizes = dict(hq=24, hkv=4, d=256, r=64) if CUDA else {}
    ok = check_case("gate-interleaved", compositions.gated_case(gen, big, **sizes))[0]
    sizes = dict(hq=8, hkv=1, d=128, hi=4, di=64, r=64, ri=32) if CUDA else {}
    case = compositions.indexer_case(gen, big, **sizes)
    ok &= check_case("sections with own head_dims", case)[0]
    case = compositions.padded_case(gen, big, heads=(4, 2, 3), d=80, stride=96, r=32)
    ok &= check_case("k/v head counts, padded heads", case)[0]
    for d in (512, 769):
        for is_neox in (True, False):
            case = compositions.narrow_case(gen, big if CUDA else small, d, 2, is_neox)
            name = f"rotary_dim 2, D={d}, {'neox' if is_neox else 'gptj'}"
            ok &= check_case(name, case)[0]
    d = 128
    case = compositions.narrow_case(gen, big, d, 32, True)
    buffers = [
        torch.full((big, w + 40), float("nan"), dtype=torch.bfloat16, device=DEV)
        for w in (2 * d, d, d)
    ]
    out = [b[:, : b.shape[1] - 40] for b in buffers]
    strided_ok, out = check_case(f"strided out= rows, D={d}", case, out)
    for b, o in zip(buffers, out):
        if not torch.isnan(b[:, o.shape[1] :]).all():
            log("    the padding of a strided output was written: FAIL")
            strided_ok = False
    return bool(ok and strided_ok)


# ----------------------------------------------------------------------------- timings


def inputs(p, tokens, dtype):
    gen = torch.Generator(device=DEV).manual_seed(tokens)
    return random_inputs(p.spec, tokens, dtype, gen, p.cos_sin_cache().to(DEV)).operands()


def constant_stride_variant(kernel):
    """The same kernel with each output's row stride written as a constant (previous emitter)."""
    widths = [int(v.aval.shape[1]) for v in kernel.program.outputs]
    source = re.sub(
        r"tok64\[:, None, None\] \* out(\d+)_stride",
        lambda m: f"tok64[:, None, None] * {widths[int(m.group(1))]}",
        kernel.source,
    )
    assert source != kernel.source
    loaded = load_kernel(
        f"{kernel.path.stem[4:]}_conststride",
        source,
        kernel.fn.__name__,
        interpret=kernel.target.interpret,
    )
    return dataclasses.replace(kernel, fn=loaded.fn, source=source, path=loaded.path)


def time_kernels(rows):
    import triton

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")

    def copy_ceiling() -> float:
        src = torch.empty(2 * 65536 * 6144, dtype=torch.bfloat16, device=DEV).normal_()
        dst = torch.empty_like(src)
        return 2 * src.numel() * 2 / bench(lambda: dst.copy_(src)) / 1e6  # GB/s, read + write

    ceiling = copy_ceiling()
    log(f"copy ceiling {ceiling:.0f} GB/s")
    for name in ("qwen3-8b", "qwen3-32b", "gemma3-1b", "glm4-9b", "gemma3-27b"):
        p = get_preset(name)
        tokens, dtype = 65536, torch.bfloat16
        program = program_of(p, dtype)
        args = inputs(p, tokens, dtype)
        kernel = lower(program, "cuda")
        variant = constant_stride_variant(kernel)
        outs = [torch.empty((tokens, v.aval.shape[1]), dtype=dtype, device=DEV)
                for v in program.outputs]  # fmt: skip
        ref = [torch.empty_like(o) for o in outs]
        kernel(*args, out=outs)
        variant(*args, out=ref)
        same = all(torch.equal(a, b) for a, b in zip(outs, ref))
        nbytes = traffic_bytes(p.spec, dtype, tokens).total
        timings = []
        for k in (kernel, variant, kernel, variant):  # interleaved, twice
            timings.append(bench(lambda k=k, a=args, o=outs: k.launch(a, o)))
        t_new, t_old = min(timings[0::2]), min(timings[1::2])
        rows.append((name, t_new * 1e3, t_old * 1e3, nbytes, ceiling, same))
        log(
            f"time {name:12s} T=65536 runtime stride {t_new * 1e3:7.1f} us "
            f"({100 * nbytes / t_new / 1e6 / ceiling:5.1f}%), constant stride "
            f"{t_old * 1e3:7.1f} us ({100 * nbytes / t_old / 1e6 / ceiling:5.1f}%), "
            f"outputs identical: {same}"
        )


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(int(os.environ.get("SEED", "20261130")))
    log(f"device: {torch.cuda.get_device_name(0) if CUDA else 'cpu (interpreter)'}; "
        f"torch {torch.__version__}")  # fmt: skip
    big, small = (1037, 3) if CUDA else (5, 3)
    ok = check_compositions(gen, big, small)
    rows: list = []
    if CUDA:
        time_kernels(rows)
    else:
        # What the timing compares, run once under the interpreter: identical outputs.
        p = get_preset("qwen3-8b")
        program = program_of(p, torch.bfloat16)
        args = inputs(p, 4, torch.bfloat16)
        kernel = lower(program, "interpret")
        variant = constant_stride_variant(kernel)
        same = all(torch.equal(a, b) for a, b in zip(kernel(*args), variant(*args)))
        log(f"constant-stride variant of qwen3-8b under the interpreter: outputs identical: {same}")
        ok &= same
        log("timings skipped: no CUDA GPU here")
    (OUT / "open_compiler_gpu.log").write_text("\n".join(LOG) + "\n")
    print("\n| preset (bf16, T=65536) | runtime stride us | % ceiling | constant stride us | "
          "% ceiling | same outputs |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for name, t_new, t_old, nbytes, ceiling, same in rows:
        new, old = (100 * nbytes / (t * 1e-6) / 1e9 / ceiling for t in (t_new, t_old))
        print(f"| {name} | {t_new:.1f} | {new:.1f} | {t_old:.1f} | {old:.1f} | {same} |")
    print(f"CHECKS {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
