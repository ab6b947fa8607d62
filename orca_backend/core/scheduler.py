"""Iteration-level FCFS scheduling (ORCA §4.2), and the request-level mode the baseline uses.

Between two iterations `schedule()` lets waiting requests join (first come, first served, while the
batch stays within `max_num_seqs` and the K/V manager can reserve their slots) and returns the
batch to run; `update_from_output()` appends the sampled tokens, ends the requests that are done
(`check_stop`), so they leave before the next iteration, and returns what changed as CoreOutputs.
With pipeline parallelism several batches are in flight; a request in flight is never scheduled
again until its batch returns.

Request-level mode (the baseline's FasterTransformer-style serving) lives here too, whole: a batch
is admitted only when nothing runs, it runs until its last request finishes (nobody joins), and
its outputs are held until then, because a request-level server answers a batch at once.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from orca_backend.core.kv_cache_manager import KVCacheManager
from orca_backend.core.request import CoreOutput, Request, RequestStatus
from orca_backend.core.stop import check_stop


@dataclass
class ScheduledBatch:
    requests: list[Request]
    num_new_tokens: list[int]  # the whole prompt for a request's first iteration, then 1

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(
        self, kv: KVCacheManager, max_num_seqs: int, request_level: bool, eos_token_id: int | None,
        pipeline_depth: int = 1,
    ) -> None:  # fmt: skip
        self.kv = kv
        self.max_num_seqs = max_num_seqs  # requests in one batch
        # With `pipeline_depth` batches in flight, that many batches' worth of requests may run.
        self.max_running = max_num_seqs * pipeline_depth
        self.request_level = request_level
        self.eos_token_id = eos_token_id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._held: list[CoreOutput] = []  # request-level mode: the running batch's outputs

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def _admit(self) -> None:
        if self.request_level and self.running:
            return
        while self.waiting and len(self.running) < self.max_running:
            request = self.waiting[0]
            if not self.kv.can_admit(request):
                break  # strict FCFS: a later, smaller request does not overtake the head of the queue
            self.waiting.popleft()
            self.kv.admit(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)

    def schedule(self) -> ScheduledBatch | None:
        self._admit()
        requests, num_new = [], []
        for request in self.running:
            if len(requests) == self.max_num_seqs:
                break
            if request.in_flight or not self.kv.reserve_step(request):
                continue
            request.in_flight = True
            requests.append(request)
            num_new.append(request.num_tokens - request.num_computed)
        return ScheduledBatch(requests, num_new) if requests else None

    def update_from_output(self, batch: ScheduledBatch, sampled: list[int]) -> list[CoreOutput]:
        """Appends each request's new token and finishes those that hit a token-level stop."""
        outputs = []
        for request, num_new, token in zip(batch.requests, batch.num_new_tokens, sampled, strict=True):
            if not self._landed(request):
                continue
            request.num_computed += num_new
            request.output_ids.append(token)
            reason = check_stop(request, token, self.eos_token_id)
            if reason is not None:
                self._end(request, reason)
            outputs.append(self._output(request))
        return self._release(outputs)

    def finish(self, request_id: str, reason: str, error: str | None = None) -> list[CoreOutput]:
        """Ends a waiting or running request now (an abort: cancelled, a stop string, an error).

        An unknown or already finished id is ignored: an abort may race the request's own end.
        """
        request = self._find(request_id)
        if request is None:
            return []
        self._end(request, reason)
        return self._release([self._output(request, error)])

    def fail_batch(self, batch: ScheduledBatch, error: str) -> list[CoreOutput]:
        """A batch whose forward failed: its requests end with the error; the engine goes on."""
        outputs = []
        for request in batch.requests:
            if self._landed(request):
                self._end(request, "error")
                outputs.append(self._output(request, error))
        return self._release(outputs)

    def fail_all(self, error: str) -> list[CoreOutput]:
        """The model is gone: every request ends with the error, held outputs included."""
        outputs, self._held = self._held, []
        for request in list(self.running) + list(self.waiting):
            request.in_flight = False
            self._end(request, "error")
            outputs.append(self._output(request, error))
        return outputs

    def _landed(self, request: Request) -> bool:
        """Its batch has returned. False for a request aborted while the batch was in flight: only
        now is its K/V safe to free, and nothing more happens to it."""
        request.in_flight = False
        if request.finished:
            self.kv.free(request)
            return False
        return True

    def _end(self, request: Request, reason: str) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        if not request.in_flight:
            self.kv.free(request)

    def _output(self, request: Request, error: str | None = None) -> CoreOutput:
        new_ids = request.output_ids[request.num_reported :]
        request.num_reported = len(request.output_ids)
        return CoreOutput(request.request_id, new_ids, request.finished, request.finish_reason, error)

    def _release(self, outputs: list[CoreOutput]) -> list[CoreOutput]:
        """Iteration-level: every output goes out now. Request-level: once the batch has ended."""
        if not self.request_level:
            return outputs
        self._held += outputs
        if self.running:
            return []
        released, self._held = self._held, []
        return released

    def _find(self, request_id: str) -> Request | None:
        for request in self.running:
            if request.request_id == request_id:
                return request
        for request in self.waiting:
            if request.request_id == request_id:
                return request
        return None
