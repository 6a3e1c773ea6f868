"""The profiling step's reader (issue 38.3, ``fqr.tools.ncu_summary``): from Nsight Compute's
text report and the ``--launch-once`` lines, per preset and T the registers, occupancy, DRAM %
and the share of issue cycles stalled on an L1TEX scoreboard dependency (ncu's rule text,
wrapped over lines, divided by the warp cycles per issued instruction)."""

from __future__ import annotations

import json

from fqr.tools import ncu_summary

REPORT = """\
==PROF== Profiling "fqr_cuda_644a9582d783": 0%....50%....100% - 18 passes
deepseek-v3 T=65536: fqr_cuda_644a9582d783
qwen3-8b T=1: fqr_cuda_a4d37fadd29c
[3675] python3.12@127.0.0.1
  fqr_cuda_644a9582d783 (65536, 1, 1)x(32, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    DRAM Throughput                   %        77.35
    Duration                         us       160.77
    Section: Warp State Statistics
    Warp Cycles Per Issued Instruction             cycle        14.00
    OPT   Est. Speedup: 22.65%
          On average, each warp of this workload spends 11.1 cycles being stalled waiting for a
          scoreboard dependency on a L1TEX (local, global, surface, texture) operation.
    Registers Per Thread             register/thread             128
    Theoretical Occupancy                     %           25
    Achieved Occupancy                        %        22.79
  fqr_cuda_a4d37fadd29c (4, 2, 1)x(64, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    DRAM Throughput                   %         0.21
    Duration                         ns     3,360.00
    Registers Per Thread             register/thread              72
"""


def test_counters_per_preset_and_tokens(tmp_path, capsys):
    log = tmp_path / "ncu.log"
    log.write_text(REPORT)
    rows = {r["preset"]: r for r in ncu_summary.parse(REPORT)}
    v3 = rows["deepseek-v3"]
    assert (v3["T"], v3["grid"], v3["block"], v3["registers"]) == (
        65536,
        [65536, 1, 1],
        [32, 1, 1],
        128,
    )
    assert (v3["theoretical_occupancy"], v3["achieved_occupancy"]) == (25, 22.79)
    assert abs(v3["l1tex_stall_share"] - 11.1 / 14.0) < 1e-12
    q = rows["qwen3-8b"]
    assert q["duration"] == 3.36 and q["grid"] == [4, 2, 1] and "l1tex_stall_share" not in q
    assert ncu_summary.main([str(log), "--json", str(tmp_path / "c.json")]) == 0
    table = capsys.readouterr().out
    assert "| deepseek-v3 | 65536 | 65536 x 32 | 128 | 25% / 23% | 77% | 79% | 160.77 |" in table
    assert "| qwen3-8b | 1 | 4 x 2 x 64 | 72 | - / - | 0% | - | 3.36 |" in table
    assert len(json.loads((tmp_path / "c.json").read_text())) == 2
