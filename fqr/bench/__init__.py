"""Measure the fused prologue against the memory-bandwidth limit and against unfused peers.

The op is memory-bound, so its figure of merit is achieved bandwidth over the *minimal traffic*
(:func:`~fqr.bench.traffic.traffic_bytes`): per token the packed ``qkv`` row read once,
``q``/``k``/``v`` written once, the position and its ``cos``/``sin`` row read once; per launch
the two norm weights. Achieved GB/s is that byte count over the kernel time; the ceiling is a
device-to-device copy of :data:`~fqr.bench.timers.CEILING_BYTES` measured in the same run
(bytes read + bytes written over its time; the fastest of ``copy_`` and the SM copy kernel).

For every (preset, dtype, tokens) cell, :func:`run_bench`:

1. draws fresh random inputs (:mod:`fqr.inputs`: per-head scaled ``qkv``, norm weights around
   their model value, random positions into the model's real RoPE table); when one set of
   inputs would fit in L2 twice over, several sets rotate so that repeated calls do not run
   from cache (:func:`~fqr.bench.traffic.rotation_sets`);
2. runs fqr and each peer (:mod:`fqr.peers`) once and checks its outputs against the float64
   formulation (:func:`fqr.reference.prologue`) with :func:`fqr.numerics.compare`: fqr under
   the requested contract (``fused`` by default), the peers under ``unfused``; ``v`` bit for
   bit. A wrong or failing implementation is reported and not timed. The check covers
   ``check_rows`` rows (the first and last ones and a random sample; 0 = all rows), every
   output is also checked finite on all rows (:mod:`fqr.bench.checks`);
3. takes each measurement of :data:`~fqr.bench.measurements.MEASUREMENTS` that applies: the
   kernel time (``triton.testing.do_bench``, L2 flushed, CUDA events), and for small token
   counts CUDA-graph replays and the host dispatch cost (:mod:`fqr.bench.timers`).

The result is one JSON-ready document (:mod:`fqr.bench.document`), read by
:mod:`fqr.bench.report` (table, failures, plot) and rendered by ``fqr bench``. Nothing is timed
without a CUDA GPU (:func:`require_gpu`).

==================  ==============================================================
module              holds
==================  ==============================================================
``traffic``         the traffic model, rotation sets
``checks``          the check before the timing
``timers``          CUDA events / graph replay / host clock, the copy ceiling
``floors``          per cell the copy floor (fastest candidate copy), the GEMM floors
``copy_kernel``     the SM copy kernel (16-byte vectors) beside ``copy_``
``copy_probe``      ``--copy-probe``: why a same-size ``copy_`` swings
``measurements``    one entry per reported figure (add a measurement kind here)
``config``          :class:`BenchConfig` and its validation
``environment``     the GPU and versions; :class:`NoGPU`
``run``             :func:`run_bench` and its steps
``document``        the JSON document: new, save, load, merge
``report``          results table, failure lines, plot
==================  ==============================================================
"""

from .checks import check_outputs, check_row_index
from .config import DEFAULT_PRESETS, DEFAULT_TOKENS, BenchConfig
from .document import SCHEMA, load_document, merge_documents, save_document
from .environment import NoGPU, environment, require_gpu
from .measurements import GRAPH_MAX_TOKENS, MEASUREMENTS, Measurement
from .run import FQR, run_bench
from .timers import CEILING_BYTES, CudaTimers
from .traffic import MAX_ROTATION_SETS, Traffic, rotation_sets, traffic_bytes

__all__ = [
    "BenchConfig",
    "CEILING_BYTES",
    "CudaTimers",
    "DEFAULT_PRESETS",
    "DEFAULT_TOKENS",
    "FQR",
    "GRAPH_MAX_TOKENS",
    "MAX_ROTATION_SETS",
    "MEASUREMENTS",
    "Measurement",
    "NoGPU",
    "SCHEMA",
    "Traffic",
    "check_outputs",
    "check_row_index",
    "environment",
    "load_document",
    "merge_documents",
    "require_gpu",
    "rotation_sets",
    "run_bench",
    "save_document",
    "traffic_bytes",
]
