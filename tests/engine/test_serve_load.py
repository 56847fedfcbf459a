"""Load: 32 concurrent streaming clients (the official `openai` async client) for ~30 s against
`dinfer serve --max-batch 32` on the embedded model. Nothing is lost and nothing fails; every answer
equals LLM.generate's for that prompt alone (batch invariance: at T = 0 and sampled with a seed,
through every lane: the checkpoint's blocks, blocks of 4, sampling); the server's metrics count what
the clients received."""

import asyncio
import math
import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from helpers.serving import MODEL, dinfer_serve  # noqa: E402

from dinfer import LLM  # noqa: E402
from dinfer.tasks import TASKS, eval_problems  # noqa: E402

CLIENTS = 32
SECONDS = 30.0
BLOCK = 8  # the embedded model's block_length (generation_config.json)


def specs():
    """The requests the clients cycle through: (endpoint, prompt, options)."""
    prompts = [p for t in TASKS for p, _ in eval_problems(t, 4, seed=5)]
    variants = [
        {},
        {"max_tokens": 5},
        {"extra_body": {"threshold": 0.7}},
        {"extra_body": {"block_length": 4}},
        {"temperature": 0.8, "seed": 3},
        {"stop": ["1"]},
    ]
    return [
        ("chat" if i % 3 else "completions", p, variants[i % len(variants)]) for i, p in enumerate(prompts)
    ]


def expected(llm, endpoint, prompt, options):
    """(text, completion tokens, finish reason) LLM.generate gives the request's prompt alone."""
    options = dict(options)
    extra = options.pop("extra_body", {})
    max_tokens = options.pop("max_tokens", 32)
    block = extra.get("block_length", BLOCK)
    chat = endpoint == "chat"
    text = prompt if chat else f"<|bos|>{prompt}<|assistant|>"
    out = llm.generate(text, chat=chat, gen_length=math.ceil(max_tokens / block) * block, **extra, **options)
    ids = out.token_ids[0][:max_tokens]
    text = llm.tokenizer.decode(ids) if len(ids) < len(out.token_ids[0]) else out.texts[0]
    return text, len(ids), "length" if len(out.token_ids[0]) >= max_tokens else "stop"


async def one(client, endpoint, prompt, options):
    """(text, finish_reason, usage) of a streamed request."""
    if endpoint == "chat":
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], stream=True, **options
        )
    else:
        stream = await client.completions.create(
            model=MODEL, prompt=f"<|bos|>{prompt}<|assistant|>", stream=True, **options
        )
    pieces, reason, usage = [], None, None
    async for chunk in stream:
        if chunk.choices:
            c = chunk.choices[0]
            pieces.append((c.delta.content if endpoint == "chat" else c.text) or "")
            reason = c.finish_reason or reason
        if chunk.usage is not None:
            usage = chunk.usage
    return "".join(pieces), reason, usage


@pytest.mark.slow  # measured 30-110 s each on a 2-core CPU (.ci/run --durations)
def test_32_streaming_clients_lose_nothing_and_decode_as_alone():
    cases = specs()
    llm = LLM()
    want = [expected(llm, *case) for case in cases]
    server = dinfer_serve("--max-batch", "32", "--log-level", "warning")
    try:
        results, errors = [], []

        async def client_loop(i, deadline):
            client = openai.AsyncOpenAI(
                base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300
            )
            k = i
            while time.monotonic() < deadline or k < i + 2:  # at least two requests each
                j = k % len(cases)
                try:
                    results.append((j, *await one(client, *cases[j])))
                except Exception as e:  # counted, then asserted none
                    errors.append((j, repr(e)))
                k += 1
            await client.close()

        async def run():
            deadline = time.monotonic() + SECONDS
            await asyncio.gather(*(client_loop(i, deadline) for i in range(CLIENTS)))

        t0 = time.monotonic()
        asyncio.run(run())
        seconds = time.monotonic() - t0
        m = server.metrics()
    finally:
        server.stop()
    assert not errors, errors[:3]
    assert len(results) >= 2 * CLIENTS
    wrong = [(cases[j], text, want[j][0]) for j, text, _, _ in results if text != want[j][0]]
    assert not wrong, f"{len(wrong)} of {len(results)} answers differ from the prompt's alone: {wrong[:3]}"
    for j, _, reason, usage in results:
        assert (usage.completion_tokens, reason) == want[j][1:]
    answered = sum(v for k, v in m.items() if k.startswith("dinfer_requests_total") and "outcome" in k)
    assert answered == len(results)
    assert m["dinfer_completion_tokens_total"] == sum(u.completion_tokens for *_, u in results)
    assert m["dinfer_prompt_tokens_total"] == sum(u.prompt_tokens for *_, u in results)
    assert m["dinfer_forwards_total"] == sum(u.forwards for *_, u in results)
    assert m["dinfer_time_to_first_block_seconds_count"] == len(results)
    assert m["dinfer_in_flight"] == m["dinfer_queue_depth"] == m["dinfer_active_requests"] == 0
    assert not [k for k in m if k.startswith("dinfer_rejected_requests_total")]
    assert m["dinfer_engine_failed_total"] == 0
    print(f"{len(results)} requests from {CLIENTS} clients in {seconds:.1f} s")
