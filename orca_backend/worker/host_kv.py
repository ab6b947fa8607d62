"""The host tier of the K/V pool (swap_space): its tensors, and the block copies between it and the
device pool that a step asks for (SchedulerOutput.kv_to_host, kv_to_device; the engine core decides
which blocks: core/host_block_pool.py).

Each of the runner's layers (the draft model's too, which shares the target's block tables) gets
a host copy of its K and V pools' layout with `num_blocks` blocks, in pinned memory on a CUDA
device, so that every copy is asynchronous: queued on the step's stream before its forward, in the
order the step lists them (device to host first), it costs the host nothing and the device's copy
engine runs it while the stream proceeds. Copies go block run by block run: a run of consecutive
source blocks into consecutive destination blocks is one copy per layer and per K and V.
"""

from __future__ import annotations

import torch


class HostKV:
    def __init__(self, device_caches: list[tuple[torch.Tensor, torch.Tensor]], num_blocks: int, block_size: int) -> None:
        pin = any(cache.is_cuda for layer in device_caches for cache in layer)
        self.block_size = block_size
        self.device_caches = device_caches
        self.caches = [tuple(torch.zeros((num_blocks * block_size, *cache.shape[1:]), dtype=cache.dtype, pin_memory=pin)
                             for cache in layer) for layer in device_caches]  # fmt: skip

    @property
    def nbytes(self) -> int:
        return sum(cache.nbytes for layer in self.caches for cache in layer)

    def copy(self, to_host: list[tuple[int, int]], to_device: list[tuple[int, int]]) -> None:
        """(device block, host block) copies, then (host block, device block) ones, in every layer."""
        for device_block, host_block, count in block_runs(to_host):
            self._copy(device_block, host_block, count, to_host=True)
        for host_block, device_block, count in block_runs(to_device):
            self._copy(device_block, host_block, count, to_host=False)

    def _copy(self, device_block: int, host_block: int, count: int, to_host: bool) -> None:
        size = self.block_size
        device_rows = slice(device_block * size, (device_block + count) * size)
        host_rows = slice(host_block * size, (host_block + count) * size)
        for device_layer, host_layer in zip(self.device_caches, self.caches, strict=True):
            for device, host in zip(device_layer, host_layer, strict=True):
                if to_host:
                    host[host_rows].copy_(device[device_rows], non_blocking=True)
                else:
                    device[device_rows].copy_(host[host_rows], non_blocking=True)


def block_runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(source, destination) block pairs as runs (source, destination, count) of consecutive blocks
    on both sides, in the pairs' order."""
    runs: list[tuple[int, int, int]] = []
    for source, destination in pairs:
        if runs and runs[-1][0] + runs[-1][2] == source and runs[-1][1] + runs[-1][2] == destination:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((source, destination, 1))
    return runs
