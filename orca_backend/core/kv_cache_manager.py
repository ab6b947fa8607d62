"""K/V bookkeeping: which slots of the pool each request holds (the pool itself is worker/kv_pool.py).

`KVCacheManager` is the interface the scheduler talks to. `ReservationKVManager` is ORCA's policy:
at admission a request gets one contiguous region of ``prompt + max_tokens`` slots, so a running
request can never run out and nothing is ever preempted; the region is freed when it leaves. A
paged, on-demand policy (vLLM) implements the same interface, growing in `reserve_step`.
"""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod

from orca_backend.core.request import Request


class KVCacheManager(ABC):
    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = capacity_tokens

    @property
    @abstractmethod
    def used_tokens(self) -> int: ...

    @abstractmethod
    def can_admit(self, request: Request) -> bool:
        """Whether `admit` would succeed now."""

    @abstractmethod
    def admit(self, request: Request) -> None:
        """Reserves the request's K/V at admission; sets `request.kv_start`."""

    def reserve_step(self, request: Request) -> bool:
        """Makes room for the request's next token; False means it must wait (or be preempted).

        Under reservation the room was taken at admission, so this always succeeds.
        """
        return True

    @abstractmethod
    def free(self, request: Request) -> None:
        """Returns everything the request holds; a no-op for a request holding nothing."""

    def fits_ever(self, request: Request) -> bool:
        """Whether the request fits an empty pool; if not, queueing it would wait forever."""
        return request.max_total_tokens <= self.capacity_tokens


class ReservationKVManager(KVCacheManager):
    """First-fit allocator of contiguous slot ranges over [0, capacity)."""

    def __init__(self, capacity_tokens: int) -> None:
        super().__init__(capacity_tokens)
        self._free: list[tuple[int, int]] = [(0, capacity_tokens)]  # sorted, coalesced (start, length)
        self._held: dict[str, tuple[int, int]] = {}
        self._used = 0

    @property
    def used_tokens(self) -> int:
        return self._used

    def _find(self, size: int) -> int | None:
        for i, (_, length) in enumerate(self._free):
            if length >= size:
                return i
        return None

    def can_admit(self, request: Request) -> bool:
        return self._find(request.max_total_tokens) is not None

    def admit(self, request: Request) -> None:
        size = request.max_total_tokens
        i = self._find(size)
        if i is None:
            raise RuntimeError(f"K/V pool cannot hold {size} more slots for request {request.request_id}")
        start, length = self._free[i]
        if length == size:
            del self._free[i]
        else:
            self._free[i] = (start + size, length - size)
        self._held[request.request_id] = (start, size)
        self._used += size
        request.kv_start = start

    def free(self, request: Request) -> None:
        held = self._held.pop(request.request_id, None)
        request.kv_start = -1
        if held is None:
            return
        start, size = held
        self._used -= size
        i = bisect.bisect(self._free, (start, size))
        self._free.insert(i, (start, size))
        # Coalesce with the right, then the left neighbour.
        if i + 1 < len(self._free) and start + size == self._free[i + 1][0]:
            self._free[i] = (start, size + self._free.pop(i + 1)[1])
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == start:
            prev_start, prev_len = self._free[i - 1]
            self._free[i - 1] = (prev_start, prev_len + self._free.pop(i)[1])


def make_kv_manager(policy: str, capacity_tokens: int) -> KVCacheManager:
    if policy == "reserve":
        return ReservationKVManager(capacity_tokens)
    raise ValueError(f"unknown K/V policy {policy!r}")
