"""The server's Prometheus metrics, in a registry of its own (several apps can live in one process).

Requests count once, when they end: by endpoint and outcome (stop / length: answered; cancelled: the
client went away; error: the engine failed it), with the prompt and completion tokens and forwards
the answered ones reported in their usage; refused requests by HTTP status. The gauges are read at
scrape time: the engine's queue and the requests decoding in it, the HTTP requests being served. The
engine's own counters (rounds, the forwards of every request it ran, cancelled ones included) come
as they stand.
"""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _EngineCounters:
    """A collector of the engine's counters, read when scraped."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        help_ = {
            "rounds": "rounds of continuous batching run (one block of every request in a lane)",
            "forwards": "model forwards of the requests the engine finished or cancelled, summed",
            "finished": "requests that left the engine (answered or cancelled)",
            "cancelled": "requests cancelled (a client went away, a stop string or max_tokens ended them)",
            "failed": "requests failed by the engine",
        }
        counters = dict(self.engine.counters)
        for name, text in help_.items():
            yield CounterMetricFamily(f"dinfer_engine_{name}", text, value=counters[name])


class Metrics:
    def __init__(self, engine):
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "dinfer_requests",
            "requests that ended, by endpoint and outcome",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.rejected = Counter(
            "dinfer_rejected_requests", "requests refused, by HTTP status", ["status"], registry=r
        )
        self.prompt_tokens = Counter(
            "dinfer_prompt_tokens", "prompt tokens of the answered requests", registry=r
        )
        self.completion_tokens = Counter(
            "dinfer_completion_tokens", "tokens of the answers sent (usage.completion_tokens)", registry=r
        )
        self.forwards = Counter(
            "dinfer_forwards", "forwards of the answered requests (usage.forwards)", registry=r
        )
        Gauge(
            "dinfer_tokens_per_forward",
            "completion tokens per forward over the answered requests",
            registry=r,
        ).set_function(self._tokens_per_forward)
        Gauge("dinfer_queue_depth", "requests waiting for a slot in the engine", registry=r).set_function(
            lambda: engine.waiting
        )
        Gauge("dinfer_in_flight", "requests decoding in the engine's slots", registry=r).set_function(
            engine.in_flight
        )
        self.active = Gauge(
            "dinfer_active_requests", "requests being served (queued or decoding)", registry=r
        )
        self.latency = Histogram(
            "dinfer_request_latency_seconds", "request to answer", registry=r, buckets=LATENCY_BUCKETS
        )
        self.first_block = Histogram(
            "dinfer_time_to_first_block_seconds",
            "request to its first committed block",
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.block_interval = Histogram(
            "dinfer_block_interval_seconds",
            "between a request's committed blocks",
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        r.register(_EngineCounters(engine))
        self._tokens = self._forwards = 0

    def answered(self, prompt_tokens: int, completion_tokens: int, forwards: int, seconds: float) -> None:
        """A request answered (its usage), `seconds` after it arrived."""
        self.prompt_tokens.inc(prompt_tokens)
        self.completion_tokens.inc(completion_tokens)
        self.forwards.inc(forwards)
        self.latency.observe(seconds)
        self._tokens += completion_tokens
        self._forwards += forwards

    def _tokens_per_forward(self) -> float:
        return self._tokens / self._forwards if self._forwards else 0.0
