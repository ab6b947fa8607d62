"""vLLM's CPU build on the same checkpoint and requests: run by offline.py inside vLLM's own venv.

    python peer_vllm.py CHECKPOINT_DIR WORKLOAD_JSON REPEAT DTYPE   -> prints one line "RESULT {json}"

Tuned as vLLM's CPU docs say (offline.py sets the environment: VLLM_CPU_OMP_THREADS_BIND over every
core, tcmalloc and Intel OpenMP preloaded, VLLM_CPU_KVCACHE_SPACE); prompts go in as token ids with
the tokenizer skipped and prefix caching off, so it does exactly the work our engine does.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    checkpoint, workload_path, repeat, dtype = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    with open(workload_path) as f:
        workload = json.load(f)
    llm = LLM(
        model=checkpoint,
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
        dtype=dtype,
        max_num_seqs=len(workload),
        max_model_len=1024,
        seed=0,
    )
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_ids"]) for r in workload]
    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True, detokenize=False) for r in workload]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    runs, tokens = [], 0
    for _ in range(repeat):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append(time.perf_counter() - start)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    # vLLM logs to stdout too: the marker tells offline.py which line is the result.
    result = {"seconds": min(runs), "output_tokens": tokens, "tokens_per_s": tokens / min(runs), "runs_s": runs}
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
