"""The embedded models' tokenizer: one token per character, written with `tokenizers` as a released
checkpoint's tokenizer.json + tokenizer_config.json (with a chat template), so the same loader reads it.

Prompts are `<|bos|>` + text + `<|assistant|>`; the answer follows, then `<|endoftext|>` to the end of
the canvas. Upper case is folded to lower case; characters outside the alphabet become `<|unk|>`.
"""

import json
import os

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from ..tasks import CHARS

EOS, MASK, BOS, ASSISTANT, UNK = "<|endoftext|>", "<|mdm_mask|>", "<|bos|>", "<|assistant|>", "<|unk|>"
SPECIAL = (EOS, MASK, BOS, ASSISTANT, UNK)  # ids 0..4, then one id per character
ALPHABET = CHARS + " "
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}{{ sep_token }}{% endif %}"
)


def special_ids() -> dict:
    return {t: i for i, t in enumerate(SPECIAL)}


def vocab_size() -> int:
    return len(SPECIAL) + len(ALPHABET)


def save_tokenizer(path) -> None:
    """Write tokenizer.json and tokenizer_config.json into the checkpoint folder `path`."""
    vocab = {t: i for i, t in enumerate(list(SPECIAL) + list(ALPHABET))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL))
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    config = {
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "mask_token": MASK,
        "sep_token": ASSISTANT,
        "unk_token": UNK,
        "model_max_length": 256,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
