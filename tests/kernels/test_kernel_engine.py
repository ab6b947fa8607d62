"""The engine's greedy tokens with the Triton kernels forced on (interpreter on CPU) equal the torch path's.

TRITON_INTERPRET must be set before triton is first imported, so the kernel run happens in a
fresh interpreter process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from orca_backend import LLM, SamplingParams
from orca_backend.families.gpt2 import GPT2Config

GEOMETRY = GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=2, initializer_range=0.3)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9], [100, 50, 25]]

SCRIPT = """
import json, sys
from orca_backend import LLM, SamplingParams
llm = LLM(sys.argv[1], kernels="triton", max_num_seqs=4)
assert llm.engine.core.executor.runner.model.ops.name == "triton"
outs = llm.generate(json.loads(sys.argv[2]), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
print(json.dumps([o.output_ids for o in outs]))
"""


def test_engine_tokens_with_triton_kernels_equal_torch_references(make_checkpoint):
    path, _ = make_checkpoint(GEOMETRY, seed=5, tokenizer=False)
    expected = LLM(str(path), kernels="torch", max_num_seqs=4).generate(
        PROMPTS, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    )
    env = os.environ | {"TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(path), json.dumps(PROMPTS)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [o.output_ids for o in expected]
