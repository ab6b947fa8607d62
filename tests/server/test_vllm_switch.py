"""A model repository written for Triton's vLLM backend, switched by one line: a config.pbtxt of
`backend: "orca"` (or "orca_baseline") and the sample's instance group, `1/model.json` of vLLM
engine arguments, `1/multi_lora.json` of adapters. The backends are installed with the installer;
the tokens streamed equal `LLM.generate`; a model.json argument nothing reads, and a hub name, fail
the load saying so (server/triton_config.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
from hf_tiny import write_lora, write_tiny_with_tokenizer

from orca_backend.entrypoints.llm import LLM
from orca_backend.entrypoints.serve import (
    ServerOptions,
    TritonServer,
    install_backend_main,
    prepare_pytriton_binary,
)
from orca_backend.sampling_params import SamplingParams

pytest.importorskip("tritonclient.grpc", reason="needs the serve extras (tritonclient)")
httpclient = pytest.importorskip("tritonclient.http", reason="needs the serve extras (tritonclient)")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from serving_utils import StreamSession, model_processes, one_request, read_metrics, wait_until  # noqa: E402

pytestmark = pytest.mark.integration

PROMPTS = ["the kalo mine", "a b c", "mine the naïve one"]
N = 8
ADMIN_KEY = "switch-test"
SAMPLE_INSTANCES = "instance_group [\n  {\n    count: 1\n    kind: KIND_MODEL\n  }\n]\n"  # the vLLM sample's


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A Qwen2-style checkpoint with a trained tokenizer, and a LoRA adapter."""
    root = tmp_path_factory.mktemp("switch-ckpt")
    base = write_tiny_with_tokenizer(root / "base", tokenizer_seed=5)
    write_lora(base, root / "A", 1, 8, ["q_proj", "v_proj"])
    return root


def write_model(repository: Path, name: str, backend: str, model_json: dict, adapters: dict | None = None) -> None:
    """One model as the vLLM backend's sample lays it out."""
    version = repository / name / "1"
    version.mkdir(parents=True)
    (repository / name / "config.pbtxt").write_text(f'backend: "{backend}"\n\n{SAMPLE_INSTANCES}')
    (version / "model.json").write_text(json.dumps(model_json))
    if adapters is not None:
        (version / "multi_lora.json").write_text(json.dumps(adapters))


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("switch")
    repository = run_dir / "source"
    base = str(checkpoint / "base")
    engine_args = {"model": base, "gpu_memory_utilization": 0.5, "enforce_eager": True, "max_num_seqs": 8,
                   "max_model_len": 256, "kv_cache_memory_bytes": 4 * 2**20, "enable_prefix_caching": True,
                   "disable_log_requests": True}  # fmt: skip
    write_model(repository, "vllm_model", "orca", {**engine_args, "enable_lora": True, "max_lora_rank": 8},
                {"A": str(checkpoint / "A")})  # fmt: skip
    write_model(repository, "vllm_baseline", "orca_baseline", engine_args)
    write_model(repository, "bad_argument", "orca", {**engine_args, "swap_spaec": 4})
    write_model(repository, "hub_name", "orca", {"model": "facebook/opt-125m-not-cached"})
    write_model(repository, "quiet", "orca", {"model": base, "kv_cache_memory_bytes": 2**20})
    with (repository / "quiet" / "config.pbtxt").open("a") as config:
        config.write('parameters { key: "REPORT_CUSTOM_METRICS" value: { string_value: "false" } }\n')
    write_model(repository, "health_checked", "orca", {"model": base, "kv_cache_memory_bytes": 2**20})
    with (repository / "health_checked" / "config.pbtxt").open("a") as config:
        for key, value in (("ENABLE_VLLM_HEALTH_CHECK", "true"), ("health_check_interval_s", "0.5"),
                           ("iteration_timeout_s", "3")):  # fmt: skip
            config.write(f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n')
    # The backends as a user installs them: the installer, into the server's backends directory.
    binary = prepare_pytriton_binary(run_dir)
    shutil.rmtree(binary.backend_directory / "orca", ignore_errors=True)
    assert install_backend_main(["--backends-dir", str(binary.backend_directory)]) == 0
    assert (binary.backend_directory / "orca_baseline" / "model.py").is_file()
    server = TritonServer(ServerOptions(models=("vllm_model", "vllm_baseline"), model_repository=repository,
                                        run_dir=run_dir, log_file=run_dir / "tritonserver.log", admin_key=ADMIN_KEY))  # fmt: skip
    server.start()
    try:
        server.wait_ready(300)
        yield server
    finally:
        server.stop()
        print(server.log_tail(20000))


def load(server, model: str) -> None:
    """Loads a model written beside the served ones (orca-serve rendered only those it started with)
    through the repository API; raises what the load failed with."""
    shutil.copytree(server.run_dir / "source" / model, server.run_dir / "model_repository" / model)
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        client.load_model(model, headers={"admin-key": ADMIN_KEY})
    finally:
        client.close()


@pytest.fixture(scope="module")
def expected(checkpoint):
    llm = LLM(str(checkpoint / "base"), enable_lora=True, max_lora_rank=8, lora_modules={"A": str(checkpoint / "A")})
    try:
        return {name: [o.output_ids for o in llm.generate(PROMPTS, SamplingParams(
                    max_tokens=N, temperature=0.0, ignore_eos=True, lora_name=name))] for name in ("A", None)}  # fmt: skip
    finally:
        llm.shutdown()


@pytest.mark.parametrize(("model", "lora"), [("vllm_model", None), ("vllm_model", "A"), ("vllm_baseline", None)])
def test_a_vllm_repository_switched_by_one_line_streams_the_offline_tokens(server, expected, model, lora):
    sampling = {"temperature": 0, "max_tokens": N, "ignore_eos": True, **({"lora_name": lora} if lora else {})}
    stream = model == "vllm_model"
    with StreamSession(server.grpc_url) as session:
        results = [session.send(model, f"p{i}", text=prompt, sampling=sampling, stream=stream)
                   for i, prompt in enumerate(PROMPTS)]  # fmt: skip
        session.wait()
    assert [r.error for r in results] == [None] * len(PROMPTS)
    assert [r.ids for r in results] == expected[lora]


def test_auto_complete_gave_each_model_its_contract(server):
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        orca = client.get_model_config("vllm_model")
        baseline = client.get_model_config("vllm_baseline")
    finally:
        client.close()
    assert orca["model_transaction_policy"]["decoupled"] and orca.get("max_batch_size", 0) == 0
    assert {t["name"] for t in orca["input"]} >= {"text_input", "input_ids", "sampling_parameters", "stream"}
    assert {t["name"] for t in orca["output"]} >= {"text_output", "finish_reason", "num_output_tokens"}
    assert baseline["max_batch_size"] == 32 and "dynamic_batching" in baseline


@pytest.mark.parametrize(("model", "message"), [
    ("bad_argument", "unsupported engine argument(s) swap_spaec"),
    ("hub_name", "'facebook/opt-125m-not-cached' is neither a local directory nor in the Hugging Face cache"),
])  # fmt: skip
def test_a_model_json_this_engine_cannot_honour_fails_the_load_saying_why(server, model, message):
    with pytest.raises(Exception, match=f"load failed for model '{model}'") as failure:
        load(server, model)
    assert message in str(failure.value)  # the client that asked is told why
    assert server.model_ready_status("vllm_model") == 200  # the others serve on


def test_a_wedged_idle_engine_makes_the_model_unready_with_the_health_check_on(server):
    """ENABLE_VLLM_HEALTH_CHECK (the vLLM backend's switch): an engine that stops answering, with no
    request anywhere, turns its model unready and says why in the log."""
    load(server, "health_checked")
    assert server.model_ready_status("health_checked") == 200
    _, (core,) = model_processes(server.process.pid, "health_checked")
    os.kill(core, signal.SIGSTOP)  # alive, answering nothing
    assert wait_until(lambda: server.model_ready_status("health_checked") != 200, timeout_s=60)
    assert "to an idle engine's health check" in server.log_tail(200_000)
    assert server.model_ready_status("vllm_model") == 200  # the others serve on


def test_report_custom_metrics_false_exports_no_series_for_the_model(server):
    """The vLLM backend's switch: with REPORT_CUSTOM_METRICS false the model exports nothing of its own,
    while a model with metrics on counts its requests."""
    load(server, "quiet")
    for model in ("quiet", "vllm_model"):
        assert one_request(server.grpc_url, model, input_ids=[5, 6], max_tokens=3, stream=True).error is None
    labelled = {(name, model) for (name, labels), _ in read_metrics(server).items() for key, model in labels
                if key == "model"}  # fmt: skip
    ours = {name for name, model in labelled if model == "quiet" and name.startswith(("vllm:", "orca_"))}
    assert not ours  # Triton's own nv_* series stay, as for any model
    assert ("vllm:generation_tokens_total", "vllm_model") in labelled
