"""The run configuration, validated before any process starts (bad input: ValueError/TypeError
naming the option), including whether the largest step the workload can schedule fits in the
host's memory (:meth:`RunConfig.host_bytes_estimate`): a run that cannot fit is refused with a
message instead of being OOM-killed later with none.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch

from ..backends import auto_backend_name, get_backend
from ..core import ACTIVATION_DTYPE_NAMES, dtype_of
from ..presets import DEFAULT_PRESET, get_preset
from ..validate import NUMERICS, check_choice
from .device import DEVICE_TYPES, host_memory_available
from .faults import FaultSpec, parse_fault
from .parallel_state import Layout
from .workload import parse_range

LAUNCHERS = ("mp", "torchrun")
MAX_TIMEOUT_S = 7 * 24 * 3600.0

# The host memory model of one step, in bytes per element of the unsharded qkv rows (``d``: the
# dtype's bytes). Upper bounds of what tests/runtime/test_runtime_memory.py measures:
# * a worker draws its batch's rows in float64 and scales them (16), casts them (d), then holds
#   its rows, its outputs and, on verified steps, their pickled reply (at most 4d over these
#   phases);
# * the engine draws each replica's rows again to verify them (16 + d, and d for the rows it
#   slices; 20 + 2d with slack), and holds every rank's replies of the steps in flight (d per
#   replica and step); the verifier's float64 working set is bounded by its chunking (at most
#   VERIFIER_BYTES_PER_CHUNK_ELEMENT per element of one chunk, verify.VERIFY_CHUNK_ELEMENTS).
WORKER_PROCESS_BYTES = 384 << 20  # a spawned worker's resident set after its imports
VERIFIER_BYTES_PER_CHUNK_ELEMENT = 512
# The engine holds every synthetic request from the start (its spec, its place in the
# scheduler's queues, the draws that make them): an upper bound of the measured peak per request.
REQUEST_BYTES = 512


def worker_bytes_per_element(d: int) -> int:
    return 16 + 4 * d


def engine_bytes_per_element(d: int, dp: int, steps_in_flight: int) -> int:
    return 20 + 2 * d + d * dp * steps_in_flight


def verifier_working_bytes() -> int:
    from .verify import VERIFY_CHUNK_ELEMENTS

    return VERIFIER_BYTES_PER_CHUNK_ELEMENT * VERIFY_CHUNK_ELEMENTS


@dataclass(frozen=True)
class RunConfig:
    preset: str = DEFAULT_PRESET
    dp: int = 1
    tp: int = 1
    device: str = "cpu"
    backend: str = "reference"
    dtype: str = "bf16"
    numerics: str = "fused"
    launcher: str = "mp"
    requests: int = 8
    prompt_len: tuple = (16, 64)
    decode_steps: int = 4
    max_batched_tokens: int = 64
    max_running: int = 32
    seed: int = 0
    verify_every: int = 1
    async_scheduling: bool = False
    fault: FaultSpec | None = None
    init_timeout_s: float = 120.0
    step_timeout_s: float = 60.0
    collective_timeout_s: float = 60.0

    @property
    def layout(self) -> Layout:
        return Layout(self.dp, self.tp)

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_of(self.dtype)

    @property
    def max_step_tokens(self) -> int:
        """The most tokens one DP replica's step can hold in this workload: the budget, or all
        that the running requests have left (at most ``max_running`` of them), if smaller."""
        per_request = self.prompt_len[1] + self.decode_steps
        return min(self.max_batched_tokens, min(self.requests, self.max_running) * per_request)

    def host_bytes_parts(self, workers_here: int | None = None) -> dict[str, int]:
        """Host memory a run takes at its largest step, in three parts named by the option
        that sets each: ``--dp`` the worker processes themselves (spawned ones), ``--requests``
        the engine's requests, ``--max-batched-tokens`` the steps: ``workers_here`` workers'
        (default: all of them, on this host) and the engine's (verifying when
        ``verify_every > 0``)."""
        preset = get_preset(self.preset)
        d = self.torch_dtype.itemsize
        workers = self.layout.world_size if workers_here is None else workers_here
        step = self.max_step_tokens * preset.spec.qkv_width
        steps = workers * step * worker_bytes_per_element(d)
        if self.verify_every > 0:
            in_flight = 2 if self.async_scheduling else 1
            steps += step * engine_bytes_per_element(d, self.dp, in_flight)
            steps += verifier_working_bytes()
        processes = workers * WORKER_PROCESS_BYTES if self.launcher == "mp" else 0
        return {
            "--dp": processes,
            "--requests": self.requests * REQUEST_BYTES,
            "--max-batched-tokens": steps,
        }

    def host_bytes_estimate(self, workers_here: int | None = None) -> int:
        """Host memory a run takes at its largest step (:meth:`host_bytes_parts`, summed)."""
        return sum(self.host_bytes_parts(workers_here).values())

    def check_host_memory(self) -> None:
        """ValueError when the run cannot fit in the host's memory, naming the option whose
        part of it is the largest (``--max-batched-tokens``, ``--requests`` or ``--dp``)."""
        available = host_memory_available()
        if available is None:
            return
        workers = None
        if self.launcher == "torchrun":  # this host runs its local ranks only
            workers = int(os.environ.get("LOCAL_WORLD_SIZE", self.layout.world_size))
        parts = self.host_bytes_parts(workers)
        need = sum(parts.values())
        if need <= available:
            return
        n_workers = self.layout.world_size if workers is None else workers
        gib = 1 << 30
        room = f"{available / gib:.1f} GiB is available"
        largest = max(parts, key=parts.__getitem__)
        if largest == "--dp":
            option, value = ("--dp", self.dp) if self.dp >= self.tp else ("--tp", self.tp)
            raise ValueError(
                f"{option} {value}: {n_workers:,} worker processes (--dp {self.dp} x --tp "
                f"{self.tp}) need about {need / gib:.1f} GiB of host memory (about "
                f"{WORKER_PROCESS_BYTES >> 20} MiB each before their first step), {room}; "
                f"lower {option}"
            )
        if largest == "--requests":
            raise ValueError(
                f"--requests {self.requests}: the engine holds every request (about "
                f"{REQUEST_BYTES} bytes each): the run needs about {need / gib:.1f} GiB of host "
                f"memory, {room}; lower --requests"
            )
        raise ValueError(
            f"--max-batched-tokens {self.max_batched_tokens}: steps of up to "
            f"{self.max_step_tokens:,} tokens need about {need / gib:.1f} GiB of host memory "
            f"({n_workers} worker{'s' if n_workers != 1 else ''} and the verifying engine), "
            f"{room}; lower --max-batched-tokens (or --requests, --prompt-len)"
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        d["prompt_len"] = list(self.prompt_len)
        d["fault"] = None if self.fault is None else self.fault.describe()
        return d

    @classmethod
    def build(
        cls, *, prompt_len: str | tuple = "16..64", fault: str | None = None, **kw
    ) -> RunConfig:
        """From CLI-shaped values; raises ValueError/TypeError naming the bad option."""
        if isinstance(prompt_len, str):
            prompt_len = parse_range(prompt_len)
        for name in ("dp", "tp", "requests", "max_batched_tokens", "max_running"):
            if name in kw and (not isinstance(kw[name], int) or kw[name] < 1):
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {kw[name]!r}")
        if kw.get("backend", "auto") == "auto":
            kw["backend"] = auto_backend_name(kw.get("device", "cpu"))
        layout = Layout(kw.get("dp", 1), kw.get("tp", 1))
        cfg = cls(prompt_len=tuple(prompt_len), fault=parse_fault(fault, layout.world_size), **kw)
        cfg.check()
        return cfg

    def check(self) -> None:
        preset = get_preset(self.preset, self.tp)  # unknown preset / tp not dividing heads
        if preset.variant != "split-qkv":
            raise ValueError(
                f"--preset: {self.preset} runs the {preset.variant!r} variant of the prologue; "
                f"the runtime's attention layer is fqr.split_qkv_rmsnorm_rope (split-qkv presets)"
            )
        check_choice("--device", self.device, DEVICE_TYPES)
        check_choice("--dtype", self.dtype, ACTIVATION_DTYPE_NAMES)
        check_choice("--numerics", self.numerics, NUMERICS)
        check_choice("--launcher", self.launcher, LAUNCHERS)
        get_backend(self.backend).require(
            self.device, named=f"--backend {self.backend}", where=f"--device {self.device}"
        )
        for name in ("decode_steps", "verify_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {value!r}")
        if self.prompt_len[1] + self.decode_steps > preset.max_position:
            raise ValueError(
                f"--prompt-len/--decode-steps reach position "
                f"{self.prompt_len[1] + self.decode_steps - 1}, beyond "
                f"{self.preset}'s {preset.max_position} RoPE positions"
            )
        for name in ("init_timeout_s", "step_timeout_s", "collective_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value <= MAX_TIMEOUT_S):
                raise ValueError(
                    f"--{name[:-2].replace('_', '-')} must be > 0 and at most "
                    f"{MAX_TIMEOUT_S:g} seconds (a week), got {value!r}"
                )
        if self.launcher == "torchrun":
            if self.async_scheduling:
                raise ValueError(
                    "--async-scheduling needs --launcher mp (under torchrun rank 0 "
                    "schedules and computes in one process)"
                )
            if self.fault is not None and self.fault.kind == "kill-parent":
                raise ValueError(
                    "--inject-fault kind=kill-parent needs --launcher mp (under "
                    "torchrun the parent is torchrun's agent)"
                )
        self.check_host_memory()
