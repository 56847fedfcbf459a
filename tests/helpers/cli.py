"""A word-level tokenizer in the released layout (tokenizer.json, tokenizer_config.json with a chat
template) for tiny checkpoints, and `dinfer ARGS` run in the test's process."""

import io
import json
import os
import sys

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from dinfer.cli import main

VOCAB, EOS, MASK = 60, 58, 59


SPECIAL = {
    "<unk>": 0,
    "<|startoftext|>": 1,
    "<role>": 2,
    "</role>": 3,
    "<|role_end|>": 4,
    "<|endoftext|>": EOS,
    "<|mask|>": MASK,
}


WORDS = ["hello", "world", "what", "is", "two", "plus", "three", "USER", "ASSISTANT"]


TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<role>{{ m['role'] | upper }}</role>{{ m['content'] }}"
    "<|role_end|>{% endfor %}{% if add_generation_prompt %}<role>ASSISTANT</role>{% endif %}"
)


def write_tokenizer(path):
    vocab = dict(SPECIAL)
    free = [i for i in range(VOCAB) if i not in vocab.values()]
    words = WORDS + [f"w{i}" for i in range(len(free) - len(WORDS))]
    vocab.update(zip(words, free))
    tok = HFTokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    tok.add_special_tokens(list(SPECIAL))
    tok.save(os.path.join(path, "tokenizer.json"))
    config = {
        "bos_token": "<|startoftext|>",
        "eos_token": {"content": "<|endoftext|>", "special": True},
        "pad_token": "<|endoftext|>",
        "chat_template": TEMPLATE,
    }
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)


def cli(capsys, monkeypatch, *args, stdin=""):
    """`dinfer ARGS` in this process (quicker than run_cli): (exit status, stdout, stderr)."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    try:
        rc = main(list(args))
    except SystemExit as e:  # -h
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err
