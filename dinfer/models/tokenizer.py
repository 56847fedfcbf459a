"""The checkpoint's tokenizer: `tokenizer.json` through the `tokenizers` package, and the chat template.

The template is rendered the way Hugging Face's `apply_chat_template(..., tokenize=False)` does (a
sandboxed jinja2 environment with trim_blocks/lstrip_blocks, `raise_exception`, the special-token
strings of tokenizer_config.json as variables), so prompts match what dInfer's tests feed the model
(shared/reference/models.md §5.3) without depending on `transformers`.
"""
from __future__ import annotations

import json
import os
from typing import Iterable, List, Optional

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"  # newer checkpoints keep the template out of the config


class Tokenizer:
    """encode/decode and the chat template of the checkpoint folder `path`.

    `eos_id` is where decoding stops; it defaults to the id of tokenizer_config.json's `eos_token`
    (pass the model config's id so the tokenizer stops where the generation loop pads).
    """

    def __init__(self, path, eos_id: Optional[int] = None):
        path = os.fspath(path)
        file = os.path.join(path, TOKENIZER_FILE)
        if not os.path.isfile(file):
            raise FileNotFoundError(f"no {TOKENIZER_FILE} in checkpoint directory {path!r}")
        self._tok = _HFTokenizer.from_file(file)
        config = read_json(os.path.join(path, CONFIG_FILE))
        self.special_tokens = {k: _token_text(v) for k, v in config.items()
                               if k.endswith("_token") and _token_text(v) is not None}
        self.eos_id = eos_id if eos_id is not None else self._token_id(self.special_tokens.get("eos_token"))
        self.chat_template = _read_template(path, config)
        # Compiled once, on first use (~1.5 ms a compile, which every prompt used to pay); lazily, so a
        # template error still surfaces where the template is used, not when the tokenizer loads.
        self._template = None

    def encode(self, text: str) -> List[int]:
        """Token ids as `tokenizer(text)["input_ids"]` gives them (the file's post-processor applies)."""
        return self._tok.encode(text).ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Text of `ids` up to, not including, the first EOS."""
        ids = [int(i) for i in ids]
        if self.eos_id in ids:
            ids = ids[:ids.index(self.eos_id)]
        return self._tok.decode(ids, skip_special_tokens=skip_special)

    def apply_chat_template(self, user_text: str) -> str:
        """One user turn followed by the assistant's generation prompt; the text itself if the
        checkpoint has no template."""
        if self.chat_template is None:
            return user_text
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.globals["raise_exception"] = _raise
            self._template = env.from_string(self.chat_template)
        return self._template.render(messages=[{"role": "user", "content": user_text}],
                                     add_generation_prompt=True, **self.special_tokens)

    def _token_id(self, token: Optional[str]) -> Optional[int]:
        return None if token is None else self._tok.token_to_id(token)


def read_json(file: str) -> dict:
    """The JSON object in `file`, or {} when the optional file is absent."""
    if not os.path.isfile(file):
        return {}
    with open(file, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{file}: not valid JSON ({e})") from e


def _read_template(path: str, config: dict) -> Optional[str]:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}], HF uses "default"
        template = {t.get("name"): t.get("template") for t in template}.get("default")
    file = os.path.join(path, TEMPLATE_FILE)
    if template is None and os.path.isfile(file):
        with open(file, encoding="utf-8") as f:
            template = f.read()
    return template


def _token_text(value) -> Optional[str]:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _raise(message: str):
    raise TemplateError(message)
