"""The checkpoint's tokenizer: `tokenizer.json` through the `tokenizers` package, and the chat template.

The template is rendered the way Hugging Face's `apply_chat_template(..., tokenize=False)` does (a
sandboxed jinja2 environment with trim_blocks/lstrip_blocks, `raise_exception`, the special-token
strings of tokenizer_config.json as variables), so prompts match what dInfer's tests feed the model
without depending on `transformers`.

Broken files end in a CheckpointError naming the file: a tokenizer.json the `tokenizers` package cannot
read, a config that is not a JSON object, a chat template that does not parse or render; and, given the
model config, a tokenizer whose ids the embedding does not cover or that lacks the eos/pad token. A
prompt character the vocabulary lacks is a ValueError naming it and its position, not a silent unk token.
"""

from __future__ import annotations

import json
import os
from typing import Iterable, List, Optional, Sequence, Union

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from .config import CONFIG_FILE as MODEL_CONFIG_FILE
from .config import CheckpointError, ModelConfig

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"  # newer checkpoints keep the template out of the config
ROLES = ("system", "user", "assistant")


class Tokenizer:
    """encode/decode and the chat template of the checkpoint folder `path`.

    `eos_id` is where decoding stops; it defaults to the model config's id when `config` is given,
    else to the id of tokenizer_config.json's `eos_token`. With `config`, the tokenizer is checked
    against the model: every id it can produce has an embedding row, and the eos and pad ids are tokens
    (the mask id is not checked: some released tokenizer copies lack the mask token).
    """

    def __init__(self, path, eos_id: Optional[int] = None, config: Optional[ModelConfig] = None):
        path = os.fspath(path)
        self.file = os.path.join(path, TOKENIZER_FILE)
        if not os.path.isfile(self.file):
            raise FileNotFoundError(f"no {TOKENIZER_FILE} in checkpoint directory {path!r}")
        try:
            self._tok = _HFTokenizer.from_file(self.file)
        except Exception as e:  # the tokenizers package raises a bare Exception for any unreadable file
            raise CheckpointError(
                f"{self.file}: not a tokenizer the tokenizers package can read ({e})"
            ) from e
        config_file = os.path.join(path, CONFIG_FILE)
        tok_config = read_json(config_file)
        self.special_tokens = {
            k: _token_text(v)
            for k, v in tok_config.items()
            if k.endswith("_token") and _token_text(v) is not None
        }
        if eos_id is None and config is not None:
            eos_id = config.eos_id
        self.eos_id = eos_id if eos_id is not None else self._token_id(self.special_tokens.get("eos_token"))
        self.chat_template, self._template_file = _read_template(path, config_file, tok_config)
        # Compiled once, on first use (~1.5 ms a compile, which every prompt used to pay); lazily, so a
        # template error still surfaces where the template is used, not when the tokenizer loads.
        self._template = None
        # Where the model itself maps unknown text to an unk token (WordLevel, WordPiece, BPE without
        # byte fallback); byte-level BPE covers every string and has none.
        model = self._tok.model
        unk = None if getattr(model, "byte_fallback", False) else getattr(model, "unk_token", None)
        self._unk = (
            (unk, self._tok.token_to_id(unk)) if unk and self._tok.token_to_id(unk) is not None else None
        )
        if config is not None:
            self._check_against(config)

    def encode(self, text: str) -> List[int]:
        """Token ids as `tokenizer(text)["input_ids"]` gives them (the file's post-processor applies);
        a ValueError naming the first character the vocabulary lacks, where it would become unk."""
        encoding = self._tok.encode(text)
        if self._unk is not None and self._unk[1] in encoding.ids:
            unk, unk_id = self._unk
            for token, (start, end) in zip(encoding.ids, encoding.offsets):
                if token == unk_id and text[start:end] != unk:  # the unk token written out is no error
                    piece = text[start:end]
                    code = " ".join(f"U+{ord(ch):04X}" for ch in piece)
                    near = text[max(0, start - 12) : end + 12]  # the text may be a chat-templated prompt
                    raise ValueError(
                        f"text position {start}: {piece!r} ({code}) in {near!r} is not in the "
                        f"vocabulary of {self.file}; it would silently become {unk}"
                    )
        return encoding.ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Text of `ids` up to, not including, the first EOS."""
        ids = [int(i) for i in ids]
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return self._tok.decode(ids, skip_special_tokens=skip_special)

    def apply_chat_template(self, conversation: Union[str, Sequence[dict]]) -> str:
        """The conversation followed by the assistant's generation prompt: one user turn (a string)
        or OpenAI-style messages [{"role": "system" | "user" | "assistant", "content": str}, ...]
        (check_messages). Without a template: the text itself, or the messages' contents joined by
        newlines. A template that fails to parse or render is a CheckpointError naming the file it
        came from; one that refuses the messages (its raise_exception, say for roles that do not
        alternate) a ValueError naming `messages`."""
        if isinstance(conversation, str):
            messages = [{"role": "user", "content": conversation}]
        else:
            messages = check_messages(conversation)
        if self.chat_template is None:
            return "\n".join(m["content"] for m in messages)
        try:
            if self._template is None:
                env = ImmutableSandboxedEnvironment(
                    trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
                )
                env.globals["raise_exception"] = _raise
                self._template = env.from_string(self.chat_template)
            return self._template.render(
                messages=messages,
                add_generation_prompt=True,
                **self.special_tokens,
            )
        except TemplateRefusal as e:
            if not isinstance(conversation, str):  # the conversation's fault, not the checkpoint's
                raise ValueError(f"messages: the checkpoint's chat template refuses them: {e}") from e
            raise CheckpointError(
                f"{self._template_file}: the chat template refuses one user turn: {e}"
            ) from e
        except (TemplateError, TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as e:
            line = f" (template line {e.lineno})" if getattr(e, "lineno", None) else ""
            raise CheckpointError(
                f"{self._template_file}: the chat template fails{line}: {type(e).__name__}: {e}"
            ) from e

    def _token_id(self, token: Optional[str]) -> Optional[int]:
        return None if token is None else self._tok.token_to_id(token)

    def _check_against(self, config: ModelConfig) -> None:
        top = max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1)
        if top >= config.vocab_size:
            raise CheckpointError(
                f"{MODEL_CONFIG_FILE}: {config.hf_key('vocab_size')} is {config.vocab_size} but "
                f"{self.file} has token ids up to {top}, which have no embedding row"
            )
        for key, value in (("eos_token_id", config.eos_id), ("pad_token_id", config.pad_id)):
            if self._tok.id_to_token(value) is None:
                raise CheckpointError(
                    f"{MODEL_CONFIG_FILE}: {key} is {value} but {self.file} has no token with "
                    f"that id (its ids reach {top})"
                )


def check_messages(messages) -> List[dict]:
    """A copy of chat messages {"role", "content"} checked: a non-empty list of objects, each with a
    role of ROLES and a non-empty string content (no other keys but an optional string "name"). A
    TypeError or ValueError naming the message and key (messages[1].role)."""
    if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages: expected a list of messages, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages: empty (expected at least one message)")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise TypeError(
                f"messages[{i}]: expected an object with role and content, got {type(m).__name__}"
            )
        extra = sorted(set(m) - {"role", "content", "name"})
        if extra:
            raise ValueError(f"messages[{i}].{extra[0]}: unknown key (expected role, content, name)")
        for key in ("role", "content"):
            if key not in m:
                raise ValueError(f"messages[{i}].{key}: missing")
            if not isinstance(m[key], str):
                raise TypeError(f"messages[{i}].{key}: expected a string, got {type(m[key]).__name__}")
        if m["role"] not in ROLES:
            raise ValueError(f"messages[{i}].role: expected one of {ROLES}, got {m['role']!r}")
        if not m["content"]:
            raise ValueError(f"messages[{i}].content: empty")
        if "name" in m and not isinstance(m["name"], str):
            raise TypeError(f"messages[{i}].name: expected a string, got {type(m['name']).__name__}")
        out.append(dict(m))
    return out


def read_json(file: str) -> dict:
    """The JSON object in `file`, or {} when the optional file is absent."""
    if not os.path.isfile(file):
        return {}
    with open(file, encoding="utf-8") as f:
        try:
            d = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{file}: not valid JSON ({e})") from e
    if not isinstance(d, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(d).__name__}")
    return d


def _read_template(path: str, config_file: str, config: dict):
    """(template text or None, the file it came from)."""
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}], HF uses "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise CheckpointError(
                f"{config_file}: chat_template lists templates {sorted(map(str, named))} but "
                "none named 'default'"
            )
        template = named["default"]
    if template is not None:
        if not isinstance(template, str):
            raise CheckpointError(
                f"{config_file}: chat_template must be a string, got {type(template).__name__}"
            )
        return template, config_file
    file = os.path.join(path, TEMPLATE_FILE)
    if os.path.isfile(file):
        with open(file, encoding="utf-8") as f:
            try:
                return f.read(), file
            except UnicodeDecodeError as e:
                raise CheckpointError(f"{file}: not UTF-8 text ({e})") from e
    return None, None


def _token_text(value) -> Optional[str]:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class TemplateRefusal(TemplateError):
    """The template's own raise_exception(message): it refuses what it was given."""


def _raise(message: str):
    raise TemplateRefusal(message)
