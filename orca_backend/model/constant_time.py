"""The constant-time measurement device's model code (families/constant_time.py says what it is for):
a forward that reads each request's last token and position and returns logits whose one high entry
is a fixed function of them. No weights, no layers, no K/V, no matmul: the same few element-wise ops
on [batch] vectors whatever the batch or the context. The one tensor that grows with the batch is the
[batch, vocab] logits the sampler reads (one fill and one scatter). With the config's step_time_ms
the forward also sleeps that long (no CPU, the GIL released): on CUDA with graphs the sleep happens
at capture only, so run such a device with enforce_eager there.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from orca_backend.config import check_parallel_layout
from orca_backend.distributed.comm import TensorParallelGroup
from orca_backend.distributed.layout import SINGLE_PROCESS, ParallelLayout
from orca_backend.families.constant_time import PRESETS, ConstantTimeConfig
from orca_backend.model.checkpoint import EOS_TOKEN, WeightSource, train_byte_level_bpe
from orca_backend.model.registry import ModelCode
from orca_backend.model.stage_input import StageInput, StageModel
from orca_kernels import AttentionMetadata, KernelOps

# The chosen token's logit, the others' being 0: softmax gives it all but e^-100 of the mass at any
# temperature up to ~10, so greedy, top-k/top-p and random sampling all pick it.
CHOSEN_LOGIT = 100.0


@dataclass
class ConstantTimeWeights:
    """Nothing: no layer (so the runner allocates no K/V pool) and no tensor."""

    layers: list[Any] = field(default_factory=list)

    def num_bytes(self) -> int:
        return 0

    @classmethod
    def load(cls, src: WeightSource, config: ConstantTimeConfig, layout: ParallelLayout, dtype: torch.dtype,
             device: torch.device) -> ConstantTimeWeights:  # fmt: skip
        check_parallel_layout(config, layout.tp_size, layout.pp_size)  # tp = pp = 1 only
        return cls()


def next_tokens(config: ConstantTimeConfig, last: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Each request's next token from its last token and that token's position: a spread over every
    id but EOS (int64, on their device)."""
    choices = config.vocab_size - (config.eos_token_id is not None)
    ids = (last * config.token_mult + positions * config.position_mult + config.offset) % choices
    if config.eos_token_id is not None:
        ids += ids >= config.eos_token_id  # skip EOS: requests end at max_tokens or a stop string
    return ids


class ConstantTimeModel(StageModel):
    def __init__(
        self, config: ConstantTimeConfig, weights: ConstantTimeWeights, ops: KernelOps,
        layout: ParallelLayout = SINGLE_PROCESS, tp: TensorParallelGroup | None = None,
    ) -> None:  # fmt: skip
        super().__init__(config, weights, ops, layout, tp, config.num_kv_heads, config.num_kv_heads)

    @torch.inference_mode()
    def forward(
        self, stage_input: StageInput, metas: Sequence[AttentionMetadata], kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """[B, vocab] float32 logits: 0 everywhere but CHOSEN_LOGIT at each request's next token."""
        if stage_input.pool_indices is not None:
            raise ValueError("the constant-time device has no hidden states: it serves no embedding request")
        last = stage_input.input_ids.index_select(0, logits_indices)
        positions = stage_input.positions.index_select(0, logits_indices)
        chosen = next_tokens(self.config, last, positions)
        logits = torch.zeros((chosen.shape[0], self.config.vocab_size), dtype=torch.float32, device=chosen.device)
        if self.config.step_time_ms:
            time.sleep(self.config.step_time_ms / 1000)
        return logits.scatter_(1, chosen.unsqueeze(1), CHOSEN_LOGIT)


def _no_weights(config: ConstantTimeConfig, seed: int) -> dict[str, torch.Tensor]:
    return {}


def write_device_dir(path: str | Path, step_time_ms: float = 0.0, seed: int = 0) -> ConstantTimeConfig:
    """A directory `model` can name: config.json (this device, with `step_time_ms`), an empty
    model.safetensors and the byte-level BPE tokenizer.json its vocabulary is sized for (so every id
    it emits decodes to text); returns the config written."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = replace(PRESETS["constant-time-measure"], step_time_ms=float(step_time_ms))
    tok = train_byte_level_bpe(config.vocab_size, seed)
    if (tok.get_vocab_size(), tok.token_to_id(EOS_TOKEN)) != (config.vocab_size, config.eos_token_id):
        raise RuntimeError(f"the tokenizer has {tok.get_vocab_size()} ids and EOS {tok.token_to_id(EOS_TOKEN)}; "
                           f"the device expects {config.vocab_size} and {config.eos_token_id}")  # fmt: skip
    tok.save(str(path / "tokenizer.json"))
    (path / "config.json").write_text(json.dumps({"architectures": [config.architecture], **asdict(config)}, indent=2))
    save_file({}, str(path / "model.safetensors"), metadata={"format": "pt"})
    return config


MODEL_CODE = ModelCode(ConstantTimeWeights, ConstantTimeModel, lambda key: key, _no_weights)
