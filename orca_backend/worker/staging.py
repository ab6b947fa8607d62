"""Host -> device staging for the small, ragged updates of a step: the sampling rows' parameters as
requests join, penalty counts and prompt marks, the step's sampling indices and random draws, the
run-ahead index.

Each `put` writes an array into a persistent host arena (pinned on CUDA) and queues one non-blocking
copy into the same place of a persistent device arena, whose view it returns: nothing is allocated
per step and nothing waits. A copy from pageable memory (a tensor made from a list or a fresh numpy
array, `.to(device)`) would wait for the stream, that is, for the step in flight.

The arena is rewritten from its start every step (`begin`), once the copies of the step before are
done: they were queued ahead of that step's forward, behind the step before it, which the host has
read back by then (the executor collects step N-1 before it sends step N+1), so the wait costs
nothing. On a CPU the device arena is a second host tensor: the copy is a memcpy of a few bytes, and
the sampler reads device memory only, on every device (what tests/graph_checks.py's guard checks).
"""

from __future__ import annotations

import numpy as np
import torch

_ALIGN = 8  # bytes: every put starts at an offset any dtype can be viewed at


class StagingArena:
    def __init__(self, device: torch.device, capacity: int = 1 << 16) -> None:
        self.device = device
        self._copied: torch.cuda.Event | None = None  # the last put's copy (CUDA)
        self._offset = 0
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        self.host = torch.empty(capacity, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        self.device_buffer = torch.empty(capacity, dtype=torch.uint8, device=self.device)
        self._host_bytes = self.host.numpy()

    def begin(self) -> None:
        """A new step: the arena is rewritten from its start, once the last step's copies are done."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        self._offset = 0

    def put(self, array: np.ndarray) -> torch.Tensor:
        """`array` (any shape, a numeric dtype) on the device: a view of the device arena, its copy queued."""
        array = np.ascontiguousarray(array)
        size = array.nbytes
        if self._offset + size > len(self._host_bytes):
            # A step's puts outgrew the arena: a larger one, from here on (the views already handed out
            # keep the old one alive, and the caching host allocator keeps pinned memory a copy reads).
            self._allocate(max(2 * len(self._host_bytes), size))
            self._offset = 0
        start, self._offset = self._offset, self._offset + -(-size // _ALIGN) * _ALIGN
        self._host_bytes[start : start + size] = array.reshape(-1).view(np.uint8)
        device_bytes = self.device_buffer[start : start + size]
        # The host side as a fresh tensor over the numpy view: a copy whose source is the arena itself.
        device_bytes.copy_(torch.from_numpy(self._host_bytes[start : start + size]), non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        return device_bytes.view(torch.from_numpy(array[:0].reshape(-1)).dtype).view(array.shape)
