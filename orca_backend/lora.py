"""LoRA adapters as the engine's layers share them, torch-free: what a request's adapter is
(`LoRARequest`), which adapters a deployment serves (`LoRARegistry`), and how PEFT's files map onto
this engine's projections (`read_adapter`).

An adapter is a directory in PEFT's format: ``adapter_config.json`` (``r``, ``lora_alpha``,
``target_modules``, ``use_rslora``) and ``adapter_model.safetensors`` (``...lora_A.weight`` [r, in]
and ``...lora_B.weight`` [out, r] per targeted module). The frontend reads both whole at
registration and refuses, naming the field, what the engine would not compute faithfully or could
not load: every key, shape, dtype and data offset, every value finite, the header and the file no
larger than an adapter of this model can be. The registration records the weights file's real path
and its SHA-256; the model runners read that file again when the adapter is first loaded
(orca_backend/model/lora.py) and load it only if it is still the file that was checked
(`read_registered_weights`), so an adapter rewritten, truncated or swapped after registration fails
its own requests with a clear error instead of serving something unchecked.

With `lora_allowed_dir`, every file of an adapter must lie inside it once symbolic links are
resolved: the check is made on the opened file itself (/proc/self/fd), so a link inside the
directory that points out of it is refused, and so is a directory swapped for a link later (its
files then no longer match the recorded digest).

Each family's PEFT module names map onto its projections (its `LoRATargets`, in
orca_backend/families/); a fused projection stacks its slices (GPT-2's ``c_attn`` is one slice of
PEFT's own fused module; the Llama family's ``q_proj``, ``k_proj``, ``v_proj`` are three slices of
``qkv``, ``gate_proj`` and ``up_proj`` two of ``gate_up``). The MLP of a mixture-of-experts layer takes no adapter (its experts have no dense
projection to add to): such adapters are refused.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from orca_backend.families import Projection, family_of

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MULTI_LORA_FILE = "multi_lora.json"  # Triton's vLLM backend's name: {adapter name: directory}


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """The adapter a request runs with. `lora_id` is unique per registration in one engine, so an
    adapter re-registered under the same name from another directory is a different adapter (its own
    prefix-cache entries, its own load)."""

    name: str
    lora_id: int
    path: str  # the adapter's directory, resolved
    rank: int = 0
    scaling: float = 1.0
    weights_file: str = ""  # adapter_model.safetensors's real path, as checked at registration
    digest: str = ""  # its SHA-256 then: a runner loads only that file's checked bytes


def adapter_id(name: str, path: str, digest: str) -> int:
    """An adapter's `lora_id`: the same wherever the same files are registered under the same name
    (the Triton instances that share one engine core each keep a registry), different when the name,
    the directory or the weights differ. 63 bits of SHA-256, positive in any int64."""
    return int.from_bytes(hashlib.sha256(f"{name}\0{path}\0{digest}".encode()).digest()[:8], "big") >> 1


@dataclass(frozen=True)
class AdapterSpec:
    """An adapter as read and checked at registration."""

    rank: int
    scaling: float  # lora_alpha / r, or / sqrt(r) with use_rslora
    # (layer, projection, slice) -> the checkpoint keys of its A and B
    modules: dict[tuple[int, str, int], tuple[str, str]]
    weights_file: str = ""  # the weights file's real path
    digest: str = ""  # the SHA-256 of its bytes


# adapter_config.json fields that change what an adapter computes and are not implemented here.
_REFUSED_FIELDS = ("use_dora", "modules_to_save", "lora_bias", "rank_pattern", "alpha_pattern", "layer_replication",
                   "use_qalora", "alora_invocation_tokens", "target_parameters", "trainable_token_indices")  # fmt: skip


def projections(model_config: Any) -> dict[str, Projection]:
    """The LoRA-able projections of the family's layers (every layer has the same ones, except a
    mixture-of-experts layer's MLP: `layer_projections`)."""
    return family_of(model_config).lora.projections(model_config)


def layer_projections(model_config: Any, layer: int) -> list[str]:
    """The projections of one layer an adapter may target (a MoE layer's MLP has none)."""
    names = list(projections(model_config))
    if getattr(model_config, "num_experts", 0) and model_config.is_moe_layer(layer):
        names = [n for n in names if n in ("qkv", "o")]
    return names


# Bounds on what registration reads: an adapter's config is a few hundred bytes; its safetensors header
# lists at most two tensors per (layer, targeted module), each entry well under _HEADER_BYTES_PER_TENSOR.
MAX_CONFIG_BYTES = 1 << 20
_HEADER_BYTES_BASE = 64 << 10
_HEADER_BYTES_PER_TENSOR = 1024
MAX_LORA_ALPHA = 1e6  # |lora_alpha|: trained adapters use up to a few hundred; larger is a corrupt config
# safetensors dtypes an adapter may store, as numpy reads them (bfloat16 as its 16 raw bits).
_DTYPES = {"F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}


class AdapterFileError(ValueError):
    """An adapter's file cannot be used; the message names the file by its base name only (it may
    reach a client), the caller adds the path where an operator reads it."""


def read_adapter(path: str | Path, model_config: Any, max_lora_rank: int, allowed_dir: Path | None = None) -> AdapterSpec:
    """Reads and checks a whole adapter directory against the model; ValueError naming what is wrong.
    With `allowed_dir`, each file must lie inside it (links resolved on the opened file)."""
    path = Path(path)
    try:
        return _read_adapter(path, model_config, max_lora_rank, allowed_dir)
    except AdapterFileError as e:
        raise ValueError(f"LoRA adapter {path}: {e}") from None


def _read_adapter(path: Path, model_config: Any, max_lora_rank: int, allowed_dir: Path | None) -> AdapterSpec:
    if not (path / ADAPTER_CONFIG).exists() and not (path / ADAPTER_CONFIG).is_symlink():
        raise AdapterFileError(f"no {ADAPTER_CONFIG} (PEFT's format is expected)")
    if not (path / ADAPTER_WEIGHTS).exists() and not (path / ADAPTER_WEIGHTS).is_symlink():
        other = " (adapter_model.bin is not read: save it with safetensors)" if (path / "adapter_model.bin").exists() else ""
        raise AdapterFileError(f"no {ADAPTER_WEIGHTS}{other}")
    raw, _ = _read_file(path / ADAPTER_CONFIG, MAX_CONFIG_BYTES, allowed_dir)
    try:
        config = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise AdapterFileError(f"{ADAPTER_CONFIG} is not readable JSON ({e})") from None
    rank, scaling = _check_config(config, max_lora_rank)
    data, weights_file = _read_file(path / ADAPTER_WEIGHTS, _max_weights_bytes(model_config, rank), allowed_dir)
    modules = check_weights(data, model_config, rank)
    return AdapterSpec(rank, scaling, modules, weights_file, hashlib.sha256(data).hexdigest())


def _check_config(config: object, max_lora_rank: int) -> tuple[int, float]:
    """(rank, scaling) of a PEFT adapter_config.json, refusing what is not computed as trained."""
    if not isinstance(config, dict):
        raise AdapterFileError(f"{ADAPTER_CONFIG} must hold a JSON object, got {type(config).__name__}")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterFileError(f"peft_type {peft_type!r} is not supported (LORA is)")
    for name in _REFUSED_FIELDS:
        if config.get(name):
            raise AdapterFileError(f"{name}={config[name]!r} is not supported (the adapter would not be computed as trained)")
    if config.get("bias", "none") != "none":
        raise AdapterFileError(f"bias={config['bias']!r} is not supported (bias 'none' is)")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise AdapterFileError(f"r must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise AdapterFileError(f"rank {rank} exceeds max_lora_rank {max_lora_rank}")
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha) \
            or abs(alpha) > MAX_LORA_ALPHA:  # fmt: skip
        raise AdapterFileError(f"lora_alpha must be a finite number of magnitude at most {MAX_LORA_ALPHA:g}, got {alpha!r}")
    return rank, float(alpha) / (rank**0.5 if config.get("use_rslora") else rank)


def _read_file(path: Path, limit: int, allowed_dir: Path | None) -> tuple[bytes, str]:
    """A regular file's bytes (at most `limit`) and its real path; with `allowed_dir`, the file opened
    must lie inside it (checked on the descriptor: no link swapped in between resolves elsewhere)."""
    real = os.path.realpath(path)
    # O_NONBLOCK: opening a FIFO put in the file's place returns at once (it is refused below) instead
    # of waiting for a writer; a regular file's reads are unaffected.
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(real, flags)
    except OSError as e:
        why = "a link changed while it was opened" if e.errno == errno.ELOOP else (e.strerror or str(e))
        raise AdapterFileError(f"{path.name} cannot be opened ({why})") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise AdapterFileError(f"{path.name} is not a regular file")
        opened = _opened_path(fd, real)
        if allowed_dir is not None and not Path(opened).is_relative_to(allowed_dir):
            raise AdapterFileError(f"{path.name} lies outside lora_allowed_dir (it resolves to another directory)")
        if info.st_size > limit:
            raise AdapterFileError(f"{path.name} holds {info.st_size} bytes, more than an adapter of this model "
                                   f"and rank can ({limit})")  # fmt: skip
        data = f.read(limit + 1)
    if len(data) > limit:
        raise AdapterFileError(f"{path.name} grew past {limit} bytes while it was read")
    return data, opened


def _opened_path(fd: int, fallback: str) -> str:
    """The path of the file a descriptor holds, as the kernel knows it (Linux); else the path opened."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return fallback


def _max_weights_bytes(model_config: Any, rank: int) -> int:
    """The largest adapter_model.safetensors a rank-`rank` adapter of this model can be: every
    projection's A and B in float64, plus the largest header allowed."""
    per_layer = sum(rank * (fan_in + fan_out) for p in projections(model_config).values() for fan_in, fan_out in p.slices)
    return 8 + _max_header_bytes(model_config) + 8 * per_layer * model_config.num_layers


def _max_header_bytes(model_config: Any) -> int:
    table = family_of(model_config).lora.peft_modules
    return _HEADER_BYTES_BASE + _HEADER_BYTES_PER_TENSOR * 2 * len(table) * model_config.num_layers


def _weights_header(data: bytes, model_config: Any, rank: int) -> tuple[dict[str, Any], int, dict[tuple[int, str, int], tuple[str, str]]]:
    """(the tensors' header entries, the header's size, the module table) of an adapter_model.safetensors:
    a bounded JSON object whose every entry has a float dtype, a shape and data offsets, each tensor's
    key and shape checked against the model."""
    if len(data) < 8:
        raise AdapterFileError(f"{ADAPTER_WEIGHTS} is not a safetensors file (only {len(data)} bytes)")
    (size,) = struct.unpack_from("<Q", data)
    limit = _max_header_bytes(model_config)
    if size > limit:
        raise AdapterFileError(f"{ADAPTER_WEIGHTS} declares a header of {size} bytes, more than an adapter of this "
                               f"model can need ({limit})")  # fmt: skip
    if 8 + size > len(data):
        raise AdapterFileError(f"{ADAPTER_WEIGHTS} is truncated (its header runs past the end of the file)")
    try:
        header = json.loads(data[8 : 8 + size])
    except (ValueError, UnicodeDecodeError) as e:
        raise AdapterFileError(f"{ADAPTER_WEIGHTS}'s header is not readable JSON ({e})") from None
    if not isinstance(header, dict):
        raise AdapterFileError(f"{ADAPTER_WEIGHTS}'s header must be a JSON object, got {type(header).__name__}")
    header.pop("__metadata__", None)
    for key, info in header.items():
        if not (isinstance(info, dict) and info.get("dtype") in _DTYPES and _ints(info.get("shape"))
                and _ints(info.get("data_offsets"), length=2)):  # fmt: skip
            raise AdapterFileError(f"{ADAPTER_WEIGHTS}: tensor {key!r} has a malformed entry (dtype "
                                   f"{', '.join(_DTYPES)}, shape and data_offsets are expected)")  # fmt: skip
    return header, size, _module_keys({key: info["shape"] for key, info in header.items()}, model_config, rank)


def check_weights(data: bytes, model_config: Any, rank: int) -> dict[tuple[int, str, int], tuple[str, str]]:
    """Checks a whole adapter_model.safetensors: its header (`_weights_header`), data offsets that
    tile the file exactly, and every value finite. Returns the module table (see AdapterSpec.modules)."""
    header, size, modules = _weights_header(data, model_config, rank)
    body = memoryview(data)[8 + size :]
    end = 0
    for key, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"]):
        dtype, (begin, stop) = _DTYPES[info["dtype"]], info["data_offsets"]
        if begin != end or stop - begin != math.prod(info["shape"]) * dtype.itemsize:
            raise AdapterFileError(f"{ADAPTER_WEIGHTS}: tensor {key!r}'s data offsets do not follow its shape and "
                                   "dtype (a truncated or corrupt file?)")  # fmt: skip
        end = stop
        if end > len(body):
            raise AdapterFileError(f"{ADAPTER_WEIGHTS} is truncated (tensor {key!r} runs past the end of the file)")
        values = np.frombuffer(body[begin:stop], dtype=dtype)
        if info["dtype"] == "BF16":
            values = (values.astype(np.uint32) << 16).view(np.float32)
        if not np.isfinite(values).all():
            raise AdapterFileError(f"{ADAPTER_WEIGHTS}: tensor {key!r} holds NaN or infinite values")
    if end != len(body):
        raise AdapterFileError(f"{ADAPTER_WEIGHTS} has {len(body) - end} bytes after its last tensor (a corrupt file?)")
    return modules


def _ints(value: object, length: int | None = None) -> bool:
    """A list of non-negative ints (of `length` items where given)."""
    return (isinstance(value, list) and (length is None or len(value) == length)
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value))  # fmt: skip


def _module_keys(shapes: dict[str, list[int]], model_config: Any, rank: int) -> dict[tuple[int, str, int], tuple[str, str]]:
    targets = family_of(model_config).lora
    table = targets.peft_modules
    # A PEFT adapter's weight key: (layer, module, A or B), under the family's prefix for its layers.
    key_pattern = re.compile(rf"^{re.escape(targets.peft_prefix)}\.(\d+)\.(.+)\.lora_([AB])\.weight$")
    projs = projections(model_config)
    found: dict[tuple[int, str, int], dict[str, str]] = {}
    for key, shape in shapes.items():
        match = key_pattern.match(key)
        target = table.get(match.group(2)) if match else None
        layer = int(match.group(1)) if match else -1
        if match is None or target is None or not 0 <= layer < model_config.num_layers:
            raise AdapterFileError(f"weight {key!r} targets no projection this engine adapts "
                                   f"(supported modules: {', '.join(table)}; embeddings and the LM head are not)")  # fmt: skip
        projection, index = target
        if projection not in layer_projections(model_config, layer):
            raise AdapterFileError(f"weight {key!r} targets the mixture-of-experts MLP of layer {layer}, which takes "
                                   "no adapter (attention projections do)")  # fmt: skip
        fan_in, fan_out = projs[projection].slices[index]
        which = match.group(3)
        expected = (rank, fan_in) if which == "A" else (fan_out, rank)
        if tuple(shape) != expected:
            raise AdapterFileError(f"{key} has shape {tuple(shape)}, expected {expected} for this model and r={rank} "
                                   "(an adapter of another base model?)")  # fmt: skip
        found.setdefault((layer, projection, index), {})[which] = key
    if not found:
        raise AdapterFileError(f"{ADAPTER_WEIGHTS} holds no lora_A / lora_B weights")
    for target, pair in found.items():
        if set(pair) != {"A", "B"}:
            raise AdapterFileError(f"layer {target[0]} {target[1]} has lora_{''.join(pair)} without its pair")
    return {target: (pair["A"], pair["B"]) for target, pair in sorted(found.items())}


def read_registered_weights(lora: LoRARequest, model_config: Any) -> tuple[bytes, dict[tuple[int, str, int], tuple[str, str]]]:
    """A model runner's read of a registered adapter's weights: the bytes of the file that was checked
    and its module table. AdapterFileError (a message fit for a client) if the file is gone or is no
    longer the one registration checked."""
    data, _ = _read_file(Path(lora.weights_file), _max_weights_bytes(model_config, lora.rank), None)
    if hashlib.sha256(data).hexdigest() != lora.digest:
        raise AdapterFileError("its weights changed since it was registered (register it again to serve the new ones)")
    return data, _weights_header(data, model_config, lora.rank)[2]  # its values were checked at registration


def read_multi_lora_json(path: str | Path) -> dict[str, str]:
    """{adapter name: directory} from a multi_lora.json (Triton's vLLM backend's file); relative
    directories are relative to the file's own directory."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"enable_lora is set but {path} does not exist: it lists the adapters "
                         '({"name": "/path/to/adapter", ...})') from None  # fmt: skip
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not readable JSON ({e})") from None
    if not isinstance(raw, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in raw.items()):
        raise ValueError(f'{path} must be a JSON object of adapter names to directories, {{"name": "/path", ...}}')
    return {name: str(path.parent / directory) for name, directory in raw.items()}


def write_random_adapter(path: str | Path, model_config: Any, rank: int, seed: int, std: float = 0.02) -> None:
    """A PEFT adapter directory for `model_config` targeting every projection this engine adapts,
    with seeded normal(0, std) A and B (benchmarks: adapters for presets, which have no checkpoint)."""
    import numpy as np
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    targets = family_of(model_config).lora
    table, prefix = targets.peft_modules, targets.peft_prefix
    projs = projections(model_config)
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(model_config.num_layers):
        allowed = layer_projections(model_config, layer)
        for module, (name, index) in table.items():
            if name not in allowed:
                continue
            fan_in, fan_out = projs[name].slices[index]
            key = f"{prefix}.{layer}.{module}.lora_"
            tensors[key + "A.weight"] = (rng.standard_normal((rank, fan_in)) * std).astype(np.float32)
            tensors[key + "B.weight"] = (rng.standard_normal((fan_out, rank)) * std).astype(np.float32)
    save_file(tensors, str(path / ADAPTER_WEIGHTS))
    modules = sorted({module.rsplit(".", 1)[1] for module in table})
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": modules, "bias": "none",
              "fan_in_fan_out": targets.fan_in_fan_out}  # fmt: skip
    (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))


class LoRARegistry:
    """The adapters requests may name (the frontend's): name -> LoRARequest, each read and checked
    whole when added. `allowed_dir`, when set, is the directory every adapter's files must lie in
    (symbolic links resolved).

    An adapter's files are watched by their stamps (inode, size, modification time): `add` of a known
    name whose files changed reads it again and gives it a new id (a new adapter: its own load, its
    own prefix-cache entries), and `changed` lists the names whose files changed since, refused ones
    included, so a watcher can re-apply them."""

    def __init__(self, model_config: Any, max_lora_rank: int, allowed_dir: str = "") -> None:
        self.model_config = model_config
        self.max_lora_rank = max_lora_rank
        self.allowed_dir = Path(allowed_dir).resolve() if allowed_dir else None
        self._adapters: dict[str, LoRARequest] = {}
        # name -> (directory, its files' stamps when last read), for the registered and the refused
        self._stamps: dict[str, tuple[str, tuple]] = {}

    @property
    def names(self) -> list[str]:
        return sorted(self._adapters)

    def add(self, name: str, path: str) -> LoRARequest:
        """Registers (or re-registers from another directory, or with changed files) an adapter;
        ValueError if it is refused."""
        if not isinstance(name, str) or not name or len(name) > 256:
            raise ValueError(f"a LoRA adapter's name must be a non-empty string of at most 256 characters, got {name!r}")
        resolved = Path(path).resolve()
        stamp = _stamp(resolved)
        known = self._adapters.get(name)
        if known is not None and self._stamps.get(name) == (str(resolved), stamp):
            return known
        self._adapters.pop(name, None)
        self._stamps[name] = (str(resolved), stamp)  # a refused adapter is retried once its files change
        if self.allowed_dir is not None and not resolved.is_relative_to(self.allowed_dir):
            raise ValueError(f"LoRA adapter {name!r}: {path} lies outside lora_allowed_dir {self.allowed_dir}")
        spec = read_adapter(resolved, self.model_config, self.max_lora_rank, self.allowed_dir)
        same = (str(resolved), spec.rank, spec.scaling, spec.weights_file, spec.digest)
        if known is not None and (known.path, known.rank, known.scaling, known.weights_file, known.digest) == same:
            self._adapters[name] = known  # touched, not changed: the same adapter
            return known
        lora = self._adapters[name] = LoRARequest(name, adapter_id(name, *same[:1], spec.digest), *same)
        return lora

    def remove(self, name: str) -> None:
        """Requests may no longer name it (those running finish with it)."""
        self._stamps.pop(name, None)
        if self._adapters.pop(name, None) is None:
            raise ValueError(f"no LoRA adapter named {name!r} is registered")

    def sync(self, adapters: dict[str, str]) -> list[str]:
        """Makes the registry hold exactly `adapters` (a re-read multi_lora.json): new, moved and
        changed ones (re-)added, missing ones removed, each on its own. Returns the errors of those
        refused (the rest still apply)."""
        errors = []
        for name in set(self._stamps) - set(adapters):
            self._stamps.pop(name, None)
            self._adapters.pop(name, None)
        for name, path in adapters.items():
            try:
                self.add(name, path)
            except Exception as e:  # noqa: BLE001 - one bad adapter is refused alone, whatever it raised
                self._adapters.pop(name, None)
                errors.append(str(e) if isinstance(e, ValueError) else f"LoRA adapter {name!r}: {e!r}")
        return errors

    def changed(self) -> list[str]:
        """The adapters (registered or refused) whose directory's files changed since they were read."""
        return sorted(name for name, (path, stamp) in self._stamps.items() if _stamp(Path(path)) != stamp)

    def get(self, name: str) -> LoRARequest:
        lora = self._adapters.get(name)
        if lora is None:  # the served names are not listed: a client learns them from the model's listing
            raise ValueError(f"LoRA adapter {name!r} is not served by this model")
        return lora


def _stamp(directory: Path) -> tuple:
    """What changes when an adapter's files are rewritten, replaced or removed: each path's own stamp
    and, where it is a link, its target's."""
    out: list[tuple[int, int, int, int] | None] = []
    for path in (directory, directory / ADAPTER_CONFIG, directory / ADAPTER_WEIGHTS):
        for follow in (False, True):
            try:
                info = os.stat(path, follow_symlinks=follow)
            except OSError:
                out.append(None)
                continue
            out.append((info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns))
    return tuple(out)
