"""Speculative decoding on CPU, side by side in one run: output tokens/s with n-gram proposals, a
draft model, an EAGLE head and the target as its own draft (the upper bound: every greedy proposal
accepted), against no speculation, at batch 1 and batch 8; with each one's acceptance rate and mean
accepted length (vLLM's: 1 + accepted / proposals).

    python benchmarks/speculative.py [--out docs/bench/speculative/RUN.json]

Where proposals can be right: the benchmark first trains (seeded, a few minutes on two cores) a
GPT-2 (25M parameters: two layers 1,024 wide) on text whose continuations repeat earlier spans, as code, templates and quoted text
do, so a model that learned to copy can be anticipated by looking its context up (n-gram) or by a
smaller model trained alike (the draft), or by an EAGLE head trained on the target's own hidden states
(one narrow Llama layer). The held-out prompts come from the same generator. Three rows
measure what speculation costs when it does not pay: a draft of random weights (every proposal
wrong: a few rounds a request, then the proposals pause), the same with `max_pause_steps` 0 (every
decode proposes and verifies, as in vLLM), and n-gram proposals on a target of random weights whose
text repeats nothing (little is proposed: the price of looking).

Every configuration runs the same greedy requests `--repeats` times, interleaved (configurations
in turn within each repeat, each repeat starting one configuration later), and the tokens of each
must equal no speculation's (checked). The JSON
holds every timing, the training losses, the machine and the commit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "client"))

from orca_backend import LLM, SamplingParams  # noqa: E402
from orca_backend.families.llama import EAGLE_HEAD_ARCHITECTURES  # noqa: E402
from orca_client import machine  # noqa: E402

VOCAB = 512
# (n_embd, n_layer, n_head): a target wide enough that a batch-1 decode step streams its weights
# from memory (~100 MB in float32), as a served model's does, and a draft about 1/50 of its size.
TARGET = (1024, 2, 16)
DRAFT = (128, 2, 4)
# The EAGLE head: one Llama layer of the target's width with 4 query heads of 64 (2 KV heads) and a
# 512-wide MLP, about 1/8 of the target's weights with its fc.
EAGLE_HEAD = dict(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  intermediate_size=512, max_position_embeddings=256)  # fmt: skip


def phrase_book(seed: int = 0, num_phrases: int = 48) -> list[list[int]]:
    """The corpus's phrases: 6-12 tokens each, no token in two of them (within a phrase each token
    determines the next)."""
    rng = np.random.default_rng(seed)
    tokens = rng.permutation(np.arange(1, VOCAB)).tolist()
    phrases, at = [], 0
    for _ in range(num_phrases):
        length = int(rng.integers(6, 13))
        phrases.append(tokens[at : at + length])
        at += length
    return phrases


PHRASES = phrase_book()


def spans_text(rng: np.random.Generator, length: int, num_spans: int = 5) -> list[int]:
    """Text made of a few of the corpus's phrases, repeated in a random order (as code, templates
    and quoted text repeat themselves): once a phrase has begun, the rest of it follows, and the
    context holds it already."""
    chosen = rng.choice(len(PHRASES), num_spans, replace=False)
    text: list[int] = []
    while len(text) < length:
        text += PHRASES[int(rng.choice(chosen))]
    return text[:length]


def descend(optimizer: torch.optim.Optimizer, schedule: torch.optim.lr_scheduler.LRScheduler, loss: torch.Tensor,
            step: int, steps: int, log: list[float], name: str) -> None:  # fmt: skip
    """One training step on `loss`; the loss logged at every 50th step and the last."""
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    schedule.step()
    if step % 50 == 0 or step == steps - 1:
        log.append(round(loss.item(), 4))
        print(f"  {name} step {step}: loss {loss.item():.3f}", flush=True)


def train(path: Path, n_embd: int, n_layer: int, n_head: int, steps: int, seed: int, log: list[float],
          length: int = 64) -> None:  # fmt: skip
    """A GPT-2 trained on `spans_text` (seeded), written to `path` in the HF format."""
    import transformers

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=256, n_embd=n_embd, n_layer=n_layer,
                                     n_head=n_head, bos_token_id=0, eos_token_id=0)  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=2e-3, total_steps=steps, pct_start=0.1)
    model.train()
    for step in range(steps):
        batch = torch.tensor([spans_text(rng, length) for _ in range(16)])
        descend(optimizer, schedule, model(batch, labels=batch).loss, step, steps, log, path.name)
    model.eval().save_pretrained(path)


def train_eagle(path: Path, target_dir: Path, steps: int, seed: int, log: list[float], length: int = 64) -> None:
    """An EAGLE head over the trained target (EAGLE_HEAD), trained (seeded) on `spans_text` to name
    the target's token two ahead of a position from the token one ahead and the target's final
    hidden state there, through the target's LM head; written as an EagleLlamaForCausalLM checkpoint
    (`fc.weight`, `layers.0.*` without its input norm)."""
    import transformers
    from safetensors.torch import save_file
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    target = transformers.GPT2LMHeadModel.from_pretrained(target_dir).eval()
    width = target.config.n_embd
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=width, attn_implementation="sdpa", **EAGLE_HEAD)
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    layer, fc = LlamaDecoderLayer(config, 0), torch.nn.Linear(2 * width, width, bias=False)
    layer.input_layernorm = torch.nn.Identity()  # EAGLE's first layer reads fc's output as it is
    rotary = LlamaRotaryEmbedding(config)
    embed = target.transformer.wte.weight.detach()  # also the (tied) LM head
    optimizer = torch.optim.AdamW([*layer.parameters(), *fc.parameters()], lr=2e-3, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=2e-3, total_steps=steps, pct_start=0.1)
    positions = torch.arange(length - 1)[None]
    mask = torch.full((length - 1, length - 1), float("-inf")).triu(1)[None, None]
    for step in range(steps):
        batch = torch.tensor([spans_text(rng, length) for _ in range(16)])
        with torch.no_grad():
            hidden = target(batch, output_hidden_states=True).hidden_states[-1]  # after the final norm
        x = fc(torch.cat([embed[batch[:, 1:]], hidden[:, :-1]], dim=-1))  # position p: token p + 1, hidden p
        out = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=rotary(x, positions))
        out = out[0] if isinstance(out, tuple) else out
        # EAGLE's loss: the output regresses onto the target's hidden state one position on (which it
        # stands in for when the head proposes further), and its logits name the token after.
        regression = torch.nn.functional.smooth_l1_loss(out, hidden[:, 1:])
        loss = regression + 0.1 * torch.nn.functional.cross_entropy((out[:, :-1] @ embed.t()).reshape(-1, VOCAB),
                                                                    batch[:, 2:].reshape(-1))  # fmt: skip
        descend(optimizer, schedule, loss, step, steps, log, path.name)
    path.mkdir(parents=True, exist_ok=True)
    architecture = EAGLE_HEAD_ARCHITECTURES["eagle"][0]  # vLLM's name for it
    (path / "config.json").write_text(json.dumps(config.to_dict() | {"architectures": [architecture]}))
    tensors = {f"layers.0.{name}": p.detach().contiguous() for name, p in layer.named_parameters()}
    save_file(tensors | {"fc.weight": fc.weight.detach().contiguous()}, str(path / "model.safetensors"))


def untrained(path: Path, n_embd: int, n_layer: int, n_head: int, seed: int) -> None:
    """A GPT-2 of random weights (initializer_range 0.3: varied tokens, as a model that copies
    nothing), written to `path`."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=256, n_embd=n_embd, n_layer=n_layer,
                                     n_head=n_head, initializer_range=0.3, bos_token_id=0, eos_token_id=0)  # fmt: skip
    transformers.GPT2LMHeadModel(config).eval().save_pretrained(path)


def run(llm: LLM, prompts: list[list[int]], batch: int, max_tokens: int) -> tuple[float, list[list[int]]]:
    """Seconds to generate every prompt's tokens, `batch` requests at a time, and the tokens."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    started, tokens = time.perf_counter(), []
    for i in range(0, len(prompts), batch):
        tokens += [o.output_ids for o in llm.generate(prompts[i : i + batch], params)]
    return time.perf_counter() - started, tokens


def _geometry(text: str) -> tuple[int, int, int]:
    values = tuple(int(v) for v in text.split(","))
    if len(values) != 3:
        raise argparse.ArgumentTypeError(f"a geometry is n_embd,n_layer,n_head, got {text!r}")
    return values  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train-steps", type=int, default=150)
    parser.add_argument("--requests", type=int, default=16, help="requests per measurement")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/orca-speculative-bench"))
    parser.add_argument("--target", type=_geometry, default=TARGET, metavar="EMBD,LAYERS,HEADS",
                        help=f"the target's GPT-2 geometry (default {','.join(map(str, TARGET))})")
    parser.add_argument("--draft", type=_geometry, default=DRAFT, metavar="EMBD,LAYERS,HEADS",
                        help=f"the draft's (default {','.join(map(str, DRAFT))})")
    parser.add_argument("--reuse-models", action="store_true",
                        help="use the target and draft a previous run trained in --work-dir (the same seeds)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    target_dir, draft_dir = args.work_dir / "target", args.work_dir / "draft"
    random_target, random_draft = args.work_dir / "random-target", args.work_dir / "random-draft"
    eagle_dir = args.work_dir / "eagle"
    losses: dict[str, list[float]] = {"target": [], "draft": [], "eagle": []}
    if not (args.reuse_models and (target_dir / "config.json").is_file() and (draft_dir / "config.json").is_file()):
        print(f"training the target and the draft ({args.train_steps} steps each)", flush=True)
        train(target_dir, *args.target, args.train_steps, seed=1, log=losses["target"])
        train(draft_dir, *args.draft, args.train_steps, seed=2, log=losses["draft"])
    if not (args.reuse_models and (eagle_dir / "config.json").is_file()):
        print(f"training the EAGLE head ({args.train_steps} steps)", flush=True)
        train_eagle(eagle_dir, target_dir, args.train_steps, seed=5, log=losses["eagle"])
    untrained(random_target, *args.target, seed=3)
    untrained(random_draft, *args.draft, seed=4)

    rng = np.random.default_rng(7)
    copying = [spans_text(rng, 64) for _ in range(args.requests)]
    random_tokens = [rng.integers(1, VOCAB, 64).tolist() for _ in range(args.requests)]
    k = args.k
    ngram = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}

    def draft(path: Path) -> dict:
        return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k}

    # name -> (target, speculative_config, prompts); each "none" row is the baseline of the rows after it.
    configs: dict[str, tuple[Path, dict | None, list[list[int]]]] = {
        "none": (target_dir, None, copying),
        "ngram": (target_dir, ngram, copying),
        "draft_model": (target_dir, draft(draft_dir), copying),
        "eagle": (target_dir, {"method": "eagle", "model": str(eagle_dir), "num_speculative_tokens": k}, copying),
        "self_draft": (target_dir, draft(target_dir), copying),
        "random_draft": (target_dir, draft(random_draft), copying),  # every proposal wrong: what it costs
        # The same with every decode proposing however often it was wrong (vLLM's way): what the
        # pause after fruitless rounds saves.
        "random_draft_no_pause": (target_dir, {**draft(random_draft), "max_pause_steps": 0}, copying),
        "none_untrained": (random_target, None, random_tokens),
        "ngram_untrained": (random_target, ngram, random_tokens),  # text that repeats nothing: little to propose
    }
    batches = [int(b) for b in args.batches.split(",")]
    results: dict[str, dict] = {}
    for batch in batches:
        engines = {name: LLM(str(target), max_num_seqs=batch, kv_capacity_tokens=8192,
                             speculative_config=json.dumps(spec) if spec else "")
                   for name, (target, spec, _) in configs.items()}  # fmt: skip
        for name, (_, _, prompts) in configs.items():  # warm-up, and the reference tokens
            run(engines[name], prompts[:batch], batch, 8)
        baseline_of, baseline = {}, "none"
        for name in configs:
            baseline = name if name.startswith("none") else baseline
            baseline_of[name] = baseline
        reference = {name: run(engines[name], prompts, batch, args.max_tokens)[1]
                     for name, (_, _, prompts) in configs.items() if name.startswith("none")}  # fmt: skip
        timings: dict[str, list[float]] = {name: [] for name in configs}
        counts: dict[str, tuple[int, int, int]] = {}
        names = list(configs)
        for repeat in range(args.repeats):
            # Each repeat starts one configuration later, so that none is always first (the first of
            # a round measured slower than its place elsewhere) or always after the same one.
            for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
                prompts = configs[name][2]
                before = engines[name].engine.core.stats()
                seconds, tokens = run(engines[name], prompts, batch, args.max_tokens)
                after = engines[name].engine.core.stats()
                expected = reference[baseline_of[name]]
                if tokens != expected:
                    raise SystemExit(f"{name} at batch {batch}: tokens differ from no speculation")
                timings[name].append(len(prompts) * args.max_tokens / seconds)
                counts[name] = (after.spec_num_drafts - before.spec_num_drafts,
                                after.spec_num_draft_tokens - before.spec_num_draft_tokens,
                                after.spec_num_accepted_tokens - before.spec_num_accepted_tokens)  # fmt: skip
        for name, rates in timings.items():
            drafts, proposed, accepted = counts[name]
            base = timings[baseline_of[name]]
            ratios = [r / b for r, b in zip(rates, base, strict=True)]  # each repeat against its own baseline
            results[f"{name}@batch{batch}"] = {
                "tok_s": rates, "tok_s_range": [min(rates), max(rates)],
                "speedup": ratios, "speedup_range": [min(ratios), max(ratios)],
                "acceptance_rate": accepted / proposed if proposed else None,
                "mean_accepted_length": 1 + accepted / drafts if drafts else None,
                "drafts": drafts, "draft_tokens": proposed, "accepted_tokens": accepted,
            }  # fmt: skip
            r = results[f"{name}@batch{batch}"]
            accept = "" if r["acceptance_rate"] is None else (
                f", acceptance {r['acceptance_rate']:.2f}, mean accepted length {r['mean_accepted_length']:.2f}")
            print(f"batch {batch} {name:>22}: {min(rates):7.1f}-{max(rates):7.1f} tok/s, "
                  f"x{min(ratios):.2f}-{max(ratios):.2f}{accept}", flush=True)
        print(f"(median speedups: {statistics.median(results[f'ngram@batch{batch}']['speedup']):.2f} n-gram)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), "commit": machine.code_revision(ROOT),
                                        "machine": machine.summary(), "k": k, "target": args.target,
                                        "draft": args.draft, "losses": losses, "results": results}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
