"""LoRASlots (core/lora_slots.py), which adapter sits in which of the runners' `max_loras` slots: a
held adapter is never evicted, an idle one is evicted least recently used, `acquire` refuses when
every slot is held; and, through the engine against transformers + peft, a running request keeps its
adapter's weights while another adapter waits for its slot."""

from __future__ import annotations

import pytest
from hf_tiny import hf_greedy, write_lora, write_tiny

from orca_backend import LLM, SamplingParams
from orca_backend.core.lora_slots import LoRASlots
from orca_backend.lora import LoRARequest

A, B, C = (LoRARequest(name, lora_id, f"/adapters/{name}") for lora_id, name in enumerate("ABC", start=1))


def test_adapters_take_the_free_slots_lowest_first_and_load_once():
    slots = LoRASlots(2)
    assert slots.acquire(A) and slots.acquire(A) and slots.acquire(B)
    assert slots.take_loads() == [(0, A), (1, B)]  # A's second holder loads nothing
    assert slots.take_loads() == []  # each load is handed out once
    assert slots.num_loads == 2
    assert slots.running_names() == ["A", "B"]


def test_acquire_refuses_while_every_slot_is_held():
    slots = LoRASlots(2)
    assert slots.acquire(A) and slots.acquire(A) and slots.acquire(B)
    slots.release(A)  # A keeps one holder: still not evictable
    assert not slots.acquire(C)
    assert slots.take_loads() == [(0, A), (1, B)] and slots.num_loads == 2  # the refusal loaded nothing
    assert slots.running_names() == ["A", "B"]
    slots.release(A)  # now nobody holds A: C takes its slot
    assert slots.acquire(C)
    assert slots.take_loads() == [(0, C)]
    assert slots.running_names() == ["B", "C"]


def test_the_least_recently_released_adapter_is_evicted_first():
    slots = LoRASlots(2)
    assert slots.acquire(A) and slots.acquire(B)
    slots.release(B)
    slots.release(A)  # B idle longer than A
    slots.take_loads()
    assert slots.acquire(C)
    assert slots.take_loads() == [(1, C)]  # B's slot
    assert slots.running_names() == ["C"]


def test_an_idle_adapter_acquired_again_is_not_reloaded_and_not_evicted():
    slots = LoRASlots(2)
    assert slots.acquire(A) and slots.acquire(B)
    slots.release(A)
    slots.release(B)
    assert slots.acquire(A)  # resident: held again, no load, and no longer idle
    slots.take_loads()
    assert slots.acquire(C)
    assert slots.take_loads() == [(1, C)]  # B, the only idle one, made room
    assert not slots.acquire(B)  # A and C are held
    assert slots.num_loads == 3
    assert slots.running_names() == ["A", "C"]


def test_running_names_drop_an_adapter_once_its_last_holder_leaves():
    slots = LoRASlots(1)
    assert slots.acquire(A) and slots.acquire(A)
    slots.release(A)
    assert slots.running_names() == ["A"]
    slots.release(A)
    assert slots.running_names() == []  # resident and idle: not running


def test_a_forgotten_adapter_frees_its_slot_and_loads_again_only_under_a_new_id():
    """An adapter that failed to load (Scheduler.fail_adapters): its slot is free at once (not merely
    idle), the other resident adapters stay, and a resident adapter is never evicted for it."""
    slots = LoRASlots(2)
    assert slots.acquire(A) and slots.acquire(B)
    slots.take_loads()
    slots.release(B)
    slots.forget(B.lora_id)
    assert slots.running_names() == ["A"]
    assert slots.acquire(C)  # B's slot, free again
    assert slots.take_loads() == [(1, C)]
    fixed_b = LoRARequest("B", 9, "/adapters/B")  # registered again with new files: a new id
    slots.release(C)
    assert slots.acquire(fixed_b)
    assert slots.take_loads() == [(1, fixed_b)]
    with pytest.raises(AssertionError, match="holds"):
        slots.forget(A.lora_id)  # a running request holds it


N_LONG, N_SHORT = 10, 2


@pytest.fixture(scope="module")
def llama_with_two_adapters(tmp_path_factory):
    """A tiny Llama and adapters A and C, with peft's merged models as the oracle."""
    root = tmp_path_factory.mktemp("slots")
    base = write_tiny("Llama", root / "base", seed=3)
    merged = {name: write_lora(base, root / name, seed, 8, ["q_proj", "v_proj", "down_proj"])
              for name, seed in (("A", 1), ("C", 9))}  # fmt: skip
    return root, merged


def test_a_running_request_keeps_its_adapter_while_another_adapter_waits(llama_with_two_adapters):
    """One slot; adapter A's short request ends while A's long one still runs, and C's request waits
    for the slot all along: were A evictable with a holder left, C would load into A's slot and the
    long request would decode its last tokens with C's weights."""
    root, merged = llama_with_two_adapters
    prompts = [[5, 17, 33, 2], [100, 7, 250, 251, 252], [60, 61, 62]]
    names, lengths = ["A", "A", "C"], [N_SHORT, N_LONG, N_LONG]
    want = [hf_greedy(merged[name], prompt, n) for prompt, name, n in zip(prompts, names, lengths, strict=True)]
    llm = LLM(str(root / "base"), dtype="float32", max_num_seqs=4, enable_lora=True, max_loras=1, max_lora_rank=8,
              lora_modules={"A": str(root / "A"), "C": str(root / "C")})  # fmt: skip
    try:
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, lora_name=name)
                  for name, n in zip(names, lengths, strict=True)]  # fmt: skip
        assert [o.output_ids for o in llm.generate(prompts, params)] == want
        assert llm.engine.stats().lora_loads == 2  # A, then C once A's requests were done
    finally:
        llm.engine.shutdown()
    # Control: C gives the long request's prompt other tokens than A does.
    assert hf_greedy(merged["C"], prompts[1], N_LONG) != want[1]
