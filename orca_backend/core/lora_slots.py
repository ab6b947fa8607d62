"""Which LoRA adapter sits in which of the model runners' `max_loras` slots (the core's side).

A request may run only while its adapter is resident. The scheduler asks for the adapter when it
admits the request (`acquire`) and gives it back when the request leaves the running set, finished
or preempted (`release`); an adapter is held while any running request holds it. A new adapter takes
a free slot, or else the slot of the least recently used adapter no running request holds (vLLM's
LRU eviction); when every slot is held, `acquire` refuses and the request keeps waiting. So the
running requests never use more than `max_loras` adapters, and a slot is never rewritten under a
request in flight.

Each load is sent to the runners with the next step (`SchedulerOutput.lora_loads`), before the rows
of that step are taken: every rank loads the same adapter into the same slot.
"""

from __future__ import annotations

from collections import OrderedDict

from orca_backend.lora import LoRARequest


class LoRASlots:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._slot_of: dict[int, int] = {}  # lora_id -> slot, for the resident adapters
        self._adapter_in: dict[int, LoRARequest] = {}  # slot -> its adapter
        self._holders: dict[int, int] = {}  # lora_id -> running requests holding it (> 0)
        self._idle: OrderedDict[int, None] = OrderedDict()  # resident, held by nobody: least recently used first
        self._free = list(range(max_loras - 1, -1, -1))  # the lowest slot first
        self._loads: list[tuple[int, LoRARequest]] = []
        self.num_loads = 0  # adapters loaded into a slot since the engine started

    def acquire(self, lora: LoRARequest) -> bool:
        """Holds the adapter for one more running request, making it resident if it is not; False (and
        nothing held) if every slot holds an adapter some running request uses."""
        lora_id = lora.lora_id
        if lora_id not in self._slot_of:
            if self._free:
                slot = self._free.pop()
            elif self._idle:
                evicted, _ = self._idle.popitem(last=False)
                slot = self._slot_of.pop(evicted)
            else:
                return False
            self._slot_of[lora_id] = slot
            self._adapter_in[slot] = lora
            self._loads.append((slot, lora))
            self.num_loads += 1
        self._idle.pop(lora_id, None)
        self._holders[lora_id] = self._holders.get(lora_id, 0) + 1
        return True

    def release(self, lora: LoRARequest) -> None:
        """One running request of the adapter left; held by none, it stays resident until evicted."""
        count = self._holders[lora.lora_id] - 1
        if count:
            self._holders[lora.lora_id] = count
        else:
            del self._holders[lora.lora_id]
            self._idle[lora.lora_id] = None

    def take_loads(self) -> list[tuple[int, LoRARequest]]:
        """The loads since the last call, for the next step's runners."""
        loads, self._loads = self._loads, []
        return loads

    def running_names(self) -> list[str]:
        """The adapters running requests use."""
        return sorted(self._adapter_in[self._slot_of[lora_id]].name for lora_id in self._holders)

    def forget(self, lora_id: int) -> None:
        """An adapter that failed to load, held by nobody now (its requests ended): its slot, if it
        still has one, is free again."""
        assert lora_id not in self._holders, "forget() of an adapter a running request holds"
        self._idle.pop(lora_id, None)
        slot = self._slot_of.pop(lora_id, None)
        if slot is not None:
            del self._adapter_in[slot]
            self._free.append(slot)
