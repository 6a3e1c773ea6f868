"""The vLLM-style runtime: run the fused op across DP x TP ranks and verify every step.

Follow a run: :class:`.config.RunConfig` -> :class:`.executor.MultiprocExecutor` (spawns
:func:`.worker.worker_main` per rank; groups from :mod:`.parallel_state`; calls over the
:class:`.message_queue.MessageQueue` ring) or :mod:`.torchrun` (ranks launched by torchrun) ->
:class:`.engine.Engine` (:mod:`.scheduler` plans steps from the :mod:`.workload`; each rank runs
its shard in :class:`.layer.PrologueLayer`; :class:`.verify.Verifier` checks the gathered
outputs against the unsharded float64 expectation).
"""

from .config import RunConfig
from .engine import Engine, RunResult
from .executor import MultiprocExecutor, RunFailed
from .message_queue import MessageQueue, QueueCancelled, QueueTimeout

__all__ = [
    "RunConfig",
    "Engine",
    "RunResult",
    "MultiprocExecutor",
    "RunFailed",
    "MessageQueue",
    "QueueCancelled",
    "QueueTimeout",
]
