"""Injected faults: ``--inject-fault rank=R,at=init|step:N,kind=raise|exit|hang|kill-parent``.

``raise`` raises in the worker (it reports FAILURE), ``exit`` ends the process with
:data:`FAULT_EXIT_CODE` without a word, ``hang`` stops the worker forever (no reply, no
collective), ``kill-parent`` SIGKILLs the engine process (the death pipe must then end every
worker). Each must end the run within a bounded time, with a message naming the rank.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass

FAULT_KINDS = ("raise", "exit", "hang", "kill-parent")
FAULT_EXIT_CODE = 17


class InjectedFault(RuntimeError):
    pass


@dataclass(frozen=True)
class FaultSpec:
    rank: int
    at: str  # "init" or "step"
    step: int | None
    kind: str

    def describe(self) -> str:
        where = "init" if self.at == "init" else f"step {self.step}"
        return f"{self.kind} on rank {self.rank} at {where}"

    def fires(self, rank: int, at: str, step: int | None = None) -> bool:
        return rank == self.rank and at == self.at and (at == "init" or step == self.step)

    def trigger(self, what: str) -> None:
        """Carry out the fault in the calling process; ``what`` names the rank."""
        print(f"fqr: {what}: injecting fault {self.describe()}", file=sys.stderr, flush=True)
        if self.kind == "raise":
            raise InjectedFault(f"injected fault ({self.describe()})")
        if self.kind == "exit":
            os._exit(FAULT_EXIT_CODE)
        if self.kind == "hang":
            while True:
                time.sleep(3600)
        if self.kind == "kill-parent":
            os.kill(os.getppid(), signal.SIGKILL)
            while True:  # the death pipe ends this process
                time.sleep(3600)


def parse_fault(text: str | None, world_size: int) -> FaultSpec | None:
    """Parse ``rank=R,at=init|step:N,kind=K``; ValueError naming ``--inject-fault`` if bad."""
    if text is None or text == "":
        return None
    fields = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"--inject-fault: expected key=value, got {part!r}")
        fields[key.strip()] = value.strip()
    unknown = set(fields) - {"rank", "at", "kind"}
    if unknown or len(fields) != 3:
        raise ValueError(f"--inject-fault needs exactly rank=, at=, kind=; got {text!r}")
    try:
        rank = int(fields["rank"])
    except ValueError:
        raise ValueError(f"--inject-fault: rank must be an int, got {fields['rank']!r}") from None
    if not 0 <= rank < world_size:
        raise ValueError(f"--inject-fault: rank {rank} not in [0, {world_size})")
    at, step = fields["at"], None
    if at.startswith("step:"):
        try:
            step = int(at[5:])
        except ValueError:
            raise ValueError(f"--inject-fault: at=step:N needs an int N, got {at!r}") from None
        if step < 0:
            raise ValueError(f"--inject-fault: step must be >= 0, got {step}")
        at = "step"
    elif at != "init":
        raise ValueError(f"--inject-fault: at must be init or step:N, got {at!r}")
    if fields["kind"] not in FAULT_KINDS:
        raise ValueError(
            f"--inject-fault: kind must be one of {', '.join(FAULT_KINDS)}, got {fields['kind']!r}"
        )
    return FaultSpec(rank, at, step, fields["kind"])
