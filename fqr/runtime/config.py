"""The run configuration, validated before any process starts (bad input: ValueError/TypeError
naming the option)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..backends import auto_backend_name, get_backend
from ..core import ACTIVATION_DTYPE_NAMES, dtype_of
from ..presets import get_preset
from ..validate import NUMERICS, check_choice
from .device import DEVICE_TYPES
from .faults import FaultSpec, parse_fault
from .parallel_state import Layout
from .workload import parse_range

LAUNCHERS = ("mp", "torchrun")


@dataclass(frozen=True)
class RunConfig:
    preset: str = "qwen3-8b"
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
        check_choice("--device", self.device, DEVICE_TYPES)
        check_choice("--dtype", self.dtype, ACTIVATION_DTYPE_NAMES)
        check_choice("--numerics", self.numerics, NUMERICS)
        check_choice("--launcher", self.launcher, LAUNCHERS)
        get_backend(self.backend).require(
            self.device, named=f"--backend {self.backend}", where=f"--device {self.device}"
        )
        if self.prompt_len[1] + self.decode_steps > preset.max_position:
            raise ValueError(
                f"--prompt-len/--decode-steps reach position "
                f"{self.prompt_len[1] + self.decode_steps - 1}, beyond "
                f"{self.preset}'s {preset.max_position} RoPE positions"
            )
        if self.verify_every < 0:
            raise ValueError(f"--verify-every must be >= 0, got {self.verify_every}")
        for name in ("init_timeout_s", "step_timeout_s", "collective_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name[:-2].replace('_', '-')} must be > 0 seconds")
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
