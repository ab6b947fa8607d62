"""benchmarks/speculative.py, small: its training text repeats phrases (so proposals can be right),
and one short run with tiny models writes every configuration's figures at each batch size, its
tokens checked against no speculation by the script itself. The figures are whatever this machine
measures: the test checks what they are made of, never their values."""

from __future__ import annotations

import json

import numpy as np
from bench_script import load_script

bench = load_script("speculative")


def test_the_text_repeats_the_corpus_phrases():
    phrases = bench.PHRASES
    tokens = [t for p in phrases for t in p]
    assert len(tokens) == len(set(tokens)) and 0 not in tokens  # no token in two phrases
    text = bench.spans_text(np.random.default_rng(1), 200)
    starts = {p[0]: p for p in phrases}
    at, seen = 0, []
    while at < len(text):  # the text is whole phrases, one after the other, some of them again
        phrase = starts[text[at]]
        assert text[at : at + len(phrase)] == phrase[: len(text) - at]
        seen.append(phrase[0])
        at += len(phrase)
    assert len(set(seen)) <= 5 < len(seen)


def test_a_short_run_writes_every_configuration(tmp_path):
    out = tmp_path / "run.json"
    bench.main(["--train-steps", "2", "--requests", "2", "--max-tokens", "6", "--repeats", "1", "--batches", "1,2",
                "--target", "32,1,2", "--draft", "16,1,2", "--work-dir", str(tmp_path / "work"), "--out", str(out)])
    report = json.loads(out.read_text())
    assert set(report) >= {"command", "commit", "machine", "k", "losses", "results"}
    assert len(report["losses"]["target"]) == len(report["losses"]["eagle"]) == 2  # steps 0 and the last
    names = ["none", "ngram", "draft_model", "eagle", "self_draft", "random_draft", "random_draft_no_pause",
             "none_untrained", "ngram_untrained"]
    assert set(report["results"]) == {f"{n}@batch{b}" for n in names for b in (1, 2)}
    for name, result in report["results"].items():
        assert len(result["tok_s"]) == len(result["speedup"]) == 1
        if name.startswith("none"):
            assert result["drafts"] == 0 and result["speedup"] == [1.0]
    assert report["results"]["self_draft@batch1"]["draft_tokens"] > 0
