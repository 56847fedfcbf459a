"""ModelConfig parsing and checkpoint I/O against the released formats.

Tiny configs with awkward sizes; checkpoints are written with the real safetensors writer and read back
by our memory-mapped parser.
"""

import dataclasses
import json
import os
import struct

import pytest
import torch
from helpers.hf_configs import DENSE_8B, LLADA2_MINI, MOE_7B, TINY_DENSE, TINY_LLADA2, TINY_MOE, tiny
from safetensors.torch import load_file, save_file

from dinfer.models import (
    CheckpointError,
    ModelConfig,
    expected_shapes,
    load_weights,
    random_weights,
    save_checkpoint,
)
from dinfer.models.families import FAMILIES

# ----------------------------------------------------------------------------------------------- config


def test_release_dense_config():
    c = ModelConfig.from_hf(DENSE_8B)
    assert (c.family, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (
        "llada",
        4096,
        32,
        32,
        32,
        128,
    )
    assert (c.vocab_size, c.intermediate_size, c.num_experts, c.expert_intermediate_size) == (
        126464,
        12288,
        0,
        None,
    )
    assert (c.mask_id, c.eos_id, c.pad_id) == (126336, 126081, 126081)
    assert (c.rope_theta, c.rotary_dim, c.rms_eps, c.max_positions) == (500000.0, 128, 1e-5, 4096)
    assert not c.qk_norm and not c.tie_embeddings and c.architectures == ("LLaDAModelLM",)


def test_release_moe_config_despite_model_type_llada():
    c = ModelConfig.from_hf(MOE_7B)
    assert (c.family, c.hidden_size, c.num_layers, c.num_heads, c.head_dim) == (
        "llada_moe",
        2048,
        16,
        16,
        128,
    )
    assert (c.num_experts, c.top_k, c.expert_intermediate_size, c.intermediate_size) == (64, 8, 1024, None)
    assert (c.mask_id, c.eos_id, c.pad_id) == (156895, 156892, 156892)  # mask is not in the release config
    assert c.qk_norm and not c.router_renormalize and not c.expert_bias
    assert (c.rope_theta, c.rotary_dim, c.max_positions) == (50000.0, 128, 8192)


@pytest.mark.parametrize("drop_architectures", [False, True])
def test_release_llada2_config(drop_architectures):
    d = {k: v for k, v in LLADA2_MINI.items() if not (drop_architectures and k == "architectures")}
    c = ModelConfig.from_hf(d)
    assert (c.family, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (
        "llada2_moe",
        2048,
        20,
        16,
        4,
        128,
    )
    assert (c.intermediate_size, c.expert_intermediate_size, c.shared_intermediate_size) == (5120, 512, 512)
    assert (c.num_experts, c.top_k, c.num_groups, c.topk_groups, c.first_k_dense) == (256, 8, 8, 4, 1)
    assert (c.router_scoring, c.routed_scaling, c.router_renormalize, c.expert_bias) == (
        "sigmoid",
        2.5,
        True,
        True,
    )
    assert (c.rotary_dim, c.rope_theta, c.rms_eps, c.qk_norm) == (64, 600000.0, 1e-6, True)
    # the release leaves the mask and eos ids to the generation code
    assert (c.mask_id, c.eos_id, c.pad_id, c.block_length) == (156895, 156892, 156892, 32)
    assert c.block_causal and c.is_moe and c.is_dense_layer(0) and not c.is_dense_layer(1)


def test_llada2_config_round_trip():
    c = ModelConfig.from_hf(LLADA2_MINI)
    assert ModelConfig.from_hf(c.to_hf()) == c
    assert ModelConfig.from_hf(c.to_hf("fused")) == c  # dInfer's pre-fused weights keep the config


def test_defaults_where_the_release_omits_keys():
    dense = {
        k: v
        for k, v in DENSE_8B.items()
        if k not in ("mask_token_id", "eos_token_id", "pad_token_id", "rms_norm_eps", "n_kv_heads")
    }
    c = ModelConfig.from_hf(dense)
    assert (c.mask_id, c.eos_id, c.pad_id, c.rms_eps, c.num_kv_heads) == (126336, 126081, 126081, 1e-5, 32)
    moe = {
        k: v for k, v in MOE_7B.items() if k not in ("eos_token_id", "pad_token_id", "partial_rotary_factor")
    }
    c = ModelConfig.from_hf(dict(moe, mask_token_id=7))
    assert (c.mask_id, c.eos_id, c.pad_id, c.rotary_dim) == (7, 156892, 156892, 128)


@pytest.mark.parametrize(
    "architectures", [["LLaDAMoEModelLM"], ["LLaDAMoEModel"], ["FusedLLaDAMoEModelLM"], None]
)
def test_moe_dispatch(architectures):
    d = dict(MOE_7B, architectures=architectures)
    if architectures is None:
        del d["architectures"]
    assert ModelConfig.from_hf(d).family == "llada_moe"


def test_dense_dispatch_on_keys_without_architectures():
    assert ModelConfig.from_hf({k: v for k, v in DENSE_8B.items() if k != "architectures"}).family == "llada"


def test_dispatch_precedence():
    """LLaDA2's grouped-routing keys name it whatever `architectures` says (another family would read
    the config and run it wrongly); otherwise a named architecture wins over another family's keys,
    and between two families' keys the more specific one wins."""
    assert ModelConfig.from_hf(dict(TINY_LLADA2, architectures=["LLaDAMoEModelLM"])).family == "llada2_moe"
    assert ModelConfig.from_hf(dict(TINY_DENSE, expert_intermediate_size=40)).family == "llada"
    no_arch = {k: v for k, v in TINY_MOE.items() if k != "architectures"}
    assert ModelConfig.from_hf(dict(no_arch, n_layers=2)).family == "llada_moe"
    with pytest.raises(
        CheckpointError,
        match=r"config\.json: unsupported architectures \['X'\]: it has neither LLaDA's d_model/n_layers "
        r"nor LLaDA-MoE's expert_intermediate_size/moe_layer_freq$",
    ):
        ModelConfig.from_hf({"architectures": ["X"], "hidden_size": 8})


def test_every_family_has_a_tiny_config_that_round_trips_in_each_layout():
    """A family added to the table needs a tiny config here; its config.json, written in each of its
    layouts, reads back as the same config (the fused layout may name another architecture)."""
    tiny_configs = {"llada": TINY_DENSE, "llada_moe": TINY_MOE, "llada2_moe": TINY_LLADA2}
    assert set(tiny_configs) == set(FAMILIES)
    for name, family in FAMILIES.items():
        c = ModelConfig.from_hf(tiny_configs[name])
        assert c.family == name and c.family_spec is family
        for layout in family.layouts:
            again = ModelConfig.from_hf(c.to_hf(layout))
            assert dataclasses.replace(again, architectures=c.architectures) == c, (name, layout)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_config_round_trip(kind, tmp_path):
    c = tiny(kind)
    assert ModelConfig.from_hf(c.to_hf()) == c
    (tmp_path / "config.json").write_text(json.dumps(c.to_hf()))
    assert ModelConfig.from_dir(tmp_path) == c


def test_fused_config():
    c = tiny("moe")
    fused = ModelConfig.from_hf(c.to_hf("fused"))
    assert fused.architectures == ("FusedLLaDAMoEModelLM",) and fused.family == "llada_moe"
    assert fused == dataclasses.replace(c, architectures=("FusedLLaDAMoEModelLM",))
    with pytest.raises(ValueError, match="fused"):
        tiny("dense").to_hf("fused")


@pytest.mark.parametrize(
    "config, key",
    [
        (dict(LLADA2_MINI, use_qkv_bias=True), "use_qkv_bias"),
        (dict(LLADA2_MINI, score_function="softmax"), "score_function"),
        (dict(LLADA2_MINI, rope_scaling={"type": "linear"}), "rope_scaling"),
        (dict(LLADA2_MINI, rotary_dim=32), "rotary_dim"),
        (dict(LLADA2_MINI, n_group=7), "n_group"),
        (dict(LLADA2_MINI, first_k_dense_replace=21), "first_k_dense_replace"),
        (dict(LLADA2_MINI, num_nextn_predict_layers=1), "num_nextn_predict_layers"),
        (dict(LLADA2_MINI, use_qk_norm=False), "use_qk_norm"),
        (dict(MOE_7B, moe_layer_freq=[0] + [1] * 15), "moe_layer_freq"),
        (dict(MOE_7B, shared_expert_intermediate_size=1024), "shared_expert_intermediate_size"),
        ({k: v for k, v in MOE_7B.items() if k != "num_experts"}, "num_experts"),
        ({k: v for k, v in MOE_7B.items() if k != "qk_layernorm"}, "qk_layernorm"),
        ({k: v for k, v in DENSE_8B.items() if k != "d_model"}, "d_model"),
        (dict(DENSE_8B, n_heads=30), "head_dim is not integral"),
        (dict(DENSE_8B, attention_layer_norm=True), "attention_layer_norm"),
        (dict(DENSE_8B, weight_tying=True), "weight_tying"),
        (dict(MOE_7B, partial_rotary_factor=0.5), "partial_rotary_factor"),
        (dict(MOE_7B, num_key_value_heads=3), "num_attention_heads"),
        ({"architectures": ["Qwen2ForCausalLM"], "hidden_size": 8}, "architectures"),
    ],
)
def test_unsupported_configs_are_rejected(config, key):
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_hf(config)


def test_missing_config_json(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        ModelConfig.from_dir(tmp_path)


# ----------------------------------------------------------------------------------------------- weights


@pytest.mark.parametrize(
    "kind, layout, shards",
    [
        ("dense", "hf", 1),
        ("dense", "hf", 3),
        ("moe", "hf", 1),
        ("moe", "hf", 3),
        ("moe", "fused", 1),
        ("moe", "fused", 3),
        ("llada2", "hf", 1),
        ("llada2", "hf", 4),
        ("llada2", "fused", 2),
    ],
)
def test_round_trip_is_bit_exact(kind, layout, shards, tmp_path):
    c = tiny(kind)
    w = random_weights(c, seed=3)
    save_checkpoint(tmp_path, c, w, layout=layout, shards=shards)
    assert os.path.isfile(tmp_path / "model.safetensors.index.json") == (shards > 1)
    assert ModelConfig.from_dir(tmp_path).family == c.family
    loaded = load_weights(tmp_path, c, dtype=torch.float32)
    assert list(loaded) == list(expected_shapes(c))
    for name, t in w.items():
        assert loaded[name].dtype == torch.float32 and torch.equal(loaded[name], t), name


def test_llada2_released_names_and_fused_qkv(tmp_path):
    """The names of models.md's LLaDA2 table; Q, K and V are row ranges of query_key_value, the
    shared expert's gate and up the two halves of shared_w13, the dense layer below
    first_k_dense_replace has no router, and the expert bias stays fp32 in a bf16 load."""
    c = tiny("llada2")
    w = random_weights(c, seed=5)
    save_checkpoint(tmp_path, c, w)
    from safetensors.torch import load_file

    f = load_file(tmp_path / "model.safetensors")
    assert torch.equal(f["model.layers.1.attention.query_key_value.weight"], w["layers.1.qkv"])
    assert f["model.layers.1.attention.query_key_value.weight"].shape == ((4 + 2 * 2) * 8, 32)
    assert torch.equal(f["model.layers.2.mlp.shared_experts.up_proj.weight"], w["layers.2.shared_w13"][12:])
    assert torch.equal(f["model.layers.2.mlp.experts.7.down_proj.weight"], w["layers.2.w2"][7])
    assert "model.layers.0.mlp.gate_proj.weight" in f and "model.layers.0.mlp.gate.weight" not in f
    assert {"model.word_embeddings.weight", "model.norm.weight", "lm_head.weight"} <= set(f)
    loaded = load_weights(tmp_path, c, dtype=torch.bfloat16)
    assert loaded["layers.1.expert_bias"].dtype == torch.float32 == loaded["layers.1.router"].dtype
    assert loaded["layers.1.qkv"].dtype == torch.bfloat16


def test_hf_layout_uses_released_names_and_expert_order(tmp_path):
    """Read with the reference safetensors reader: w13 rows are gate then up, per expert."""
    c = tiny("moe")
    w = random_weights(c)
    save_checkpoint(tmp_path, c, w)
    raw = load_file(tmp_path / "model.safetensors")
    I = c.expert_intermediate_size
    assert torch.equal(raw["model.layers.1.mlp.experts.5.gate_proj.weight"], w["layers.1.w13"][5, :I])
    assert torch.equal(raw["model.layers.1.mlp.experts.5.up_proj.weight"], w["layers.1.w13"][5, I:])
    assert torch.equal(raw["model.layers.1.mlp.experts.7.down_proj.weight"], w["layers.1.w2"][7])
    assert torch.equal(raw["model.layers.0.mlp.gate.weight"], w["layers.0.router"])
    assert torch.equal(raw["model.layers.0.self_attn.q_norm.weight"], w["layers.0.q_norm"])
    assert torch.equal(raw["lm_head.weight"], w["lm_head"])
    assert len(raw) == 3 + c.num_layers * (9 + 3 * c.num_experts)


def test_dense_released_names(tmp_path):
    c = tiny("dense")
    w = random_weights(c)
    save_checkpoint(tmp_path, c, w, shards=2)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(index) == 3 + 9 * c.num_layers
    raw = {}
    for shard in set(index.values()):
        raw.update(load_file(tmp_path / shard))
    assert torch.equal(
        raw["model.transformer.blocks.1.ff_proj.weight"], w["layers.1.gate"]
    )  # ff_proj is the gate
    assert torch.equal(raw["model.transformer.blocks.1.ff_out.weight"], w["layers.1.down"])
    assert torch.equal(raw["model.transformer.ff_out.weight"], w["lm_head"])
    assert torch.equal(raw["model.transformer.wte.weight"], w["embed"])


def test_fused_layout_is_detected_by_tensor_names(tmp_path):
    """A fused checkpoint loads with the HF-layout config too: layout comes from the names."""
    c = tiny("moe")
    w = random_weights(c)
    save_checkpoint(tmp_path, c, w, layout="fused")
    assert "model.layers.0.mlp.w1" in load_file(tmp_path / "model.safetensors")
    assert ModelConfig.from_dir(tmp_path).architectures == ("FusedLLaDAMoEModelLM",)
    loaded = load_weights(tmp_path, c, dtype=torch.float32)
    assert torch.equal(loaded["layers.1.w13"], w["layers.1.w13"])


@pytest.mark.parametrize("file_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtype_handling_router_stays_fp32(file_dtype, tmp_path):
    c = tiny("moe", moe_router_enable_expert_bias=True)
    w = random_weights(c)
    save_checkpoint(tmp_path, c, w, dtype=file_dtype)
    loaded = load_weights(tmp_path, c)  # bfloat16 by default
    assert "layers.0.expert_bias" in loaded
    for name, t in w.items():
        stored = t.to(file_dtype)
        want = stored.float() if name.endswith("router") else stored.to(torch.bfloat16)
        assert loaded[name].dtype == want.dtype and torch.equal(loaded[name], want), name


def test_derived_buffers_are_ignored(tmp_path):
    """RoPE frequencies some exports save are recomputed from rope_theta, so they are not "unexpected"."""
    c = tiny("dense")
    w = random_weights(c)
    save_checkpoint(tmp_path, c, w)
    raw = load_file(tmp_path / "model.safetensors")
    raw["model.transformer.blocks.0.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(raw, tmp_path / "model.safetensors")
    assert torch.equal(load_weights(tmp_path, c, dtype=torch.float32)["layers.0.q"], w["layers.0.q"])


def test_extra_tensors_are_reported(tmp_path):
    c = tiny("dense")
    save_checkpoint(tmp_path, c, random_weights(c))
    raw = load_file(tmp_path / "model.safetensors")
    raw["model.transformer.step"] = torch.tensor([3], dtype=torch.int64)
    raw["model.transformer.blocks.0.q_bias"] = torch.zeros(64)
    save_file(raw, tmp_path / "model.safetensors")
    with pytest.raises(
        CheckpointError,
        match=r"model\.safetensors: unexpected tensor "
        r"'model\.transformer\.blocks\.0\.q_bias' and 1 more",
    ):
        load_weights(tmp_path, c)


def _mapped_file(address):
    """The file backing `address` in this process's memory map, or None."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return fields[5].strip() if len(fields) > 5 else None
    return None


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc/self/maps")
def test_loading_without_a_cast_does_not_copy(tmp_path):
    c = tiny("dense")
    save_checkpoint(tmp_path, c, random_weights(c))
    file = os.path.realpath(tmp_path / "model.safetensors")
    loaded = load_weights(tmp_path, c, dtype=torch.float32)
    for name in ("embed", "layers.1.down", "lm_head"):
        assert _mapped_file(loaded[name].untyped_storage().data_ptr()) == file, name
    cast = load_weights(tmp_path, c, dtype=torch.bfloat16)
    assert _mapped_file(cast["embed"].untyped_storage().data_ptr()) != file


# ----------------------------------------------------------------------------------------------- errors


def _saved(tmp_path, kind="dense", **kwargs):
    c = tiny(kind)
    save_checkpoint(tmp_path, c, random_weights(c), **kwargs)
    return c


def _rewrite(tmp_path, change):
    """Re-save model.safetensors after change(dict of tensors) with the reference writer."""
    raw = load_file(tmp_path / "model.safetensors")
    change(raw)
    save_file(raw, tmp_path / "model.safetensors")


def test_missing_tensor_is_named(tmp_path):
    c = _saved(tmp_path)
    _rewrite(tmp_path, lambda raw: raw.pop("model.transformer.blocks.1.up_proj.weight"))
    with pytest.raises(ValueError, match=r"model\.transformer\.blocks\.1\.up_proj\.weight"):
        load_weights(tmp_path, c)


def test_missing_expert_is_named(tmp_path):
    c = _saved(tmp_path, "moe")
    _rewrite(tmp_path, lambda raw: raw.pop("model.layers.1.mlp.experts.6.down_proj.weight"))
    with pytest.raises(ValueError, match=r"experts\.6\.down_proj"):
        load_weights(tmp_path, c)


def test_wrong_shape(tmp_path):
    c = _saved(tmp_path, "moe")
    name = "model.layers.0.mlp.experts.3.up_proj.weight"
    _rewrite(tmp_path, lambda raw: raw.__setitem__(name, torch.zeros(41, 48)))
    with pytest.raises(ValueError, match=r"up_proj.*\[41, 48\], expected \[40, 48\]"):
        load_weights(tmp_path, c)


def test_unsupported_dtype(tmp_path):
    c = _saved(tmp_path)
    name = "model.transformer.ln_f.weight"
    _rewrite(tmp_path, lambda raw: raw.__setitem__(name, raw[name].double()))
    with pytest.raises(ValueError, match=r"ln_f\.weight.*F64"):
        load_weights(tmp_path, c)


def _write_raw(path, header, data=b"", header_len=None):
    blob = json.dumps(header).encode() if isinstance(header, dict) else header
    path.write_bytes(struct.pack("<Q", len(blob) if header_len is None else header_len) + blob + data)


@pytest.mark.parametrize(
    "header, header_len, message",
    [
        (b"{not json", None, "corrupt safetensors header"),
        (b"[1, 2]", None, "not a JSON object"),
        ({}, 10**6, "header length 1000000 runs past"),
    ],
)
def test_corrupt_header(tmp_path, header, header_len, message):
    c = tiny("dense")
    _write_raw(tmp_path / "model.safetensors", header, bytes(64), header_len)
    with pytest.raises(ValueError, match=message):
        load_weights(tmp_path, c)


def _grow_end(entry):
    entry["data_offsets"][1] += 4


def _far_offsets(entry):
    entry["data_offsets"] = [10**9, 10**9 + 4 * 64 * 64]


@pytest.mark.parametrize(
    "edit, message",
    [
        (_grow_end, "needs 16384"),  # offsets inconsistent with shape x dtype
        (_far_offsets, "outside the"),
        (lambda entry: entry.pop("data_offsets"), "corrupt header entry"),
        (lambda entry: entry.update(shape=[64, "64"]), "corrupt header entry"),
    ],
)
def test_corrupt_tensor_entry_is_named(tmp_path, edit, message):
    c = _saved(tmp_path)
    path = tmp_path / "model.safetensors"
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    edit(header["model.transformer.blocks.0.q_proj.weight"])
    _write_raw(path, header, blob[8 + n :])
    with pytest.raises(ValueError, match=r"blocks\.0\.q_proj\.weight.*" + message):
        load_weights(tmp_path, c)


def test_truncated_data(tmp_path):
    c = _saved(tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match="truncated"):
        load_weights(tmp_path, c)
    path.write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match="truncated"):
        load_weights(tmp_path, c)


def test_missing_shard(tmp_path):
    c = _saved(tmp_path, "moe", shards=3)
    os.remove(tmp_path / "model-00002-of-00003.safetensors")
    with pytest.raises(FileNotFoundError, match="model-00002-of-00003.safetensors"):
        load_weights(tmp_path, c)


def test_index_pointing_to_the_wrong_shard(tmp_path):
    c = _saved(tmp_path, "moe", shards=3)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["lm_head.weight"] = "model-00001-of-00003.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match="lm_head.weight"):
        load_weights(tmp_path, c)


def test_missing_weights_files(tmp_path):
    c = tiny("dense")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_weights(tmp_path, c)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_weights(tmp_path / "nowhere", c)


def test_save_rejects_bad_weights(tmp_path):
    c = tiny("dense")
    w = random_weights(c)
    with pytest.raises(ValueError, match="layers.0.q"):
        save_checkpoint(tmp_path, c, dict(w, **{"layers.0.q": torch.zeros(3, 3)}))
    del w["lm_head"]
    with pytest.raises(ValueError, match="lm_head"):
        save_checkpoint(tmp_path, c, w)


# ------------------------------------------------------------------------------ config against weights


def test_fused_layout_expert_count_names_the_key(tmp_path):
    """The fused layout has no per-expert names to count: the stacked shapes name num_experts."""
    c = _saved(tmp_path, "moe", layout="fused")
    fewer = tiny("moe", num_experts=4)
    with pytest.raises(
        CheckpointError,
        match=r"config\.json: num_experts is 4 but tensor "
        r"'model\.layers\.0\.mlp\.gate\.weight' .*\[8, 48\], expected \[4, 48\]",
    ):
        load_weights(tmp_path, fewer)
    assert load_weights(tmp_path, c)["layers.1.w13"].shape[0] == c.num_experts


def test_sharded_layer_count_and_unlisted_tensors(tmp_path):
    c = _saved(tmp_path, "dense", shards=3)
    with pytest.raises(
        CheckpointError, match=r"n_layers is 1 but the shards of .*index\.json holds layers 0\.\.1"
    ):
        load_weights(tmp_path, tiny("dense", n_layers=1))
    # A tensor a shard holds but the index does not list is still part of the checkpoint.
    shard = tmp_path / "model-00003-of-00003.safetensors"
    raw = load_file(shard)
    raw["model.transformer.blocks.0.extra.weight"] = torch.zeros(4)
    save_file(raw, shard)
    with pytest.raises(
        CheckpointError,
        match=r"model-00003-of-00003\.safetensors: unexpected tensor "
        r"'model\.transformer\.blocks\.0\.extra\.weight'",
    ):
        load_weights(tmp_path, c)


def test_index_entries_must_be_file_names(tmp_path):
    _saved(tmp_path, "moe", shards=2)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["lm_head.weight"] = "../elsewhere.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"weight_map\['lm_head\.weight'\] = '\.\./elsewhere"):
        load_weights(tmp_path, tiny("moe"))


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(mask_token_id=97), r"mask_token_id is 97 but vocab_size is 97"),
        (
            {"mask_token_id": None},
            r"mask_token_id is 156895 \(absent, so the release's default\) but vocab_size is 97",
        ),
        (dict(pad_token_id=96), r"mask_token_id and pad_token_id are both 96"),
        (dict(rope_theta=float("inf")), r"rope_theta=inf must be a positive number"),
        (dict(architectures="LLaDAMoEModelLM"), r"architectures='LLaDAMoEModelLM' must be a list"),
        (dict(moe_router_enable_expert_bias=1), r"moe_router_enable_expert_bias=1 must be true or false"),
    ],
)
def test_config_values_name_file_and_key(changes, message):
    with pytest.raises(CheckpointError, match=r"^my/config\.json: " + message):
        ModelConfig.from_hf(dict(TINY_MOE, **changes), file="my/config.json")
