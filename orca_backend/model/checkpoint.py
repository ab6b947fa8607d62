"""Hugging Face checkpoints: reading them (any family), and writing seeded random GPT-2 ones.

No model hub is reachable at run time, so tests and benchmarks make their own checkpoints. The
writer produces exactly what `transformers`' GPT2LMHeadModel.save_pretrained would (HF names,
Conv1D `[in, out]` orientation, tied LM head left out), so `transformers` can load it as the oracle.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from orca_backend.families.gpt2 import GPT2Config

EOS_TOKEN = "<|endoftext|>"
logger = logging.getLogger("orca.model")


def random_hf_state_dict(config: GPT2Config, seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Seeded random weights under HF GPT-2 names.

    Biases and LayerNorm parameters are random too (HF initialises them to 0/1), so a forward pass
    that drops or misplaces one of them cannot still match the reference.
    """
    gen = torch.Generator().manual_seed(seed)
    std = config.initializer_range
    e, inner = config.n_embd, config.n_inner

    def normal(*shape: int, mean: float = 0.0, scale: float = std) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale + mean).to(dtype)

    sd = {"transformer.wte.weight": normal(config.vocab_size, e), "transformer.wpe.weight": normal(config.n_positions, e)}
    for i in range(config.n_layer):
        p = f"transformer.h.{i}."
        sd |= {
            p + "ln_1.weight": normal(e, mean=1.0, scale=0.1), p + "ln_1.bias": normal(e, scale=0.1),
            p + "attn.c_attn.weight": normal(e, 3 * e), p + "attn.c_attn.bias": normal(3 * e),
            p + "attn.c_proj.weight": normal(e, e), p + "attn.c_proj.bias": normal(e),
            p + "ln_2.weight": normal(e, mean=1.0, scale=0.1), p + "ln_2.bias": normal(e, scale=0.1),
            p + "mlp.c_fc.weight": normal(e, inner), p + "mlp.c_fc.bias": normal(inner),
            p + "mlp.c_proj.weight": normal(inner, e), p + "mlp.c_proj.bias": normal(e),
        }  # fmt: skip
    sd |= {"transformer.ln_f.weight": normal(e, mean=1.0, scale=0.1), "transformer.ln_f.bias": normal(e, scale=0.1)}
    return sd


class WeightSource:
    """HF-named tensors of a checkpoint, read whole or as one slice along a dimension.

    Backed by safetensors files (opened lazily, so a tensor-parallel rank reads only its shard from
    disk) or by an in-memory state dict (presets). Key names are normalised by the family's `rename`.
    """

    def __init__(self, entries: dict[str, Any]) -> None:
        self._entries = entries  # name -> tensor, or safetensors slice handle; both index like tensors

    @classmethod
    def from_state_dict(cls, sd: dict[str, torch.Tensor]) -> WeightSource:
        return cls(dict(sd))

    @classmethod
    def from_dir(
        cls, model_dir: str | Path, rename: Callable[[str], str | None] = lambda key: key, quantized: str = ""
    ) -> WeightSource:  # fmt: skip
        """Every tensor of the checkpoint's safetensors files: the files the sharded index
        (model.safetensors.index.json) names, else model*.safetensors. `rename` maps a stored key to
        the name the model asks for, or None to skip it. `quantized`: what the config declares,
        "fp8" (FP8 weights and scales are read, model/fp8.py, and input scales skipped), "int8"
        (W8A8's int8 weights and scales, model/w8a8.py) or an integer format (its packed weights,
        scales, zero points and g_idx, model/int_quant.py); any other quantized tensor is refused."""
        model_dir = Path(model_dir)
        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            files = [model_dir / name for name in names]
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise ValueError(f"{model_dir}: the index names shards that are not there: {', '.join(missing)}")
        else:
            files = sorted(model_dir.glob("model*.safetensors"))
        if not files:
            raise ValueError(f"{model_dir}: no model.safetensors found (only safetensors checkpoints are supported)")
        entries: dict[str, Any] = {}
        for f in files:
            handle = safe_open(str(f), framework="pt")
            for key in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                name = rename(key)
                if name is None:  # not read by the model: neither checked nor kept
                    continue
                entry = handle.get_slice(key)
                if quantized == "fp8" and key.endswith(".input_scale"):
                    continue  # activations are not quantized here (model/fp8.py)
                if not _declared_tensor(quantized, key, entry.get_dtype()):
                    _refuse_quantized(model_dir, key, entry.get_dtype())
                entries[name] = entry
        if quantized == "fp8":
            _check_fp8_projections(model_dir, entries)
        elif quantized == "int8":
            _check_int8_projections(model_dir, entries)
        elif quantized:
            _check_int_projections(model_dir, entries, INT_TENSORS[quantized])
        return cls(entries)

    def with_tensors(self, tensors: dict[str, torch.Tensor]) -> WeightSource:
        """This source and `tensors` under their names (what a checkpoint takes from another model)."""
        return WeightSource({**self._entries, **tensors})

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        entry = self._entry(name)
        return tuple(entry.shape) if isinstance(entry, torch.Tensor) else tuple(entry.get_shape())

    def dtype(self, name: str) -> torch.dtype:
        entry = self._entry(name)
        return entry.dtype if isinstance(entry, torch.Tensor) else SAFETENSORS_DTYPES[entry.get_dtype()]

    def _entry(self, name: str) -> Any:
        if name not in self._entries:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        return self._entries[name]

    def get(self, name: str, dim: int | None = None, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        entry = self._entry(name)
        if dim is None:
            return entry[:]
        index = [slice(None)] * (dim + 1)
        index[dim] = slice(lo, hi)
        return entry[tuple(index)]


# What quantized checkpoints store beside (or instead of) plain weights: FP8's scales, GPTQ's and AWQ's
# packed integers with their scales and zero points, bitsandbytes' and compressed-tensors' state.
QUANTIZED_TENSOR_SUFFIXES = ("weight_scale", "weight_scale_inv", "input_scale", "qweight", "qzeros", "scales",
                             "g_idx", "weight_packed", "weight_zero_point", "weight_shape", "SCB", "absmax",
                             "quant_map", "quant_state")  # fmt: skip
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
                      "F8_E4M3": torch.float8_e4m3fn, "I32": torch.int32, "I64": torch.int64, "I8": torch.int8}  # fmt: skip
# What each integer format stores for one linear layer beside its name (model/int_quant.py reads them):
# (packed integers, the rest).
INT_TENSORS = {
    "gptq": ("qweight", ("qzeros", "scales", "g_idx")),
    "gptq_v2": ("qweight", ("qzeros", "scales", "g_idx")),
    "awq": ("qweight", ("qzeros", "scales")),
    "compressed-tensors": ("weight_packed", ("weight_scale", "weight_zero_point", "weight_shape")),
}


def _declared_tensor(quantized: str, key: str, dtype: str) -> bool:
    """Whether a stored tensor is one of what the declared quantization stores."""
    if quantized == "fp8":
        return _fp8_tensor(key, dtype)
    if quantized == "int8":  # W8A8: int8 weights and their float scales
        return (dtype == "I8" and key.endswith(".weight")) or (key.endswith(".weight_scale") and dtype in FLOAT_DTYPES)
    if quantized:
        packed, rest = INT_TENSORS[quantized]
        return key.rsplit(".", 1)[-1] in (packed, *rest)
    return False


def _check_int_projections(model_dir: Path, entries: dict[str, Any], tensors: tuple[str, tuple[str, ...]]) -> None:
    """A config that declares integer weights over a checkpoint holding none would be served
    unquantized: refused. Projections the quantizer left in float are served so, and logged."""
    packed = [name for name in entries if name.endswith("." + tensors[0])]
    if not packed:
        raise ValueError(f"{model_dir}: config.json's quantization_config declares integer weights, but the "
                         f"checkpoint holds no {tensors[0]} tensor: it would be served unquantized")  # fmt: skip
    floats = sorted(name for name, entry in entries.items() if _is_projection(name, entry))
    if floats:
        logger.warning("%s: %d decoder projections are not quantized and are served in float (%d are): %s",
                       model_dir, len(floats), len(packed), _first_names(floats))  # fmt: skip


def _check_int8_projections(model_dir: Path, entries: dict[str, Any]) -> None:
    """A W8A8 config over a checkpoint holding no int8 weight would be served unquantized: refused;
    projections left in float are served so, and logged."""
    int8 = [name for name, entry in entries.items() if entry.get_dtype() == "I8"]
    if not int8:
        raise ValueError(f"{model_dir}: config.json's quantization_config declares int8 weights (int-quantized), but "
                         "the checkpoint holds no int8 (I8) weight: it would be served unquantized")  # fmt: skip
    floats = sorted(name for name, entry in entries.items() if _is_projection(name, entry) and entry.get_dtype() != "I8")
    if floats:
        logger.warning("%s: %d decoder projections are not int8 and are served in float (%d are): %s", model_dir,
                       len(floats), len(int8), _first_names(floats))  # fmt: skip


def _fp8_tensor(key: str, dtype: str) -> bool:
    """What an FP8 checkpoint stores beyond float tensors: FP8 weights and their float scales."""
    return (dtype == "F8_E4M3" and key.endswith(".weight")) or (
        key.endswith((".weight_scale", ".weight_scale_inv")) and dtype in FLOAT_DTYPES
    )


def _check_fp8_projections(model_dir: Path, entries: dict[str, Any]) -> None:
    """A config that declares FP8 over a checkpoint holding no FP8 weight would be served in float,
    unquantized, to a user who believes it FP8: refused, saying what is missing. So is an FP8 tensor
    other than a decoder projection (an embedding, the LM head), which would be read without its
    scale. A checkpoint with some projections left in float (a quantizer's `modules_to_not_convert`)
    is served as it is, the float ones named in the log."""
    fp8 = [name for name, entry in entries.items() if entry.get_dtype() == "F8_E4M3"]
    if not fp8:
        scales = sum(name.endswith((".weight_scale", ".weight_scale_inv")) for name in entries)
        found = f"only {scales} scale tensors beside float weights" if scales else "no weight_scale or weight_scale_inv"
        raise ValueError(f"{model_dir}: config.json's quantization_config declares an FP8 checkpoint (quant_method "
                         f"'fp8'), but it holds no FP8 (F8_E4M3) weight ({found}): it would be served unquantized, "
                         "in float; quantize its weights, or drop quantization_config to serve it as float")  # fmt: skip
    unread = [name for name in fp8 if not _is_projection(name, entries[name])]
    if unread:
        raise ValueError(f"{model_dir}: FP8 tensors {', '.join(unread)} are not decoder projections, the only FP8 "
                         "weights this engine reads with their scales")  # fmt: skip
    floats = sorted(name for name, entry in entries.items()
                    if _is_projection(name, entry) and entry.get_dtype() != "F8_E4M3")  # fmt: skip
    if floats:
        logger.warning("%s: %d decoder projections are not FP8 and are served in float (%d are FP8): %s", model_dir,
                       len(floats), len(fp8), _first_names(floats))  # fmt: skip


def _first_names(names: list[str], most: int = 8) -> str:
    """The first `most` names, and how many more there are, for a log line."""
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _is_projection(name: str, entry: Any) -> bool:
    """A decoder layer's linear weight: its 2-D weights (its norms are 1-D; FP8 is served for dense
    Llama-family models only, whose layers hold no other matrix)."""
    return name.startswith("model.layers.") and name.endswith(".weight") and len(entry.get_shape()) == 2


def _refuse_quantized(model_dir: Path, key: str, dtype: str) -> None:
    """A checkpoint whose tensors are quantized would load (cast to the engine's dtype) and answer
    wrongly: refused, naming the tensor, whether or not its config.json says so."""
    suffix = key.rsplit(".", 1)[-1]
    if suffix in QUANTIZED_TENSOR_SUFFIXES or dtype not in FLOAT_DTYPES:
        raise ValueError(f"{model_dir}: tensor {key!r} ({dtype}) belongs to a quantized checkpoint, which this "
                         "engine does not serve (it computes with unquantized float weights only)")


def gpt2_key(key: str) -> str | None:
    """OpenAI's original upload has no "transformer." prefix, and old checkpoints carry attention-mask buffers."""
    if key.endswith((".attn.bias", ".attn.masked_bias")):
        return None
    return key if key.startswith(("transformer.", "lm_head.")) else "transformer." + key


def hf_config_dict(config: GPT2Config) -> dict:
    return {
        "model_type": "gpt2",
        "architectures": [config.architecture],
        "activation_function": "gelu_new",
        "n_inner": None,
        "n_ctx": config.n_positions,
        "bos_token_id": config.eos_token_id,
        "tie_word_embeddings": True,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "torch_dtype": "float32",
        **asdict(config),
    }


def write_random_checkpoint(path: str | Path, config: GPT2Config, seed: int = 0, tokenizer: bool = True) -> GPT2Config:
    """Writes config.json + model.safetensors (+ tokenizer.json) to `path`; returns the config written.

    With `tokenizer`, a byte-level BPE is trained on a seeded synthetic corpus with the model's
    vocab size; the model's vocab is set to exactly the tokenizer's size and its EOS to the
    tokenizer's end-of-text token, so every id the model can emit decodes to text.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if tokenizer:
        tok = train_byte_level_bpe(config.vocab_size, seed)
        tok.save(str(path / "tokenizer.json"))
        config = replace(config, vocab_size=tok.get_vocab_size(), eos_token_id=tok.token_to_id(EOS_TOKEN))
    (path / "config.json").write_text(json.dumps(hf_config_dict(config), indent=2))
    save_file(random_hf_state_dict(config, seed), str(path / "model.safetensors"), metadata={"format": "pt"})
    return config


def train_byte_level_bpe(vocab_size: int, seed: int = 0):
    """A GPT-2-style byte-level BPE tokenizer trained on seeded pseudo-English."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_synthetic_corpus(seed), trainer=trainer)
    return tok


def _synthetic_corpus(seed: int, lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "to", "ra", "su", "vi", "de", "po", "an", "el", "or", "is", "un", "th", "er", "ch", "sh", "qu"]
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(3000)]
    words += ["the", "a", "of", "and", "to", "in", "is", "it", "that", "for", "héllo", "naïve", "日本", "😀"]
    punct = [".", ",", "!", "?", ";", ""]
    return [" ".join(rng.choices(words, k=rng.randint(4, 16))) + rng.choice(punct) for _ in range(lines)]
