"""`dinfer serve` through the official `openai` client and raw HTTP: answers equal to LLM.generate's
at T = 0, OpenAI's streaming format, the usage docs' examples, malformed requests refused with a 4xx
naming the field (the server healthy after each), and property-based requests over the request
models that never get a 5xx.

One server for the module: `python -m dinfer serve --port P` (the embedded model, no other flag) in a
subprocess on 127.0.0.1, stopped at the end."""

import json
import re
import subprocess
import sys

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from helpers.serving import MODEL, ROOT, dinfer_serve, get, parse_metrics, sse_events  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from dinfer import LLM  # noqa: E402
from dinfer.serve import protocol as P  # noqa: E402
from dinfer.tasks import TASKS, eval_problems  # noqa: E402

PROMPTS = [p for t in TASKS for p, _ in eval_problems(t, 2)]


@pytest.fixture(scope="module")
def server():
    s = dinfer_serve()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def llm():
    return LLM()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def raw(prompt: str) -> str:
    """A completion prompt: the chat template written out, as the embedded models were trained."""
    return f"<|bos|>{prompt}<|assistant|>"


def post(server, path, body=None, content=None, headers=None, **kw):
    return httpx.post(server.url + path, json=body, content=content, headers=headers, timeout=120, **kw)


def chat_stream(client, prompt, **kw):
    """(content pieces, finish chunks, usage chunk) of a streamed chat completion."""
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], stream=True, **kw
        )
    )
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    return pieces, chunks


# ------------------------------------------------------------------------------------------ answers


@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_llm_generate(server, client, llm, stream):
    expected = llm.generate(PROMPTS)
    for prompt, text, ids in zip(PROMPTS, expected.texts, expected.token_ids):
        if stream:
            pieces, chunks = chat_stream(client, prompt)
            got, usage = "".join(pieces), chunks[-1].usage
            assert chunks[0].choices[0].delta.role == "assistant"
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
        else:
            r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}])
            got, usage = r.choices[0].message.content, r.usage
            assert r.choices[0].finish_reason == "stop" and r.object == "chat.completion"
        assert got == text, prompt
        assert usage.completion_tokens == len(ids) and usage.prompt_tokens == len(
            llm.tokenizer.encode(llm.tokenizer.apply_chat_template(prompt))
        )
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert usage.forwards >= 1 and usage.tokens_per_forward == round(len(ids) / usage.forwards, 4)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_take_the_prompt_as_is(server, client, llm, stream):
    prompts = PROMPTS[::3]
    expected = llm.generate([raw(p) for p in prompts], chat=False)
    for prompt, text in zip(prompts, expected.texts):
        if stream:
            chunks = list(client.completions.create(model=MODEL, prompt=raw(prompt), stream=True))
            got = "".join(c.choices[0].text for c in chunks if c.choices)
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
            assert chunks[-1].usage.completion_tokens == len(llm.tokenizer.encode(text))
        else:
            got = client.completions.create(model=MODEL, prompt=raw(prompt)).choices[0].text
        assert got == text
    # token ids, and one prompt in a list, are the same prompt
    ids = llm.tokenizer.encode(raw(prompts[0]))
    for prompt in (ids, [ids], [raw(prompts[0])]):
        assert client.completions.create(model=MODEL, prompt=prompt).choices[0].text == expected.texts[0]
    # without the template the embedded models end at once (they were trained on templated prompts)
    r = client.completions.create(model=MODEL, prompt=prompts[0])
    assert r.choices[0].text == llm.generate(prompts[0], chat=False).texts[0]


def test_the_stream_sends_each_committed_block_once_in_openais_format(server, llm):
    prompt = "chain:7++-+---+"
    expected = llm.generate(prompt, block_length=2).texts[0]
    body = dict(model=MODEL, messages=[{"role": "user", "content": prompt}], stream=True, block_length=2)
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    assert text.endswith("data: [DONE]\n\n") and all(
        part.startswith("data: ") for part in text.split("\n\n") if part
    )
    events = sse_events(text.split("\n\n"))
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL for c in chunks)
    assert len({c["id"] for c in events[:-1]}) == 1
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant" and all("role" not in d for d in deltas[1:])
    pieces = [d.get("content", "") for d in deltas]
    # incremental deltas, block by block (blocks of 2 tokens: several), never the cumulative text
    assert "".join(pieces) == expected and len([p for p in pieces if p]) >= len(expected) // 2
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["stop"]
    assert deltas[-1] == {}
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(expected)
    # stream_options.include_usage = false leaves the usage chunk out
    body["stream_options"] = {"include_usage": False}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        events = sse_events(r.read().decode().split("\n\n"))
    assert events[-1] == "[DONE]" and all(e["choices"] for e in events[:-1])


def test_max_tokens_stop_strings_and_sampling(server, client, llm):
    prompt = "chain:6++++-+++"
    # max_tokens: decoded as a whole block (the checkpoint's 8), cut back to 3 tokens
    whole = llm.generate(prompt, gen_length=8).token_ids[0]
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=3
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    assert r.choices[0].message.content == llm.tokenizer.decode(whole[:3])
    pieces, chunks = chat_stream(client, prompt, max_completion_tokens=3)
    assert "".join(pieces) == r.choices[0].message.content and chunks[-1].usage.completion_tokens == 3
    # a stop string ends the answer before it, as LLM.generate's stop does
    answer = llm.generate(prompt).texts[0]
    stop = answer[3:5]
    cut = llm.generate(prompt, stop=stop)
    for stream in (False, True):
        if stream:
            pieces, chunks = chat_stream(client, prompt, stop=[stop, "zz"])
            text, reason, usage = "".join(pieces), chunks[-2].choices[0].finish_reason, chunks[-1].usage
        else:
            r = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": prompt}], stop=stop
            )
            text, reason, usage = r.choices[0].message.content, r.choices[0].finish_reason, r.usage
        assert (text, reason) == (cut.texts[0], "stop") and usage.completion_tokens == len(cut.token_ids[0])
    # sampling: a seeded request samples what LLM.generate samples for the prompt alone
    sampled = llm.generate(PROMPTS, temperature=0.9, seed=11)
    for prompt, text in zip(PROMPTS[:4], sampled.texts):
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0.9, seed=11
        )
        assert r.choices[0].message.content == text
    # the dLLM extras are the config classes' options
    options = dict(block_length=4, threshold=0.7, decoder="credit", cache="dual")
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], extra_body=options
    )
    assert r.choices[0].message.content == llm.generate(PROMPTS[0], **options).texts[0]
    joint = dict(decoder="joint", threshold=0.7, edit_threshold=0.5, max_post_edit_steps=2)
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[1]}], extra_body=joint
    )
    assert r.choices[0].message.content == llm.generate(PROMPTS[1], **joint).texts[0]


def test_conversations_take_the_chat_template(server, client, llm):
    messages = [
        {"role": "system", "content": "add:"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "000232+"}, {"type": "text", "text": "072753"}],
        },
    ]
    r = client.chat.completions.create(model=MODEL, messages=messages)
    flat = [{"role": "system", "content": "add:"}, {"role": "user", "content": "000232+072753"}]
    ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(flat))
    assert r.usage.prompt_tokens == len(ids) and r.choices[0].message.content == llm.generate([ids]).texts[0]


def test_models_health_metrics_and_openapi(server, client):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert get(server.url + "/health") == (200, json.dumps({"status": "ok"}, separators=(",", ":")))
    status, text = get(server.url + "/metrics")
    assert status == 200
    m = parse_metrics(text)
    for name in (
        "dinfer_prompt_tokens_total",
        "dinfer_completion_tokens_total",
        "dinfer_forwards_total",
        "dinfer_tokens_per_forward",
        "dinfer_queue_depth",
        "dinfer_in_flight",
        "dinfer_request_latency_seconds_count",
        "dinfer_time_to_first_block_seconds_count",
        "dinfer_block_interval_seconds_count",
        "dinfer_engine_rounds_total",
    ):
        assert name in m, name
    spec = json.loads(get(server.url + "/openapi.json")[1])
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"):
        assert path in spec["paths"], path
    chat = spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    for field in (
        "messages",
        "max_tokens",
        "temperature",
        "seed",
        "stop",
        "n",
        "stream",
        "block_length",
        "threshold",
        "decoder",
        "cache",
    ):
        assert field in chat, field


def test_the_usage_docs_serve_examples_work(server):
    """docs/usage.md's Serve section: its curl and Python examples, run against this server."""
    usage = (ROOT / "docs" / "usage.md").read_text()
    section = usage.split("\n## Serve\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, re.S)
    shell = [b for lang, b in blocks if lang == "bash" and "curl" in b]
    python = [b for lang, b in blocks if lang == "python"]
    assert shell and python
    port = str(server.port)
    for code in shell:
        out = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", code.replace("8000", port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        assert '"finish_reason":"stop"' in out.stdout and "data: [DONE]" in out.stdout
    for code in python:
        out = subprocess.run(
            [sys.executable, "-c", code.replace("8000", port)], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        assert "0049150" in out.stdout  # the add example's answer


# ------------------------------------------------------------------------------------------ bad requests

CHAT = "/v1/chat/completions"
DONE = "/v1/completions"
MSG = [{"role": "user", "content": "add:000232+072753"}]


def chat(**kw):
    return {"model": MODEL, "messages": MSG, **kw}


def completion(**kw):
    return {"model": MODEL, "prompt": raw("sort:isvma"), **kw}


BAD = [
    # (path, JSON body or raw bytes, status, the field named, words of the message)
    (CHAT, b'{"model": ', 400, None, "not valid JSON"),
    (CHAT, b"[1, 2]", 400, None, "must be a JSON object"),
    (CHAT, b"", 400, None, "must be a JSON object"),
    (CHAT, {"messages": MSG}, 400, "model", "required"),
    (CHAT, dict(chat(), model="gpt-4"), 404, "model", "not served here"),
    (CHAT, {"model": MODEL}, 400, "messages", "required"),
    (CHAT, chat(messages=[]), 400, "messages", "empty"),
    (CHAT, chat(messages="hi"), 400, "messages", "valid list"),
    (CHAT, chat(messages=[{"role": "robot", "content": "x"}]), 400, "messages[0].role", "'user'"),
    (CHAT, chat(messages=[{"role": "user", "content": 7}]), 400, "messages[0].content", "a string"),
    (CHAT, chat(messages=[{"role": "user", "content": ""}]), 400, "messages[0].content", "empty"),
    (CHAT, chat(messages=[{"role": "user"}]), 400, "messages[0].content", "required"),
    (
        CHAT,
        chat(messages=[{"role": "user", "content": "caf\u00e9"}]),
        400,
        "messages",
        "not in the vocabulary",
    ),
    (CHAT, chat(max_tokens="10"), 400, "max_tokens", "valid integer"),
    (CHAT, chat(max_tokens=0), 400, "max_tokens", "greater than or equal to 1"),
    (CHAT, chat(max_tokens=10**6), 400, "max_tokens", "exceed the 256 positions"),
    (CHAT, chat(max_tokens=4, max_completion_tokens=5), 400, "max_completion_tokens", "differs"),
    (CHAT, chat(temperature=-1), 400, "temperature", "must be in"),
    (CHAT, chat(temperature="hot"), 400, "temperature", "valid number"),
    (CHAT, chat(seed=-1), 400, "seed", "must be in"),
    (CHAT, chat(decoder="beam"), 400, "decoder", "expected one of"),
    (CHAT, chat(cache="paged"), 400, "cache", "bidirectional model"),
    (CHAT, chat(threshold=1.5), 400, "threshold", "must be in"),
    (CHAT, chat(block_length=0), 400, "block_length", "must be in"),
    (CHAT, chat(block_length=True), 400, "block_length", "valid integer"),
    (CHAT, chat(edit_threshold=0.5), 400, "edit_threshold", "only the joint decoder"),
    (CHAT, chat(decoder="joint", edit_threshold="x"), 400, "edit_threshold", "valid number"),
    (CHAT, chat(decoder="joint", max_post_edit_steps=-1), 400, "max_post_edit_steps", "must be in"),
    (CHAT, chat(n=2), 400, "n", "only n = 1"),
    (CHAT, chat(stop=5), 400, "stop", "a string or a list of strings"),
    (CHAT, chat(stop=[""]), 400, "stop", "empty stop string"),
    (CHAT, chat(stop=[None]), 400, "stop", "got a list of nulls"),
    (CHAT, chat(stream="yes"), 400, "stream", "valid boolean"),
    (CHAT, chat(top_p=0.5), 400, "top_p", "only 1.0"),
    (CHAT, chat(logprobs=True), 400, "logprobs", "only False"),
    (CHAT, chat(stream_options={"include_usage": 1}), 400, "stream_options.include_usage", "valid boolean"),
    (CHAT, chat(beam_width=4), 400, "beam_width", "unknown field"),
    (DONE, completion(prompt=""), 400, "prompt", "empty"),
    (DONE, completion(prompt=[]), 400, "prompt", "empty"),
    (DONE, completion(prompt=["a", "b"]), 400, "prompt", "one prompt per request"),
    (DONE, completion(prompt=[5, 999]), 400, "prompt", "outside the vocabulary"),
    (DONE, completion(prompt=[1, "a"]), 400, "prompt", "a mixed list"),
    (DONE, completion(prompt="a" * 300), 400, "prompt", "leave no room"),
    (DONE, completion(echo=True), 400, "echo", "only False"),
    (DONE, completion(suffix="x"), 400, "suffix", "not supported"),
]


@pytest.mark.parametrize(
    "path, body, status, param, words", BAD, ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)]
)
def test_a_malformed_request_gets_a_4xx_naming_the_field(server, path, body, status, param, words):
    if isinstance(body, bytes):
        r = post(server, path, content=body, headers={"content-type": "application/json"})
    else:
        r = post(server, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    if param is not None:
        assert error["message"].startswith(param.split("[")[0])
    assert get(server.url + "/health")[0] == 200


def test_other_bad_requests(server):
    # a body over the limit is refused before it is read
    r = post(server, CHAT, content=b"x" * (9 << 20), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "exceeds" in r.json()["error"]["message"]
    r = httpx.get(server.url + CHAT)
    assert r.status_code == 405 and r.json()["error"]["message"] == "Method Not Allowed"
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    # a client that sends half a request and hangs up does not stall the server
    import socket

    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b'POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n{"model"')
    assert get(server.url + "/health")[0] == 200
    rejected = parse_metrics(get(server.url + "/metrics")[1])
    assert rejected['dinfer_rejected_requests_total{status="400"}'] >= len([b for b in BAD if b[2] == 400])


# ------------------------------------------------------------------------------------------ properties

FIELDS = [
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "temperature",
    "seed",
    "stop",
    "n",
    "stream",
    "block_length",
    "threshold",
    "decoder",
    "cache",
    "top_p",
    "user",
    "logprobs",
    "junk",
]
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 300) | st.floats(-2, 3) | st.text("ab:+0S ", max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(["role", "content", "x"]), inner, max_size=3)
    ),
    max_leaves=6,
)
GOOD = {
    "model": st.just(MODEL),
    "messages": st.just(MSG),
    "prompt": st.sampled_from([raw("sort:isvma"), [2, 33, 41, 16, 3]]),
    "max_tokens": st.integers(1, 12),
    "temperature": st.sampled_from([0, 0.5]),
    "seed": st.integers(0, 3),
    "stop": st.sampled_from(["0", ["a", "b"]]),
    "n": st.just(1),
    "stream": st.booleans(),
    "block_length": st.sampled_from([4, 8]),
    "threshold": st.sampled_from([0.5, 0.9]),
    "decoder": st.sampled_from(["threshold", "credit"]),
    "cache": st.sampled_from(["vicinity", "dual"]),
    "top_p": st.just(1),
    "user": st.just("me"),
    "logprobs": st.none(),
    "junk": JSON,
}


KNOWN = {*P.ChatCompletionRequest.model_fields, *P.CompletionRequest.model_fields, "junk"}


@st.composite
def bodies(draw):
    body = {}
    for field in FIELDS:
        choice = draw(st.sampled_from(["good", "good", "bad", "absent"]))
        if choice == "good":
            body[field] = draw(GOOD[field])
        elif choice == "bad":
            body[field] = draw(JSON)
    if draw(st.booleans()):
        body.pop("junk", None)
    return draw(st.sampled_from([CHAT, DONE])), body


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(bodies())
def test_any_request_is_answered_or_refused_with_a_4xx(server, case):
    path, body = case
    r = post(server, path, body)
    assert r.status_code == 200 or 400 <= r.status_code < 500, (body, r.text)
    if r.status_code != 200:
        error = P.ErrorResponse.model_validate(r.json()).error
        # the field named is one of the request's (sent, or required and missing), or none (the body)
        assert error.message and (error.param is None or re.split(r"[\[.]", error.param)[0] in KNOWN)
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = sse_events(r.text.split("\n\n"))
        assert events[-1] == "[DONE]"
        model = P.ChatCompletionChunk if path == CHAT else P.Completion
        for e in events[:-1]:
            model.model_validate(e)
    else:
        (P.ChatCompletion if path == CHAT else P.Completion).model_validate(r.json())
    assert get(server.url + "/health")[0] == 200
