"""Measure the fused prologue against the memory-bandwidth limit and against unfused peers.

The op is memory-bound, so its figure of merit is achieved bandwidth over the *minimal traffic*
(:func:`traffic_bytes`): per token the packed ``qkv`` row read once, ``q``/``k``/``v`` written
once, the position and its ``cos``/``sin`` row read once; per launch the two norm weights.
Achieved GB/s is that byte count over the kernel time; the ceiling is a device-to-device copy of
:data:`CEILING_BYTES` measured in the same run (bytes read + bytes written over its time).

For every (preset, dtype, tokens) cell, :func:`run_bench`:

1. builds fresh random inputs (``qkv ~ N(0, 1)``, norm weights around their model value,
   random positions into the model's real RoPE table, :meth:`fqr.presets.Preset.cos_sin_cache`);
   when one set of inputs would fit in L2 twice over, several sets rotate so that repeated
   calls do not run from cache (:func:`rotation_sets`);
2. runs fqr and each peer (:mod:`fqr.peers`) once and checks its outputs against the float64
   formulation (:func:`fqr.golden.exact_prologue`) with :func:`fqr.numerics.compare`: fqr under
   the requested contract (``fused`` by default), the peers under ``unfused``; ``v`` bit for bit.
   A wrong or failing implementation is reported and not timed. The check covers
   ``check_rows`` rows (the first and last ones and a random sample; 0 = all rows), every
   output is also checked finite on all rows;
3. times each one with ``triton.testing.do_bench(..., return_mode="median")`` (L2 flushed before
   every call, CUDA events around it); for ``tokens <= GRAPH_MAX_TOKENS`` also as CUDA-graph
   replays (``triton.testing.do_bench_cudagraph``, many calls per graph, median per call) and the
   host dispatch cost per call without graphs (host clock over back-to-back calls, median of
   several rounds).

The result is one JSON-ready document (:data:`SCHEMA`), rendered by ``fqr bench`` as a table and
a plot. Nothing here runs without a CUDA GPU (:func:`require_gpu`).
"""

from __future__ import annotations

import math
import platform
import statistics
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from .numerics import compare
from .peers import PEER_NAMES, PrologueShape, build_peer, peer_unavailable_reason
from .presets import Preset

SCHEMA = "fqr-bench/1"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
DEFAULT_TOKENS = (1, 16, 128, 1024, 4096, 16384, 65536)
GRAPH_MAX_TOKENS = 256
CEILING_BYTES = 2 << 30  # size of the copied buffer: 2 GiB read + 2 GiB written
CACHE_DTYPE = torch.float32  # fqr reads the real table in fp32
POSITIONS_DTYPE = torch.int64  # vLLM's positions
MAX_ROTATION_SETS = 32
DEFAULT_L2_BYTES = 50 << 20  # H200, if the device does not say
FQR = "fqr"


class NoGPU(RuntimeError):
    """The bench needs a CUDA GPU and none is visible."""


def require_gpu() -> None:
    """Raise :class:`NoGPU` (one line) when torch sees no CUDA device."""
    if not torch.cuda.is_available():
        raise NoGPU(
            "fqr bench needs a CUDA GPU and torch sees none on this machine "
            "(run it on the GPU machine; `fqr bench --from-json FILE` renders saved results)"
        )


# ------------------------------------------------------------------------- traffic model


@dataclass(frozen=True)
class Traffic:
    """Minimal bytes one call must move (each term read or written exactly once)."""

    qkv_read: int
    qkv_written: int  # q, k and v together: the same width as the qkv row
    positions: int
    cos_sin: int  # one table row (R values) per token
    weights: int  # q and k norm weights, once per call

    @property
    def total(self) -> int:
        return self.qkv_read + self.qkv_written + self.positions + self.cos_sin + self.weights


def traffic_bytes(
    preset: Preset,
    dtype: torch.dtype,
    tokens: int,
    cache_dtype: torch.dtype = CACHE_DTYPE,
    positions_dtype: torch.dtype = POSITIONS_DTYPE,
) -> Traffic:
    """The minimal traffic of one call of the prologue on ``tokens`` tokens of ``preset``.

    ``T*W*e`` read + ``T*W*e`` written (``W = (Hq + 2*Hkv)*D``, ``e`` the element size),
    ``T`` positions, ``T*R`` table values (``R`` = rotary_dim), and the weights (``2*D`` values for
    a per-head norm, ``(Hq + Hkv)*D`` for a full-width norm, none without a norm).
    """
    elt = torch.finfo(dtype).bits // 8
    row = tokens * preset.qkv_width * elt
    if preset.norm == "none":
        weight_values = 0
    elif preset.norm == "head":
        weight_values = 2 * preset.head_dim
    else:
        weight_values = preset.q_size + preset.kv_size
    return Traffic(
        qkv_read=row,
        qkv_written=row,
        positions=tokens * (torch.iinfo(positions_dtype).bits // 8),
        cos_sin=tokens * preset.rotary_dim * (torch.finfo(cache_dtype).bits // 8),
        weights=weight_values * elt,
    )


def rotation_sets(set_bytes: int, l2_bytes: int) -> int:
    """How many input sets to rotate so that consecutive calls overflow L2 (at most 32)."""
    if set_bytes <= 0:
        raise ValueError(f"set_bytes must be positive, got {set_bytes}")
    return max(1, min(MAX_ROTATION_SETS, math.ceil(2 * l2_bytes / set_bytes)))


# ------------------------------------------------------------------------------ inputs


@dataclass
class PrologueInputs:
    qkv: torch.Tensor
    positions: torch.Tensor
    q_weight: torch.Tensor | None
    k_weight: torch.Tensor | None


def make_inputs(
    preset: Preset,
    dtype: torch.dtype,
    tokens: int,
    device,
    generator: torch.Generator,
    max_position: int | None = None,
) -> PrologueInputs:
    """Fresh random inputs: ``qkv ~ N(0, 1)``, weights ``offset-free value + 0.1*N(0, 1)``."""
    max_position = max_position or preset.max_position
    qkv = torch.randn(tokens, preset.qkv_width, generator=generator, device=device).to(dtype)
    positions = torch.randint(
        0, max_position, (tokens,), generator=generator, device=device, dtype=POSITIONS_DTYPE
    )
    if preset.norm == "none":
        return PrologueInputs(qkv, positions, None, None)
    q_len, k_len = (
        (preset.head_dim, preset.head_dim)
        if preset.norm == "head"
        else (preset.q_size, preset.kv_size)
    )
    centre = 0.0 if preset.weight_offset else 1.0  # Gemma-style weights are stored as w - 1

    def weight(n):
        return (centre + 0.1 * torch.randn(n, generator=generator, device=device)).to(dtype)

    return PrologueInputs(qkv, positions, weight(q_len), weight(k_len))


def check_row_index(
    tokens: int, check_rows: int, generator: torch.Generator, device
) -> torch.Tensor:
    """Rows to compare: all when ``check_rows`` is 0 or covers T, else the first and last 64
    rows and a random sample, ``check_rows`` in all."""
    if check_rows <= 0 or check_rows >= tokens:
        return torch.arange(tokens, device=device)
    edge = min(64, check_rows // 4)
    middle = torch.randperm(tokens - 2 * edge, generator=generator, device=device)
    middle = middle[: check_rows - 2 * edge] + edge
    ends = torch.cat(
        [torch.arange(edge, device=device), torch.arange(tokens - edge, tokens, device=device)]
    )
    return torch.cat([ends, middle]).sort().values


# ------------------------------------------------------------------------------- checks


def check_outputs(
    outputs,
    exact,
    rows: torch.Tensor,
    head_dim: int,
    numerics: str,
    expected_shapes,
    expected_dtype: torch.dtype,
) -> dict:
    """Compare ``(q, k, v)`` with the float64 ``exact`` ``(q, k, v)`` on ``rows``."""
    report = {"passed": True, "rows": int(rows.numel()), "numerics": numerics}
    for name, out, ref, shape in zip("qkv", outputs, exact, expected_shapes):
        if (
            not isinstance(out, torch.Tensor)
            or tuple(out.shape) != tuple(shape)
            or out.dtype != expected_dtype
        ):
            got = (
                f"{list(out.shape)} {out.dtype}"
                if isinstance(out, torch.Tensor)
                else type(out).__name__
            )
            report[name] = {
                "passed": False,
                "error": f"got {got}, expected {list(shape)} {expected_dtype}",
            }
            report["passed"] = False
            continue
        nonfinite_all = int((~torch.isfinite(out)).sum())
        c = compare(
            out.index_select(0, rows),
            ref,
            head_dim=head_dim,
            numerics=numerics,
            bitwise=(name == "v"),
        ).to_dict()
        c["nonfinite_all_rows"] = nonfinite_all
        c["passed"] = bool(c["passed"] and nonfinite_all == 0)
        report[name] = c
        report["passed"] = report["passed"] and c["passed"]
    return report


# ------------------------------------------------------------------------------- timing


def _cycle(fn: Callable, input_sets: list) -> Callable[[], object]:
    state = {"i": 0}

    def call():
        i = state["i"]
        state["i"] = (i + 1) % len(input_sets)
        return fn(input_sets[i])

    return call


class CudaTimers:
    """How the bench reads the clock on a CUDA device (Triton's benchmarking helpers)."""

    def kernel_us(self, call: Callable[[], object], warmup_ms: float, rep_ms: float) -> float:
        """Median kernel time in µs (``triton.testing.do_bench``: L2 flushed, CUDA events)."""
        from triton.testing import do_bench

        return 1e3 * do_bench(call, warmup=warmup_ms, rep=rep_ms, return_mode="median")

    def graph_us(self, call: Callable[[], object], rep_ms: float) -> float:
        """Median µs per call of CUDA-graph replays (``do_bench_cudagraph``, many calls a graph)."""
        from triton.testing import do_bench_cudagraph

        return 1e3 * do_bench_cudagraph(call, rep=rep_ms, return_mode="median")

    def dispatch_us(self, call: Callable[[], object], calls: int = 200, rounds: int = 7) -> float:
        """Host cost per call in µs without graphs: host clock over back-to-back calls."""
        call()
        torch.cuda.synchronize()
        per_call = []
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(calls):
                call()
            per_call.append((time.perf_counter() - start) / calls * 1e6)
            torch.cuda.synchronize()
        return statistics.median(per_call)

    def copy_ceiling(
        self, nbytes: int = CEILING_BYTES, warmup_ms: float = 25, rep_ms: float = 200
    ) -> dict:
        """Device-to-device copy of ``nbytes``: bytes read + written over its median time."""
        src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").normal_()
        dst = torch.empty_like(src)
        us = self.kernel_us(lambda: dst.copy_(src), warmup_ms, rep_ms)
        moved = 2 * src.numel() * src.element_size()
        src = dst = None  # free both before the next measurement
        torch.cuda.empty_cache()
        return {"bytes": moved, "us": us, "gbps": moved / us / 1e3}


# ------------------------------------------------------------------------------ the run


@dataclass
class BenchConfig:
    presets: list[Preset]
    tokens: list[int]
    dtypes: list[torch.dtype]
    compare: list[str] = field(default_factory=lambda: list(PEER_NAMES))
    backend: str = "triton"
    numerics: str = "fused"
    check_rows: int = 1024
    warmup_ms: float = 10.0
    rep_ms: float = 50.0
    graph_rep_ms: float = 20.0
    seed: int = 0

    def __post_init__(self):
        if not self.presets:
            raise ValueError("presets: give at least one preset")
        for t in self.tokens:
            if not isinstance(t, int) or isinstance(t, bool) or t < 1:
                raise ValueError(f"tokens must be positive integers, got {t!r}")
        if not self.tokens:
            raise ValueError("tokens: give at least one token count")
        for d in self.dtypes:
            if d not in DTYPE_NAMES:
                raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {d}")
        if not self.dtypes:
            raise ValueError("dtype: give at least one dtype")
        for c in self.compare:
            if c not in PEER_NAMES:
                raise ValueError(f"compare must be a subset of {','.join(PEER_NAMES)}, got {c!r}")
        if self.numerics not in ("fused", "unfused"):
            raise ValueError(f"--numerics must be fused or unfused, got {self.numerics!r}")
        if self.check_rows < 0:
            raise ValueError(f"check_rows must be >= 0, got {self.check_rows}")
        for name in ("warmup_ms", "rep_ms", "graph_rep_ms"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def cells(self) -> int:
        return len(self.presets) * len(self.dtypes) * len(self.tokens)

    def settings(self) -> dict:
        d = asdict(self)
        d["presets"] = [p.name for p in self.presets]
        d["dtypes"] = [DTYPE_NAMES[t] for t in self.dtypes]
        return d


def environment(device: torch.device) -> dict:
    """What ran the bench: the GPU (name, SMs, memory, L2) and the software versions."""
    import importlib.metadata as md

    try:
        triton_version = md.version("triton")
    except md.PackageNotFoundError:
        triton_version = None
    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "python": platform.python_version(),
        "device": device.type,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            gpu=props.name,
            sm_count=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
            l2_bytes=getattr(props, "L2_cache_size", None) or DEFAULT_L2_BYTES,
        )
    else:
        env.update(gpu=platform.processor() or device.type, l2_bytes=DEFAULT_L2_BYTES)
    return env


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def _fqr_callable(preset: Preset, cache: torch.Tensor, backend: str, numerics: str):
    from .prologue import split_qkv_rmsnorm_rope

    def run(x: PrologueInputs):
        return split_qkv_rmsnorm_rope(
            x.qkv,
            x.positions,
            cache,
            x.q_weight,
            x.k_weight,
            num_heads=preset.num_heads,
            num_kv_heads=preset.num_kv_heads,
            head_dim=preset.head_dim,
            eps=preset.eps,
            is_neox=preset.is_neox,
            weight_offset=preset.weight_offset,
            norm=preset.norm,
            numerics=numerics,
            backend=backend,
        )

    return run


def _peer_callable(peer):
    return lambda x: peer(x.qkv, x.positions, x.q_weight, x.k_weight)


def _poison_free_memory(nbytes: int, device: torch.device) -> None:
    """Fill and free a block as large as the outputs, so that the caching allocator most likely
    hands NaN-filled memory to the next outputs: elements a kernel fails to write then show."""
    block = torch.full((max(1, nbytes // 4),), float("nan"), dtype=torch.float32, device=device)
    del block


def _measure_impl(
    fn: Callable,
    sets: list,
    exact,
    rows,
    preset: Preset,
    numerics: str,
    tokens: int,
    traffic: int,
    ceiling_gbps: float,
    cfg: BenchConfig,
    timers,
    device: torch.device,
) -> dict:
    """Check one implementation on the first input set, then (only if right) time it."""
    shapes = [(tokens, preset.q_size), (tokens, preset.kv_size), (tokens, preset.kv_size)]
    result: dict = {
        "check": None,
        "us": None,
        "gbps": None,
        "pct_ceiling": None,
        "graph_us": None,
        "dispatch_us": None,
        "error": None,
    }
    try:
        _poison_free_memory(2 * traffic, device)
        outputs = fn(sets[0])
        _synchronize(device)
        result["check"] = check_outputs(
            outputs, exact, rows, preset.head_dim, numerics, shapes, sets[0].qkv.dtype
        )
        del outputs
    except Exception as e:  # a failing implementation is reported, the run goes on
        result["error"] = _error_text(e)
        return result
    if not result["check"]["passed"]:
        return result
    call = _cycle(fn, sets)
    try:
        us = timers.kernel_us(call, cfg.warmup_ms, cfg.rep_ms)
    except Exception as e:
        result["error"] = _error_text(e)
        return result
    gbps = traffic / us / 1e3
    result.update(us=us, gbps=gbps, pct_ceiling=100 * gbps / ceiling_gbps)
    if tokens <= GRAPH_MAX_TOKENS:
        # A graph or dispatch failure is reported beside the numbers; the kernel itself was right.
        for key, measure in (
            ("graph_us", lambda: timers.graph_us(call, cfg.graph_rep_ms)),
            ("dispatch_us", lambda: timers.dispatch_us(call)),
        ):
            try:
                result[key] = measure()
            except Exception as e:
                result.setdefault("timing_errors", {})[key] = _error_text(e)
    return result


def _launcher_callable(preset: Preset, dtype: torch.dtype, cache: torch.Tensor, numerics: str):
    """The bare generated-kernel launcher (``fqr.lowering.lower``), without the public op's
    argument checks: its dispatch cost, beside the public op's, splits host time between them."""
    from .lowering import lower
    from .prologue import preset_program

    kernel = lower(preset_program(preset, dtype, numerics=numerics), target="cuda")

    def run(x: PrologueInputs):
        args = [x.qkv, x.positions, cache] + [w for w in (x.q_weight, x.k_weight) if w is not None]
        return kernel(*args)

    return run


def run_bench(
    cfg: BenchConfig,
    progress: Callable[[str], None] = lambda text: None,
    advance: Callable[[], None] = lambda: None,
    device: str = "cuda",
    timers=None,
    on_row: Callable[[dict], None] = lambda doc: None,
) -> dict:
    """Run every cell of ``cfg``; return the result document (module docstring).

    ``progress(text)`` is told what is running; ``advance()`` is called after the copy ceiling
    and after each cell, ``on_row(doc)`` after each cell with the document so far
    (``doc["complete"]`` turns true at the end), so a run cut short still leaves its rows.
    The bench proper runs on ``device="cuda"`` with :class:`CudaTimers`;
    another device needs its own ``timers`` (the tests drive the bookkeeping on CPU that way).
    """
    device = torch.device(device)
    if device.type == "cuda":
        require_gpu()
        timers = timers or CudaTimers()
    elif timers is None:
        raise ValueError(f"device {device.type!r}: pass timers (CudaTimers needs a CUDA device)")
    from .backends import resolve_backend
    from .golden import exact_prologue

    resolve_backend(cfg.backend, device)  # unavailable -> one clear error before any work
    env = environment(device)
    progress("copy ceiling")
    ceiling = timers.copy_ceiling()
    advance()
    doc = {
        "schema": SCHEMA,
        "environment": env,
        "settings": cfg.settings(),
        "ceiling": ceiling,
        "rows": [],
        "skipped": {},
        "passed": True,
        "complete": False,
    }
    generator = torch.Generator(device=device)
    row_generator = torch.Generator()
    for preset in cfg.presets:
        shape = PrologueShape.of_preset(preset)
        cache = preset.cos_sin_cache().to(device)
        peers_here = []
        for peer in cfg.compare:
            reason = peer_unavailable_reason(peer, shape)
            if reason:
                doc["skipped"][f"{peer}/{preset.name}"] = reason
            else:
                peers_here.append(peer)
        for dtype in cfg.dtypes:
            torch._dynamo.reset()  # each (preset, dtype) compiles its own compile peer afresh
            impls = {FQR: (_fqr_callable(preset, cache, cfg.backend, cfg.numerics), cfg.numerics)}
            launcher = None
            if cfg.backend == "triton" and any(t <= GRAPH_MAX_TOKENS for t in cfg.tokens):
                try:
                    launcher = _launcher_callable(preset, dtype, cache, cfg.numerics)
                except Exception as e:  # the public op's own check reports a broken lowering
                    doc["skipped"][f"launcher/{preset.name}/{DTYPE_NAMES[dtype]}"] = _error_text(e)
            for peer in peers_here:
                impls[peer] = (_peer_callable(build_peer(peer, shape, cache, dtype)), "unfused")
            for tokens in cfg.tokens:
                label = f"{preset.name} {DTYPE_NAMES[dtype]} T={tokens}"
                seed = cfg.seed * 1_000_003 + zlib.crc32(label.encode()) % 1_000_003
                generator.manual_seed(seed)
                row_generator.manual_seed(seed)
                traffic = traffic_bytes(preset, dtype, tokens)
                n_sets = rotation_sets(traffic.total, env["l2_bytes"])
                sets = [
                    make_inputs(preset, dtype, tokens, device, generator) for _ in range(n_sets)
                ]
                rows = check_row_index(tokens, cfg.check_rows, row_generator, "cpu").to(device)
                x0 = sets[0]
                exact = exact_prologue(
                    x0.qkv.index_select(0, rows),
                    x0.positions.index_select(0, rows),
                    cache,
                    x0.q_weight,
                    x0.k_weight,
                    num_heads=preset.num_heads,
                    num_kv_heads=preset.num_kv_heads,
                    head_dim=preset.head_dim,
                    eps=preset.eps,
                    is_neox=preset.is_neox,
                    weight_offset=preset.weight_offset,
                    norm=preset.norm,
                )
                row = {
                    "preset": preset.name,
                    "dtype": DTYPE_NAMES[dtype],
                    "tokens": tokens,
                    "bytes": traffic.total,
                    "traffic": asdict(traffic),
                    "input_sets": n_sets,
                    "impls": {},
                    "speedup": {},
                }
                for name, (fn, numerics) in impls.items():
                    progress(f"{label}: {name}")
                    row["impls"][name] = _measure_impl(
                        fn,
                        sets,
                        exact,
                        rows,
                        preset,
                        numerics,
                        tokens,
                        traffic.total,
                        ceiling["gbps"],
                        cfg,
                        timers,
                        device,
                    )
                ours = row["impls"][FQR]["us"]
                if launcher is not None and ours is not None and tokens <= GRAPH_MAX_TOKENS:
                    progress(f"{label}: kernel launcher dispatch")
                    try:
                        row["impls"][FQR]["launcher_dispatch_us"] = timers.dispatch_us(
                            _cycle(launcher, sets)
                        )
                    except Exception as e:
                        row["impls"][FQR].setdefault("timing_errors", {})[
                            "launcher_dispatch_us"
                        ] = _error_text(e)
                for name in impls:
                    theirs = row["impls"][name]["us"]
                    if name != FQR and ours and theirs:
                        row["speedup"][name] = theirs / ours
                if any(
                    r["error"] or not (r["check"] or {}).get("passed", False)
                    for r in row["impls"].values()
                ):
                    doc["passed"] = False
                doc["rows"].append(row)
                del sets, exact, x0
                on_row(doc)
                advance()
            del impls, launcher
            if device.type == "cuda":
                torch.cuda.empty_cache()
    doc["complete"] = True
    return doc


def save_document(doc: dict, path) -> None:
    """Write ``doc`` as JSON to ``path`` atomically (a reader never sees half a file)."""
    import json
    import os
    from pathlib import Path

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)


def load_document(path) -> dict:
    """Read a saved ``fqr bench --json`` document (checks its schema)."""
    import json
    from pathlib import Path

    if not Path(path).is_file():
        raise ValueError(f"--from-json: no such file {path}")
    text = Path(path).read_text()
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--from-json {path}: not JSON ({e.msg} at line {e.lineno})") from None
    problem = document_problem(doc)
    if problem is not None:
        raise ValueError(f"--from-json {path}: {problem}")
    return doc


_ROW_FIELDS = (("preset", str), ("dtype", str), ("tokens", int), ("impls", dict), ("speedup", dict))
_IMPL_NUMBERS = ("us", "gbps", "pct_ceiling", "graph_us", "dispatch_us")


def document_problem(doc) -> str | None:
    """Why ``doc`` is not a document the report can render (every field it reads, with its
    type), or None."""
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        return f"not an {SCHEMA} document"
    for key, kind in (
        ("environment", dict),
        ("settings", dict),
        ("ceiling", dict),
        ("rows", list),
        ("passed", bool),
    ):
        if key not in doc:
            return f"no {key!r}"
        if not isinstance(doc[key], kind):
            return f"{key!r} must be a JSON {kind.__name__}, got {type(doc[key]).__name__}"
    if not isinstance(doc["ceiling"].get("gbps"), (int, float)):
        return "'ceiling' has no number 'gbps'"
    if not isinstance(doc.get("skipped", {}), dict):
        return "'skipped' must be a JSON object"
    for i, row in enumerate(doc["rows"]):
        where = f"rows[{i}]"
        if not isinstance(row, dict):
            return f"{where} must be a JSON object"
        for key, kind in _ROW_FIELDS:
            if not isinstance(row.get(key), kind) or isinstance(row.get(key), bool):
                return f"{where} has no {kind.__name__} {key!r}"
        if FQR not in row["impls"]:
            return f"{where} has no {FQR!r} measurement"
        for name, impl in row["impls"].items():
            at = f"{where}.impls[{name!r}]"
            if not isinstance(impl, dict):
                return f"{at} must be a JSON object"
            for key in _IMPL_NUMBERS:
                value = impl.get(key)
                if value is not None and (not isinstance(value, (int, float)) or value is True):
                    return f"{at}.{key} must be a number or null, got {value!r:.40}"
            if not isinstance(impl.get("error"), (str, type(None))):
                return f"{at}.error must be text or null"
            if not isinstance(impl.get("check"), (dict, type(None))):
                return f"{at}.check must be an object or null"
    return None


def merge_documents(docs: list[dict]) -> dict:
    """One document from several runs (each row keeps the ceiling of its own run)."""
    if len(docs) == 1:
        return docs[0]
    merged = {
        "schema": SCHEMA,
        "environment": docs[0]["environment"],
        "settings": docs[0]["settings"],
        "ceiling": docs[0]["ceiling"],
        "rows": [],
        "skipped": {},
        "passed": True,
        "complete": True,
        "runs": [],
    }
    for d in docs:
        merged["runs"].append({"environment": d["environment"], "ceiling": d["ceiling"]})
        for r in d["rows"]:
            merged["rows"].append(dict(r, ceiling_gbps=d["ceiling"]["gbps"]))
        merged["skipped"].update(d.get("skipped", {}))
        merged["passed"] = merged["passed"] and d.get("passed", False)
        merged["complete"] = merged["complete"] and d.get("complete", True)
    return merged
