"""Issue 24.4 on the GPU: why ``numerics="unfused"`` is not bit-identical to vLLM's native
prologue on CUDA at rotary widths <= 64, and whether FMA contraction is the cause.

For each case of vLLM's grid (head_dim 64/128/256, rotary ratio 1, 1/2, 1/4, NeoX and GPT-J;
bf16, table in bf16 as vLLM keeps it), the share of bit-identical q/k elements between:
vLLM's native code on CUDA and on the CPU (same inputs), fqr's kernel on CUDA as it launches
by default (an unfused kernel without contraction: its rounding points, EmittedKernel) and
with contraction forced on (``fp_fusion=True``, Triton's ``enable_fp_fusion``: what the
default was before), and fqr's reference backend on the CPU. Prints one table; JSON under
``$OUT``.

    PYTHONPATH=. python3 scripts/unfused_cuda_bits.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from support.vllm_native import vllm_native_case  # noqa: E402

import fqr  # noqa: E402
from fqr.lowering import lower  # noqa: E402
from fqr.numerics import ordered_bits  # noqa: E402
from fqr.prologue.split_qkv import SPLIT_QKV_RMSNORM_ROPE as DECL  # noqa: E402

TENSORS = ("qkv", "positions", "table", "q_weight", "k_weight")
OUT = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="fqr-bits-"))


def share(got: torch.Tensor, want: torch.Tensor) -> float:
    ulp = ordered_bits(got.detach().cpu()) - ordered_bits(want.detach().cpu())
    return float((ulp == 0).double().mean())


def kernel_qk(native, **options):
    args, kwargs = native.args, native.fqr_kwargs(backend="triton")
    call = DECL.bound(DECL.bind(args, kwargs))
    DECL.validate(call)
    kernel = lower(DECL.program(call), "cuda", **options)
    q, k = kernel(*DECL.operands(call))[:2]
    return q, k


def main() -> int:
    if not torch.cuda.is_available():
        print("unfused_cuda_bits: needs a CUDA GPU", file=sys.stderr)
        return 2
    device = "cuda"
    gen = torch.Generator().manual_seed(24)
    rows, header = [], ["case", "cuda~cpu native", "fqr~cuda", "fma~cuda", "fqr~cpu", "ref~cpu"]
    for d in (64, 128, 256):
        for ratio in (1.0, 0.5, 0.25):
            for is_neox in (True, False):
                r = int(d * ratio)
                native = vllm_native_case(
                    gen, torch.bfloat16, d, r, is_neox=is_neox, table_in_dtype=True,
                    heads=8, kv_heads=2, tokens=257, max_position=8192, device="cpu",
                )  # fmt: skip
                cpu_q, cpu_k = native.vllm()
                cuda = replace(
                    native,
                    **{f: getattr(native, f).to(device) for f in TENSORS},
                )
                cuda_q, cuda_k = cuda.vllm()
                ref_q, ref_k, _ = fqr.split_qkv_rmsnorm_rope(
                    *native.args, **native.fqr_kwargs(backend="reference")
                )
                fqr_q, fqr_k = kernel_qk(cuda)
                fma_q, fma_k = kernel_qk(cuda, fp_fusion=True)

                def both(a, b, a2, b2):
                    return round(min(share(a, b), share(a2, b2)), 5)

                rows.append(
                    [
                        f"d={d} r={r} {'neox' if is_neox else 'gptj'}",
                        both(cuda_q, cpu_q, cuda_k, cpu_k),
                        both(fqr_q, cuda_q, fqr_k, cuda_k),
                        both(fma_q, cuda_q, fma_k, cuda_k),
                        both(fqr_q, cpu_q, fqr_k, cpu_k),
                        both(ref_q, cpu_q, ref_k, cpu_k),
                    ]
                )
    (OUT / "unfused_cuda_bits.json").write_text(json.dumps({"header": header, "rows": rows}))
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    for line in [header, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(line, widths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
