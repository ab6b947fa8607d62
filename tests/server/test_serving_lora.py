"""Multi-LoRA through a real tritonserver: `lora_name` in `sampling_parameters` on both models (the
vLLM backend's contract), adapters listed in each model version's multi_lora.json, an unknown adapter
failing alone, Triton's OpenAI frontend routing `model: base<sep>adapter` (replayed), the adapters'
metrics, and multi_lora.json re-read at run time."""

from __future__ import annotations

import json

import pytest
from hf_tiny import write_lora, write_tiny_with_tokenizer

from orca_backend.entrypoints.llm import LLM
from orca_backend.sampling_params import SamplingParams

pytest.importorskip("tritonclient.grpc", reason="needs the serve extras (tritonclient)")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from serving_utils import StreamSession, frontend_inputs, metric, read_metrics, start_server, wait_until  # noqa: E402

pytestmark = pytest.mark.integration

PROMPTS = ["the kalo mine", "a b c", "mine the naïve one", "one two"]
NAMES = ["A", None, "B", "A"]
N = 12


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """A Qwen2-style checkpoint with its own tokenizer, and adapters A, B (and C, added at run time)."""
    root = tmp_path_factory.mktemp("lora")
    base_path = root / "base"
    base = write_tiny_with_tokenizer(base_path, tokenizer_seed=2)
    write_lora(base, root / "A", 1, 8, ["q_proj", "v_proj", "down_proj"])
    write_lora(base, root / "B", 2, 4, ["o_proj", "gate_proj"])
    write_lora(base, root / "C", 3, 8, ["k_proj", "up_proj"])
    return root


@pytest.fixture(scope="module")
def server(adapters, tmp_path_factory):
    server = start_server(
        tmp_path_factory.mktemp("triton-lora"), adapters / "base", lora_modules={"A": str(adapters / "A"),
        "B": str(adapters / "B")}, parameters={"kv_capacity_tokens": "4096", "max_loras": "2",
        "allow_runtime_lora_updating": "true", "lora_allowed_dir": str(adapters)},
    )  # fmt: skip
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def expected(adapters):
    llm = LLM(str(adapters / "base"), enable_lora=True, max_loras=2,
              lora_modules={"A": str(adapters / "A"), "B": str(adapters / "B"), "C": str(adapters / "C")})  # fmt: skip
    try:
        outs = {}
        for name in ("A", "B", "C", None):
            params = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, lora_name=name)
            outs[name] = [o.output_ids for o in llm.generate(PROMPTS, params)]
        return outs
    finally:
        llm.engine.shutdown()


def sampling(name: str | None) -> dict:
    return {"temperature": 0, "ignore_eos": True} | ({"lora_name": name} if name else {})


def test_mixed_adapters_stream_the_offline_tokens_on_both_models(server, expected):
    assert expected["A"] != expected[None] and expected["B"] != expected[None]  # the adapters change the tokens
    for model in ("orca", "baseline"):  # the baseline's batches mix adapters as the engine does
        with StreamSession(server.grpc_url) as session:
            for i, (prompt, name) in enumerate(zip(PROMPTS, NAMES, strict=True)):
                session.send(model, f"{model}{i}", text=prompt, max_tokens=N, sampling=sampling(name), stream=True)
            results = session.wait()
        for i, (result, name) in enumerate(zip(results, NAMES, strict=True)):
            assert result.error is None, result.error
            assert result.ids == expected[name][i], (model, name)


def test_an_unknown_adapter_fails_alone(server, expected):
    # each on its own stream: a stream's error callback does not say which request it is for
    with StreamSession(server.grpc_url) as good_session, StreamSession(server.grpc_url) as bad_session:
        good = good_session.send("orca", "good", text=PROMPTS[0], max_tokens=N, sampling=sampling("A"), stream=True)
        bad = bad_session.send("orca", "bad", text=PROMPTS[0], max_tokens=N, sampling=sampling("nope"), stream=True)
        bad_session.wait()
        good_session.wait()
    assert bad.error is not None and "LoRA adapter 'nope' is not served by this model" in bad.error
    assert good.error is None and good.ids == expected["A"][0]


def test_openai_frontend_routes_base_separator_adapter(server, expected):
    """`model: orca_B` with --lora-separator _ reaches the model as lora_name "B" in sampling_parameters;
    the frontend finds the model's adapters in the version's multi_lora.json (with model.json's
    enable_lora), which the server wrote."""
    version = server.run_dir / "model_repository" / "orca" / "1"
    assert json.loads((version / "model.json").read_text()) == {"enable_lora": "true"}
    assert set(json.loads((version / "multi_lora.json").read_text())) == {"A", "B"}
    with StreamSession(server.grpc_url) as session:
        session.send_inputs("orca", frontend_inputs(PROMPTS[2], stream=True, max_tokens=N, temperature=0, lora_name="B"), "oa")
        (result,) = session.wait()
    assert result.error is None, result.error
    # the frontend sends ignore_eos false: the tokens are the offline run's up to an EOS
    assert result.ids == expected["B"][2][: len(result.ids)] and result.ids


def test_adapter_metrics(server):
    """vLLM's lora_requests_info (max_lora, running and waiting adapters as labels) and the per-request
    series labelled by adapter."""
    def counted(lora_name: str) -> bool:  # the metrics thread exports a finished request within a few ticks
        return metric(server, "vllm:e2e_request_latency_seconds_count", "orca", lora_name=lora_name) > 0

    assert wait_until(lambda: counted("A") and counted("B") and counted(""))  # "": the base model's
    assert metric(server, "vllm:request_success_total", "orca", lora_name="A", finished_reason="length") > 0

    def info() -> list[dict[str, str]]:
        return [dict(labels) for (name, labels), _ in read_metrics(server).items()
                if name == "vllm:lora_requests_info" and ("model", "orca") in labels]  # fmt: skip

    # Only the current series ("now": nothing running or waiting once the requests ended), not one per
    # combination seen while they ran.
    assert wait_until(lambda: [(i["running_lora_adapters"], i["waiting_lora_adapters"]) for i in info()] == [("", "")])
    assert [i["max_lora"] for i in info()] == ["2"]


def test_multi_lora_json_is_reread_at_run_time(server, adapters, expected):
    """allow_runtime_lora_updating: C added and B removed by editing the file; B's running requests
    would finish, new ones are refused. An adapter rewritten in place is read again."""
    path = server.run_dir / "model_repository" / "orca" / "1" / "multi_lora.json"
    path.write_text(json.dumps({"A": str(adapters / "A"), "C": str(adapters / "C")}))

    def send(name: str):  # noqa: ANN202 - the stream's result
        with StreamSession(server.grpc_url) as session:
            result = session.send("orca", text=PROMPTS[1], max_tokens=N, sampling=sampling(name), stream=True)
            session.wait()
        return result

    def serves(name: str, weights: str) -> bool:  # the watcher thread re-reads the file within about a second
        result = send(name)
        return result.error is None and result.ids == expected[weights][1]

    def refused(name: str) -> bool:
        result = send(name)
        return result.error is not None and f"LoRA adapter {name!r} is not served by this model" in result.error

    assert wait_until(lambda: serves("C", "C"), timeout_s=30, interval_s=0.5)
    assert refused("B")
    path.write_text(json.dumps({"A": str(adapters / "A"), "C": "/etc"}))  # outside lora_allowed_dir: refused, logged
    assert wait_until(lambda: refused("C"), timeout_s=30, interval_s=0.5)

    # A's files rewritten in place with C's: the watcher sees them change, reads A again (a new adapter,
    # loaded afresh, not the old weights from the host cache or the slot) and A's requests get C's tokens.
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (adapters / "A" / name).write_bytes((adapters / "C" / name).read_bytes())
    assert wait_until(lambda: serves("A", "C"), timeout_s=30, interval_s=0.5)
