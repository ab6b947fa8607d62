"""A Hugging Face `tokenizers` tokenizer.json, with what tokenizer_config.json beside it adds.

Prompts are encoded the way `transformers`' tokenizers encode them by default (special tokens
on): a Llama-family tokenizer.json prepends BOS through its post-processor, GPT-2's adds nothing.
The chat template (tokenizer_config.json's `chat_template`, or a chat_template.jinja file) is
kept for the serving layer; the engine itself never applies it.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer


class Tokenizer:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._tokenizer = HFTokenizer.from_file(str(self.path))
        config_path = self.path.parent / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template_path = self.path.parent / "chat_template.jinja"
        self.chat_template: str | None = config.get("chat_template") or (
            template_path.read_text() if template_path.is_file() else None
        )

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)
