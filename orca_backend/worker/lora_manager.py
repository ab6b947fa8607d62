"""A runner's LoRA adapters: the slots' weights the model reads (model/lora.py's `LoRAStack`), which
adapter each slot holds, and the adapters' host copies.

The core decides which adapter goes in which slot (core/lora_slots.py) and sends the loads with a
step; every rank loads its own shard of the same adapter into the same slot before that step's rows
are taken, so a request's row finds its adapter's slot here (`slot_of`). An adapter read from disk
is kept on the host (up to `max_cpu_loras`, least recently used dropped first), so one evicted from
its slot and wanted again is copied back without reading its file.

An adapter that cannot be read (its files changed since it was registered) leaves its slot zeroed
and marked: a step that runs a token of it fails, and the scheduler's bisection ends that
adapter's requests alone with the message, while the others go on.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import torch

from orca_backend.distributed.layout import ParallelLayout
from orca_backend.lora import LoRARequest, read_adapter
from orca_backend.model.lora import AdapterWeights, LoRAStack, read_adapter_weights

logger = logging.getLogger("orca.worker")


class LoRAManager:
    def __init__(
        self, model: object, model_config: object, layout: ParallelLayout, max_loras: int, max_rank: int,
        max_cpu_loras: int, dtype: torch.dtype, device: torch.device,
    ) -> None:  # fmt: skip
        self.model_config, self.layout = model_config, layout
        self.max_rank, self.dtype = max_rank, dtype
        self.max_cpu_loras = max_cpu_loras or max_loras
        self.stack = LoRAStack(model_config, layout, max_loras, max_rank, dtype, device)
        model.lora = self.stack  # the model adds the adapters of each step's tokens from these slots
        self.slot_of: dict[int, int] = {}  # lora_id -> slot, for the resident adapters (InputBatch reads it)
        self._id_in: dict[int, int] = {}  # slot -> lora_id
        self._failed: dict[int, str] = {}  # slot -> why its adapter could not be loaded
        self._host: OrderedDict[int, AdapterWeights] = OrderedDict()  # lora_id -> weights, least recent first
        logger.info("LoRA: %d slots of rank %d, %.1f MiB", max_loras, max_rank, self.stack.num_bytes() / 2**20)

    def load(self, loads: list[tuple[int, LoRARequest]]) -> None:
        """Puts each adapter in its slot, replacing the one there."""
        for slot, lora in loads:
            replaced = self._id_in.pop(slot, None)
            if replaced is not None:
                self.slot_of.pop(replaced, None)
            self._failed.pop(slot, None)
            try:
                self.stack.load(slot, self._weights(lora))
            except Exception as e:  # noqa: BLE001 - reported by the steps that run it (`check`)
                self._failed[slot] = f"LoRA adapter {lora.name!r} ({lora.path}) could not be loaded: {e}"
                logger.error("%s", self._failed[slot])
                self.stack.load(slot, {})
            self.slot_of[lora.lora_id] = slot
            self._id_in[slot] = lora.lora_id

    def check(self, token_slots: np.ndarray) -> None:
        """Raises if a token of the step runs an adapter that failed to load."""
        for slot, message in self._failed.items():
            if (token_slots == slot).any():
                raise RuntimeError(message)

    def _weights(self, lora: LoRARequest) -> AdapterWeights:
        weights = self._host.get(lora.lora_id)
        if weights is not None:
            self._host.move_to_end(lora.lora_id)
            return weights
        spec = read_adapter(lora.path, self.model_config, self.max_rank)
        weights = read_adapter_weights(lora, spec, self.model_config, self.layout, self.max_rank, self.dtype)
        self._host[lora.lora_id] = weights
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)
        return weights
