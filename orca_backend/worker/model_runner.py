"""Runs one iteration of (a slice of) the model on a `BatchMeta`: flat inputs, forward, sampling.

The runner owns what lives on the model's device: the weights, the K/V pool of its layers and
the sampler. It knows nothing of requests or scheduling, so the same class runs in the engine's
process (tp = pp = 1) and inside each worker process.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from orca_backend.config import AnyModelConfig, EngineConfig
from orca_backend.distributed.comm import TensorParallelGroup
from orca_backend.distributed.layout import SINGLE_PROCESS, ParallelLayout
from orca_backend.model.device import torch_dtype
from orca_backend.model.loader import load_model
from orca_backend.model.stage_input import StageInput
from orca_backend.worker.batch_meta import BatchMeta, SamplerOutput
from orca_backend.worker.bitmask import apply_bitmask, decode_bitmask
from orca_backend.worker.cpu_allocator import tune_cpu_allocator
from orca_backend.worker.kv_pool import allocate_kv_pool
from orca_backend.worker.sampler import Sampler
from orca_kernels import AttentionMetadata


class ModelRunner:
    def __init__(
        self, config: EngineConfig, model_config: AnyModelConfig, device: torch.device,
        layout: ParallelLayout = SINGLE_PROCESS, tp: TensorParallelGroup | None = None,
    ) -> None:  # fmt: skip
        self.device = device  # checked by the caller (make_executor, or the worker process for its rank)
        if self.device.type == "cpu":
            tune_cpu_allocator()
        self.layout = layout
        self.model = load_model(config, model_config, self.device, layout, tp)
        self.block_size = config.block_size
        num_slots = config.kv_capacity_tokens // config.block_size * config.block_size  # whole blocks
        self.kv_caches = allocate_kv_pool(
            len(self.model.weights.layers), num_slots, self.model.num_kv_heads, model_config.head_dim,
            torch_dtype(config.dtype), self.device,
        )  # fmt: skip
        self.sampler = Sampler()

    @torch.inference_mode()
    def execute(self, batch_meta: BatchMeta) -> SamplerOutput:
        """The whole model in this process: forward and sample."""
        return self.sample(self.run_stage(batch_meta), batch_meta)

    @torch.inference_mode()
    def run_stage(self, batch_meta: BatchMeta, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's layers; logits on the last stage, activations for the next stage otherwise."""
        input_ids, positions, attn_meta, logits_indices = self._prepare_inputs(batch_meta)
        return self.model.forward(StageInput(input_ids, positions, hidden), attn_meta, self.kv_caches, logits_indices)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, batch_meta: BatchMeta) -> SamplerOutput:
        self.sampler.release(batch_meta.released_ids)
        if batch_meta.bitmask_rows:  # structured output: the grammar's mask comes before any sampling step
            rows = batch_meta.bitmask_rows
            apply_bitmask(logits, decode_bitmask(batch_meta.bitmask, len(rows)), rows)
        return self.sampler.sample(logits, batch_meta)

    def _prepare_inputs(self, batch_meta: BatchMeta) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Every per-iteration index tensor from one host array and one device copy, the block
        tables from a second: this runs every iteration, and one conversion of many numbers is far
        cheaper than several small ones. A batch of decodes only (one new token per request, the
        steady state) converts just its tokens, slots and context lengths: its positions, query
        offsets and logits rows follow from them."""
        num_tokens, num_requests = batch_meta.num_tokens, len(batch_meta.context_lens)
        decode_only = num_tokens == num_requests  # every request has at least one new token
        if decode_only:
            # numpy converts a list of ints several times faster than torch.tensor()
            host = np.array(batch_meta.input_ids + batch_meta.slot_mapping + batch_meta.context_lens, dtype=np.int64)
            context_host = host[2 * num_tokens :]
            rows = np.arange(num_requests + 1, dtype=np.int64)
            host = np.concatenate((host[:num_tokens], context_host - 1, host[num_tokens : 2 * num_tokens], rows,
                                   context_host, rows[:-1]))  # fmt: skip
            max_query_len = 1
        else:
            logits_indices = [end - 1 for end in batch_meta.query_start[1:]]
            host = np.array(
                batch_meta.input_ids + batch_meta.positions + batch_meta.slot_mapping + batch_meta.query_start
                + batch_meta.context_lens + logits_indices,
                dtype=np.int64,
            )  # fmt: skip
            query_host = host[3 * num_tokens : 3 * num_tokens + num_requests + 1]
            context_host = host[3 * num_tokens + num_requests + 1 : 3 * num_tokens + 2 * num_requests + 1]
            max_query_len = int((query_host[1:] - query_host[:-1]).max())
        flat = torch.from_numpy(host).to(self.device, non_blocking=True)
        input_ids, positions, slot_mapping, query_start, context_lens, logits_index_tensor = flat.split(
            [num_tokens, num_tokens, num_tokens, num_requests + 1, num_requests, num_requests]
        )
        # Ragged tables into one right-padded array by a mask, not a Python loop of row copies
        # (about half the time at 256 requests).
        tables = batch_meta.block_tables
        lengths = np.fromiter(map(len, tables), dtype=np.int64, count=num_requests)
        block_tables = np.zeros((num_requests, int(lengths.max())), dtype=np.int32)
        block_tables[np.arange(block_tables.shape[1])[None, :] < lengths[:, None]] = np.fromiter(
            itertools.chain.from_iterable(tables), dtype=np.int32, count=int(lengths.sum())
        )
        attn_meta = AttentionMetadata(
            query_start=query_start.to(torch.int32),
            context_lens=context_lens.to(torch.int32),
            block_tables=torch.from_numpy(block_tables).to(self.device, non_blocking=True),
            slot_mapping=slot_mapping,
            block_size=self.block_size,
            max_query_len=max_query_len,
            max_context_len=int(context_host.max()),
            query_start_host=batch_meta.query_start,
            context_lens_host=batch_meta.context_lens,
            block_tables_host=tables,
        )
        return input_ids, positions, attn_meta, logits_index_tensor
