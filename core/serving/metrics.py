"""The server's metrics in Prometheus' text format, at serve.py's /metrics: vLLM's names, labelled with model_name
as vLLM's are, so that a dashboard made for vLLM reads them; and the decode batch's size, which vLLM has not.
The engine tells them of each step (batch, token), the replies of each prompt's prefill (prefix) and each request's
end (done).
"""
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class Metrics:
    """One private registry (several apps in one process stay apart); each quantity measured once."""

    def __init__(self, model_name: str = "model"):
        self.registry = CollectorRegistry()

        def labelled(kind, name: str, doc: str, **kw):
            return kind(name, doc, ["model_name"], registry=self.registry, **kw).labels(model_name)
        self.running = labelled(Gauge, "vllm:num_requests_running", "Requests in the engine's batch")
        self.waiting = labelled(Gauge, "vllm:num_requests_waiting", "Requests queued for a free slot")
        self.kv_usage = labelled(Gauge, "vllm:kv_cache_usage_perc", "The KV cache's slots in use, 0 to 1")
        self.prompt_tokens = labelled(Counter, "vllm:prompt_tokens", "Prompt tokens received")
        self.generated_tokens = labelled(Counter, "vllm:generation_tokens", "Tokens generated, every choice's")
        self.ttft = labelled(Histogram, "vllm:time_to_first_token_seconds", "From submission to the first token",
                             buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
        self.itl = labelled(Histogram, "vllm:inter_token_latency_seconds", "Between a request's tokens",
                            buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5))
        self.e2e = labelled(Histogram, "vllm:e2e_request_latency_seconds", "From submission to the request's end",
                            buckets=(.05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        self.prefix_queries = labelled(Counter, "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = labelled(Counter, "vllm:prefix_cache_hits", "Prompt tokens the prefix cache held")
        self.batch_size = labelled(Histogram, "nanogpt_batch_size", "Rows in each decoding forward",
                                   buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.last: dict[int, float] = {}  # id(handle) -> when its last tokens were drawn

    def batch(self, rows: int) -> None:  # the engine's thread (or its process's reader), each decoding forward
        self.batch_size.observe(rows)

    def token(self, handle, rows: int) -> None:  # likewise, each request's step: rows tokens drawn
        self.generated_tokens.inc(rows)
        if handle.cancelled.is_set():  # drawn before the engine heard that the request ended: no latency
            return
        now, key = time.monotonic(), id(handle)
        if key in self.last:
            self.itl.observe(now - self.last[key])
        else:
            self.ttft.observe(now - handle.submitted)
        self.last[key] = now

    def prefix(self, queried: int, hit: int) -> None:  # a prompt prefilled, hit of its tokens from the prefix cache
        self.prefix_queries.inc(queried)
        self.prefix_hits.inc(hit)

    def done(self, handle) -> None:
        self.last.pop(id(handle), None)
        self.e2e.observe(time.monotonic() - handle.submitted)

    def render(self, engine) -> bytes:
        self.running.set(engine.running)
        self.waiting.set(engine.waiting_count())
        self.kv_usage.set(engine.slots_used / engine.settings.max_batch)
        return generate_latest(self.registry)
