"""The OpenAI-compatible HTTP app (FastAPI) over the continuous-batching engine (dinfer.engine).

    POST /v1/completions        the prompt as is (or its token ids)
    POST /v1/chat/completions   messages in the checkpoint's chat template
    GET  /v1/models             the served model
    GET  /health                200 while the engine thread runs
    GET  /metrics               Prometheus text (dinfer.serve.metrics)
    GET  /openapi.json, /docs   the API, from the request and response models (dinfer.serve.protocol)

A request is checked (the body's types by its pydantic model, the generation options by the config
classes, the prompt by the tokenizer, its length against the engine's positions; each refusal a 4xx
with an OpenAI-style JSON error naming the field), then submitted to the engine, whose thread calls
the request's callback with each committed block; the callback hands the events to the event loop
(loop.call_soon_threadsafe), which never waits on the model. Each block's tokens extend the answer
(dinfer.serve.answer): a stream sends the new text as a chunk at once. An answer that ends before
the engine's request does (a stop string, max_tokens reached a block early) cancels the request,
which frees its slot at the next block boundary; the answer's usage waits for the engine's last
word on it (its forwards), at most that one round. A client that goes away (a watcher on the ASGI
receive channel, for streamed and whole answers alike) cancels its request the same way. When
max_queue requests wait, a new one gets 429 with Retry-After; when every lane (configuration) is
busy, 503 with Retry-After.
"""

import asyncio
import dataclasses
import logging
import math
import time
import uuid
from typing import List, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

import dinfer_kernels as dk

from ..engine import Engine, QueueFull
from ..generate import GenerationConfig, check_for_model
from ..llm import LLM, generation_config, stop_strings
from ..params import check_windows
from . import protocol as P
from .answer import Answer
from .metrics import Metrics

log = logging.getLogger(__name__)

MAX_BODY = 8 << 20  # bytes of a request body; a prompt is far less, a larger body is refused unread
RETRY_AFTER = "1"  # seconds: a slot frees at the next block boundary


class APIError(Exception):
    """A request refused: the HTTP status and an OpenAI-style error naming the field (`param`)."""

    def __init__(
        self, status: int, message: str, param=None, kind="invalid_request_error", code=None, headers=None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers

    def response(self) -> JSONResponse:
        error = P.ErrorDetail(message=self.message, type=self.kind, param=self.param, code=self.code)
        return JSONResponse(P.ErrorResponse(error=error).model_dump(), self.status, headers=self.headers)


def _param_of(message: str) -> Optional[str]:
    """The option a config class's or the tokenizer's message names: its text before the first ': '."""
    head = message.split(": ", 1)[0]
    return head if head and " " not in head else None


class _ClientGone(Exception):
    pass


class _EngineFailed(Exception):
    pass


class _Job:
    """A request in the engine as the event loop sees it: the engine thread's events, queued."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.pending: List[tuple] = []  # an event looked at (wait_first) and not yet taken
        self.rid: Optional[int] = None

    def events(self, kind: str, *args) -> None:  # called from the engine thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, args))
        except RuntimeError:  # the loop is closed: the server is going down
            pass

    async def get(self) -> tuple:
        return self.pending.pop() if self.pending else await self.queue.get()

    async def wait_first(self) -> tuple:
        if not self.pending:
            self.pending.append(await self.queue.get())
        return self.pending[0]


class _Run:
    """One submitted request until it ends: its answer, events, timings, cancellation and metrics."""

    def __init__(
        self, server: "Server", request: Request, endpoint: str, job: _Job, answer: Answer, prompt_len: int
    ):
        self.server, self.endpoint, self.job, self.answer, self.prompt_len = (
            server,
            endpoint,
            job,
            answer,
            prompt_len,
        )
        self.t0 = self.last_block = time.perf_counter()
        self.blocks, self.forwards, self.over = 0, 0, False
        self.cancelled = False
        server.metrics.active.inc()
        self.watcher = asyncio.ensure_future(self._watch(request))

    async def _watch(self, request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.job.queue.put_nowait(("disconnect", ()))

    def _cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self.server.engine.cancel(self.job.rid)

    async def deltas(self):
        """The answer's text as it becomes final, piece by piece; ends when the engine is done with
        the request. _EngineFailed, _ClientGone."""
        metrics = self.server.metrics
        while True:
            kind, args = await self.job.get()
            if kind == "block":
                now = time.perf_counter()
                (metrics.block_interval if self.blocks else metrics.first_block).observe(
                    now - self.last_block
                )
                self.blocks, self.last_block = self.blocks + 1, now
                self.answer.add(args[0].tolist())
                if self.answer.finish_reason is not None:
                    self._cancel()  # a no-op when this block was the request's last
            elif kind == "finish":
                self.answer.finish(args[0].tolist())
                self.forwards = args[1]
            elif kind == "error":
                raise _EngineFailed(args[0])
            else:
                raise _ClientGone()
            piece = self.answer.delta()
            if piece:
                yield piece
            if kind == "finish":
                return

    def usage(self) -> P.Usage:
        n = len(self.answer.ids)
        return P.Usage(
            prompt_tokens=self.prompt_len,
            completion_tokens=n,
            total_tokens=self.prompt_len + n,
            forwards=self.forwards,
            tokens_per_forward=round(n / self.forwards, 4) if self.forwards else 0.0,
        )

    def end(self, outcome: str) -> None:
        """The request is over for the client: `outcome` is its finish reason, or cancelled / error."""
        if self.over:
            return
        self.over = True
        self.watcher.cancel()
        if outcome in ("cancelled", "error"):
            self._cancel()
        m = self.server.metrics
        m.active.dec()
        m.requests.labels(self.endpoint, outcome).inc()
        if outcome in ("stop", "length"):
            m.answered(self.prompt_len, len(self.answer.ids), self.forwards, time.perf_counter() - self.t0)


def _engine_error(e: Exception) -> APIError:
    if isinstance(e, MemoryError):  # no lane or cache for the request now: others must finish first
        return APIError(
            503, f"the server is busy: {e}", kind="server_error", headers={"Retry-After": RETRY_AFTER}
        )
    return APIError(500, f"the engine failed the request: {type(e).__name__}: {e}", kind="server_error")


def _sse(payload) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


class Server:
    """The engine and what the endpoints share: the model's LLM, its name, the metrics."""

    def __init__(
        self, llm: LLM, name: str, max_batch: int, max_queue: int, max_len: Optional[int], max_lanes: int
    ):
        self.llm, self.name = llm, name
        self.engine = Engine(llm.model, max_batch, max_queue, max_len, max_lanes)
        self.metrics = Metrics(self.engine)
        self.created = int(time.time())

    # ------------------------------------------------------------------------------ checking a request

    def config(self, body: P.GenerationRequest, max_tokens: Optional[int], prompt_len: int):
        """(GenerationConfig, max_tokens) of a request: the server's defaults under the request's
        options, the generation length max_tokens rounded up to whole blocks (within the positions
        left after the prompt), checked by the config classes."""
        defaults = self.llm.defaults
        given = {
            k: getattr(body, k)
            for k in (
                "block_length",
                "threshold",
                "decoder",
                "cache",
                "edit_threshold",
                "max_post_edit_steps",
                "temperature",
                "seed",
            )
            if getattr(body, k) is not None
        }
        try:
            base = generation_config(**{**defaults, **given})
            check_for_model(self.llm.model, base)
            check_windows(base, self.llm.model.config.max_positions)
        except (TypeError, ValueError) as e:
            raise APIError(400, str(e), _param_of(str(e))) from e
        if max_tokens is None:
            max_tokens = defaults.get("gen_length", GenerationConfig.gen_length)
        room = self.engine.max_len - prompt_len
        if max_tokens > room:
            raise APIError(
                400,
                f"max_tokens: {prompt_len} prompt tokens + {max_tokens} exceed the {self.engine.max_len} "
                f"positions this server takes"
                + ("" if body.max_tokens else " (max_tokens not given: the default)"),
                "max_tokens",
            )
        # A block length above the answer would cap to it and split the lanes: whole blocks instead.
        block = given.get("block_length", defaults.get("block_length", GenerationConfig.block_length))
        gen_length = min(math.ceil(max_tokens / block) * block, room)
        cfg = dataclasses.replace(base, gen_length=gen_length, block_length=block)
        if cfg.decoder.temperature == 0:  # the seed draws nothing: it must not split the lanes
            cfg = dataclasses.replace(
                cfg, decoder=dataclasses.replace(cfg.decoder, seed=GenerationConfig().decoder.seed)
            )
        return cfg, max_tokens

    def prompt_ids(self, prompt, name: str) -> List[int]:
        """The token ids of a completion's prompt (as is) or of chat messages (in the template)."""
        try:
            if name == "messages":
                prompt = self.llm.tokenizer.apply_chat_template(prompt)
            ids = self.llm.encode(prompt, False, name)
        except (TypeError, ValueError) as e:
            raise APIError(400, str(e), _param_of(str(e)) or name) from e
        if not ids:
            raise APIError(400, f"{name}: empty prompt", name)
        if len(ids) >= self.engine.max_len:
            raise APIError(
                400,
                f"{name}: {len(ids)} tokens leave no room to generate in the {self.engine.max_len} positions "
                "this server takes",
                name,
            )
        return ids

    # ------------------------------------------------------------------------------ serving it

    async def generate(self, request: Request, body: P.GenerationRequest, endpoint: str, prompt: tuple):
        """The response to a checked body: prompt = (text, ids or messages; the field's name)."""
        if body.model != self.name:
            raise APIError(
                404,
                f"model: {body.model!r} is not served here; this server serves {self.name!r}",
                "model",
                code="model_not_found",
            )
        try:
            stops = stop_strings(body.stop)
        except (TypeError, ValueError) as e:
            raise APIError(400, str(e), "stop") from e
        max_tokens = body.max_tokens
        if isinstance(body, P.ChatCompletionRequest) and body.max_completion_tokens is not None:
            if max_tokens is not None and max_tokens != body.max_completion_tokens:
                raise APIError(
                    400, "max_completion_tokens: differs from max_tokens (give one)", "max_completion_tokens"
                )
            max_tokens = body.max_completion_tokens
        # off the event loop: a long prompt's template and tokenization take a while
        ids = await run_in_threadpool(self.prompt_ids, *prompt)
        cfg, max_tokens = self.config(body, max_tokens, len(ids))
        key = dk.sequence_key(ids) if cfg.decoder.temperature > 0 else 0  # LLM.generate's, alone
        job = _Job(asyncio.get_running_loop())
        try:
            job.rid = self.engine.submit(ids, cfg, job.events, key)
        except QueueFull as e:
            raise APIError(
                429,
                f"the server is busy: {e}; retry later",
                kind="rate_limit_error",
                headers={"Retry-After": RETRY_AFTER},
            ) from e
        except ValueError as e:
            raise APIError(400, str(e), "max_tokens") from e
        run = _Run(
            self,
            request,
            endpoint,
            job,
            Answer(self.llm.tokenizer, self.llm.model.config.eos_id, max_tokens, stops),
            len(ids),
        )
        chat = endpoint == "chat"
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        try:
            first = await job.wait_first()  # the status waits for the request's first word
        except BaseException:
            run.end("cancelled")
            raise
        if first[0] == "error":
            run.end("error")
            raise _engine_error(first[1][0])
        if first[0] == "disconnect":
            run.end("cancelled")
            return Response(status_code=499)  # nobody reads it
        if body.stream:
            include_usage = body.stream_options is None or body.stream_options.include_usage
            return StreamingResponse(
                self._stream(run, rid, created, chat, include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            text = "".join([piece async for piece in run.deltas()])
        except _ClientGone:
            run.end("cancelled")
            return Response(status_code=499)
        except _EngineFailed as e:
            run.end("error")
            raise _engine_error(e.args[0]) from e
        except BaseException:
            run.end("cancelled")
            raise
        run.end(run.answer.finish_reason)
        if chat:
            return P.ChatCompletion(
                id=rid,
                created=created,
                model=self.name,
                usage=run.usage(),
                choices=[
                    P.ChatChoice(
                        message=P.AssistantMessage(content=text), finish_reason=run.answer.finish_reason
                    )
                ],
            )
        return P.Completion(
            id=rid,
            created=created,
            model=self.name,
            usage=run.usage(),
            choices=[P.CompletionChoice(text=text, finish_reason=run.answer.finish_reason)],
        )

    async def _stream(self, run: _Run, rid: str, created: int, chat: bool, include_usage: bool):
        """SSE: a chunk per piece of new text (a committed block's), a last chunk with the
        finish_reason, one with the usage (choices empty), then [DONE]."""

        def chunk(text: Optional[str], finish=None, first=False, usage=None, choices=True):
            if chat:
                delta = P.Delta(role="assistant", content=text or "") if first else P.Delta(content=text)
                parts = [P.ChatChunkChoice(delta=delta, finish_reason=finish)] if choices else []
                return _sse(
                    P.ChatCompletionChunk(
                        id=rid, created=created, model=self.name, choices=parts, usage=usage
                    )
                )
            parts = [P.CompletionChoice(text=text or "", finish_reason=finish)] if choices else []
            return _sse(P.Completion(id=rid, created=created, model=self.name, choices=parts, usage=usage))

        first = True
        try:
            try:
                async for piece in run.deltas():
                    yield chunk(piece, first=first)
                    first = False
            except _EngineFailed as e:
                run.end("error")
                error = _engine_error(e.args[0])
                yield _sse(P.ErrorResponse(error=P.ErrorDetail(message=error.message, type=error.kind)))
                yield "data: [DONE]\n\n"
                return
            except _ClientGone:
                run.end("cancelled")
                return
            if first and chat:
                yield chunk("", first=True)
            yield chunk(None, finish=run.answer.finish_reason)
            if include_usage:
                yield chunk(None, usage=run.usage(), choices=False)
            yield "data: [DONE]\n\n"
            run.end(run.answer.finish_reason)
        finally:  # the client went away mid-stream (the response was cancelled), or all was sent
            run.end("cancelled")

    def models(self) -> P.ModelList:
        return P.ModelList(
            data=[P.ModelCard(id=self.name, created=self.created, max_model_len=self.engine.max_len)]
        )


class _BodyLimit:
    """ASGI middleware: a request body over `limit` bytes gets 413 before the app reads it (a
    declared Content-Length at once, a chunked body as soon as it passes the limit)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            return await self._refuse(send)
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.limit:
                return await self._refuse(send)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, send):
        response = APIError(413, f"the request body exceeds {self.limit} bytes").response()
        await response({"type": "http"}, None, send)


def _validation_error(exc: RequestValidationError) -> APIError:
    """A body pydantic refused: the first error, naming its field (messages.0.role)."""
    e = exc.errors()[0]
    loc = list(e["loc"][1:] if e["loc"][:1] == ("body",) else e["loc"])
    if e["type"] == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {e.get('ctx', {}).get('error', e['msg'])}")
    if not loc:
        return APIError(400, f"the body must be a JSON object ({e['msg']})")
    param = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc).lstrip(".")
    msg = e["msg"].removeprefix("Value error, ")
    if e["type"] == "missing":
        msg = "required"
    elif e["type"] == "extra_forbidden":
        msg = "unknown field"
    return APIError(400, f"{param}: {msg}", param)


def create_app(
    llm: LLM,
    name: str,
    max_batch: int = 8,
    max_queue: int = 64,
    max_len: Optional[int] = None,
    max_lanes: int = 4,
    max_body: int = MAX_BODY,
) -> FastAPI:
    """The app serving `llm` as model `name`; its engine thread runs until the app shuts down."""
    server = Server(llm, name, max_batch, max_queue, max_len, max_lanes)

    async def lifespan(app):
        yield
        server.engine.shutdown()

    app = FastAPI(
        title="dinfer",
        summary="OpenAI-compatible serving of a diffusion language model",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.server = server
    errors = {status: {"model": P.ErrorResponse} for status in (400, 404, 413, 429, 500, 503)}

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        server.metrics.rejected.labels(str(exc.status)).inc()
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        return await api_error(request, _validation_error(exc))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):  # a bug: logged, and still JSON
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        error = APIError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error")
        return await api_error(request, error)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return await api_error(request, APIError(exc.status_code, str(exc.detail), kind=kind))

    streamed = {"text/event-stream": {"schema": {"type": "string"}, "description": "with stream: true"}}

    @app.post(
        "/v1/completions",
        response_model=P.Completion,
        responses={**errors, 200: {"content": streamed}},
    )
    async def completions(body: P.CompletionRequest, request: Request):
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(400, f"prompt: one prompt per request, got {len(prompt)}", "prompt")
            prompt = prompt[0]
        return await server.generate(request, body, "completions", (prompt, "prompt"))

    @app.post(
        "/v1/chat/completions",
        response_model=P.ChatCompletion,
        responses={**errors, 200: {"content": streamed}},
    )
    async def chat_completions(body: P.ChatCompletionRequest, request: Request):
        messages = [m.as_dict() for m in body.messages]
        return await server.generate(request, body, "chat", (messages, "messages"))

    @app.get("/v1/models", response_model=P.ModelList)
    async def models():
        return server.models()

    @app.get("/health")
    async def health():
        if not server.engine.alive:
            return JSONResponse({"status": "engine stopped"}, 503)
        return {"status": "ok"}

    @app.get("/metrics", response_class=Response)
    async def metrics():
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(_BodyLimit, limit=max_body)
    return app
