"""`orca-serve`: run a real tritonserver on this project's model repository.

The reusable piece is `TritonServer` (a context manager): tests and the benchmark start a server on
free ports with it, `orca-serve` is a thin CLI around it. Without a `tritonserver` on PATH (or in
$TRITONSERVER) it prepares the one shipped in the `nvidia-pytriton` wheel (docs/architecture.md,
"Where tritonserver comes from").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from orca_backend.lora import MULTI_LORA_FILE
from orca_backend.net import free_ports

ALL_MODELS = ("orca", "baseline")

# orca-serve's exit codes besides tritonserver's own: 1 for a failed start, this one when
# --exit-on-model-failure saw a served model stop being ready.
EXIT_MODEL_FAILED = 3
MODEL_POLL_INTERVAL_S = 1.0


def default_model_repository() -> Path:
    """The repository checked in next to this package (editable install), else ./model_repository."""
    beside_package = Path(__file__).resolve().parents[2] / "model_repository"
    return beside_package if beside_package.is_dir() else Path.cwd() / "model_repository"


@dataclass
class TritonBinary:
    """Where the server binary is and how to run it (extra args and environment)."""

    path: Path
    backend_directory: Path | None = None  # None: the binary's built-in default (/opt/tritonserver/backends)
    env: dict[str, str] = field(default_factory=dict)


def find_tritonserver(work_dir: Path) -> TritonBinary:
    """$TRITONSERVER, then `tritonserver` on PATH, else the nvidia-pytriton wheel's binary."""
    explicit = os.environ.get("TRITONSERVER")
    if explicit:
        if not Path(explicit).is_file():
            raise FileNotFoundError(f"$TRITONSERVER={explicit} is not a file")
        return TritonBinary(Path(explicit), env=dict(os.environ))
    on_path = shutil.which("tritonserver")
    if on_path:
        return TritonBinary(Path(on_path), env=dict(os.environ))
    return prepare_pytriton_binary(work_dir)


def prepare_pytriton_binary(work_dir: Path) -> TritonBinary:
    """Makes the nvidia-pytriton wheel's tritonserver runnable with this Python.

    The wheel keeps one Python backend stub per Python version apart from the backend; the stub
    must sit in `backends/python/`, so the backends are copied to a run directory of our own.
    """
    try:
        import pytriton
    except ImportError:
        raise FileNotFoundError(
            "no tritonserver found: set $TRITONSERVER, put tritonserver on PATH, or "
            "`pip install nvidia-pytriton` (pip install -e '.[serve]')"
        ) from None
    package_dir = Path(pytriton.__file__).resolve().parent
    server_dir = package_dir / "tritonserver"
    binary = server_dir / "bin" / "tritonserver"
    py_version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = server_dir / "python_backend_stubs" / py_version / "triton_python_backend_stub"
    if not binary.is_file() or not stub.is_file():
        raise FileNotFoundError(f"nvidia-pytriton at {package_dir} lacks tritonserver or a Python {py_version} stub")

    backends = work_dir / "backends"
    if not (backends / "python" / "triton_python_backend_stub").is_file():
        shutil.copytree(server_dir / "backends", backends, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy2(stub, backends / "python" / "triton_python_backend_stub")

    env = dict(os.environ)
    lib_dirs = []
    # The stub links libpython3.X.so.1.0 and embeds whichever the loader finds first. A system
    # libpython of another patch level than this interpreter breaks multiprocessing inside the
    # model ('_thread.RLock' object has no attribute '_recursion_count'), so this interpreter's own
    # shared libpython goes first.
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        libdir = sysconfig.get_config_var("LIBDIR")
        if libdir:
            lib_dirs.append(libdir)
    # The stub's RPATH is relative to its original location, which the copy breaks.
    lib_dirs.append(str(package_dir.parent / "nvidia_pytriton.libs"))
    if env.get("LD_LIBRARY_PATH"):
        lib_dirs.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = ":".join(lib_dirs)
    return TritonBinary(binary, backend_directory=backends, env=env)


# The Python-based backends this package provides (Triton loads <backends>/<name>/model.py for every
# model whose config.pbtxt names the backend; the Python backend's stub and library come from
# <backends>/python): module and class of each one's TritonPythonModel.
BACKENDS = {"orca": ("orca_backend.server.orca_model", "OrcaModel"),
            "orca_baseline": ("orca_backend.server.baseline_model", "BaselineModel")}  # fmt: skip


def install_backends(backends_dir: Path) -> list[Path]:
    """Writes each backend's model.py (a shim: the logic stays in this installed package) under
    `backends_dir`, beside Triton's `python` backend; returns the files written."""
    if not (backends_dir / "python").is_dir():
        raise FileNotFoundError(f"{backends_dir} has no python backend: pass Triton's backends directory "
                                "(/opt/tritonserver/backends in NVIDIA's images)")  # fmt: skip
    written = []
    for name, (module, cls) in BACKENDS.items():
        target = backends_dir / name / "model.py"
        target.parent.mkdir(exist_ok=True)
        target.write_text(f'"""The `{name}` Python-based backend, written by `orca-serve install-backend`: its '
                          f'logic lives in the installed orca_backend package."""\n\n'
                          f"from {module} import {cls} as TritonPythonModel\n\n"
                          '__all__ = ["TritonPythonModel"]\n')  # fmt: skip
        written.append(target)
    return written


def backends_with_ours(binary: TritonBinary, work_dir: Path) -> TritonBinary:
    """The binary with a backends directory that holds ours: the pytriton copy itself, or for a server
    installed elsewhere a run directory linking each of its backends beside ours (its own directory
    may not be writable)."""
    if binary.backend_directory is not None:
        install_backends(binary.backend_directory)
        return binary
    system = binary.path.resolve().parent.parent / "backends"
    if not (system / "python").is_dir():
        raise FileNotFoundError(f"tritonserver at {binary.path}: no backends directory with the python backend at "
                                f"{system}; run `orca-serve install-backend --backends-dir DIR` into its "
                                "backends directory and start tritonserver yourself")  # fmt: skip
    run_backends = work_dir / "backends"
    run_backends.mkdir(exist_ok=True)
    for entry in system.iterdir():
        link = run_backends / entry.name
        if entry.name not in BACKENDS and not link.exists():
            link.symlink_to(entry)
    install_backends(run_backends)
    return TritonBinary(binary.path, backend_directory=run_backends, env=binary.env)


_PARAM_RE = re.compile(
    r'parameters\s*\{\s*key:\s*"(?P<key>[^"]+)"\s*value:\s*\{\s*string_value:\s*"(?P<value>[^"]*)"\s*\}\s*\}'
)


def render_config(text: str, overrides: dict[str, str], top_level: dict[str, int] | None = None) -> str:
    """Rewrites `parameters` string values (adding missing keys) and top-level integer fields."""
    remaining = dict(overrides)

    def replace(match: re.Match[str]) -> str:
        key = match.group("key")
        if key not in remaining:
            return match.group(0)
        return _param_block(key, remaining.pop(key))

    text = _PARAM_RE.sub(replace, text)
    for key, value in remaining.items():
        text = text.rstrip("\n") + "\n" + _param_block(key, value) + "\n"
    for key, number in (top_level or {}).items():
        pattern = re.compile(rf"(?m)^(\s*{re.escape(key)}\s*:\s*)\d+")
        if not pattern.search(text):
            raise ValueError(f"config.pbtxt has no top-level {key} to override")
        text = pattern.sub(rf"\g<1>{int(number)}", text, count=1)
    return text


_INSTANCE_GROUP_RE = re.compile(r"instance_group\s*\[\s*\{(?P<group>[^}]*)\}\s*\]")


def with_instance_count(text: str, count: int) -> str:
    """config.pbtxt with its one instance_group's count set (its kind kept)."""
    if count < 1:
        raise ValueError(f"an instance count must be >= 1, got {count}")
    groups = _INSTANCE_GROUP_RE.findall(text)
    if len(groups) != 1 or not re.search(r"count\s*:\s*\d+", groups[0]):
        raise ValueError("config.pbtxt must hold one instance_group with one group and a count to set the count")
    return _INSTANCE_GROUP_RE.sub(
        lambda m: m.group(0).replace(m.group("group"), re.sub(r"count\s*:\s*\d+", f"count: {count}", m.group("group"))),
        text, count=1,
    )  # fmt: skip


def _param_block(key: str, value: str) -> str:
    escaped = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'parameters {{\n  key: "{key}"\n  value: {{ string_value: "{escaped}" }}\n}}'


@dataclass
class ServerOptions:
    models: tuple[str, ...] = ALL_MODELS
    model_repository: Path | None = None  # default: default_model_repository()
    parameters: dict[str, str] = field(default_factory=dict)  # config.pbtxt parameter overrides, every model
    model_parameters: dict[str, dict[str, str]] = field(default_factory=dict)  # per-model overrides
    max_num_seqs: int | None = None  # orca's engine batch (config.pbtxt parameter max_num_seqs)
    max_batch_size: int | None = None  # the baseline's Triton max_batch_size (its dynamic batcher and engine)
    max_queue_delay_us: int | None = None  # baseline's dynamic_batching max_queue_delay_microseconds
    instances: int | None = None  # orca's Triton instances (stub processes) over its one engine core
    # LoRA adapters {name: directory}: written as each model version's multi_lora.json (and a model.json
    # with enable_lora, which Triton's OpenAI frontend reads to route `model: base<sep>adapter`), with
    # the parameter enable_lora set. Empty: the repository's own files, if any.
    lora_modules: dict[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"
    http_port: int = 0  # 0: a free port
    grpc_port: int = 0
    metrics_port: int = 0
    log_verbose: int = 0
    log_file: Path | None = None  # None: inherit stdout/stderr
    run_dir: Path | None = None  # None: a temporary directory, removed on stop()
    exit_timeout_s: int = 10
    extra_args: tuple[str, ...] = ()
    # The model-repository API (load/unload; a load may carry model code) answers only callers that
    # send this key, over HTTP and gRPC. None: a random key nobody is told, so the API is closed.
    # An --http-restricted-api / --grpc-restricted-protocol in extra_args replaces ours.
    admin_key: str | None = None
    # Linux: Triton gets SIGTERM when the thread that started it exits (a killed test run leaves
    # no orphan server holding ports). Start from a long-lived thread, or turn this off.
    die_with_parent: bool = True


class TritonServer:
    """A tritonserver process on a rendered run copy of the model repository.

    >>> with TritonServer(ServerOptions(parameters={"model": "gpt2-tiny"})) as server:
    ...     server.grpc_url  # "127.0.0.1:PORT"
    """

    def __init__(self, options: ServerOptions | None = None) -> None:
        self.options = options or ServerOptions()
        key = self.options.admin_key
        if key is not None and not re.fullmatch(r"[A-Za-z0-9_-]+", key):
            raise ValueError("the admin key may hold letters, digits, '-' and '_' only (e.g. `openssl rand -hex 32`)")
        self._admin_key = key or secrets.token_hex(32)
        self.process: subprocess.Popen[bytes] | None = None
        self._own_run_dir = self.options.run_dir is None
        self.run_dir = Path(self.options.run_dir or tempfile.mkdtemp(prefix="orca-serve-"))
        host = self.options.host
        connect_host = "127.0.0.1" if host in ("0.0.0.0", "") else host
        self.connect_host = connect_host
        picked = iter(free_ports(3, connect_host))  # for the ports the options leave to us
        self.http_port = self.options.http_port or next(picked)
        self.grpc_port = self.options.grpc_port or next(picked)
        self.metrics_port = self.options.metrics_port or next(picked)
        self._log_handle = None

    # Endpoints as clients want them.
    @property
    def http_url(self) -> str:
        return f"{self.connect_host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.connect_host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.connect_host}:{self.metrics_port}/metrics"

    def render_repository(self) -> Path:
        source = Path(self.options.model_repository or default_model_repository())
        target = self.run_dir / "model_repository"
        if target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True)
        for name in self.options.models:
            if name not in ALL_MODELS and not (source / name).is_dir():
                raise ValueError(f"unknown model {name!r}; the repository has: {', '.join(ALL_MODELS)}")
            shutil.copytree(source / name, target / name, ignore=shutil.ignore_patterns("__pycache__"))
            config_path = target / name / "config.pbtxt"
            overrides = {**self.options.parameters, **self.options.model_parameters.get(name, {})}
            top_level: dict[str, int] = {}
            if self.options.max_batch_size is not None and name == "baseline":
                top_level["max_batch_size"] = self.options.max_batch_size
            if self.options.max_num_seqs is not None and name == "orca":
                overrides["max_num_seqs"] = str(self.options.max_num_seqs)
            if self.options.max_queue_delay_us is not None and name == "baseline":
                top_level["max_queue_delay_microseconds"] = self.options.max_queue_delay_us
            if self.options.lora_modules:
                overrides["enable_lora"] = "true"
                version = target / name / "1"
                adapters = {n: str(Path(path).resolve()) for n, path in self.options.lora_modules.items()}
                (version / MULTI_LORA_FILE).write_text(json.dumps(adapters, indent=2))
                (version / "model.json").write_text(json.dumps({"enable_lora": "true"}))
            text = render_config(config_path.read_text(), overrides, top_level)
            if self.options.instances is not None and name == "orca":
                text = with_instance_count(text, self.options.instances)
            config_path.write_text(text)
        return target

    def command(self, binary: TritonBinary, repository: Path) -> list[str]:
        o = self.options
        cmd = [
            str(binary.path),
            f"--model-repository={repository}",
            f"--http-address={o.host}", f"--http-port={self.http_port}",
            f"--grpc-address={o.host}", f"--grpc-port={self.grpc_port}",
            f"--metrics-address={o.host}", f"--metrics-port={self.metrics_port}",
            # Explicit control loads only the chosen models and lets a model whose engine died
            # unload itself, which is how readiness turns false on Triton 2.51.
            "--model-control-mode=explicit",
            *(f"--load-model={name}" for name in o.models),
            f"--exit-timeout-secs={o.exit_timeout_s}",
            f"--log-verbose={o.log_verbose}",
        ]
        if binary.backend_directory is not None:
            cmd.append(f"--backend-directory={binary.backend_directory}")
        for flag in ("--http-restricted-api", "--grpc-restricted-protocol"):
            if not any(arg.startswith(flag + "=") for arg in o.extra_args):
                cmd.append(f"{flag}=model-repository:admin-key={self._admin_key}")
        return cmd + list(o.extra_args)

    def start(self) -> TritonServer:
        if self.process is not None:
            raise RuntimeError("server already started")
        binary = backends_with_ours(find_tritonserver(self.run_dir), self.run_dir)
        repository = self.render_repository()
        env = dict(binary.env)
        # The Python backend stub runs `python` packages from PATH's environment: this venv first.
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
        stdout = None
        if self.options.log_file is not None:
            self._log_handle = open(self.options.log_file, "ab")  # noqa: SIM115 - closed in stop()
            stdout = self._log_handle
        # Own session: Ctrl-C in a terminal reaches us, and we shut Triton down in order.
        self.process = subprocess.Popen(
            self.command(binary, repository), env=env, stdout=stdout, stderr=subprocess.STDOUT if stdout else None,
            start_new_session=True, preexec_fn=_parent_death_signal() if self.options.die_with_parent else None,
        )
        return self

    def log_tail(self, chars: int = 4000) -> str:
        if self.options.log_file is None or not Path(self.options.log_file).is_file():
            return ""
        return Path(self.options.log_file).read_text(errors="replace")[-chars:]

    def _get(self, path: str) -> int:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}{path}", timeout=2) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except (urllib.error.URLError, OSError):
            return 0

    def model_ready_status(self, name: str) -> int:
        """HTTP status of the model's readiness endpoint: 200 ready, 0 no answer (down, or too busy)."""
        return self._get(f"/v2/models/{name}/ready")

    def is_ready(self) -> bool:
        return self._get("/v2/health/ready") == 200 and all(
            self.model_ready_status(name) == 200 for name in self.options.models
        )

    def failed_models(self) -> list[str]:
        """Served models whose readiness endpoint answers with an error: a model whose engine died
        unloads itself. No answer at all is no verdict (a busy server may miss the timeout)."""
        return [name for name in self.options.models if self.model_ready_status(name) not in (0, 200)]

    def is_live(self) -> bool:
        return self._get("/v2/health/live") == 200

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                code = None if self.process is None else self.process.returncode
                raise RuntimeError(f"tritonserver exited (code {code}) before becoming ready\n{self.log_tail()}")
            if self.is_ready():
                return
            time.sleep(0.25)
        # What answered: 200 ready, an error status not (yet) ready, 0 no answer at all (down, or too busy).
        readiness = {name: self.model_ready_status(name) for name in self.options.models}
        raise TimeoutError(f"tritonserver not ready after {timeout_s:.0f} s (live: {self.is_live()}, each model's "
                           f"readiness status: {readiness})\n{self.log_tail()}")

    def stop(self, timeout_s: float | None = None) -> int | None:
        """SIGINT (Triton drains in-flight requests up to --exit-timeout-secs), then SIGKILL the group."""
        code = None
        if self.process is not None:
            wait_s = timeout_s if timeout_s is not None else self.options.exit_timeout_s + 15
            if self.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    self.process.send_signal(signal.SIGINT)
                try:
                    self.process.wait(timeout=wait_s)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.process.pid, signal.SIGKILL)
                    self.process.wait()
            # Stubs left behind by a crash belong to the server's session: end them too.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
            code = self.process.returncode
            self.process = None
        if self._log_handle is not None:
            self._log_handle.close()
            self._log_handle = None
        if self._own_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        return code

    def __enter__(self) -> TritonServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _parent_death_signal() -> Callable[[], None] | None:
    """A preexec_fn asking Linux for SIGTERM when the parent goes away (None elsewhere).

    prctl is looked up here, in the parent: between fork and exec the child must not import.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def _parse_key_values(items: list[str], flag: str = "--param") -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"orca-serve: {flag} expects KEY=VALUE, got {item!r}")
        out[key.strip()] = value
    return out


class ModelFailureMonitor:
    """Polls the served models' readiness once a second and names those that stopped being ready.

    Triton's /v2/health/ready skips unloaded models, so this is the only way a supervisor outside
    hears that a model's engine died. A model counts as failed when two polls in a row say so.
    """

    def __init__(self, server: TritonServer, interval_s: float = MODEL_POLL_INTERVAL_S) -> None:
        self.server = server
        self.interval_s = interval_s
        self._next_poll = time.monotonic()
        self._suspects: set[str] = set()

    def poll(self) -> list[str]:
        """The models confirmed failed (empty until one is); polls only when the interval is over."""
        now = time.monotonic()
        if now < self._next_poll:
            return []
        self._next_poll = now + self.interval_s
        failed = self.server.failed_models()
        confirmed = [name for name in failed if name in self._suspects]
        self._suspects = set(failed)
        return confirmed


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="orca-serve", description=__doc__.splitlines()[0],
        epilog=f"exit status: 0 after SIGINT/SIGTERM, 1 when the server does not start, {EXIT_MODEL_FAILED} when "
               "--exit-on-model-failure saw a model fail, else tritonserver's own when it exits by itself",
    )  # fmt: skip
    p.add_argument("--models", default=",".join(ALL_MODELS), help="comma-separated models to load (orca,baseline)")
    p.add_argument("--model-repository", type=Path, default=None, help="default: the checked-in model_repository")
    p.add_argument("--model", help="preset name (gpt2-small, llama-150m, ...) or HF checkpoint directory (GPT-2, Llama, Mistral, Qwen2, Qwen3)")
    p.add_argument("--tokenizer", help="tokenizer.json or a directory holding one")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ...")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--max-num-seqs", type=int, help="orca: requests per engine iteration")
    p.add_argument("--instances", type=int,
                   help="orca: Triton instances (stub processes) over its one engine core; raise it when one stub "
                        "cannot send the tokens the engine makes (default: config.pbtxt's count, 1)")  # fmt: skip
    p.add_argument("--max-batch-size", type=int, help="baseline: Triton's dynamic-batcher max_batch_size")
    p.add_argument("--max-queue-delay-us", type=int, help="baseline dynamic_batching max_queue_delay_microseconds")
    p.add_argument("--kv-capacity-tokens", type=int, help="K/V pool size in token slots")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
                   help="K/V stored in the model's dtype (auto) or in FP8 with per-head scales (vLLM's name)")
    p.add_argument("--enforce-eager", action="store_true", default=None,
                   help="CUDA: run every step eagerly instead of replaying the decode steps' CUDA graphs")
    p.add_argument("--kv-policy", choices=("reserve", "paged"),
                   help="orca: reserve prompt + max_tokens at admission (ORCA) or page K/V on demand (vLLM)")
    p.add_argument("--block-size", type=int, help="orca: K/V slots per block")
    p.add_argument("--enable-prefix-caching", action="store_true", default=None,
                   help="orca: share the K/V of equal prompt prefixes")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="orca: schedule each step while the last one runs (one process: tp = pp = 1; unset: on "
                        "where that applies on CUDA, off on a CPU)")
    p.add_argument("--speculative-config", metavar="JSON",
                   help='orca: speculative decoding, vLLM\'s speculative_config, e.g. '
                        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}\'')
    p.add_argument("--max-num-batched-tokens", type=int,
                   help="orca: tokens per engine iteration; longer prompts are prefilled in chunks (0: no limit)")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="serve these LoRA adapters (PEFT directories; vLLM's flag): requests name one with "
                        "lora_name in sampling_parameters. Sets enable_lora and writes each model's multi_lora.json")
    p.add_argument("--max-loras", type=int, help="LoRA adapters resident at once (the others wait, evicted LRU)")
    p.add_argument("--max-lora-rank", type=int, help="the largest adapter rank served (default 16)")
    p.add_argument("--distributed-executor-backend", choices=("mp", "ray"),
                   help="where tp x pp > 1 ranks run: worker processes on this host (mp, the default) or actors on "
                        "the Ray cluster at --ray-address (ray)")
    p.add_argument("--ray-address", help="the Ray cluster to join (default auto: the one `ray start` made here)")
    p.add_argument("--tensor-parallel-size", type=int, help="worker processes per pipeline stage (heads split)")
    p.add_argument("--pipeline-parallel-size", type=int, help="pipeline stages (layers split), one batch in flight each")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="any other config.pbtxt parameter, for every model (repeatable)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 to serve the network)")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--log-verbose", type=int, default=0)
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for the models to load")
    p.add_argument("--exit-on-model-failure", action="store_true",
                   help="once every model was ready, poll each model's readiness every second; when one stops "
                        "being ready (its engine died and it unloaded itself), stop tritonserver and exit with "
                        f"code {EXIT_MODEL_FAILED}, so that a supervisor (compose restart policy, systemd, "
                        "Kubernetes) restarts the deployment. Without it the other models go on serving")
    p.add_argument("--iteration-log", type=Path, metavar="DIR",
                   help="write each served model's iteration log (one JSON line per engine iteration) to "
                        "DIR/<model>.jsonl; off by default")
    p.add_argument("--admin-key", default=os.environ.get("ORCA_ADMIN_KEY") or None,
                   help="the key Triton's model-repository API (load/unload) asks for, over HTTP (header admin-key) "
                        "and gRPC (triton-grpc-protocol-admin-key); default $ORCA_ADMIN_KEY, else a random key "
                        "nobody is told: the API is closed")
    p.add_argument("--triton-arg", action="append", default=[], metavar="ARG",
                   help="an extra tritonserver argument, appended as is (repeatable); write the value after '=', "
                        "e.g. --triton-arg=--http-restricted-api=model-repository:admin-key=SECRET")
    return p


def options_from_args(args: argparse.Namespace) -> ServerOptions:
    models = tuple(m.strip() for m in args.models.split(",") if m.strip())
    unknown = [m for m in models if m not in ALL_MODELS]
    if unknown or not models:
        raise SystemExit(f"--models: choose from {', '.join(ALL_MODELS)}, got {args.models!r}")
    params = _parse_key_values(args.param)
    for flag in ("model", "tokenizer", "device", "dtype", "kv_cache_dtype", "kv_capacity_tokens", "tensor_parallel_size",
                 "pipeline_parallel_size", "enforce_eager", "max_loras", "max_lora_rank", "distributed_executor_backend",
                 "ray_address"):  # fmt: skip
        value = getattr(args, flag)
        if value is None:
            continue
        if flag in ("model", "tokenizer") and Path(value).exists():
            value = Path(value).resolve()
        params[flag] = str(value).lower() if isinstance(value, bool) else str(value)
    # The K/V and chunking knobs are orca's: the baseline stays ORCA-reserved, request-level serving.
    orca_params = {
        flag: str(value).lower()
        for flag in ("kv_policy", "block_size", "enable_prefix_caching", "max_num_batched_tokens", "async_scheduling",
                     "speculative_config")
        if (value := getattr(args, flag)) is not None
    }
    model_parameters: dict[str, dict[str, str]] = {"orca": orca_params} if orca_params else {}
    if args.iteration_log is not None:
        args.iteration_log.mkdir(parents=True, exist_ok=True)
        for model in models:
            log = str((args.iteration_log / f"{model}.jsonl").resolve())
            model_parameters[model] = {**model_parameters.get(model, {}), "iteration_log": log}
    return ServerOptions(
        models=models, model_repository=args.model_repository, parameters=params,
        model_parameters=model_parameters,
        max_num_seqs=args.max_num_seqs, max_batch_size=args.max_batch_size, max_queue_delay_us=args.max_queue_delay_us,
        instances=args.instances,
        lora_modules=_parse_key_values(args.lora_modules, "--lora-modules"),
        host=args.host, http_port=args.http_port, grpc_port=args.grpc_port, metrics_port=args.metrics_port,
        log_verbose=args.log_verbose, extra_args=tuple(args.triton_arg), admin_key=args.admin_key,
    )


def install_backend_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="orca-serve install-backend",
        description="Install the `orca` and `orca_baseline` Python-based backends into Triton's backends directory: "
                    "a model whose config.pbtxt says backend: \"orca\" then needs no model.py of its own.")  # fmt: skip
    parser.add_argument("--backends-dir", type=Path, default=Path("/opt/tritonserver/backends"),
                        help="Triton's backends directory, holding its python backend (default: NVIDIA's images')")
    args = parser.parse_args(argv)
    try:
        for path in install_backends(args.backends_dir):
            print(f"orca-serve: installed {path}")
    except (FileNotFoundError, OSError) as exc:
        print(f"orca-serve install-backend: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["install-backend"]:
        return install_backend_main(argv[1:])
    args = build_parser().parse_args(argv)
    server = TritonServer(options_from_args(args))
    stop_requested = False

    def request_stop(signum: int, _frame: object) -> None:
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    try:
        server.start()
    except (FileNotFoundError, ValueError) as exc:
        print(f"orca-serve: {exc}", file=sys.stderr)
        server.stop()
        return 1
    try:
        deadline = time.monotonic() + args.ready_timeout
        while not stop_requested and not server.is_ready():
            if server.process is None or server.process.poll() is not None:
                print(f"orca-serve: tritonserver exited with code {server.process.returncode}", file=sys.stderr)
                return 1
            if time.monotonic() > deadline:
                print(f"orca-serve: models not ready after {args.ready_timeout:.0f} s", file=sys.stderr)
                return 1
            time.sleep(0.25)
        if not stop_requested:
            print(
                f"orca-serve: ready — models {', '.join(server.options.models)}\n"
                f"  gRPC     {server.grpc_url}\n"
                f"  HTTP     http://{server.http_url}  (e.g. POST /v2/models/orca/generate_stream)\n"
                f"  metrics  {server.metrics_url}",
                flush=True,
            )
        monitor = ModelFailureMonitor(server) if args.exit_on_model_failure else None
        while not stop_requested and server.process is not None and server.process.poll() is None:
            failed = monitor.poll() if monitor is not None else []
            if failed:
                print(
                    f"orca-serve: model {', '.join(map(repr, failed))} is no longer ready (its engine failed and it "
                    "unloaded itself, or the model-repository API unloaded it; the tritonserver log above says "
                    "which); --exit-on-model-failure: "
                    f"stopping tritonserver and exiting with code {EXIT_MODEL_FAILED} for a supervisor to restart",
                    file=sys.stderr, flush=True,
                )  # fmt: skip
                return EXIT_MODEL_FAILED
            time.sleep(0.25)
        if not stop_requested:
            print(f"orca-serve: tritonserver exited with code {server.process.returncode}", file=sys.stderr)
            return server.process.returncode or 1
        print("orca-serve: shutting down", file=sys.stderr, flush=True)
        return 0
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
