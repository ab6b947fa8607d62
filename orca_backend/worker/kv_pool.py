"""Sizing the K/V pool from a GPU's memory: vLLM's `gpu_memory_utilization`.

The engine may use `utilization` x the device's memory. Before it loads anything it reads the device
(the baseline): what is in use then (its CUDA context, another engine in the same process, other
processes on the GPU) is not its own, and it refuses to start when less than its budget is free, as
vLLM does. After the weights are loaded, the largest step the scheduler can send
(max_num_batched_tokens tokens, max_num_seqs logits rows) runs once; torch's peak allocation over it
(weights included) and what the process came to hold outside torch's allocator (cuBLAS and NCCL
workspaces), each counted from the baseline, are what the model needs besides its K/V. The pool takes
the rest of the budget in whole blocks. The CUDA graphs are captured after
the pool, from what the budget leaves of the device (1 - utilization); a capture that runs out of
memory says what to lower (model_runner.py).

What the profile step does not see: the ragged attention kernel's own scratch (it reads a padded,
empty K/V), and, with max_num_batched_tokens 0 (unchunked prefill), a step of several whole prompts
larger than the profiled one; vLLM asks for a token budget for the same reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

GIB = 2**30


@dataclass(frozen=True)
class MemoryReading:
    """The device's memory as torch and the driver see it at one moment."""

    total_bytes: int  # the device's memory
    free_bytes: int  # free by the driver's count
    reserved_bytes: int  # held by torch's caching allocator
    allocated_bytes: int  # torch's allocation now
    peak_allocated_bytes: int  # torch's peak allocation since the last reset

    @property
    def non_torch_bytes(self) -> int:
        """In use outside torch's allocator: the CUDA context, libraries' workspaces, other processes."""
        return max(self.total_bytes - self.free_bytes - self.reserved_bytes, 0)


@dataclass(frozen=True)
class MemoryProfile:
    """What the model needs besides its K/V pool, measured around the profile step."""

    total_bytes: int
    weights_bytes: int  # torch's allocation after loading, before the profile step
    peak_bytes: int  # torch's peak allocation over the profile step, weights included
    non_torch_bytes: int  # in use outside torch's allocator since the baseline (cuBLAS, NCCL)


def check_free_memory(baseline: MemoryReading, utilization: float) -> None:
    """ValueError, with the figures and what to change, when the device has less free than the
    engine's budget before it loads anything (another engine or process holds the rest)."""
    budget = int(baseline.total_bytes * utilization)
    if baseline.free_bytes < budget:
        raise ValueError(
            f"gpu_memory_utilization={utilization:g} asks for {budget / GIB:.2f} GiB of the device's "
            f"{baseline.total_bytes / GIB:.2f} GiB, but only {baseline.free_bytes / GIB:.2f} GiB is free before "
            "loading (other engines or processes hold the rest); lower gpu_memory_utilization so that the "
            "engines on this GPU add up to at most 1, or size the pool with kv_cache_memory_bytes"
        )


def profile_memory(baseline: MemoryReading, loaded: MemoryReading, run_largest_step: Callable[[], None],
                   read: Callable[[], MemoryReading]) -> MemoryProfile:  # fmt: skip
    """Runs the largest step once and reads the memory after it, each figure counted from `baseline`
    (read before loading); `loaded` is the reading after loading (`read` resets nothing: the caller
    resets torch's peak after `loaded`, before calling)."""
    run_largest_step()
    after = read()
    return MemoryProfile(
        total_bytes=after.total_bytes,
        weights_bytes=loaded.allocated_bytes - baseline.allocated_bytes,
        peak_bytes=after.peak_allocated_bytes - baseline.allocated_bytes,
        non_torch_bytes=max(after.non_torch_bytes - baseline.non_torch_bytes, 0),
    )


def kv_pool_tokens(profile: MemoryProfile, utilization: float, bytes_per_token: int, block_size: int) -> int:
    """The token slots (whole blocks) the budget leaves for the K/V pool; ValueError, with the
    figures and what to change, when that is less than one block."""
    available = int(profile.total_bytes * utilization) - profile.peak_bytes - profile.non_torch_bytes
    tokens = max(available, 0) // bytes_per_token // block_size * block_size
    if tokens < block_size:
        raise ValueError(
            f"gpu_memory_utilization={utilization:g} leaves no room for the K/V pool: {describe(profile, utilization)}, "
            f"{available / GIB:.2f} GiB left, less than one block of {block_size} tokens ({bytes_per_token} bytes a "
            "token); raise gpu_memory_utilization, lower max_num_batched_tokens or max_num_seqs, or size the pool "
            "with kv_cache_memory_bytes"
        )
    return tokens


def describe(profile: MemoryProfile, utilization: float) -> str:
    """How the budget was spent, in words (the load log and errors)."""
    activations = profile.peak_bytes - profile.weights_bytes
    return (f"{utilization:g} x {profile.total_bytes / GIB:.2f} GiB = {profile.total_bytes * utilization / GIB:.2f} GiB, "
            f"of which the weights take {profile.weights_bytes / GIB:.2f} GiB, the largest step's activations "
            f"{activations / GIB:.2f} GiB and memory outside torch {profile.non_torch_bytes / GIB:.2f} GiB")  # fmt: skip


def read_cuda_memory(device: object) -> MemoryReading:
    """The reading of a CUDA device (after a synchronize, so the profile step has run)."""
    import torch

    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return MemoryReading(total_bytes=total, free_bytes=free, reserved_bytes=torch.cuda.memory_reserved(device),
                         allocated_bytes=torch.cuda.memory_allocated(device),
                         peak_allocated_bytes=torch.cuda.max_memory_allocated(device))  # fmt: skip
