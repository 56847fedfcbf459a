"""`dinfer serve`: an OpenAI-compatible server (FastAPI + uvicorn) on the continuous-batching engine.

    from dinfer.serve import serve
    serve("tiny-llada-moe", port=8000)          # blocks; Ctrl-C stops it

The layers: the HTTP app (dinfer.serve.app: endpoints, request checks, SSE streams, metrics) ->
the engine thread (dinfer.engine: queue, lanes) -> per configuration a lane (a Generator with its
slots and KV cache) -> rounds of block decoding. The web stack is the `serve` extra
(`pip install "dinfer[serve]"`); importing this package without it raises an ImportError that says so.
"""

from typing import Optional

INSTALL = 'pip install "dinfer[serve]"  (from a checkout: pip install -e ".[serve]")'


def _require() -> None:
    missing = []
    for module in ("fastapi", "uvicorn", "prometheus_client"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise ImportError(f"dinfer serve needs {', '.join(missing)}: {INSTALL}")


_require()

from .app import create_app  # noqa: E402


def serve(
    model=None,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_batch: int = 8,
    max_queue: int = 64,
    max_len: Optional[int] = None,
    max_lanes: int = 4,
    device=None,
    dtype=None,
    quantize: Optional[str] = None,
    name: Optional[str] = None,
    llm=None,
    log_level: str = "info",
    **defaults,
) -> None:
    """Serves `model` (a checkpoint folder or an embedded model's name; or a loaded `llm`) until
    interrupted. name: the model id clients send (default: the --model argument as given, or the
    embedded default's name); defaults: generation options every request starts from."""
    import uvicorn

    from ..llm import LLM
    from ..models.embedded import DEFAULT

    if llm is None:
        llm = LLM(model, device=device, dtype=dtype, quantize=quantize, **defaults)
    if name is None:
        name = DEFAULT if model is None else str(model)
    app = create_app(
        llm, name, max_batch=max_batch, max_queue=max_queue, max_len=max_len, max_lanes=max_lanes
    )
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)


__all__ = ["create_app", "serve", "INSTALL"]
