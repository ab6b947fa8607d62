"""The iteration log (core/iteration_log.py): one JSON line per iteration, written off the engine
loop, whose counts add up to what the engine did, and which drops lines rather than stall."""

from __future__ import annotations

import json
import threading

from orca_backend import EngineConfig, SamplingParams
from orca_backend.core.iteration_log import IterationLog
from orca_backend.engine.llm_engine import LLMEngine
from orca_backend.entrypoints.serve import build_parser, options_from_args


def test_the_lines_add_up_to_what_the_engine_did(tiny_checkpoint, tmp_path):
    path = tmp_path / "orca.jsonl"
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint[0]), iteration_log=str(path), max_num_seqs=3))
    prompts, lengths = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10], [11, 12]], [6, 3, 9, 4, 7]
    streams = engine.add_requests(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                                            for n in lengths])  # fmt: skip
    while engine.has_work():
        engine.step()
    generated = sum(len(e.new_token_ids) for s in streams for e in s)
    iterations = engine.core.num_iterations
    engine.shutdown()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    *steps, closed = lines
    assert closed == {"event": "closed", "dropped": 0} and len(steps) == iterations
    assert [s["iteration"] for s in steps] == list(range(1, iterations + 1))
    assert sum(s["generated_tokens"] for s in steps) == generated == sum(lengths)
    assert sum(s["prompt_tokens"] for s in steps) == sum(map(len, prompts))  # no preemption, no prefix cache
    assert sum(s["decode_tokens"] for s in steps) == sum(lengths) - len(prompts)  # a prompt's pass samples the first
    assert max(s["requests"] for s in steps) == 3 and all(s["seconds"] > 0 for s in steps)
    assert steps[-1]["running"] == steps[-1]["waiting"] == 0 and steps[-1]["kv_blocks_used"] == 0
    assert all(s["time"] <= t["time"] for s, t in zip(steps, steps[1:], strict=False))


def test_lines_count_each_adapters_tokens(tmp_path):
    """With LoRA, each line says how many tokens each adapter ran ("" for the base model)."""
    from orca_backend.config import PRESETS
    from orca_backend.lora import write_random_adapter

    write_random_adapter(tmp_path / "a", PRESETS["llama-tiny"], rank=4, seed=0)
    path = tmp_path / "orca.jsonl"
    engine = LLMEngine(EngineConfig(model="llama-tiny", iteration_log=str(path), enable_lora=True,
                                    lora_modules={"a": str(tmp_path / "a")}))  # fmt: skip
    prompts, names = [[1, 2, 3], [4, 5], [6]], ["a", None, "a"]
    engine.add_requests(prompts, [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, lora_name=n)
                                  for n in names])  # fmt: skip
    while engine.has_work():
        engine.step()
    engine.shutdown()
    *steps, _ = [json.loads(line) for line in path.read_text().splitlines()]
    assert steps[0]["lora_tokens"] == {"a": 4, "": 2}  # the prompts: 3 + 1 with the adapter, 2 without
    assert sum(s["lora_tokens"]["a"] for s in steps) == 4 + 2 * 3  # and each one's 3 decodes


class StuckStream:
    """A file whose writes block until released: a disk far slower than the engine."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.lines: list[str] = []

    def write(self, text: str) -> int:
        self.release.wait(30)
        self.lines.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_a_full_queue_drops_lines_and_never_blocks_the_loop():
    stream = StuckStream()
    log = IterationLog("stuck", max_queued=2, stream=stream)
    for i in range(50):  # each call returns at once; the writer holds one line, the queue two
        log.record({"iteration": i})
    assert 47 <= log.dropped <= 48
    stream.release.set()
    log.close()
    written = [json.loads(line) for line in stream.lines]
    assert written[-1] == {"event": "closed", "dropped": log.dropped}
    assert len(written) - 1 + log.dropped == 50  # every line was written or counted as dropped


def test_orca_serve_gives_each_model_its_own_log(tmp_path):
    options = options_from_args(build_parser().parse_args(["--iteration-log", str(tmp_path / "logs")]))
    assert {model: p["iteration_log"] for model, p in options.model_parameters.items()} == {
        model: str(tmp_path / "logs" / f"{model}.jsonl") for model in options.models}
    assert (tmp_path / "logs").is_dir()
