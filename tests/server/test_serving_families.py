"""The families of issue #30 served end to end: a mixture-of-experts preset (Mixtral) and a Gemma 3
preset (sliding-window local layers, q/k norm, two rope bases) through a real tritonserver, on both
models, streamed over gRPC: the tokens equal the offline engine's on the same preset."""

from __future__ import annotations

import pytest

from orca_backend.entrypoints.llm import LLM
from orca_backend.sampling_params import SamplingParams

pytest.importorskip("tritonclient.grpc", reason="needs the serve extras (tritonclient)")

from serving_utils import StreamSession, start_server  # noqa: E402 - after the skip

pytestmark = pytest.mark.integration

PROMPTS = [[5, 6, 7] * 15, [9], [100, 101, 102, 103, 104]]  # the first runs past gemma3-tiny's 32-token window
LENGTHS = [40, 12, 20]


@pytest.mark.parametrize("preset", ["mixtral-tiny", "gemma3-tiny"])
def test_streams_equal_offline_generate_on_both_models(tmp_path, preset):
    llm = LLM(preset, max_num_seqs=4)
    try:
        expected = llm.generate(PROMPTS, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in LENGTHS])
    finally:
        llm.engine.shutdown()
    server = start_server(tmp_path, preset, parameters={"kv_capacity_tokens": "2048"})  # type: ignore[arg-type]
    try:
        for model in ("orca", "baseline"):
            with StreamSession(server.grpc_url) as session:
                for i, (prompt, n) in enumerate(zip(PROMPTS, LENGTHS, strict=True)):
                    session.send(model, f"{model}{i}", input_ids=prompt, max_tokens=n,
                                 sampling={"temperature": 0, "ignore_eos": True}, stream=True)  # fmt: skip
                results = session.wait()
            for result, want in zip(results, expected, strict=True):
                assert result.error is None, result.error
                assert result.ids == want.output_ids
    finally:
        server.stop()
