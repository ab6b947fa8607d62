"""Hooks tests install in the model worker processes of a tp x pp pool (executor/multiproc.py).

A worker is spawned, so a test cannot patch it from outside: the test puts one of these objects in
the place of the pool's entry point (`monkeypatch.setattr(multiproc, "worker_main", hook)`). The
object travels pickled to each new process with its shared counters, sets the process up, and then
runs the real entry point.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from typing import Any

_ctx = mp.get_context("spawn")

GRAPH_KINDS = ("decode", "mixed", "verify")


class StaticBufferWorker:
    """Every rank runs its steps on the CUDA graphs' static buffers, as a GPU rank replays its graphs
    (eagerly: a CPU captures nothing), and checks that each step wrote its K/V pool only in the live
    tokens' slots. With `guard` (the Triton kernels, in the interpreter) each step also runs under the
    capture guard (tests/graph_checks.py). A failed check fails the rank, which fails the
    engine. `runs(rank)` counts each rank's static-buffer steps by graph kind."""

    def __init__(self, world_size: int, guard: bool = False) -> None:
        self.guard = guard
        self._runs = _ctx.Array("i", world_size * len(GRAPH_KINDS))

    def runs(self, rank: int) -> dict[str, int]:
        counts = self._runs[rank * len(GRAPH_KINDS) : (rank + 1) * len(GRAPH_KINDS)]
        return dict(zip(GRAPH_KINDS, counts, strict=True))

    def __call__(self, rank: int, *args: Any) -> None:  # in the worker process
        if self.guard:  # before anything imports triton: the kernels are decorated in the interpreter's mode
            os.environ["TRITON_INTERPRET"] = "1"
        from orca_backend.worker import worker_proc

        worker_proc.ModelRunner = self._runner_class(rank)
        worker_proc.worker_main(rank, *args)

    def _runner_class(self, rank: int) -> type:
        import pytest
        from graph_checks import guard_steps, run_checking_pool

        from orca_backend.worker.cuda_graphs import capture_sizes, mixed_capture_sizes, verify_capture_sizes
        from orca_backend.worker.model_runner import ModelRunner

        hook = self

        class StaticBufferRunner(ModelRunner):
            def __init__(self, config, *args: Any, **kwargs: Any) -> None:
                super().__init__(config, *args, **kwargs)
                graphs = {"decode": self.static_decode(capture_sizes(config.max_num_seqs)),
                          "mixed": self.static_mixed(mixed_capture_sizes(config.max_num_batched_tokens))}  # fmt: skip
                if self.num_speculative_tokens:
                    graphs["verify"] = self.static_verify(verify_capture_sizes(config.max_num_seqs))
                monkeypatch = pytest.MonkeyPatch()  # never undone: the process ends with the pool
                for kind, static in graphs.items():
                    if hook.guard:
                        guard_steps(monkeypatch, self, static)
                    static.run = self._checked(static.run, rank * len(GRAPH_KINDS) + GRAPH_KINDS.index(kind))
                self.decode_graphs, self.mixed_graphs = graphs["decode"], graphs["mixed"]
                self.verify_graphs = graphs.get("verify")

            def _checked(self, run, counter: int):
                def checked_run(inputs, ahead=None, hidden=None):
                    logits, _ = run_checking_pool(run, self.kv_caches, inputs, ahead, hidden)
                    hook._runs[counter] += 1
                    return logits

                return checked_run

        return StaticBufferRunner
