"""ORCA's reservation K/V manager: contiguous first-fit regions, freed and coalesced on leave."""

from __future__ import annotations

import random

import pytest

from orca_backend.core.kv_cache_manager import ReservationKVManager
from orca_backend.core.request import Request
from orca_backend.sampling_params import SamplingParams


def req(rid: str, prompt: int, max_tokens: int) -> Request:
    return Request(rid, [1] * prompt, SamplingParams(max_tokens=max_tokens), arrival_time=0.0)


def test_reserves_prompt_plus_max_tokens_and_frees():
    kv = ReservationKVManager(100)
    a, b = req("a", 10, 20), req("b", 5, 5)
    kv.admit(a)
    kv.admit(b)
    assert (a.kv_start, b.kv_start) == (0, 30)
    assert kv.used_tokens == 40
    kv.free(a)
    assert kv.used_tokens == 10 and a.kv_start == -1
    kv.free(a)  # double free is a no-op
    assert kv.used_tokens == 10
    kv.free(b)
    assert kv.used_tokens == 0 and kv.can_admit(req("c", 50, 50))


def test_never_overcommits_and_regions_never_overlap():
    rng = random.Random(0)
    kv = ReservationKVManager(500)
    live: dict[str, Request] = {}
    for step in range(2000):
        if live and rng.random() < 0.45:
            kv.free(live.pop(rng.choice(sorted(live))))
        else:
            r = req(f"r{step}", rng.randint(1, 40), rng.randint(1, 40))
            if kv.can_admit(r):
                kv.admit(r)
                live[r.request_id] = r
            else:
                with pytest.raises(RuntimeError):
                    kv.admit(r)
        spans = sorted((r.kv_start, r.kv_start + r.max_total_tokens) for r in live.values())
        assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:], strict=False))
        assert spans == [] or spans[-1][1] <= 500
        assert kv.used_tokens == sum(r.max_total_tokens for r in live.values())
    for r in list(live.values()):
        kv.free(r)
    assert kv.used_tokens == 0 and kv._free == [(0, 500)]


def test_fits_ever():
    kv = ReservationKVManager(64)
    assert kv.fits_ever(req("a", 32, 32))
    assert not kv.fits_ever(req("b", 32, 33))
