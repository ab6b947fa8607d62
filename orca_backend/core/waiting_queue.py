"""The queue of requests waiting for admission: by priority, first come first served within one.

Lower priority values are served first (vLLM's convention; every request defaults to 0, which makes
the queue plain FCFS). So that a busy high-priority class cannot starve a lower one, a waiting
request gains one level for every `aging_s` seconds it has waited: a request of priority p waits at
most about (p - the best priority in use) x aging_s longer than FCFS would make it wait.

Each priority class is an insertion-ordered dict, so adding, taking the head and removing any
request (a cancel, a timeout) are O(1); choosing the next request compares the classes' heads only.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from orca_backend.core.request import Request


class WaitingQueue:
    def __init__(self, aging_s: float = 0.0) -> None:
        self.aging_s = aging_s
        self._classes: dict[int, dict[str, Request]] = {}  # priority -> requests, head first
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Request]:
        for priority in sorted(self._classes):
            yield from self._classes[priority].values()

    def __contains__(self, request: Request) -> bool:
        members = self._classes.get(request.priority)
        return members is not None and members.get(request.request_id) is request

    def append(self, request: Request) -> None:
        """A new arrival: the tail of its class."""
        self._classes.setdefault(request.priority, {})[request.request_id] = request
        self._len += 1

    def appendleft(self, request: Request) -> None:
        """A preempted request: the head of its class (it was admitted before everyone waiting in it)."""
        members = self._classes.get(request.priority, {})
        self._classes[request.priority] = {request.request_id: request, **members}
        self._len += 1

    def insert(self, request: Request) -> None:
        """A request that waited out of the queue (for its grammar to compile): its place in its class by
        arrival, before those that arrived after it. O(1) when nobody did; else the class is rebuilt."""
        members = self._classes.get(request.priority)
        key = (request.arrival_time, request.arrival_order)
        if not members or _arrival(next(reversed(members.values()))) < key:
            self.append(request)
            return
        items = list(members.items())
        at = next(i for i, (_, queued) in enumerate(items) if _arrival(queued) > key)
        items.insert(at, (request.request_id, request))
        self._classes[request.priority] = dict(items)
        self._len += 1

    def remove(self, request: Request) -> None:
        members = self._classes[request.priority]
        del members[request.request_id]
        if not members:
            del self._classes[request.priority]
        self._len -= 1

    def head(self, now: float) -> Request | None:
        """The request to admit next: the best effective priority among the classes' heads, the
        earliest arrival on a tie."""
        best, best_key = None, None
        for members in self._classes.values():
            request = next(iter(members.values()))
            key = (self._effective_priority(request, now), request.arrival_time)
            if best_key is None or key < best_key:
                best, best_key = request, key
        return best

    def _effective_priority(self, request: Request, now: float) -> int:
        if self.aging_s <= 0:
            return request.priority
        return request.priority - math.floor(max(now - request.arrival_time, 0.0) / self.aging_s)


def _arrival(request: Request) -> tuple[float, int]:
    return request.arrival_time, request.arrival_order
