"""Executors run a step (a SchedulerOutput) on the model: in this process, or on tp x pp worker processes."""

from __future__ import annotations

from orca_backend.config import EngineConfig
from orca_backend.executor.base import BatchFailed, Executor, WorkerFailure
from orca_backend.families import AnyModelConfig

__all__ = ["BatchFailed", "Executor", "WorkerFailure", "make_executor"]


def make_executor(config: EngineConfig, model_config: AnyModelConfig) -> Executor:
    """In-process for tp = pp = 1 (whatever the backend: one rank runs where the core runs), worker
    processes or Ray actors (`distributed_executor_backend`) otherwise. Raises ValueError for a device
    this machine lacks before any process starts."""
    from orca_backend.model.device import check_device  # torch: only where a model runs

    device = check_device(config.device)
    if config.tensor_parallel_size * config.pipeline_parallel_size == 1:
        from orca_backend.executor.local import LocalExecutor
        from orca_backend.worker.model_runner import ModelRunner

        return LocalExecutor(ModelRunner(config, model_config, device), config.async_scheduling)
    if config.distributed_executor_backend == "ray":
        from orca_backend.executor.ray_executor import RayExecutor

        return RayExecutor(config, model_config)
    from orca_backend.executor.multiproc import WorkerPoolExecutor

    return WorkerPoolExecutor(config, model_config)
