"""What the CUDA-graph tests check a static-buffer step with, on the CPU: a recorder of every launch
(torch ops, C kernel calls, Triton launches) with memory named rather than numbered, so that two
steps of one bucket can be compared launch by launch; and a guard that fails a step on anything a
CUDA graph cannot capture (tests/worker/test_cuda_graphs.py, test_mixed_graphs.py)."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

import orca_kernels.cpu_attention
import orca_kernels.cpu_gpt2_ops
import orca_kernels.cpu_llama_ops
from orca_backend.model import gemm
from orca_backend.worker.cuda_graphs import StepGraphs
from orca_backend.worker.eagle_proposer import EagleProposer
from orca_backend.worker.model_runner import ModelRunner
from orca_backend.worker.runner_proposer import RunnerProposer


class LaunchRecorder(TorchDispatchMode):
    """Records every torch op (through the dispatcher) and every C kernel call (through the kernel
    loaders, patched by `record_c_kernels`) with memory named, not numbered: a named buffer (static
    buffers, the K/V pool, the weights) by its name and offset, a temporary by the order in which it
    was allocated within the recording. Two recordings are equal when the launches are."""

    def __init__(self, named: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.regions: list[tuple[int, int, str]] = []  # (start, end, name), the newest last
        # Opaque tensors (oneDNN's packed weights: no storage a pointer could name) by identity.
        self.opaque: dict[int, str] = {}
        self.temporaries = 0
        for name, tensor in named.items():
            self._add_region(tensor, name)
        self.launches: list[tuple] = []

    def _add_region(self, tensor: torch.Tensor, name: str) -> None:
        if tensor.layout == torch._mkldnn:
            self.opaque[id(tensor)] = name
            return
        storage = tensor.untyped_storage()
        if storage.nbytes():
            self.regions.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes(), name))

    def name_of(self, address: int) -> tuple[str, int] | None:
        for start, end, name in reversed(self.regions):
            if start <= address < end:
                return name, address - start
        return None

    def _describe(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.layout == torch._mkldnn:
            if id(value) not in self.opaque:
                self._add_region(value, f"opaque{len(self.opaque)}")
            return ("opaque", self.opaque[id(value)], tuple(value.shape), str(value.dtype))
        if isinstance(value, torch.Tensor):
            where = self.name_of(value.data_ptr()) if value.numel() else ("empty", 0)
            if where is None:  # memory no op made and no name covers: name it by first appearance
                where = (f"outside{len(self.regions)}", 0)
                self._add_region(value, where[0])
            return ("tensor", where, tuple(value.shape), value.stride(), str(value.dtype))
        if isinstance(value, (list, tuple)):
            return tuple(self._describe(v) for v in value)
        if isinstance(value, dict):
            return tuple((k, self._describe(v)) for k, v in sorted(value.items()))
        if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return str(value)
        return value

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and t.layout != torch._mkldnn]  # fmt: skip
        described = (self._describe(args), self._describe(kwargs))
        out = func(*args, **kwargs)
        input_storages = {t.untyped_storage().data_ptr() for t in inputs}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in input_storages:
                self._add_region(t, f"temp{self.temporaries}")  # a new allocation
                self.temporaries += 1
        self.launches.append(("op", str(func), described, self._describe(out)))
        return out

    def c_call(self, name: str, args: tuple) -> None:
        described = []
        for arg in args:
            where = self.name_of(arg) if isinstance(arg, int) and arg > 1 << 20 else None
            described.append(where if where is not None else arg)
        self.launches.append(("c", name, tuple(described)))


class _RecordedKernel:
    """A C kernel whose calls the active recorder sees."""

    active: LaunchRecorder | None = None

    def __init__(self, name: str, kernel: ctypes._CFuncPtr) -> None:
        self.name, self.kernel = name, kernel

    def __call__(self, *args: Any) -> Any:
        if _RecordedKernel.active is not None:
            _RecordedKernel.active.c_call(self.name, args)
        return self.kernel(*args)


def record_c_kernels(monkeypatch: pytest.MonkeyPatch) -> int:
    """Patches every C kernel loader (functools.cache'd functions returning a ctypes function, or a
    dict of them by dtype) of the CPU kernel modules and the GEMM to return recording wrappers;
    returns how many."""
    patched = 0
    for module in (orca_kernels.cpu_attention, orca_kernels.cpu_gpt2_ops, orca_kernels.cpu_llama_ops, gemm):
        for attribute, loader in list(vars(module).items()):
            if not hasattr(loader, "cache_info") or loader.__wrapped__.__code__.co_argcount:
                continue
            try:
                kernel = loader()
            except Exception:  # noqa: BLE001 - a loader this machine cannot build is not called either
                continue
            name = f"{module.__name__}.{attribute}"
            if isinstance(kernel, ctypes._CFuncPtr):
                wrapped = _RecordedKernel(name, kernel)
            elif isinstance(kernel, dict) and all(isinstance(k, ctypes._CFuncPtr) for k in kernel.values()):
                wrapped = {dtype: _RecordedKernel(name, k) for dtype, k in kernel.items()}
            else:
                continue
            monkeypatch.setattr(module, attribute, lambda wrapped=wrapped: wrapped)
            patched += 1
    return patched


def record_triton_kernels(monkeypatch: pytest.MonkeyPatch) -> bool:
    """Records every Triton launch (interpreter) with its grid and arguments, as `c_call` records C
    calls; the interpreter's own torch ops inside a launch are not recorded (a GPU runs none)."""
    from triton.runtime.interpreter import InterpretedFunction

    real_run = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        recorder = _RecordedKernel.active
        if recorder is not None and not warmup:
            recorder.launches.append(("triton", self.__name__, grid, recorder._describe(args), recorder._describe(kwargs)))
            with _disable_current_modes():
                return real_run(self, *args, grid=grid, warmup=warmup, **kwargs)
        return real_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", run)
    return True


def named_buffers(runner: ModelRunner | RunnerProposer, graphs: StepGraphs) -> dict[str, torch.Tensor]:
    """The memory a step of `graphs` may read that lives longer than the step, by name: the static
    buffers, the K/V pool, and every tensor the model holds (weights, rope tables, LoRA slots). A
    proposer's passes: its pool, and its draft model or EAGLE head (with the target's tables it reads)."""
    named = {name: getattr(graphs, name) for name in ("tokens", "requests", "block_tables", "lora_map", "every_token",
                                                      "hidden_in")}  # fmt: skip
    named = {name: tensor for name, tensor in named.items() if tensor is not None}
    for i, (k, v) in enumerate(runner.kv_caches):
        named[f"k_cache{i}"], named[f"v_cache{i}"] = k, v
    seen: set[int] = set()

    def walk(prefix: str, value: Any, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            named[prefix] = value
        elif depth == 0 or id(value) in seen or isinstance(value, (str, bytes, int, float, bool, type(None))):
            return
        elif isinstance(value, dict):
            seen.add(id(value))
            for key, item in value.items():
                walk(f"{prefix}[{key!r}]", item, depth - 1)
        elif isinstance(value, (list, tuple)):
            seen.add(id(value))
            for i, item in enumerate(value):
                walk(f"{prefix}[{i}]", item, depth - 1)
        elif dataclasses.is_dataclass(value) or type(value).__module__.startswith(("orca_backend", "orca_kernels")):
            seen.add(id(value))
            for key, item in vars(value).items():
                walk(f"{prefix}.{key}", item, depth - 1)

    walk("model", runner.head if isinstance(runner, EagleProposer) else runner.model, 6)
    return named


def run_checking_pool(run: Callable[..., Any], kv_caches: list[tuple[torch.Tensor, torch.Tensor]], inputs: Any,
                      *args: Any) -> tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]]:  # fmt: skip
    """`run(inputs, *args)` (a static-buffer step or pass), asserting that the K/V pool `kv_caches`
    changed only in the step's live tokens' slots: its padding wrote nothing. Returns what `run`
    returned, and the pool as it was before."""
    before = [(k.clone(), v.clone()) for k, v in kv_caches]
    out = run(inputs, *args)
    untouched = torch.ones(before[0][0].shape[0], dtype=torch.bool)
    untouched[torch.from_numpy(inputs.slot_mapping.reshape(-1).copy())] = False
    for (k0, v0), (k1, v1) in zip(before, kv_caches, strict=True):
        assert torch.equal(k0[untouched], k1[untouched]) and torch.equal(v0[untouched], v1[untouched])
    return out, before


class HostReadError(AssertionError):
    """A graph-path step did what a CUDA graph cannot capture."""


# The Tensor methods that read a value back to the host: a captured graph would keep the value of the
# capture (or the capture fails outright on a GPU).
HOST_READS = ("tolist", "numpy", "item", "__bool__", "__int__", "__float__", "__index__")


class CaptureGuard(TorchDispatchMode):
    """Fails a graph-path step on what a capture cannot hold: a read of a tensor's value on the host
    (`HOST_READS`), and a copy to the device whose source is host memory other than a registered
    staging buffer. On a GPU the host memory is the CPU's; on a CPU, where every tensor is host
    memory, the device's is what is registered as such (`named_buffers`) and what the step's own ops
    made, so any other tensor an op reads (a numpy array or a Python list turned into a tensor during
    the step, say) reached the device through a host copy."""

    def __init__(self, device_tensors: Iterable[torch.Tensor], staging: Iterable[np.ndarray | torch.Tensor]) -> None:
        super().__init__()
        self.regions: list[tuple[int, int]] = []
        self.staging: list[tuple[int, int]] = []
        # Opaque tensors (oneDNN's packed weights: no storage to locate) registered by identity.
        self.opaque: set[int] = set()
        self.suspended = 0
        for tensor in device_tensors:
            if tensor.layout == torch._mkldnn:
                self.opaque.add(id(tensor))
            else:
                self._add(self.regions, tensor)
        for buffer in staging:
            self._add(self.staging, torch.from_numpy(buffer) if isinstance(buffer, np.ndarray) else buffer)

    @staticmethod
    def _add(regions: list[tuple[int, int]], tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if storage.nbytes():
            regions.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))

    @staticmethod
    def _inside(regions: list[tuple[int, int]], tensor: torch.Tensor) -> bool:
        address = tensor.data_ptr()
        return any(start <= address < end for start, end in regions)

    def check_read(self, what: str, tensor: torch.Tensor) -> None:
        """`tensor`, read by `what`, must be device memory (on a CPU: registered, or made by the step),
        or a registered staging buffer being copied to the device."""
        if tensor.layout == torch._mkldnn:
            if id(tensor) not in self.opaque:
                raise HostReadError(f"{what} reads an opaque tensor that is no registered buffer: {tuple(tensor.shape)}")
            return
        if not tensor.numel():
            return
        host = tensor.device.type == "cpu" and not self._inside(self.regions, tensor)
        # lift_fresh: torch.from_numpy over a staging buffer, as the source of its copy, under a mode.
        if host and not (what.startswith(("aten.copy_", "aten.lift_fresh")) and self._inside(self.staging, tensor)):
            raise HostReadError(f"{what} reads host memory that is no registered staging buffer: "
                                f"{tuple(tensor.shape)} {tensor.dtype}")  # fmt: skip

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.suspended:
            for tensor in tree_flatten((args, kwargs))[0]:
                if isinstance(tensor, torch.Tensor):
                    self.check_read(str(func), tensor)
        out = func(*args, **kwargs)
        for tensor in tree_flatten(out)[0]:
            # Made by the step: device memory from here on (a view of a staging buffer stays host memory).
            if isinstance(tensor, torch.Tensor) and tensor.layout == torch._mkldnn:
                self.opaque.add(id(tensor))
            elif isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu" and not self._inside(self.staging, tensor):
                self._add(self.regions, tensor)
        return out

    @contextlib.contextmanager
    def suspend(self) -> Iterator[None]:
        """Code that stands for a GPU's own work (Triton's interpreter running a kernel) reads freely."""
        self.suspended += 1
        try:
            yield
        finally:
            self.suspended -= 1


@contextlib.contextmanager
def capture_guard(monkeypatch: pytest.MonkeyPatch, guard: CaptureGuard) -> Iterator[CaptureGuard]:
    """`guard` active, with the host reads patched to fail (except inside a suspended region)."""
    with monkeypatch.context() as patch:
        for name in HOST_READS:
            real = getattr(torch.Tensor, name)

            def read(self, *args, _real=real, _name=name, **kwargs):
                if not guard.suspended:
                    raise HostReadError(f"Tensor.{_name}() of a {tuple(self.shape)} {self.dtype} tensor in a graph step")
                return _real(self, *args, **kwargs)

            patch.setattr(torch.Tensor, name, read)
        with guard:
            yield guard


def guard_triton_launches(monkeypatch: pytest.MonkeyPatch, current: list[CaptureGuard | None]) -> None:
    """Triton's interpreter runs a launch as host code (it reads and copies its arguments): the active
    guard (current[0]) checks the launch's tensor arguments, then is suspended for the launch."""
    from triton.runtime.interpreter import InterpretedFunction

    real_run = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        guard = current[0]
        if guard is None or warmup:
            return real_run(self, *args, grid=grid, warmup=warmup, **kwargs)
        for arg in tree_flatten((args, kwargs))[0]:
            if isinstance(arg, torch.Tensor):
                guard.check_read(f"triton {self.__name__}", arg)
        with guard.suspend(), _disable_current_modes():
            return real_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", run)


@dataclasses.dataclass
class GuardedSteps:
    """What `guard_steps` saw: the live request count of every step that passed, and every failure
    (the engine ends a failed step's requests and goes on, so a test reads them here)."""

    passed: list[int] = dataclasses.field(default_factory=list)
    failures: list[HostReadError] = dataclasses.field(default_factory=list)


def guard_steps(monkeypatch: pytest.MonkeyPatch, runner: ModelRunner | RunnerProposer, graphs: StepGraphs) -> GuardedSteps:
    """Every `graphs.run` from here on runs under a fresh `CaptureGuard` (the registered device memory
    as it is then)."""
    from triton.runtime.interpreter import InterpretedFunction

    if not hasattr(InterpretedFunction.run, "guarded"):
        current: list[CaptureGuard | None] = [None]
        guard_triton_launches(monkeypatch, current)
        InterpretedFunction.run.guarded = current
    current = InterpretedFunction.run.guarded
    run, seen = graphs.run, GuardedSteps()

    def guarded_run(inputs, ahead=None, hidden=None):
        # `ahead` and `hidden` are device memory by their contract (the device made them): on a CPU, registered.
        device_inputs = [*(ahead or ()), *([hidden] if hidden is not None else [])]
        guard = CaptureGuard([*named_buffers(runner, graphs).values(), *device_inputs], graphs.staging_buffers())
        current[0] = guard
        try:
            with capture_guard(monkeypatch, guard):
                logits = run(inputs, ahead, hidden)
        except HostReadError as e:
            seen.failures.append(e)
            raise
        finally:
            current[0] = None
        seen.passed.append(inputs.num_requests)
        return logits

    monkeypatch.setattr(graphs, "run", guarded_run)
    return seen


class StepRecorder:
    """Records every forward on `graphs` from its creation on, under its bucket (`graphs.bucket`):
    `recordings` maps a bucket to [(the step, its launches)], the step named by its live (tokens,
    requests), or "padding" for the all-padding step a capture records (`record_padding`)."""

    def __init__(self, runner: ModelRunner | RunnerProposer, graphs: StepGraphs) -> None:
        self.runner, self.graphs = runner, graphs
        self.recordings: dict[int, list[tuple[object, list[tuple]]]] = {}
        self.label: object = None
        self.size = 0  # the bucket of the step being run
        self._forward, run = graphs.forward, graphs.run

        def labelled_run(inputs, ahead=None, hidden=None):
            self.label = (inputs.num_tokens, inputs.num_requests)
            self.size = graphs.bucket(graphs.size_of(inputs))
            return run(inputs, ahead, hidden)

        graphs.forward, graphs.run = self._recorded_forward, labelled_run

    def _recorded_forward(self, stage_input, metas, logits_indices):
        recorder = LaunchRecorder(named_buffers(self.runner, self.graphs))
        _RecordedKernel.active = recorder
        try:
            with recorder:
                logits = self._forward(stage_input, metas, logits_indices)
        finally:
            _RecordedKernel.active = None
        self.recordings.setdefault(self.size, []).append((self.label, recorder.launches))
        return logits

    def record_padding(self) -> None:
        """Records, for each bucket recorded so far, the all-padding step its capture would run."""
        for size in list(self.recordings):
            self.graphs.load_padding(size)
            self.label, self.size = "padding", size
            self.graphs.forward(*self.graphs.views(size))

    def assert_identical_launches(self) -> None:
        """Within each bucket every step made the first one's launches, and none read a value back."""
        for bucket, steps in self.recordings.items():
            first = steps[0][1]
            ops = [launch[1] for launch in first]
            assert "aten._local_scalar_dense.default" not in ops and not any("nonzero" in op for op in ops), ops
            for label, launches in steps[1:]:
                assert len(launches) == len(first), (bucket, label)
                for i, (a, b) in enumerate(zip(first, launches, strict=True)):
                    assert a == b, f"bucket {bucket}: launch {i} differs for step {label}:\n{a}\n{b}"
