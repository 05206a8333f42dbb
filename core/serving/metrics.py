"""The server's metrics: the engine's counters and histograms in Prometheus' text format, at serve.py's /metrics.

The engine tells them of each step (batch, token: from its thread, or from the engine process's reader
thread); the replies, of each request's end (done); /metrics renders them with the running and waiting
counts read then.
"""
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class Metrics:
    """The engine's counters and histograms in one private registry (several apps in one process stay apart)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("nanogpt_requests_running", "Requests in the engine's batch", registry=r)
        self.waiting = Gauge("nanogpt_requests_waiting", "Requests queued for a free slot", registry=r)
        self.prompt_tokens = Counter("nanogpt_prompt_tokens", "Prompt tokens received", registry=r)
        self.generated_tokens = Counter("nanogpt_generation_tokens", "Tokens generated, every row", registry=r)
        self.ttft = Histogram("nanogpt_time_to_first_token_seconds", "From submission to the first token",
                              buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30), registry=r)
        self.tbt = Histogram("nanogpt_time_per_output_token_seconds", "Between one step's tokens and the next",
                             buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1), registry=r)
        self.batch_size = Histogram("nanogpt_batch_size", "Rows in each decoding forward",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.last: dict[int, float] = {}  # id(handle) -> when its last tokens were drawn

    def batch(self, rows: int) -> None:  # the engine's thread (or its process's reader), each decoding forward
        self.batch_size.observe(rows)

    def token(self, handle, rows: int) -> None:  # likewise, each request's step
        now = time.monotonic()
        key = id(handle)
        if key in self.last:
            self.tbt.observe(now - self.last[key])
        else:
            self.ttft.observe(now - handle.submitted)
        self.last[key] = now
        self.generated_tokens.inc(rows)

    def done(self, handle) -> None:
        self.last.pop(id(handle), None)

    def render(self, engine) -> bytes:
        self.running.set(engine.running)
        self.waiting.set(engine.waiting_count())
        return generate_latest(self.registry)

