"""Runs one iteration: turns a scheduled batch into flat model inputs, runs the model, samples.

The runner owns the model, the K/V pool and the sampler: everything on the model's device. The
scheduler and the K/V bookkeeping stay on the engine side, so a worker process can host a runner.
"""

from __future__ import annotations

import torch

from orca_backend.config import EngineConfig, ModelConfig
from orca_backend.engine.kv_cache import allocate_kv_pool
from orca_backend.engine.sampler import Sampler
from orca_backend.engine.scheduler import ScheduledBatch
from orca_backend.model.loader import load_model
from orca_kernels import AttentionMetadata


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig) -> None:
        self.device = torch.device(config.device)
        self.model = load_model(config, model_config, self.device)
        self.kv_caches = allocate_kv_pool(
            model_config.n_layer, config.kv_capacity_tokens, model_config.n_head, model_config.head_dim,
            config.torch_dtype, self.device,
        )  # fmt: skip
        self.sampler = Sampler(model_config.eos_token_id, config.seed)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> list[int]:
        input_ids, positions, meta, logits_indices = self.prepare_inputs(batch)
        logits = self.model.forward(input_ids, positions, meta, self.kv_caches, logits_indices)
        return self.sampler.sample(logits, batch.requests)

    def release(self, request_id: str) -> None:
        self.sampler.release(request_id)

    def prepare_inputs(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start = [0]
        context_lens: list[int] = []
        kv_starts: list[int] = []
        for request, num_new in zip(batch.requests, batch.num_new_tokens, strict=True):
            first = request.num_computed  # position of the first new token
            prompt_len = request.num_prompt_tokens
            if first >= prompt_len:  # decode: only generated tokens are new
                input_ids += request.output_ids[first - prompt_len : first - prompt_len + num_new]
            elif first + num_new <= prompt_len:
                input_ids += request.prompt_ids[first : first + num_new]
            else:
                input_ids += (request.prompt_ids + request.output_ids)[first : first + num_new]
            positions += range(first, first + num_new)
            slot_mapping += range(request.kv_start + first, request.kv_start + first + num_new)
            query_start.append(query_start[-1] + num_new)
            context_lens.append(first + num_new)
            kv_starts.append(request.kv_start)

        def tensor(values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        meta = AttentionMetadata(
            query_start=tensor(query_start, torch.int32),
            context_lens=tensor(context_lens, torch.int32),
            kv_starts=tensor(kv_starts, torch.int32),
            slot_mapping=tensor(slot_mapping),
            max_query_len=max(batch.num_new_tokens),
            max_context_len=max(context_lens),
            query_start_host=query_start,
            context_lens_host=context_lens,
            kv_starts_host=kv_starts,
        )
        logits_indices = tensor([end - 1 for end in query_start[1:]])
        return tensor(input_ids), tensor(positions), meta, logits_indices
