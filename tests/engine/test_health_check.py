"""The health check of an idle engine (EngineConfig.health_check_interval_s, ENABLE_VLLM_HEALTH_CHECK
when served): with nothing outstanding the frontend pings the core's loop, and a loop that does not
answer within iteration_timeout_s is taken as hung, so the engine is found dead before any request
finds it."""

from __future__ import annotations

import os
import signal
import threading

from serving_utils import wait_until

from orca_backend.config import EngineConfig
from orca_backend.engine.llm_engine import LLMEngine
from orca_backend.sampling_params import SamplingParams


def test_a_wedged_idle_engine_is_found_dead_by_its_health_check(tiny_checkpoint):
    engine = LLMEngine.launch(EngineConfig(model=str(tiny_checkpoint[0]), iteration_timeout_s=2.0,
                                           health_check_interval_s=0.2))  # fmt: skip
    try:
        stream = engine.add_request([1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        assert len([t for event in stream for t in event.new_token_ids]) == 3
        os.kill(engine.core.process.pid, signal.SIGSTOP)  # wedged: alive, answering nothing
        assert wait_until(lambda: not engine.healthy, timeout_s=60)
        assert "to an idle engine's health check" in engine.dead_reason
        engine.core.process.join(timeout=30)
        assert engine.core.process.exitcode == -signal.SIGKILL  # killed by the watchdog, stopped or not
    finally:
        engine.shutdown()


def test_the_core_answers_a_ping_with_a_frame_from_its_loop(tiny_checkpoint):
    """The loop itself answers (an idle core emits nothing otherwise): the frame moves the stats'
    clock, with no request anywhere."""
    from orca_backend.core.engine_core import EngineCore

    config = EngineConfig(model=str(tiny_checkpoint[0]))
    core = EngineCore(config, config.model_config())
    frames: list = []
    loop = threading.Thread(target=core.run_forever, args=(frames.append,), daemon=True)
    loop.start()
    try:
        assert not frames  # idle: nothing to report
        core.ping()
        assert wait_until(lambda: frames, timeout_s=60)
        assert len(frames[0]) == 0 and core.num_iterations == 0  # a frame, and no iteration ran for it
    finally:
        core.stop()
        loop.join(timeout=30)
        core.shutdown()
