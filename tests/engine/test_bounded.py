"""Every generation ends: non-finite logits stop a run with NonFiniteLogitsError within a
chunk, a block never outlives its length in forwards, and seeded sampling is keyed on the request,
not its slot in the batch."""

import shutil
import subprocess
import sys

import pytest
import torch
from conftest import ROOT
from helpers.engine_models import MOE, ScriptedModel, model_of, run
from safetensors.torch import load_file, save_file

import dinfer.decoders
from dinfer import LLM, NonFiniteLogitsError
from dinfer.decoders import DecoderConfig
from dinfer.generate import GenerationConfig, generate
from dinfer.models.embedded import model_dir

PROMPT = "add:048213+000937"
UNROLL = GenerationConfig().unroll  # forwards between two host checks


class Runaway(AssertionError):
    """A loop that would never end: raised by a guard instead of hanging the test."""


def guarded(model, limit=200):
    """Counts model.forward calls in model.calls; raises Runaway past `limit`."""
    forward = model.forward
    model.calls = 0

    def counted(*args, **kw):
        model.calls += 1
        if model.calls > limit:
            raise Runaway(f"{model.calls} forwards: the loop does not end")
        return forward(*args, **kw)

    model.forward = counted
    return model


@pytest.fixture(scope="module")
def nan_checkpoint(tmp_path_factory):
    """The embedded tiny-llada-moe with every weight NaN (a corrupt download, a bad conversion)."""
    path = tmp_path_factory.mktemp("nan-llada-moe") / "model"
    shutil.copytree(model_dir("tiny-llada-moe"), path)
    weights = load_file(path / "model.safetensors")
    save_file(
        {k: torch.full_like(v, float("nan")) if v.is_floating_point() else v for k, v in weights.items()},
        str(path / "model.safetensors"),
    )
    return str(path)


def test_nan_weights_stop_with_a_clear_error_via_llm(nan_checkpoint):
    llm = LLM(nan_checkpoint, device="cpu")
    guarded(llm.model)
    with pytest.raises(NonFiniteLogitsError, match=r"non-finite logits .* at forward 1 of prompt 0, block 0"):
        llm.generate(PROMPT)
    assert llm.model.calls <= UNROLL  # the chunk that met them, no more


def test_nan_weights_stop_with_a_clear_error_via_cli(nan_checkpoint):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dinfer",
            "generate",
            "--prompt",
            PROMPT,
            "--model",
            nan_checkpoint,
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "non-finite logits" in lines[0] and "forward 1 of prompt 0" in lines[0], (
        proc.stderr
    )


@pytest.mark.gpu
def test_nan_weights_stop_on_a_gpu_with_cuda_graphs(nan_checkpoint):
    """The flags accumulate in place on the device and are read at the chunk's sync, under capture
    and replay too (bf16, the GPU default)."""
    llm = LLM(nan_checkpoint, device="cuda")
    guarded(llm.model)
    with pytest.raises(NonFiniteLogitsError, match=r"at forward 1 of prompt 0, block 0"):
        llm.generate([PROMPT, PROMPT + "1"], cuda_graphs=True)
    assert llm.model.calls <= UNROLL


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_logits_that_turn_non_finite_later_stop_the_run(value):
    """A model whose activations overflow only after a few forwards: the error names that forward,
    at most one chunk later; a clean run of the same model needs more forwards than that."""
    clean = guarded(model_of(MOE, scale=20))
    kw = dict(gen_length=32, decoder=DecoderConfig(threshold=0.99), cache="vicinity", early_stop=False)
    _, stats = run(clean, [[4, 5, 6]], **kw)
    bad_from = 4
    assert stats.forwards > bad_from + UNROLL
    model = guarded(model_of(MOE, scale=20))
    forward = model.forward

    def overflowing(*args, **kwargs):
        logits = forward(*args, **kwargs)
        if model.calls >= bad_from:
            logits[0, 7] = value
        return logits

    model.forward = overflowing
    with pytest.raises(NonFiniteLogitsError, match=f"at forward {bad_from} of prompt 0"):
        run(model, [[4, 5, 6]], **kw)
    assert bad_from <= model.calls < bad_from + UNROLL


class PoisonedAt(ScriptedModel):
    """ScriptedModel whose logits are NaN at one absolute position."""

    def __init__(self, position):
        super().__init__(lambda p: torch.full_like(p, 5))
        self.position = position

    def forward(
        self, emb, pos, cache, seq_lens, write_back=True, logits_rows=None, block_mask=None, block_table=None
    ):
        logits = super().forward(emb, pos, cache, seq_lens, write_back, logits_rows, block_mask, block_table)
        flat = pos.flatten() if logits_rows is None else pos.flatten()[logits_rows]
        logits[flat == self.position] = float("nan")
        return logits


def test_the_error_names_the_prompt_and_ignores_padding_rows():
    """Only prompt 1 (20 tokens, blocks at 16, 24, 32) reaches position 30, in its block 1. Prompt 0
    (2 tokens + 16) has padding rows at positions 18..23 whose logits the model may spoil freely."""
    with pytest.raises(NonFiniteLogitsError, match=r"of prompt 1, block 1"):
        run(guarded(PoisonedAt(30)), [[1, 2], [3] * 20], gen_length=16, early_stop=False)
    out, _ = run(guarded(PoisonedAt(20)), [[1, 2]], gen_length=16, early_stop=False)
    assert out[0] == [5] * 16


def test_a_block_never_takes_more_forwards_than_its_length(monkeypatch):
    """The loop's invariant, with a decode step broken on purpose (it undoes every commit): an
    internal error after block_length forwards instead of a loop without end."""
    real = dinfer.decoders.dk.decode_step

    def commits_nothing(logits, tokens, *args, **kw):
        before = tokens.clone()
        out = real(logits, tokens, *args, **kw)
        tokens.copy_(before)
        return out

    monkeypatch.setattr(dinfer.decoders.dk, "decode_step", commits_nothing)
    model = guarded(ScriptedModel(lambda p: torch.full_like(p, 5)))
    with pytest.raises(
        RuntimeError,
        match=r"internal error: block 0 of prompt 0 is not settled \(5 left\) after 8 forwards",
    ):
        run(model, [[1, 2, 3]], gen_length=16, block_length=8)
    assert model.calls == 8


def test_seeded_sampling_is_keyed_on_the_request():
    """16 prompts at temperature 3 with a seed: the same tokens alone, in one batch, through 3 slots
    (continuous batching, compaction) and in shuffled order."""
    model = model_of(MOE, seed=4, scale=20)
    torch.manual_seed(0)
    prompts = [torch.randint(0, 58, (int(n),)).tolist() for n in torch.randint(1, 20, (16,))]
    cfg = GenerationConfig(
        gen_length=16,
        block_length=8,
        cache="vicinity",
        decoder=DecoderConfig(threshold=0.5, temperature=3.0, seed=11),
    )
    alone = [generate(model, [p], cfg)[0][0].tolist() for p in prompts]
    batch = [o.tolist() for o in generate(model, prompts, cfg)[0]]
    slots = [o.tolist() for o in generate(model, prompts, cfg, batch_size=3)[0]]
    order = torch.randperm(16).tolist()
    shuffled = [o.tolist() for o in generate(model, [prompts[i] for i in order], cfg)[0]]
    assert batch == alone and slots == alone
    assert [shuffled[order.index(i)] for i in range(16)] == alone
    other_seed = dict(cfg.decoder.__dict__, seed=12)
    reseeded = generate(
        model, prompts, GenerationConfig(**{**cfg.__dict__, "decoder": DecoderConfig(**other_seed)})
    )[0]
    assert [o.tolist() for o in reseeded] != alone  # the seed still matters


def test_copies_of_a_prompt_sample_apart():
    """n copies of one prompt in a run give n samples; the first samples as the prompt would alone."""
    model = model_of(MOE, seed=4, scale=20)
    cfg = GenerationConfig(
        gen_length=16,
        block_length=8,
        cache="vicinity",
        decoder=DecoderConfig(threshold=0.5, temperature=3.0, seed=11),
    )
    prompt = [5, 9, 17, 3]
    copies = [o.tolist() for o in generate(model, [prompt] * 4, cfg)[0]]
    assert copies[0] == generate(model, [prompt], cfg)[0][0].tolist()
    assert len({tuple(c) for c in copies}) == 4
