"""dinfer.LLM and the `dinfer generate` command on a tiny random LLaDA-MoE checkpoint in the released
HF layout (config.json, model.safetensors, tokenizer.json, tokenizer_config.json with a chat template)."""

import json
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import ROOT
from helpers.cli import EOS, MASK, TEMPLATE, VOCAB, cli, write_tokenizer

from dinfer import LLM, GenerationConfig
from dinfer.models import CheckpointError, ModelConfig, random_weights, save_checkpoint
from dinfer.models.tokenizer import Tokenizer

FAST = dict(gen_length=16, block_length=8)


def tiny_config() -> ModelConfig:
    return ModelConfig(
        family="llada_moe",
        hidden_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=4,
        head_dim=12,
        vocab_size=VOCAB,
        intermediate_size=None,
        num_experts=8,
        top_k=2,
        expert_intermediate_size=40,
        qk_norm=True,
        rope_theta=50000.0,
        rotary_dim=12,
        rms_eps=1e-5,
        max_positions=256,
        mask_id=MASK,
        eos_id=EOS,
        pad_id=EOS,
        tie_embeddings=False,
        router_renormalize=False,
        expert_bias=False,
        architectures=("LLaDAMoEModelLM",),
    )


def lively_weights(config: ModelConfig) -> dict:
    """Random weights that make varied, confident predictions. At N(0, 0.02²) attention is uniform and
    every [MASK] row predicts the same token; larger q/k make RoPE positions matter, larger outputs let
    the context move the residual stream, and a larger head separates the logits, so that a batch's
    different float rounding cannot flip a choice. EOS is made to win where token 24 nearly wins, so
    some prompts stop early (deterministically, for seed 3)."""
    w = random_weights(config, seed=3)
    for name in w:
        if name.endswith((".q", ".k")):
            w[name] *= 20
        if name.endswith((".v", ".o", ".w13", ".w2")):
            w[name] *= 10
    w["lm_head"] *= 20
    w["lm_head"][EOS] = 1.05 * w["lm_head"][24]
    return w


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llada-moe")
    config = tiny_config()
    save_checkpoint(path, config, lively_weights(config))
    write_tokenizer(path)
    return str(path)


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(ckpt, device="cpu", **FAST)


def run_cli(*args, stdin=None):
    return subprocess.run(
        [sys.executable, "-m", "dinfer", *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )


# ------------------------------------------------------------------------------------------- tokenizer


def test_tokenizer_template_encode_decode(ckpt):
    tok = Tokenizer(ckpt)
    text = tok.apply_chat_template("hello world")
    assert text == "<|startoftext|><role>USER</role>hello world<|role_end|><role>ASSISTANT</role>"
    ids = tok.encode(text)
    assert ids[:3] == [1, 2] + tok.encode("USER") and ids[-1] == 3
    assert tok.eos_id == EOS
    assert tok.decode(tok.encode("hello world") + [EOS] + tok.encode("what")) == "hello world"
    assert tok.decode([MASK] + tok.encode("two")) == "two"
    assert tok.decode([MASK] + tok.encode("two"), skip_special=False) == "<|mask|> two"


def test_chat_template_of_messages(ckpt):
    tok = Tokenizer(ckpt)
    chat = [
        {"role": "system", "content": "two"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "world", "name": "bot"},
        {"role": "user", "content": "what"},
    ]
    assert tok.apply_chat_template(chat) == (
        "<|startoftext|><role>SYSTEM</role>two<|role_end|><role>USER</role>hello<|role_end|>"
        "<role>ASSISTANT</role>world<|role_end|><role>USER</role>what<|role_end|><role>ASSISTANT</role>"
    )
    # one user message is the one-turn prompt
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == tok.apply_chat_template("hi")


@pytest.mark.parametrize(
    "messages, error, match",
    [
        ([], ValueError, "messages: empty"),
        ("hello", None, None),  # a string is one user turn, not messages
        ({"role": "user", "content": "x"}, TypeError, "messages: expected a list of messages, got dict"),
        (["hello"], TypeError, r"messages\[0\]: expected an object with role and content, got str"),
        ([{"content": "x"}], ValueError, r"messages\[0\].role: missing"),
        ([{"role": "user"}], ValueError, r"messages\[0\].content: missing"),
        ([{"role": "bot", "content": "x"}], ValueError, r"messages\[0\].role: expected one of"),
        ([{"role": "user", "content": 3}], TypeError, r"messages\[0\].content: expected a string, got int"),
        ([{"role": 1, "content": "x"}], TypeError, r"messages\[0\].role: expected a string, got int"),
        (
            [{"role": "user", "content": "x"}, {"role": "user", "content": ""}],
            ValueError,
            r"messages\[1\].content: empty",
        ),
        ([{"role": "user", "content": "x", "tool": 1}], ValueError, r"messages\[0\].tool: unknown key"),
        ([{"role": "user", "content": "x", "name": 2}], TypeError, r"messages\[0\].name: expected a string"),
    ],
)
def test_bad_chat_messages(ckpt, messages, error, match):
    tok = Tokenizer(ckpt)
    if error is None:
        assert tok.apply_chat_template(messages).endswith("hello<|role_end|><role>ASSISTANT</role>")
        return
    with pytest.raises(error, match=match):
        tok.apply_chat_template(messages)


def test_a_template_that_refuses_messages_is_the_requests_fault(ckpt, tmp_path):
    for name in os.listdir(ckpt):
        (tmp_path / name).write_bytes(open(os.path.join(ckpt, name), "rb").read())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('the first role must be user') }}"
        "{% endif %}" + TEMPLATE
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer(tmp_path)
    with pytest.raises(
        ValueError, match="messages: the checkpoint's chat template refuses them: the first role"
    ):
        tok.apply_chat_template([{"role": "system", "content": "x"}, {"role": "user", "content": "y"}])
    assert tok.apply_chat_template("hello").endswith("hello<|role_end|><role>ASSISTANT</role>")
    config["chat_template"] = "{{ raise_exception('no') }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="the chat template refuses one user turn: no"):
        Tokenizer(tmp_path).apply_chat_template("hello")


def test_tokenizer_without_template_or_config(ckpt, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes(open(os.path.join(ckpt, "tokenizer.json"), "rb").read())
    tok = Tokenizer(tmp_path)
    assert tok.apply_chat_template("hello") == "hello"
    assert tok.eos_id is None and tok.decode(tok.encode("two three")) == "two three"
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer(tmp_path / "nowhere")


# ------------------------------------------------------------------------------------------------- LLM


def test_generate_one_prompt(llm):
    r = llm.generate("what is two plus three")
    assert len(r.texts) == len(r.token_ids) == 1
    assert len(r.token_ids[0]) <= FAST["gen_length"] and EOS not in r.token_ids[0]
    assert r.texts[0] == llm.tokenizer.decode(r.token_ids[0])
    assert {
        "forwards",
        "refreshes",
        "tokens",
        "seconds",
        "tokens_per_forward",
        "tokens_per_second",
        "phase_seconds",
        "loop_overhead_fraction",
    } <= set(r.stats)
    assert r.stats["forwards"] >= r.stats["refreshes"] >= 1


def test_generate_batch_and_batch_size_splitting(llm):
    prompts = ["hello", "what is two plus three", "hello world", "two"]
    whole = llm.generate(prompts)
    assert len(whole.texts) == len(whole.token_ids) == 4
    lengths = [len(t) for t in whole.token_ids]
    assert max(lengths) == FAST["gen_length"] and min(lengths) < FAST["gen_length"]  # EOS ends some early
    assert len({tuple(t) for t in whole.token_ids}) == 4
    got = {}
    split = llm.generate(prompts, batch_size=3, on_finish=got.__setitem__)
    assert split.token_ids == whole.token_ids and split.texts == whole.texts
    assert got == dict(enumerate(split.texts))  # every prompt reported once, with its text
    singles = [llm.generate(p) for p in prompts]
    assert [s.token_ids[0] for s in singles] == whole.token_ids
    # Per-sequence forwards: equal to forwards alone; in a batch, between the singles' sum (a batch
    # also steps sequences whose block is already done) and every sequence on every forward.
    assert all(s.stats["sequence_forwards"] == s.stats["forwards"] for s in singles)
    assert (
        sum(s.stats["forwards"] for s in singles)
        <= whole.stats["sequence_forwards"]
        <= 4 * whole.stats["forwards"]
    )
    # At most 3 in flight: no forward ran more than 3 sequences, so it took more forwards.
    assert split.stats["sequence_forwards"] <= 3 * split.stats["forwards"]
    assert split.stats["forwards"] > whole.stats["forwards"]


def test_chat_template_and_pre_tokenised_prompts(llm):
    tok = llm.tokenizer
    templated = tok.encode(tok.apply_chat_template("hello world"))
    assert llm.generate("hello world").token_ids == llm.generate([templated]).token_ids
    assert (
        llm.generate("hello world", chat=False).token_ids
        == llm.generate([tok.encode("hello world")]).token_ids
    )
    # token ids as arrays: numpy or torch, one per prompt or stacked
    expected = llm.generate([templated]).token_ids
    assert llm.generate([np.array(templated)]).token_ids == expected
    assert llm.generate(torch.tensor([templated])).token_ids == expected


def test_options_defaults_and_overrides(llm):
    # Per-call options override the LLM's defaults, which override GenerationConfig's.
    r = llm.generate(
        "hello", gen_length=8, decoder="fixed", steps_per_block=4, cache="dual", align_blocks=False
    )  # one block of 8 masks in 4 steps
    assert r.stats["forwards"] == 4 and len(r.token_ids[0]) <= 8
    assert GenerationConfig().gen_length != FAST["gen_length"]
    for decoder in ("credit", "hierarchical"):
        assert len(llm.generate("hello", decoder=decoder, smoothing=True, unroll=1).texts) == 1


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(decoder="nope"), ValueError, "decoder"),
        (dict(cache="nope"), ValueError, "cache"),
        (dict(gen_length=0), ValueError, "gen_length"),
        (dict(block_length=0), ValueError, "block_length"),
        (dict(batch_size=0), ValueError, "batch_size"),
        (dict(thresold=0.5), TypeError, "thresold"),
    ],
)
def test_generate_bad_options(llm, kwargs, error, match):
    with pytest.raises(error, match=match):
        llm.generate("hello", **kwargs)


@pytest.mark.parametrize(
    "prompts,match",
    [
        ("", "empty prompt"),
        ([[]], "empty prompt"),
        ([], "at least one prompt"),
        ("hello " * 250, "exceed the model's 256 positions"),
        ([[1, VOCAB]], "outside the vocabulary"),
    ],
)
def test_generate_bad_prompts(llm, prompts, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts)


def test_llm_errors(ckpt, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(tmp_path)
    with pytest.raises(TypeError, match="block_size"):
        LLM(ckpt, block_size=8)
    with pytest.raises(ValueError, match="dtype"):
        LLM(ckpt, dtype="int8")
    for name in ("tokenizer.json", "model.safetensors"):
        broken = tmp_path / name
        broken.mkdir()
        for f in os.listdir(ckpt):
            if f != name:
                (broken / f).write_bytes(open(os.path.join(ckpt, f), "rb").read())
        with pytest.raises(FileNotFoundError, match=name):
            LLM(broken)


def test_dtype_names(ckpt):
    assert LLM(ckpt, dtype="bf16").model.dtype == torch.bfloat16
    assert LLM(ckpt, dtype=torch.float16).model.dtype == torch.float16
    assert LLM(ckpt, device="cpu").model.dtype == torch.float32


# ------------------------------------------------------------------------------------------------- CLI


def test_cli_plain_and_json(ckpt, llm):
    expected = llm.generate(["hello", "two plus three"])
    plain = run_cli(
        "generate",
        "--model",
        ckpt,
        "--prompt",
        "hello",
        "--prompt",
        "two plus three",
        "--gen-length",
        "16",
        "--block-length",
        "8",
        "--device",
        "cpu",
    )
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.splitlines() == expected.texts
    assert "tokens/forward" in plain.stderr
    js = run_cli(
        "generate", "--model", ckpt, "--gen-length", "16", "--block-length", "8", "--json", stdin="hello\n"
    )
    assert js.returncode == 0, js.stderr
    out = json.loads(js.stdout)
    assert out["token_ids"] == expected.token_ids[:1] and out["texts"] == expected.texts[:1]
    assert out["stats"]["forwards"] >= 1


@pytest.mark.parametrize(
    "args,match",
    [
        (["--decoder", "nope"], "invalid choice"),
        (["--cache", "nope"], "invalid choice"),
        (["--gen-length", "0"], "gen_length"),
        (["--dtype", "int8"], "dtype"),
        (["--batch-size", "0"], "batch_size"),
    ],
)
def test_cli_errors(ckpt, args, match):
    r = run_cli("generate", "--model", ckpt, "--prompt", "hello", *args)
    assert r.returncode == 2 and match in r.stderr and "Traceback" not in r.stderr


def test_cli_eval_rejects_a_zero_batch_size(ckpt):
    r = run_cli("eval", "--model", ckpt, "--tasks", "add", "--num-problems", "1", "--batch-size", "0")
    assert r.returncode == 2 and "batch_size" in r.stderr and "Traceback" not in r.stderr


def test_cli_serve_without_the_extra_says_how_to_install_it(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # as if not installed: importing it fails
    for name in [m for m in sys.modules if m == "dinfer.serve" or m.startswith("dinfer.serve.")]:
        monkeypatch.delitem(sys.modules, name)
    rc, _, err = cli(capsys, monkeypatch, "serve")
    assert rc == 2 and 'dinfer serve needs fastapi: pip install "dinfer[serve]"' in err


@pytest.mark.parametrize(
    "args, match", [(["--max-batch", "0"], "max_batch: must be"), (["--port", "70000"], "port: must be in")]
)
def test_cli_serve_errors(ckpt, capsys, monkeypatch, args, match):
    pytest.importorskip("fastapi")
    rc, _, err = cli(capsys, monkeypatch, "serve", "--model", ckpt, *args)
    assert rc == 2 and match in err


def test_cli_missing_checkpoint(tmp_path):
    r = run_cli("generate", "--model", str(tmp_path / "missing"), "--prompt", "hello")
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr


def test_generation_config_json_defaults(ckpt, tmp_path):
    for f in os.listdir(ckpt):
        (tmp_path / f).write_bytes(open(os.path.join(ckpt, f), "rb").read())
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"max_new_tokens": 8, "block_length": 4, "temperature": 0.6})
    )
    llm = LLM(tmp_path, device="cpu")
    assert llm.defaults == {"gen_length": 8, "block_length": 4}  # AR sampling keys do not apply
    assert max(len(t) for t in llm.generate(["hello", "two"]).token_ids) <= 8
    assert LLM(tmp_path, device="cpu", gen_length=16).defaults["gen_length"] == 16
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 0}))
    with pytest.raises(ValueError, match="max_new_tokens"):
        LLM(tmp_path, device="cpu")


# ------------------------------------------------------------------ clear errors, stop strings, CLI habits


@pytest.mark.parametrize(
    "prompts,match",
    [
        (5, "prompts: expected a string, a list of strings or a list of token-id lists, got int"),
        (
            [1, 2, 3],
            r"prompts\[0\]: expected a string or a list of token ids, got int \(one tokenised prompt",
        ),
        (["hello", [[1, 2]]], r"prompts\[1\]\[0\]: expected a token id \(int\), got list"),
        ([[1, 2.5]], r"prompts\[0\]\[1\]: expected a token id"),
        ([b"hello"], r"prompts\[0\]: expected a string or a list of token ids, got bytes"),
    ],
)
def test_generate_badly_shaped_prompts(llm, prompts, match):
    with pytest.raises(TypeError, match=match):
        llm.generate(prompts)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(decoder=3), TypeError, "decoder: expected a decoder name"),
        (dict(decoder=GenerationConfig()), TypeError, "decoder: expected a decoder name"),
        (dict(batch_size="2"), TypeError, "batch_size: expected an int"),
        (dict(stop=5), TypeError, "stop: expected a string or a list of strings"),
        (dict(stop=[""]), ValueError, r"stop\[0\]"),
    ],
)
def test_generate_bad_option_types(llm, kwargs, error, match):
    with pytest.raises(error, match=match):
        llm.generate("hello", **kwargs)


def test_stop_strings_cut_the_answer():
    llm = LLM(device="cpu")  # the embedded model: one character per token
    prompt = "add:048213+000937"
    full = llm.generate(prompt)
    text = full.texts[0]
    stop = text[3:5]
    cut = llm.generate(prompt, stop=["never there", stop])
    assert cut.texts == [text[: text.find(stop)]]
    ids = cut.token_ids[0]
    assert ids == full.token_ids[0][: len(ids)] and llm.tokenizer.decode(ids) == cut.texts[0]
    assert llm.generate(prompt, stop="never there").texts == full.texts


def test_evaluate_reports_each_task():
    from dinfer.evaluate import evaluate

    seen = []  # the embedded model: its tokenizer has the task prompts' characters
    result = evaluate(LLM(device="cpu"), "add,sort", num_problems=2, warmup=False, on_task=seen.append)
    assert [list(r["tasks"]) for r in seen] == [["add"], ["add", "sort"]]
    assert seen[0]["overall"]["problems"] == 2 and seen[-1] == result


def test_cli_one_prompt_per_line(ckpt, llm, tmp_path, capsys, monkeypatch):
    expected = llm.generate(["hello", "two plus three"]).texts
    args = ("generate", "--model", ckpt, "--gen-length", "16", "--block-length", "8", "--device", "cpu")
    rc, out, err = cli(capsys, monkeypatch, *args, stdin="hello\n\ntwo plus three\n")
    assert rc == 0, err
    assert out.splitlines() == expected and "2 prompt(s)" in err
    f = tmp_path / "prompts.txt"
    f.write_text("hello\n  \ntwo plus three\n")
    assert cli(capsys, monkeypatch, *args, "--prompts-file", str(f))[1].splitlines() == expected
    assert (
        cli(capsys, monkeypatch, *args, "--prompts-file", "-", stdin="hello\ntwo plus three")[1].splitlines()
        == expected
    )
    rc, _, err = cli(capsys, monkeypatch, *args, "--prompts-file", str(tmp_path / "none.txt"))
    assert rc == 2 and "prompts-file: cannot read" in err
    rc, _, err = cli(capsys, monkeypatch, *args, stdin="\n \n")
    assert rc == 2 and "prompts: none given" in err


def test_cli_max_new_tokens_stop_and_output(ckpt, llm, tmp_path, capsys, monkeypatch):
    prompts = ["hello", "two plus three"]
    expected = llm.generate(prompts, gen_length=8)
    stop = expected.texts[1].split()[1]
    cut = llm.generate(prompts, gen_length=8, stop=stop).texts
    out_file = tmp_path / "answers.jsonl"
    rc, out, err = cli(
        capsys,
        monkeypatch,
        "generate",
        "--model",
        ckpt,
        "--prompt",
        prompts[0],
        "--prompt",
        prompts[1],
        "--max-new-tokens",
        "8",
        "--block-length",
        "8",
        "--stop",
        stop,
        "--device",
        "cpu",
        "--output",
        str(out_file),
        "--progress",
    )
    assert rc == 0, err
    assert out.splitlines() == cut and cut != expected.texts
    lines = sorted((json.loads(line) for line in out_file.read_text().splitlines()), key=lambda d: d["index"])
    assert lines == [{"index": i, "prompt": p, "text": t} for i, (p, t) in enumerate(zip(prompts, cut))]
    assert "2/2" in err  # the progress bar


@pytest.mark.parametrize("command", ["generate", "eval"])
def test_cli_output_checked_before_the_work(ckpt, tmp_path, capsys, monkeypatch, command):
    what = ["--prompt", "hello"] if command == "generate" else ["--tasks", "add", "--num-problems", "1"]
    rc, _, err = cli(
        capsys,
        monkeypatch,
        command,
        "--model",
        ckpt,
        *what,
        "--device",
        "cpu",
        "--output",
        str(tmp_path / "nowhere" / "x.json"),
    )
    assert rc == 2 and "output: directory" in err and "does not exist" in err
    assert "1/1" not in err and "prompt(s)" not in err  # nothing ran


def test_cli_help_shows_the_defaults(ckpt, capsys, monkeypatch):
    from dinfer.models.embedded import generation_defaults, model_dir

    g = cli(capsys, monkeypatch, "generate", "--model", ckpt, "-h")[1]
    cfg = GenerationConfig()
    assert "--max-new-tokens GEN_LENGTH" in g
    for flag, value in (
        ("gen-length", cfg.gen_length),
        ("threshold", cfg.decoder.threshold),
        ("seed", cfg.decoder.seed),
        ("cache", cfg.cache),
    ):
        assert re.search(rf"--{flag} .*?\(default: {value}\)", g, re.S), flag
    embedded = cli(capsys, monkeypatch, "generate", "-h")[1]  # the embedded model's generation_config.json
    assert re.search(
        rf"--gen-length .*?\(default: {generation_defaults(model_dir(None))['gen_length']}\)", embedded, re.S
    )
    e = cli(capsys, monkeypatch, "eval", "-h")[1]
    assert re.search(r"--batch-size .*?\(default: 1\)", e, re.S) and "(default: None)" not in g + e


def test_cli_no_chat_empty_answer_hint(capsys, monkeypatch):
    rc, out, err = cli(
        capsys,
        monkeypatch,
        "generate",
        "--prompt",
        "add:048213+000937",
        "--no-chat",
        "--device",
        "cpu",
        "--json",
    )
    assert rc == 0, err
    assert json.loads(out)["texts"] == [""]
    assert "trained on prompts in its chat template" in err


def test_cli_ctrl_c_keeps_finished_answers(ckpt, llm):
    prompts = [f"hello w{i}" for i in range(40)]
    options = dict(gen_length=64, block_length=8, early_stop=False)
    first = llm.generate(prompts[:1], **options).texts[0]
    args = [
        sys.executable,
        "-m",
        "dinfer",
        "generate",
        "--model",
        ckpt,
        "--batch-size",
        "1",
        "--no-early-stop",
        "--gen-length",
        "64",
        "--block-length",
        "8",
    ]
    for p in prompts:
        args += ["--prompt", p]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        line = proc.stdout.readline()  # the first answer, printed as soon as it is done
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert line.rstrip("\n") == first
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == [err.strip()] and err.startswith("dinfer: interrupted;")
    assert "answer(s) printed" in err and "Traceback" not in err
    assert len(rest.splitlines()) < len(prompts) - 1


def test_cli_ctrl_c_with_json_prints_the_finished_answers(capsys):
    """--json prints at the end; interrupted, it prints the answers finished so far (null the rest)."""
    from dinfer.cli import _interrupted, _parser, _Printer
    from dinfer.evaluate import Progress

    args = _parser(None).parse_args(["generate", "--json", "--prompt", "a", "--prompt", "b", "--prompt", "c"])
    printer = _Printer(["a", "b", "c"], False, None, Progress(3, False))
    printer(1, "second")
    line = _interrupted(args, {"printer": printer})
    assert json.loads(capsys.readouterr().out) == {"texts": [None, "second", None], "interrupted": True}
    assert line == "dinfer: interrupted; 1 answer(s) printed"
