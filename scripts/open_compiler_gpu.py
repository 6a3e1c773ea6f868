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

from fqr import ops, reference  # noqa: E402
from fqr.bench import traffic_bytes  # noqa: E402
from fqr.core import Section, spec, trace  # noqa: E402
from fqr.inputs import random_inputs  # noqa: E402
from fqr.lowering import lower  # noqa: E402
from fqr.lowering.loader import load_kernel  # noqa: E402
from fqr.numerics import compare  # noqa: E402
from fqr.presets import get_preset  # noqa: E402
from fqr.prologue import preset_program  # noqa: E402
from fqr.rope_cache import rope_cos_sin_cache  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
TARGET = "cuda" if CUDA else "interpret"
OUT = Path(os.environ.get("OUT", "/tmp/out"))
MAX_POS = 32768
LOG: list[str] = []


def log(line: str) -> None:
    print(line, flush=True)
    LOG.append(line)


def randn(gen, *shape, scale=1.0, centre=0.0, dtype=torch.bfloat16):
    x = torch.randn(*shape, generator=gen, dtype=torch.float64) * scale + centre
    return x.to(dtype)


def norm64(x, w, d, offset=0.0):
    return reference.rms_norm(x, w, eps=1e-6, group_size=d, weight_offset=offset)


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


def check_gate(gen, tokens):
    hq, hkv, d, r = (24, 4, 256, 64) if CUDA else (3, 1, 64, 16)
    width = (2 * hq + 2 * hkv) * d

    def gated(row, pos, cache, qw, kw):
        q, gate, k, v = ops.split_heads(
            row,
            [
                Section(hq, d, 0, 2 * d),
                Section(hq, d, d, 2 * d),
                Section(hkv, d, 2 * hq * d),
                Section(hkv, d, (2 * hq + hkv) * d),
            ],
        )
        q = ops.rms_norm(q, qw, eps=1e-6, group_size=d, weight_offset=1.0)
        k = ops.rms_norm(k, kw, eps=1e-6, group_size=d, weight_offset=1.0)
        return ops.rope(q, pos, cache, head_dim=d), gate, ops.rope(k, pos, cache, head_dim=d), v

    program = trace(
        gated,
        spec("T", width),
        spec("T", dtype=torch.int64),
        spec("P", r, dtype=torch.float32),
        spec(d),
        spec(d),
    )
    row = randn(gen, tokens, width, scale=2.0)
    pos = torch.randint(0, MAX_POS, (tokens,), generator=gen)
    cache = rope_cos_sin_cache(r, MAX_POS, 1e7)
    qw, kw = randn(gen, d, scale=0.2), randn(gen, d, scale=0.2)
    pairs = row[:, : 2 * hq * d].reshape(tokens, hq, 2, d)
    q_in, gate = pairs[:, :, 0].reshape(tokens, -1), pairs[:, :, 1].reshape(tokens, -1)
    k_in, v = row[:, 2 * hq * d : (2 * hq + hkv) * d], row[:, (2 * hq + hkv) * d :]
    expected = [
        reference.rope(norm64(q_in, qw, d, 1.0), pos, cache, head_dim=d),
        gate,
        reference.rope(norm64(k_in, kw, d, 1.0), pos, cache, head_dim=d),
        v,
    ]
    name = "gate-interleaved (qwen3.5 shape)" if CUDA else "gate-interleaved"
    return run_checked(name, program, (row, pos, cache, qw, kw), expected, [d] * 4, (1, 3))[0]


def check_indexer(gen, tokens):
    hq, hkv, d, hi, di, r, ri = (8, 1, 128, 4, 64, 64, 32) if CUDA else (3, 1, 64, 2, 32, 64, 16)
    widths = [hq * d, hkv * d, hkv * d, hi * di, di]
    offsets = [sum(widths[:i]) for i in range(5)]

    def indexed(row, pos, cache, icache, qw, kw, iqw, ikw):
        q, k, v, iq, ik = ops.split_heads(
            row,
            [
                Section(hq, d, offsets[0]),
                Section(hkv, d, offsets[1]),
                Section(hkv, d, offsets[2]),
                Section(hi, di, offsets[3]),
                Section(1, di, offsets[4]),
            ],
        )
        q = ops.rope(ops.rms_norm(q, qw, eps=1e-6, group_size=d), pos, cache, head_dim=d)
        k = ops.rope(ops.rms_norm(k, kw, eps=1e-6, group_size=d), pos, cache, head_dim=d)
        iq = ops.rms_norm(iq, iqw, eps=1e-6, group_size=di, weight_offset=1.0)
        ik = ops.rms_norm(ik, ikw, eps=1e-6, group_size=di, weight_offset=1.0)
        iq = ops.rope(iq, pos, icache, head_dim=di, is_neox=False)
        return q, k, v, iq, ops.rope(ik, pos, icache, head_dim=di, is_neox=False)

    program = trace(
        indexed,
        spec("T", sum(widths)),
        spec("T", dtype=torch.int64),
        spec("P", r, dtype=torch.float32),
        spec("P", ri, dtype=torch.float32),
        spec(d),
        spec(d),
        spec(di),
        spec(di),
    )
    row = randn(gen, tokens, sum(widths), scale=2.0)
    pos = torch.randint(0, MAX_POS, (tokens,), generator=gen)
    cache, icache = rope_cos_sin_cache(r, MAX_POS, 1e6), rope_cos_sin_cache(ri, MAX_POS, 1e4)
    qw, kw = randn(gen, d, scale=0.2, centre=1.0), randn(gen, d, scale=0.2, centre=1.0)
    iqw, ikw = randn(gen, di, scale=0.2), randn(gen, di, scale=0.2)
    part = [row[:, a : a + w] for a, w in zip(offsets, widths)]
    expected = [
        reference.rope(norm64(part[0], qw, d), pos, cache, head_dim=d),
        reference.rope(norm64(part[1], kw, d), pos, cache, head_dim=d),
        part[2],
        reference.rope(norm64(part[3], iqw, di, 1.0), pos, icache, head_dim=di, is_neox=False),
        reference.rope(norm64(part[4], ikw, di, 1.0), pos, icache, head_dim=di, is_neox=False),
    ]
    args = (row, pos, cache, icache, qw, kw, iqw, ikw)
    return run_checked("sections with own head_dims", program, args, expected, [d, d, d, di, di],
                       (2,))[0]  # fmt: skip


def check_padded(gen, tokens):
    heads, d, stride, r = (4, 2, 3), 80, 96, 32
    offsets = [0, heads[0] * stride, (heads[0] + heads[1]) * stride]

    def padded(row, pos, cache, qw, kw):
        q, k, v = ops.split_heads(
            row, [Section(h, d, off, stride) for h, off in zip(heads, offsets)]
        )
        q = ops.rope(ops.rms_norm(q, qw, eps=1e-6, group_size=d), pos, cache, head_dim=d)
        return q, ops.rope(ops.rms_norm(k, kw, eps=1e-6, group_size=d), pos, cache, head_dim=d), v

    width = sum(heads) * stride
    program = trace(
        padded,
        spec("T", width),
        spec("T", dtype=torch.int64),
        spec("P", r, dtype=torch.float32),
        spec(d),
        spec(d),
    )
    full = randn(gen, tokens, sum(heads), stride, scale=2.0)
    full[..., d:] = float("nan")
    pos = torch.randint(0, MAX_POS, (tokens,), generator=gen)
    cache = rope_cos_sin_cache(r, MAX_POS, 1e6)
    qw, kw = randn(gen, d, scale=0.2, centre=1.0), randn(gen, d, scale=0.2, centre=1.0)
    q_in, k_in, v = (
        full[:, a : a + h, :d].reshape(tokens, -1)
        for a, h in zip((0, heads[0], heads[0] + heads[1]), heads)
    )
    expected = [
        reference.rope(norm64(q_in, qw, d), pos, cache, head_dim=d),
        reference.rope(norm64(k_in, kw, d), pos, cache, head_dim=d),
        v,
    ]
    args = (full.reshape(tokens, width), pos, cache, qw, kw)
    return run_checked("k/v head counts, padded heads", program, args, expected, [d] * 3, (2,))[0]


def narrow_program(d, r, is_neox):
    def prologue(row, pos, cache, qw, kw):
        q, k, v = ops.split_qkv(row, 2, 1, d)
        q = ops.rope(ops.rms_norm(q, qw, eps=1e-6, group_size=d), pos, cache, head_dim=d,
                     is_neox=is_neox)  # fmt: skip
        k = ops.rope(ops.rms_norm(k, kw, eps=1e-6, group_size=d), pos, cache, head_dim=d,
                     is_neox=is_neox)  # fmt: skip
        return q, k, v

    return trace(
        prologue,
        spec("T", 4 * d),
        spec("T", dtype=torch.int64),
        spec("P", r, dtype=torch.float32),
        spec(d),
        spec(d),
    )


def check_narrow(gen, tokens, d, is_neox, strided_out=False):
    r = 2 if not strided_out else 32
    program = narrow_program(d, r, is_neox)
    row = randn(gen, tokens, 4 * d, scale=2.0)
    pos = torch.randint(0, MAX_POS, (tokens,), generator=gen)
    cache = rope_cos_sin_cache(r, MAX_POS, 1e6)
    qw, kw = randn(gen, d, scale=0.2, centre=1.0), randn(gen, d, scale=0.2, centre=1.0)
    expected = [
        reference.rope(norm64(row[:, : 2 * d], qw, d), pos, cache, head_dim=d, is_neox=is_neox),
        reference.rope(
            norm64(row[:, 2 * d : 3 * d], kw, d), pos, cache, head_dim=d, is_neox=is_neox
        ),
        row[:, 3 * d :],
    ]
    out, buffers = None, []
    if strided_out:
        widths = (2 * d, d, d)
        buffers = [
            torch.full((tokens, w + 40), float("nan"), dtype=torch.bfloat16, device=DEV)
            for w in widths
        ]
        out = [b[:, :w] for b, w in zip(buffers, widths)]
    name = (
        f"strided out= rows, D={d}"
        if strided_out
        else f"rotary_dim 2, D={d}, {'neox' if is_neox else 'gptj'}"
    )
    ok, out = run_checked(name, program, (row, pos, cache, qw, kw), expected, [d] * 3, (2,), out)
    for b, o in zip(buffers, out or []):
        if not torch.isnan(b[:, o.shape[1] :]).all():
            log("    the padding of a strided output was written: FAIL")
            ok = False
    return ok


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
    for name in ("qwen3-8b", "qwen3-32b", "qwen3.5-27b", "glm4-9b", "gemma3-27b"):
        p = get_preset(name)
        tokens, dtype = 65536, torch.bfloat16
        program = preset_program(p, dtype)
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
    ok = True
    ok &= check_gate(gen, big)
    ok &= check_indexer(gen, big)
    ok &= check_padded(gen, big)
    for d in (512, 769):
        for is_neox in (True, False):
            ok &= check_narrow(gen, big if CUDA else small, d, is_neox)
    ok &= check_narrow(gen, big, 128, True, strided_out=True)
    rows: list = []
    if CUDA:
        time_kernels(rows)
    else:
        # What the timing compares, run once under the interpreter: identical outputs.
        p = get_preset("qwen3-8b")
        program = preset_program(p, torch.bfloat16)
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
