"""What a deployment exposes and how it fails: worker sockets stay on loopback, and
`orca-serve --exit-on-model-failure` exits (for a supervisor to restart it) when a model's engine dies,
while Triton's model load/unload API stays closed to callers without the admin key."""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from core_hooks import pid_alive

from orca_backend import EngineConfig, SamplingParams
from orca_backend.engine.llm_engine import LLMEngine
from orca_backend.entrypoints.serve import EXIT_MODEL_FAILED
from orca_backend.executor.multiproc import (
    STORE_DIR_PREFIX,
    make_store_dir,
    remove_stale_store_dirs,
    worker_socket_env,
)
from orca_backend.families.gpt2 import GPT2Config
from orca_backend.net import free_ports
from orca_client.served_path import process_tree

# Four heads and an even vocabulary so that tp=2 splits both.
MODEL = GPT2Config(vocab_size=384, n_positions=128, n_embd=64, n_layer=2, n_head=4, initializer_range=0.3)
TCP_LISTEN = "0A"  # st column of /proc/net/tcp


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint):
    return make_checkpoint(MODEL)[0]


# ------------------------------------------------------------------------------ /proc/net parsing
def proc_net_address(hex_address: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """(address, port) of a /proc/net/tcp{,6} address column: the address is printed as 32-bit
    words in host byte order, the port in big-endian hex."""
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    if sys.byteorder == "little":
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(raw), int(port, 16)


def is_loopback(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 from a dual-stack socket
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state that process `pid` holds."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()  # sl local_address rem_address st ... uid timeout inode
            if fields[3] == TCP_LISTEN and fields[9] in inodes:
                address, port = proc_net_address(fields[1])
                found.append((str(address), port))
    return found


def test_proc_net_parsing_tells_loopback_from_every_interface():
    # Lines as the kernel writes them (x86, little-endian words): a wildcard listener must be caught.
    lines = {
        "00000000:1F40": "0.0.0.0",
        "0100007F:1F40": "127.0.0.1",
        "020200C0:1F40": "192.0.2.2",
        "00000000000000000000000000000000:1F40": "::",
        "00000000000000000000000001000000:1F40": "::1",
        "0000000000000000FFFF00000100007F:1F40": "::ffff:7f00:1",  # ::ffff:127.0.0.1
    }
    if sys.byteorder != "little":
        pytest.skip("the sample lines are a little-endian host's")
    parsed = {hex_address: proc_net_address(hex_address) for hex_address in lines}
    assert {h: str(a) for h, (a, _) in parsed.items()} == lines
    assert all(port == 8000 for _, port in parsed.values())
    assert [str(a) for a, _ in parsed.values() if is_loopback(a)] == ["127.0.0.1", "::1", "::ffff:7f00:1"]


def test_proc_net_parsing_reads_a_wildcard_listener_of_this_process():
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("0.0.0.0", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert ("0.0.0.0", port) in listening_sockets(os.getpid())


# ------------------------------------------------------------------------------ workers on loopback
def test_worker_socket_env_keeps_the_users_interface():
    assert worker_socket_env({}) == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    assert worker_socket_env({"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": ""}) == {"NCCL_SOCKET_IFNAME": "lo"}


def test_tp2_workers_listen_on_loopback_only_and_remove_their_store(checkpoint):
    engine = LLMEngine(EngineConfig(model=str(checkpoint), tensor_parallel_size=2, max_num_seqs=2))
    executor = engine.core.executor
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        engine.add_request([1, 2, 3], params)
        while engine.has_work():  # collectives run: every socket the data plane needs is open
            engine.step()
        assert Path(executor.store_dir).is_dir()
        listeners = {pid: listening_sockets(pid) for pid in executor.pids}
        assert all(listeners.values()), listeners  # gloo listens in each worker: the check is not vacuous
        exposed = {pid: [(a, p) for a, p in socks if not is_loopback(ipaddress.ip_address(a))]
                   for pid, socks in listeners.items()}  # fmt: skip
        assert not any(exposed.values()), exposed
    finally:
        engine.shutdown()
    assert not Path(executor.store_dir).exists()


def test_a_killed_masters_store_is_removed_by_its_orphaned_workers(checkpoint):
    """SIGKILL the engine core (the workers' master): it cannot remove its file store; the workers
    notice they are orphaned, remove it and exit."""
    engine = LLMEngine.launch(EngineConfig(model=str(checkpoint), tensor_parallel_size=2))
    try:
        core, workers = engine.core.pid, engine.core.worker_pids
        (store,) = [p for p in Path(tempfile.gettempdir()).glob(f"{STORE_DIR_PREFIX}*-{core}-*")]
        os.kill(core, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while (store.exists() or any(map(pid_alive, workers))) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not store.exists() and not any(map(pid_alive, workers))
    finally:
        engine.shutdown()


def test_stale_store_dirs_of_gone_masters_are_swept(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    live = Path(make_store_dir())  # this process's
    stale = Path(str(live).replace(f"-{os.getpid()}-", f"-{gone.pid}-"))
    stale.mkdir()
    (stale / "store").write_bytes(b"x")
    other_namespace = tmp_path / f"{STORE_DIR_PREFIX}1-{gone.pid}-abc"  # judged only in its own pid namespace
    other_namespace.mkdir()
    assert remove_stale_store_dirs() == [str(stale)]
    assert live.is_dir() and other_namespace.is_dir() and not stale.exists()


# ------------------------------------------------------------------------------ orca-serve supervision
def _status(url: str, method: str = "GET", headers: dict[str, str] | None = None) -> int:
    request = urllib.request.Request(url, method=method, headers=headers or {}, data=b"{}" if method == "POST" else None)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return 0


@pytest.mark.integration
def test_exit_on_model_failure_exits_with_its_code_and_leaves_nothing_running(checkpoint, tmp_path):
    """SIGKILL the `orca` model's engine core: the model unloads itself, orca-serve notices, stops
    tritonserver and exits with EXIT_MODEL_FAILED. The model-repository API is restricted to an
    admin key meanwhile, which must not keep the model from unloading itself (an in-process call)."""
    pytest.importorskip("tritonclient.grpc", reason="needs the serve extras (tritonclient)")
    import tritonclient.grpc as grpcclient
    from serving_utils import engine_processes  # imports tritonclient
    from tritonclient.utils import InferenceServerException

    http_port, grpc_port, metrics_port = free_ports(3)
    key = "test-admin-key"
    log = tmp_path / "orca-serve.log"
    command = [
        sys.executable, "-m", "orca_backend.entrypoints.serve", "--models", "orca", "--model", str(checkpoint),
        "--device", "cpu",
        "--kv-capacity-tokens", "4096", "--http-port", str(http_port), "--grpc-port", str(grpc_port),
        "--metrics-port", str(metrics_port), "--exit-on-model-failure",
        f"--triton-arg=--http-restricted-api=model-repository:admin-key={key}",
        f"--triton-arg=--grpc-restricted-protocol=model-repository:admin-key={key}",
    ]  # fmt: skip
    base = f"http://127.0.0.1:{http_port}"
    with open(log, "wb") as out:
        serve = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    tree_pids: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while _status(f"{base}/v2/models/orca/ready") != 200:
            assert serve.poll() is None, f"orca-serve exited with {serve.returncode}:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"orca not ready:\n{log.read_text()[-4000:]}"
            time.sleep(0.5)

        # The load/unload API answers only with the key, over HTTP and gRPC; health needs none.
        assert _status(f"{base}/v2/repository/index", "POST") == 403
        assert _status(f"{base}/v2/repository/models/orca/unload", "POST") == 403
        assert _status(f"{base}/v2/repository/index", "POST", {"admin-key": key}) == 200
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        try:
            with pytest.raises(InferenceServerException, match="restricted"):
                client.get_model_repository_index()
            # Triton's gRPC frontend expects the restricted header under a prefix of its own.
            assert client.get_model_repository_index(headers={"triton-grpc-protocol-admin-key": key}) is not None
            assert client.is_model_ready("orca")
        finally:
            client.close()

        # orca-serve watches the models only once it has seen every one ready itself (it polls every
        # 0.25 s): killing the engine before that would leave it waiting for readiness, not watching.
        while "orca-serve: ready" not in log.read_text():
            assert serve.poll() is None, f"orca-serve exited with {serve.returncode}:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"orca-serve never said ready:\n{log.read_text()[-4000:]}"
            time.sleep(0.25)
        tree = process_tree(serve.pid)
        tree_pids = [p.pid for p in tree if p.pid != serve.pid]
        _, core, _ = engine_processes(serve.pid)
        os.kill(core, signal.SIGKILL)
        try:
            code = serve.wait(timeout=180)
        except subprocess.TimeoutExpired:
            pytest.fail(f"orca-serve still runs after its model failed:\n{log.read_text()[-4000:]}")
        text = log.read_text()
        assert code == EXIT_MODEL_FAILED, text[-4000:]
        assert "'orca' is no longer ready" in text and "--exit-on-model-failure" in text
        deadline = time.monotonic() + 60
        while any(map(pid_alive, tree_pids)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p.cmdline for p in tree if p.pid in tree_pids and pid_alive(p.pid)]
    finally:
        if serve.poll() is None:
            serve.send_signal(signal.SIGTERM)
            try:
                serve.wait(timeout=60)
            except subprocess.TimeoutExpired:
                serve.kill()
                serve.wait()
        for pid in tree_pids:  # only if the test failed: never leave a server holding its ports
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
