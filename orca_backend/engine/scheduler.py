"""Iteration-level FCFS scheduling (ORCA §4.2), and the request-level mode the baseline uses.

Between two iterations `schedule()` lets waiting requests join (first come, first served, while the
batch stays within `max_batch_size` and the K/V manager can reserve their slots) and returns the
batch to run; `update_from_output()` appends the sampled tokens and ends the requests that are done,
so they leave before the next iteration. With pipeline parallelism several batches are in flight;
a request in flight is never scheduled again until its batch returns.

In request-level mode a batch is admitted only when nothing runs, and runs until its last request
finishes: nobody joins mid-way (FasterTransformer-style serving, the paper's baseline).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from orca_backend.engine.kv_cache import KVCacheManager
from orca_backend.engine.request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    requests: list[Request]
    num_new_tokens: list[int]  # the whole prompt for a request's first iteration, then 1

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(
        self, kv: KVCacheManager, max_batch_size: int, request_level: bool, eos_token_id: int | None,
        pipeline_depth: int = 1,
    ) -> None:  # fmt: skip
        self.kv = kv
        self.max_batch_size = max_batch_size  # requests in one batch
        # With `pipeline_depth` batches in flight, that many batches' worth of requests may run.
        self.max_running = max_batch_size * pipeline_depth
        self.request_level = request_level
        self.eos_token_id = eos_token_id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

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
            if len(requests) == self.max_batch_size:
                break
            if request.in_flight or not self.kv.reserve_step(request):
                continue
            request.in_flight = True
            requests.append(request)
            num_new.append(request.num_tokens - request.num_computed)
        return ScheduledBatch(requests, num_new) if requests else None

    def update_from_output(self, batch: ScheduledBatch, sampled: list[int]) -> list[Request]:
        """Appends each request's new token and finishes those that hit a token-level stop.

        Returns the requests that received a token (finished ones included).
        """
        updated = []
        for request, num_new, token in zip(batch.requests, batch.num_new_tokens, sampled, strict=True):
            request.in_flight = False
            if request.finished:  # aborted while its batch was in flight: only now is its K/V safe to free
                self.kv.free(request)
                continue
            request.num_computed += num_new
            request.output_ids.append(token)
            updated.append(request)
            params = request.params
            is_eos = token == self.eos_token_id and not params.ignore_eos
            if (is_eos or token in params.stop_token_ids) and len(request.output_ids) > params.min_tokens:
                self.finish(request, "stop")
            elif len(request.output_ids) >= params.max_tokens:
                self.finish(request, "length")
        return updated

    def finish(self, request: Request, reason: str) -> None:
        """Ends a request now; it leaves the batch before the next iteration."""
        if request.finished:
            return
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        if not request.in_flight:
            self.kv.free(request)

    def find(self, request_id: str) -> Request | None:
        for request in self.running:
            if request.request_id == request_id:
                return request
        for request in self.waiting:
            if request.request_id == request_id:
                return request
        return None
