"""The torch side of EngineConfig's plain strings: dtype names and device names."""

from __future__ import annotations

import torch

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH_DTYPES[name]


def check_device(name: str) -> torch.device:
    """The torch device for a config's device string; a ValueError if this machine lacks it."""
    device = torch.device(name)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device {name!r} requested but torch sees no CUDA device")
        if device.index is not None and device.index >= count:
            raise ValueError(f"device {name!r} requested but torch sees only {count} CUDA device(s)")
    return device
