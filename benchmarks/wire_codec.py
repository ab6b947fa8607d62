"""The control channel's cost per step: encode + decode of a 256-request SchedulerOutput as msgpack
(orca_backend/wire.py, what the worker pools send) against pickle (what they sent before, and what a
message injected on a Ray connection could have abused), in alternating rounds of one process.

    .venv/bin/python benchmarks/wire_codec.py --out docs/bench/wire_codec.json

Two steps: the steady state (248 decodes and 8 new 512-token prompts) and a burst of admissions
(256 new 256-token prompts), every request with a full set of sampling parameters. Each round times
`--reps` round trips of one codec; the report gives each codec's range over the rounds, not its best.
"""

from __future__ import annotations

import argparse
import json
import pickle
import random
import time
from collections.abc import Callable
from pathlib import Path

from orca_backend.sampling_params import SamplingParams
from orca_backend.scheduler_output import NewRequest, SchedulerOutput, decode_step, encode_step
from orca_client.machine import code_revision, describe

VOCAB = 32000


def make_steps(seed: int = 0) -> dict[str, SchedulerOutput]:
    rng = random.Random(seed)

    def new(i: int, prompt_len: int) -> NewRequest:
        params = SamplingParams(max_tokens=256, temperature=0.7, top_p=0.9, top_k=50, seed=i, stop=["\n\n"],
                                stop_token_ids=[2], presence_penalty=0.1, logprobs=1,
                                logit_bias={rng.randrange(VOCAB): 1.0 for _ in range(4)})  # fmt: skip
        ids = [rng.randrange(VOCAB) for _ in range(prompt_len)]
        return NewRequest(f"req-{i}", ids, prompt_len, list(range(prompt_len // 16 + 1)), params, i, [2], 0)

    ids = [f"req-{i}" for i in range(256)]
    steady = SchedulerOutput(
        7, ids, [1] * 248 + [512] * 8, [300] * 248 + [0] * 8, [new(248 + i, 512) for i in range(8)],
        ids[:248], [rng.randrange(VOCAB) for _ in range(248)], ids[:16], [[rng.randrange(4096)] for _ in range(16)],
        [], [f"old-{i}" for i in range(8)],
    )  # fmt: skip
    admission = SchedulerOutput(1, ids, [256] * 256, [0] * 256, [new(i, 256) for i in range(256)])
    return {"steady: 248 decodes + 8 new 512-token prompts": steady, "admission: 256 new 256-token prompts": admission}


CODECS: dict[str, tuple[Callable[[SchedulerOutput], bytes], Callable[[bytes], SchedulerOutput]]] = {
    "pickle": (lambda step: pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL), pickle.loads),
    "msgpack": (encode_step, decode_step),
}


def round_trip_ms(step: SchedulerOutput, codec: str, reps: int) -> float:
    encode, decode = CODECS[codec]
    started = time.perf_counter()
    for _ in range(reps):
        decode(encode(step))
    return (time.perf_counter() - started) / reps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results = {}
    for name, step in make_steps().items():
        for codec, (encode, decode) in CODECS.items():
            assert decode(encode(step)) == step, codec
        times: dict[str, list[float]] = {codec: [] for codec in CODECS}
        for _ in range(args.rounds):  # alternating, so a noisy moment hits both codecs
            for codec in CODECS:
                times[codec].append(round_trip_ms(step, codec, args.reps))
        results[name] = {codec: {"bytes": len(CODECS[codec][0](step)), "round_trip_ms_min": min(ms),
                                 "round_trip_ms_max": max(ms), "round_trip_ms": ms}
                         for codec, ms in times.items()}  # fmt: skip
        for codec, r in results[name].items():
            print(f"{name:48s} {codec:8s} {r['bytes']:8d} bytes  encode+decode "
                  f"{r['round_trip_ms_min']:.2f}-{r['round_trip_ms_max']:.2f} ms")
    report = {"command": f"python benchmarks/wire_codec.py --rounds {args.rounds} --reps {args.reps}",
              "commit": code_revision(), "machine": describe(), "results": results}  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
