"""A runner's LoRA adapters: the slots' weights the model reads (model/lora.py's `LoRAStack`), which
adapter each slot holds, and the adapters' host copies.

The core decides which adapter goes in which slot (core/lora_slots.py) and sends the loads with a
step; every rank loads its own shard of the same adapter into the same slot before that step's rows
are taken, so a request's row finds its adapter's slot here (`slot_of`). An adapter read from disk
is kept on the host (up to `max_cpu_loras`, least recently used dropped first), so one evicted from
its slot and wanted again is copied back without reading its file.

An adapter that cannot be loaded (its file gone, or no longer the file registration checked) leaves
its slot zeroed; `load` returns why, in words fit for a client (no server path; the log has it), and
the runner reports it with the step's tokens: the core ends that adapter's requests with the reason
and refuses it from then on, while the step's other rows go on (core/scheduler.py `fail_adapters`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from orca_backend.distributed.layout import ParallelLayout
from orca_backend.lora import AdapterFileError, LoRARequest, read_registered_weights
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
        self._host: OrderedDict[int, AdapterWeights] = OrderedDict()  # lora_id -> weights, least recent first
        logger.info("LoRA: %d slots of rank %d, %.1f MiB", max_loras, max_rank, self.stack.num_bytes() / 2**20)

    def load(self, loads: list[tuple[int, LoRARequest]]) -> dict[int, str]:
        """Puts each adapter in its slot, replacing the one there. Returns {lora_id: why} for those
        that could not be loaded (their slots hold zeros)."""
        failed = {}
        for slot, lora in loads:
            replaced = self._id_in.pop(slot, None)
            if replaced is not None:
                self.slot_of.pop(replaced, None)
            try:
                self.stack.load(slot, self._weights(lora))
            except Exception as e:  # noqa: BLE001 - the adapter's requests fail with it; the runner goes on
                failed[lora.lora_id] = load_failure(lora.name, e)
                logger.error("LoRA adapter %r (id %d, %s) could not be loaded: %r", lora.name, lora.lora_id,
                             lora.weights_file, e)  # fmt: skip
                self.stack.load(slot, {})
            self.slot_of[lora.lora_id] = slot
            self._id_in[slot] = lora.lora_id
        return failed

    def unload(self, lora_ids: set[int]) -> None:
        """Zeroes the slots of adapters that failed to load on another rank (every rank then runs the
        same zeros for their rows, which the core discards)."""
        for lora_id in lora_ids:
            slot = self.slot_of.get(lora_id)
            if slot is not None:
                self.stack.load(slot, {})
            self._host.pop(lora_id, None)

    def _weights(self, lora: LoRARequest) -> AdapterWeights:
        weights = self._host.get(lora.lora_id)
        if weights is not None:
            self._host.move_to_end(lora.lora_id)
            return weights
        data, modules = read_registered_weights(lora, self.model_config)
        weights = read_adapter_weights(lora, data, modules, self.model_config, self.layout, self.max_rank, self.dtype)
        self._host[lora.lora_id] = weights
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)
        return weights


def load_failure(name: str, error: Exception) -> str:
    """What a client is told of an adapter that could not be loaded: the reason where it is the
    adapter file's (those messages name no server path), else only the kind of error."""
    if isinstance(error, AdapterFileError):
        return f"LoRA adapter {name!r} could not be loaded: {error}"
    return f"LoRA adapter {name!r} could not be loaded ({type(error).__name__}; the server log has the details)"
