"""The server's slots under clients that leave, too many requests and answers that end early: a
disconnect (mid-stream, waiting for a whole answer, or still queued) frees its slot at the next
block boundary; past --max-queue a request gets 429 with Retry-After, and 503 when every lane is
busy with other settings; a stop string ends the request in the engine, not only the answer. The
server stays up and serves the next requests.

The server runs the embedded model with EOS suppressed (tests/helpers/endless_server.py): a request
with a large max_tokens and blocks of 2 tokens stays in flight for ~100 rounds, long enough to act
on it while it runs. One slot, two queued requests, one lane."""

import asyncio
import json
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from helpers.serving import MODEL, endless_serve  # noqa: E402

CANCELLED = 'dinfer_requests_total{endpoint="chat",outcome="cancelled"}'
LONG = dict(max_tokens=200, block_length=2)


@pytest.fixture(scope="module")
def server():
    s = endless_serve("--max-batch", "1", "--max-queue", "2", "--max-lanes", "1", "--log-level", "warning")
    yield s
    s.stop()


def body(prompt="sort:hfgthrjs", stream=True, **kw):
    return dict(model=MODEL, messages=[{"role": "user", "content": prompt}], stream=stream, **{**LONG, **kw})


def wait_for(server, check, timeout=60.0):
    """The metrics once check(metrics) holds; fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if check(m):
            return m
        assert time.monotonic() < deadline, f"metrics never got there: {m}"
        time.sleep(0.05)


def idle(m) -> bool:
    return m["dinfer_in_flight"] == 0 and m["dinfer_queue_depth"] == 0 and m["dinfer_active_requests"] == 0


def short_request_works(server):
    r = httpx.post(server.url + "/v1/chat/completions", json=body(stream=False, max_tokens=4), timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 4


def test_a_client_that_disconnects_frees_its_slot(server):
    before = server.metrics()
    # mid-stream: the first block's chunk, then the connection closes
    with (
        httpx.Client(timeout=60) as c,
        c.stream("POST", server.url + "/v1/chat/completions", json=body()) as r,
    ):
        assert r.status_code == 200
        first = next(r.iter_lines())  # then the line iterator is dropped, which closes the connection
        assert first.startswith("data: ")
    m = wait_for(server, lambda m: m[CANCELLED] == before.get(CANCELLED, 0) + 1 and idle(m))
    assert m["dinfer_engine_cancelled_total"] == before["dinfer_engine_cancelled_total"] + 1
    # it left after a few of its 100 blocks, not at its end
    assert m["dinfer_engine_rounds_total"] - before["dinfer_engine_rounds_total"] < 50
    short_request_works(server)
    # waiting for a whole answer: the client gives up after a second
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=body(stream=False), timeout=1.0)
    wait_for(server, lambda m: m[CANCELLED] == before.get(CANCELLED, 0) + 2 and idle(m))
    short_request_works(server)


def test_past_max_queue_a_request_gets_429_and_the_queued_ones_can_leave(server):
    before = server.metrics()

    async def run():
        async def hold():  # a streamed request that stays until cancelled
            async with httpx.AsyncClient(timeout=120) as c:
                async with c.stream("POST", server.url + "/v1/chat/completions", json=body()) as r:
                    async for _ in r.aiter_lines():
                        pass

        held = []
        for _ in range(3):  # one in the slot, two queued (the queue's bound)
            held.append(asyncio.create_task(hold()))
            n = len(held)
            await asyncio.to_thread(
                wait_for, server, lambda m: m["dinfer_in_flight"] + m["dinfer_queue_depth"] == n
            )
        m = server.metrics()
        assert (m["dinfer_in_flight"], m["dinfer_queue_depth"]) == (1, 2)
        async with httpx.AsyncClient(timeout=60) as c:
            r = await c.post(server.url + "/v1/chat/completions", json=body(stream=False))
        for task in held:  # the clients go away: the queued requests leave at once, the running one
            task.cancel()  # at its next block boundary
        await asyncio.gather(*held, return_exceptions=True)
        return r

    r = asyncio.run(run())
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    error = r.json()["error"]
    assert error["type"] == "rate_limit_error" and "max_queue 2" in error["message"]
    m = wait_for(server, lambda m: idle(m) and m[CANCELLED] == before.get(CANCELLED, 0) + 3)
    assert (
        m['dinfer_rejected_requests_total{status="429"}']
        == before.get('dinfer_rejected_requests_total{status="429"}', 0) + 1
    )
    short_request_works(server)


def test_a_request_for_a_busy_lane_gets_503(server):
    with (
        httpx.Client(timeout=60) as c,
        c.stream("POST", server.url + "/v1/chat/completions", json=body()) as r,
    ):
        assert r.status_code == 200, r.read()
        lines = r.iter_lines()  # kept: a dropped line iterator closes the connection
        assert '"content"' in next(lines)  # running, in the only lane (blocks of 2)
        other = httpx.post(
            server.url + "/v1/chat/completions", json=body(stream=False, block_length=4), timeout=60
        )
    assert other.status_code == 503 and other.headers["retry-after"] == "1"
    assert "lanes" in other.json()["error"]["message"]
    wait_for(server, idle)
    # with the lane idle, the other configuration takes it
    r = httpx.post(server.url + "/v1/chat/completions", json=body(stream=False, block_length=4, max_tokens=8))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_ends_the_request_in_the_engine(server, stream):
    full = httpx.post(
        server.url + "/v1/chat/completions", json=body(stream=False, max_tokens=64), timeout=60
    ).json()
    text, forwards = full["choices"][0]["message"]["content"], full["usage"]["forwards"]
    assert len(text) == 64  # one character per token; no EOS
    stop = text[10:12]
    before = server.metrics()
    b = body(stream=stream, max_tokens=64, stop=[stop])
    if stream:
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=b, timeout=60) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: {")]
        chunks = [json.loads(line[6:]) for line in lines]
        got = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        reason = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
        usage = chunks[-1]["usage"]
    else:
        out = httpx.post(server.url + "/v1/chat/completions", json=b, timeout=60).json()
        got, reason, usage = (
            out["choices"][0]["message"]["content"],
            out["choices"][0]["finish_reason"],
            out["usage"],
        )
    assert (got, reason) == (text[: text.index(stop)], "stop")
    assert usage["completion_tokens"] == len(got) and usage["forwards"] < forwards / 2
    m = wait_for(server, idle)
    assert m["dinfer_engine_cancelled_total"] == before["dinfer_engine_cancelled_total"] + 1
