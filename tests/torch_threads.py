"""torch's intra-op thread count for one block: the CPU kernels split their work over OpenMP threads
by it, and the tests that check the split set it themselves rather than inherit the runner's."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
