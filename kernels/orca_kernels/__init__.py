"""Fused kernels for ORCA's selective batching, each beside its plain torch reference.

Installed as `orca_kernels`. The model never calls a kernel module directly: it asks
`get_ops(device)` for a `KernelOps` bundle, which is where the Triton-vs-torch choice is made.
"""

from orca_kernels.attention import AttentionMetadata
from orca_kernels.dispatch import KernelOps, get_ops

__all__ = ["AttentionMetadata", "KernelOps", "get_ops"]
