"""Broken checkpoints end in clear errors.

Each case copies an embedded model (dinfer/assets) into tmp_path, breaks one thing the way real
checkpoints break (a config that disagrees with the weights, truncated or corrupt safetensors, a shard
the index lists but nobody copied, bad JSON, wrong types, a tokenizer or chat template that does not
load), loads it through `LLM` as a user would, and asserts the exception type and that the message
names the file and the key or tensor, with both values where two disagree.
"""

import json
import os
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer as HFTokenizer

from dinfer.llm import LLM
from dinfer.models import CheckpointError
from dinfer.models.embedded import model_dir

DENSE, MOE = "tiny-llada", "tiny-llada-moe"
WEIGHTS = "model.safetensors"


def copy_model(name, dst):
    """The embedded model `name` in folder dst; the weights are a symlink until a case rewrites them."""
    src = model_dir(name)
    os.makedirs(dst)
    for file in os.listdir(src):
        if file == WEIGHTS:
            os.symlink(os.path.join(src, file), os.path.join(dst, file))
        else:
            shutil.copy(os.path.join(src, file), dst)
    return dst


# --------------------------------------------------------------------------------------- edit helpers


def edit_json(file, **changes):
    def edit(path):
        p = os.path.join(path, file)
        with open(p) as f:
            d = json.load(f)
        d.update(changes)
        with open(p, "w") as f:
            json.dump(d, f)

    return edit


def config(**changes):
    return edit_json("config.json", **changes)


def write(file, text):
    def edit(path):
        p = os.path.join(path, file)
        if os.path.lexists(p):
            os.remove(p)
        with open(p, "wb") as f:
            f.write(text if isinstance(text, bytes) else text.encode())

    return edit


def remove(file):
    return lambda path: os.remove(os.path.join(path, file))


def tensors(change):
    """Rewrite model.safetensors after change(dict of tensors), with the reference writer."""

    def edit(path):
        p = os.path.join(path, WEIGHTS)
        raw = load_file(p)
        change(raw)
        os.remove(p)
        save_file(raw, p)

    return edit


def raw_bytes(change):
    """Rewrite model.safetensors as change(header dict, data bytes) -> (header, data)."""

    def edit(path):
        p = os.path.join(path, WEIGHTS)
        with open(p, "rb") as f:
            blob = f.read()
        (n,) = struct.unpack("<Q", blob[:8])
        header, data = change(json.loads(blob[8 : 8 + n]), blob[8 + n :])
        text = json.dumps(header).encode()
        os.remove(p)
        with open(p, "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text + data)

    return edit


def truncate(fraction):
    def edit(path):
        p = os.path.join(path, WEIGHTS)
        with open(p, "rb") as f:
            blob = f.read()
        write(WEIGHTS, blob[: int(len(blob) * fraction)])(path)

    return edit


def overlap(header, data):
    """Two tensors of one size pointed at the same bytes: every offset in range, the data not covered."""
    a, b = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    header[b]["data_offsets"] = list(header[a]["data_offsets"])
    return header, data


def index_to(missing_shard):
    """A model.safetensors.index.json placing every tensor in model.safetensors, one in a shard that is
    not there."""

    def edit(path):
        names = list(load_file(os.path.join(path, WEIGHTS)))
        weight_map = dict.fromkeys(names, WEIGHTS)
        weight_map[names[-1]] = missing_shard
        write("model.safetensors.index.json", json.dumps({"metadata": {}, "weight_map": weight_map}))(path)

    return edit


def truncated_text(file, chars):
    def edit(path):
        with open(os.path.join(path, file)) as f:
            text = f.read()
        write(file, text[:chars])(path)

    return edit


def tokenizer_edit(change):
    def edit(path):
        p = os.path.join(path, "tokenizer.json")
        tok = HFTokenizer.from_file(p)
        change(tok)
        tok.save(p)

    return edit


def drop_vocab_entry(token_id):
    def edit(path):
        p = os.path.join(path, "tokenizer.json")
        with open(p) as f:
            d = json.load(f)
        d["model"]["vocab"] = {t: i for t, i in d["model"]["vocab"].items() if i != token_id}
        with open(p, "w") as f:
            json.dump(d, f)

    return edit


def template(text):
    return edit_json("tokenizer_config.json", chat_template=text)


def template_file(text):
    def edit(path):
        edit_json("tokenizer_config.json", chat_template=None)(path)
        write("chat_template.jinja", text)(path)

    return edit


def both(*edits):
    def edit(path):
        for e in edits:
            e(path)

    return edit


# --------------------------------------------------------------------------------------------- cases
# (id, model, edit, prompt or None (loading alone fails), exception, message regex)

CASES = [
    # config.json against the weights
    (
        "layers-fewer",
        DENSE,
        config(n_layers=2),
        None,
        CheckpointError,
        r"config\.json: n_layers is 2 but .*model\.safetensors holds layers 0\.\.3",
    ),
    (
        "layers-more",
        MOE,
        config(num_hidden_layers=6, moe_layer_freq=[1] * 6),
        None,
        CheckpointError,
        r"config\.json: num_hidden_layers is 6 but .*model\.safetensors holds layers 0\.\.3",
    ),
    (
        "experts-fewer",
        MOE,
        config(num_experts=4),
        None,
        CheckpointError,
        r"config\.json: num_experts is 4 but .*model\.safetensors holds experts 0\.\.7",
    ),
    (
        "hidden",
        MOE,
        config(hidden_size=128),
        None,
        CheckpointError,
        r"config\.json: hidden_size is 128 but tensor 'model\.embed_tokens\.weight' in .*model\.safetensors "
        r"has shape \[48, 256\], expected \[48, 128\]",
    ),
    (
        "heads-moe",
        MOE,
        config(num_attention_heads=16, num_key_value_heads=16),
        None,
        CheckpointError,
        r"config\.json: head_dim \(hidden_size/num_attention_heads\) is 16 but tensor "
        r"'model\.layers\.0\.self_attn\.q_norm\.weight' .* has shape \[32\]",
    ),
    (
        "kv-heads",
        DENSE,
        config(n_kv_heads=4),
        None,
        CheckpointError,
        r"config\.json: n_kv_heads x head_dim .* is 128 but tensor 'model\.transformer\.blocks\.0\.k_proj\.weight'"
        r".*\[256, 256\]",
    ),
    (
        "mlp-width",
        DENSE,
        config(mlp_hidden_size=512),
        None,
        CheckpointError,
        r"config\.json: mlp_hidden_size is 512 but tensor 'model\.transformer\.blocks\.0\.ff_proj\.weight'",
    ),
    (
        "expert-width",
        MOE,
        config(expert_intermediate_size=128),
        None,
        CheckpointError,
        r"config\.json: expert_intermediate_size is 128 but tensor 'model\.layers\.0\.mlp\.experts\.0\."
        r"gate_proj\.weight'.*\[256, 256\], expected \[128, 256\]",
    ),
    (
        "vocab-larger",
        MOE,
        config(vocab_size=64),
        None,
        CheckpointError,
        r"config\.json: vocab_size is 64 but tensor 'model\.embed_tokens\.weight'.*\[48, 256\]",
    ),
    (
        "qk-norm-off",
        MOE,
        config(qk_layernorm=False),
        None,
        CheckpointError,
        r"config\.json: qk_layernorm is false but .*model\.safetensors holds tensor "
        r"'model\.layers\.0\.self_attn\.q_norm\.weight'",
    ),
    (
        "expert-bias-on",
        MOE,
        config(moe_router_enable_expert_bias=True),
        None,
        CheckpointError,
        r"config\.json: moe_router_enable_expert_bias is true but .*model\.safetensors has no tensor "
        r"'model\.layers\.0\.mlp\.expert_bias'",
    ),
    (
        "family",
        MOE,
        lambda p: shutil.copy(os.path.join(model_dir(DENSE), "config.json"), p),
        None,
        CheckpointError,
        r"config\.json: architectures \['LLaDAModelLM'\] describe a llada model but "
        r".*model\.safetensors holds llada_moe tensors",
    ),
    # special token ids
    (
        "mask-out-of-range",
        DENSE,
        config(mask_token_id=48),
        None,
        CheckpointError,
        r"config\.json: mask_token_id is 48 but embedding_size is 48",
    ),
    (
        "eos-out-of-range",
        MOE,
        config(eos_token_id=1000, pad_token_id=None),
        None,
        CheckpointError,
        r"config\.json: eos_token_id is 1000 but vocab_size is 48",
    ),
    (
        "mask-is-eos",
        DENSE,
        config(mask_token_id=0),
        None,
        CheckpointError,
        r"config\.json: mask_token_id and eos_token_id are both 0",
    ),
    # wrong types and bad JSON
    (
        "layers-string",
        DENSE,
        config(n_layers="4"),
        None,
        CheckpointError,
        r"config\.json: n_layers='4' must be",
    ),
    (
        "qk-norm-string",
        MOE,
        config(qk_layernorm="yes"),
        None,
        CheckpointError,
        r"config\.json: qk_layernorm='yes' must be true or false",
    ),
    (
        "config-not-json",
        DENSE,
        write("config.json", '{"d_model": 256,'),
        None,
        CheckpointError,
        r"config\.json: not valid JSON",
    ),
    (
        "config-a-list",
        MOE,
        write("config.json", "[1, 2]"),
        None,
        CheckpointError,
        r"config\.json: expected a JSON object, got list",
    ),
    ("config-missing", DENSE, remove("config.json"), None, FileNotFoundError, r"no config\.json"),
    # the weights files
    ("truncated", MOE, truncate(0.5), None, CheckpointError, r"model\.safetensors.*truncated"),
    (
        "header-garbage",
        DENSE,
        write(WEIGHTS, b"\xff" * 64),
        None,
        CheckpointError,
        r"model\.safetensors: header length .* runs past",
    ),
    (
        "overlapping-data",
        MOE,
        raw_bytes(overlap),
        None,
        CheckpointError,
        r"model\.safetensors: not a valid safetensors file \(safetensors: ",
    ),
    (
        "missing-tensor",
        MOE,
        tensors(lambda raw: raw.pop("model.layers.2.self_attn.k_proj.weight")),
        None,
        CheckpointError,
        r"model\.safetensors \(hf layout\) has no tensor 'model\.layers\.2\.self_attn\.k_proj\.weight'",
    ),
    (
        "extra-tensor",
        DENSE,
        tensors(lambda raw: raw.__setitem__("model.transformer.blocks.1.attn_bias", torch.zeros(256))),
        None,
        CheckpointError,
        r"model\.safetensors: unexpected tensor 'model\.transformer\.blocks\.1\.attn_bias'",
    ),
    (
        "transposed",
        DENSE,
        tensors(
            lambda raw: raw.__setitem__(
                "model.transformer.blocks.3.ff_out.weight",
                raw["model.transformer.blocks.3.ff_out.weight"].t().contiguous(),
            )
        ),
        None,
        CheckpointError,
        r"config\.json: d_model is 256 but tensor 'model\.transformer\.blocks\.3\.ff_out\.weight'"
        r" in .*model\.safetensors has shape \[768, 256\], expected \[256, 768\]",
    ),
    (
        "integer-weight",
        MOE,
        tensors(lambda raw: raw.__setitem__("model.norm.weight", raw["model.norm.weight"].to(torch.int64))),
        None,
        CheckpointError,
        r"tensor 'model\.norm\.weight' in .*model\.safetensors has dtype I64",
    ),
    ("weights-missing", DENSE, remove(WEIGHTS), None, FileNotFoundError, r"no model\.safetensors"),
    (
        "shard-missing",
        MOE,
        index_to("model-00002-of-00002.safetensors"),
        None,
        FileNotFoundError,
        r"model-00002-of-00002\.safetensors' \(listed in model\.safetensors\.index\.json\) does not exist",
    ),
    (
        "index-not-json",
        DENSE,
        write("model.safetensors.index.json", "{"),
        None,
        CheckpointError,
        r"model\.safetensors\.index\.json: corrupt index",
    ),
    # the tokenizer and the chat template
    (
        "tokenizer-truncated",
        MOE,
        truncated_text("tokenizer.json", 300),
        None,
        CheckpointError,
        r"tokenizer\.json: not a tokenizer the tokenizers package can read",
    ),
    ("tokenizer-missing", DENSE, remove("tokenizer.json"), None, FileNotFoundError, r"no tokenizer\.json"),
    (
        "tokenizer-beyond-vocab",
        DENSE,
        tokenizer_edit(lambda tok: tok.add_tokens([f"<t{i}>" for i in range(4)])),
        None,
        CheckpointError,
        r"config\.json: embedding_size/vocab_size is 48 but .*tokenizer\.json has token ids "
        r"up to 51",
    ),
    (
        "tokenizer-lacks-eos",
        MOE,
        both(drop_vocab_entry(47), config(eos_token_id=47, pad_token_id=47)),
        None,
        CheckpointError,
        r"config\.json: eos_token_id is 47 but .*tokenizer\.json has no token with that id",
    ),
    (
        "tokenizer-config-not-json",
        DENSE,
        write("tokenizer_config.json", "{'eos_token': 1}"),
        None,
        CheckpointError,
        r"tokenizer_config\.json: not valid JSON",
    ),
    (
        "template-syntax",
        MOE,
        template("{% for m in messages %}{{ m['content'] }}"),
        "what is 2+3?",
        CheckpointError,
        r"tokenizer_config\.json: the chat template fails .*TemplateSyntaxError",
    ),
    (
        "template-render",
        DENSE,
        template("{{ messages[3]['content'] }}"),
        "what is 2+3?",
        CheckpointError,
        r"tokenizer_config\.json: the chat template fails: UndefinedError",
    ),
    (
        "template-file-syntax",
        DENSE,
        template_file("{{ bos_token }{% if %}"),
        "what is 2+3?",
        CheckpointError,
        r"chat_template\.jinja: the chat template fails \(template line 1\)",
    ),
    (
        "unknown-character",
        MOE,
        lambda p: None,
        "what is 2\u00d73?",
        ValueError,
        r"text position 16: '\u00d7' \(U\+00D7\) in 's\|>what is 2\u00d73\?<\|assistan' is not in the "
        r"vocabulary of .*tokenizer\.json; it would silently "
        r"become <\|unk\|>",
    ),
    (
        "generation-config",
        DENSE,
        write("generation_config.json", "[32]"),
        None,
        CheckpointError,
        r"generation_config\.json: expected a JSON object",
    ),
]


@pytest.mark.parametrize(
    "model, edit, prompt, error, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_broken_checkpoint(tmp_path, model, edit, prompt, error, message):
    path = copy_model(model, str(tmp_path / "ckpt"))
    edit(path)
    with pytest.raises(error, match=message):
        llm = LLM(path, device="cpu")
        llm.generate(prompt, gen_length=8, block_length=8)


def test_nan_weights_load(tmp_path):
    """NaN weights are a valid checkpoint as far as the files go: loading reads headers, never values.
    The generation loop's runtime check (not this module's) turns the NaN logits into an error."""
    path = copy_model(DENSE, str(tmp_path / "ckpt"))
    tensors(lambda raw: raw["model.transformer.blocks.1.q_proj.weight"].fill_(float("nan")))(path)
    llm = LLM(path, device="cpu")
    assert llm.model.config.num_layers == 4


def test_unk_token_written_out_is_no_error(tmp_path):
    """Only characters the vocabulary lacks are errors; the unk token itself is a real token."""
    llm = LLM(copy_model(MOE, str(tmp_path / "ckpt")), device="cpu")
    assert llm.tokenizer.encode("a<|unk|>b") == llm.tokenizer.encode("a") + [4] + llm.tokenizer.encode("b")
