"""Serve a trained model over OpenAI's HTTP API (completions, chat completions, models), with a chat page at /.

    python serve.py --out_dir=out-shakespeare-char                  # http://127.0.0.1:8000, the page at /
    python serve.py --init_from=gpt2 --port=8080                    # GPT-2 weights (needs transformers)
    python serve.py --out_dir=RUN --host=0.0.0.0 --api_key=SECRET   # or SERVE_API_KEY=SECRET in the environment

    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "out-shakespeare-char", "prompt": "ROMEO:", "max_tokens": 50, "temperature": 0}'

Any OpenAI client works: OpenAI(base_url="http://127.0.0.1:8000/v1", api_key=...). The model's name is
its out_dir's folder name (or init_from), unless --model_name says otherwise.

Requests are batched continuously by core/serving/engine.py's BatchEngine (on a CPU in a process of its own,
EngineProcess): one forward per step decodes the next token of every running request, each with its own seeded generator, so a request's text is what
model.generate gives it alone. Every request field is implemented or refused with a 400 that names it.
Here: the request models, the text side (whole characters, stop strings, logprobs), the routes at module
level over app.state.served, and main.
"""
from core.errors import quiet_start
quiet_start(__name__)  # as a script: Ctrl-C during the imports below (seconds) is one line

import asyncio
import dataclasses
import hmac
import ipaddress
import json
import os
import secrets
import signal
import socket
import sys
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Sequence

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException

from core import runtime
from core.weights import resolver
from core.data.chat import ChatTemplate
from core.config import parse_args
from core.serving.engine import (MAX_LOGPROBS, BatchEngine, EngineProcess, EngineRequest, PromptScores, ServerStopping,
                         TokenScore, engine_sampling)
from core.errors import UserError, first_line, run_cli
from core.data.tokenizer import StreamDecoder, Tokenizer
from model import GPT, check_sampling_args, window_shift

API_KEY_ENV = "SERVE_API_KEY"
PAGE = Path(__file__).with_name("serve.html")


@dataclasses.dataclass
class ServeConfig:
    init_from: str = "resume"        # 'resume' (out_dir/ckpt.pt), a GPT-2 name, or a save_pretrained directory
    out_dir: str = "out"             # where init_from=resume finds ckpt.pt
    host: str = "127.0.0.1"          # another address than loopback opens the model to the network
    port: int = 8000
    api_key: str | None = None       # require `Authorization: Bearer KEY` on /v1; None: $SERVE_API_KEY, if set
    model_name: str | None = None    # the name clients pass as `model`; None: out_dir's folder name, or init_from
    max_tokens_limit: int = 4096     # the most new tokens one request may ask for (past the context the window slides)
    max_n: int = 16                  # the most choices one request may ask for
    max_body_bytes: int = 1_000_000  # a larger request body gets 413
    window_shift: int | None = None  # past block_size the window slides this far at once; None: block_size // 2
    max_batch: int = 16              # the most rows decoded at once (KV cache slots); more requests wait their turn
    prefill_chunk: int = 512         # at most this many prompt tokens fed per step (all requests), between decodes
    device: str = "auto"             # auto, cpu, cuda, cuda:N, mps
    dtype: str = "auto"              # auto, float32, bfloat16, float16
    threads: int = 1                 # torch's CPU threads (docs/performance.md); 0: torch's default, one per core
    engine: str = "auto"             # process: the engine in a process of its own (CPU); thread: in this one; auto: process on a CPU

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise UserError(f"port must be in 0..65535, got {self.port}")
        for key in ("max_tokens_limit", "max_n", "max_body_bytes", "max_batch", "prefill_chunk"):
            if getattr(self, key) < 1:
                raise UserError(f"{key} must be at least 1, got {getattr(self, key)}")
        if self.api_key == "":
            raise UserError("--api_key is empty; pass a secret, or leave it out to serve without one")
        resolver.check_init_from(self.init_from)
        if self.engine not in ("auto", "process", "thread"):
            raise UserError(f"--engine must be auto, process or thread, got {self.engine!r}")


# -----------------------------------------------------------------------------
# text: whole characters, stop strings, finish reasons


class Row:
    """One choice's text as its ids arrive: only whole UTF-8 characters, cut at a stop string.

    Each id taken is kept with its score (for logprobs) up to the one that finished the row."""

    def __init__(self, tok: Tokenizer, stops: list[str], stop_ids: set[int], max_tokens: int):
        self.decoder, self.stops, self.stop_ids, self.max_tokens = StreamDecoder(tok), stops, stop_ids, max_tokens
        self.text, self.sent, self.tokens = "", 0, 0
        self.finish: str | None = None
        self.scored: list[tuple[int, TokenScore | None]] = []  # every id taken, with its score
        self.unsent_scores = 0  # how many of them no chunk has carried yet

    def push(self, token: int, score: TokenScore | None = None) -> str:
        """Take one id; return the text that is now safe to send (held back: a possible stop string's start)."""
        if self.finish:
            return ""
        self.tokens += 1
        self.scored.append((token, score))
        self.unsent_scores += 1
        if token in self.stop_ids:  # <|endoftext|>, or the end of a chat turn
            self.finish = "stop"
        else:
            self.text += self.decoder.push(token)
            cut = min((i for i in (self.text.find(s, max(0, self.sent - len(s))) for s in self.stops) if i >= 0),
                      default=-1)
            if cut >= 0:
                self.text, self.finish = self.text[:cut], "stop"
            elif self.tokens == self.max_tokens:
                self.text, self.finish = self.text + self.decoder.flush(), "length"
        end = len(self.text) if self.finish else len(self.text) - self._held_back()
        piece, self.sent = self.text[self.sent:end], max(self.sent, end)
        return piece

    def take_scores(self) -> list[tuple[int, TokenScore | None]]:
        """The ids (with scores) taken since the last call: what the next stream chunk carries."""
        new = self.scored[len(self.scored) - self.unsent_scores:]
        self.unsent_scores = 0
        return new

    def _held_back(self) -> int:
        """Length of the longest end of text that begins a stop string."""
        for k in range(min(len(self.text), max(map(len, self.stops), default=1) - 1), 0, -1):
            if any(s.startswith(self.text[-k:]) for s in self.stops):
                return k
        return 0


def completion_logprobs(tok: Tokenizer, scored: list[tuple[int, TokenScore | None]], offset: int = 0) -> dict:
    """OpenAI's completions logprobs: tokens, token_logprobs, top_logprobs, text_offset (from offset on)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, sc in scored:
        text = tok.decode([token])
        out["tokens"].append(text)
        out["token_logprobs"].append(None if sc is None else sc.logprob)
        out["top_logprobs"].append(None if sc is None else {tok.decode([i]): lp for i, lp in sc.top})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def chat_logprobs(tok: Tokenizer, scored: list[tuple[int, TokenScore | None]], stop_ids: set[int]) -> list[dict]:
    """OpenAI's chat logprobs.content: one entry per token of the reply (the end-of-turn token left out)."""
    def entry(i: int, lp: float) -> dict:
        text = tok.decode([i])
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
    return [{**entry(t, sc.logprob), "top_logprobs": [entry(i, lp) for i, lp in sc.top]}
            for t, sc in scored if sc is not None and t not in stop_ids]


# -----------------------------------------------------------------------------
# requests: every field OpenAI documents is implemented here or refused (extra="forbid" names it)


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(Strict):
    include_usage: bool = False


class Common(Strict):
    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None  # not OpenAI's; vLLM's extra field (extra_body={"top_k": ...})
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None


class CompletionRequest(Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None


class ChatRequest(Common):
    messages: list[dict[str, Any]]  # checked by the template, whose errors name the message
    logprobs: bool = False
    top_logprobs: int | None = None


class TokenizeRequest(Strict):
    prompt: str
    add_special_tokens: bool = True  # vLLM's field; this tokenizer adds no special tokens either way
    model: str | None = None


class DetokenizeRequest(Strict):
    tokens: list[int]
    model: str | None = None


@dataclasses.dataclass
class Served:
    """What the routes need, on app.state.served: the model's engine, tokenizer, template and limits."""
    engine: "BatchEngine | EngineProcess"
    tok: Tokenizer
    template: ChatTemplate | None
    cfg: ServeConfig
    name: str
    device: str
    block_size: int
    window_shift: int
    api_key: str | None
    created: int
    metrics: "Metrics"


# -----------------------------------------------------------------------------
# errors: every one in OpenAI's shape


class APIError(Exception):
    """A request the server refuses, sent as OpenAI's {"error": {...}} with this status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


async def api_error(request, e: APIError):
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status)


async def invalid(request, e: RequestValidationError):
    err = e.errors()[0]
    if err["type"] == "json_invalid":
        return JSONResponse(error_body(f"the body is not valid JSON: {err.get('ctx', {}).get('error', '')}"),
                            status_code=400)
    loc = [str(part) for part in err["loc"] if part != "body"]
    param = loc[0] if loc else None  # the request's field; deeper parts name union members or list items
    if err["type"] == "extra_forbidden":
        where = f" (in {'.'.join(loc[:-1])})" if len(loc) > 1 else ""
        return JSONResponse(error_body(f"{loc[-1]}: this server does not support the field '{loc[-1]}'{where}; "
                                       f"leave it out (docs/serving.md lists the fields it takes)",
                                       param=param, code="unsupported_field"), status_code=400)
    got = json.dumps(err.get("input"))[:80] if err["type"] != "missing" else "nothing"
    message = f"{param}: {err['msg']} (got {got})" if param else f"the body: {err['msg']}"
    return JSONResponse(error_body(message, param=param), status_code=400)


async def http_error(request, e: HTTPException):
    return JSONResponse(error_body(str(e.detail), code=str(e.status_code)), status_code=e.status_code)


async def crash(request, e: Exception):
    return JSONResponse(error_body(f"internal error: {first_line(e)}", "server_error"), status_code=500)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# -----------------------------------------------------------------------------
# metrics: Prometheus' text format at /metrics


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


# -----------------------------------------------------------------------------
# checking a request


def served(request: Request) -> Served:
    return request.app.state.served


async def check_key(request: Request) -> None:  # async: a plain def would run in a worker thread
    api_key = served(request).api_key
    if api_key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
        raise APIError(401, "missing or wrong API key: send the header `Authorization: Bearer KEY`",
                       code="invalid_api_key")


def check_model(sv: Served, model: str | None) -> None:
    if model is not None and model != sv.name:
        raise APIError(400, f"model '{model}' is not served here; this server serves '{sv.name}' (GET /v1/models)",
                       "model", "model_not_found")


def messages_of(req: ChatRequest) -> list[dict]:
    """{role, content} dicts; content given as OpenAI's list of text parts is joined into one string."""
    def text(content):
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            return "".join(str(p.get("text", "")) for p in content)
        return content
    return [{"role": m.get("role"), "content": text(m.get("content"))} if "content" in m else m
            for m in req.messages]


def engine_request(sv: Served, req: Common, prompt: list[int], max_tokens: int, eot: int | None,
                   logprobs: int | None, echo: bool, seed: int) -> EngineRequest:
    top_p = None if req.top_p == 1 else req.top_p
    sampling = engine_sampling(req.temperature, req.top_k, top_p, seed, sv.device, eot, sv.window_shift,
                               sv.tok.vocab_size)
    bias = {int(k): v for k, v in (req.logit_bias or {}).items()}
    return EngineRequest(prompt, req.n, max_tokens, sampling, logprobs, echo, req.presence_penalty,
                         req.frequency_penalty, bias)


def check_params(sv: Served, req: Common, default_max: int, allow_zero: bool = False) -> tuple[int, list[str], int]:
    """(max_tokens, stop strings, seed), each checked; APIError names the first field that is wrong."""
    cfg = sv.cfg
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = default_max if max_tokens is None else max_tokens
    if not (0 if allow_zero else 1) <= max_tokens <= cfg.max_tokens_limit:
        raise APIError(400, f"max_tokens must be in 1..{cfg.max_tokens_limit} on this server (0 only with echo), "
                            f"got {max_tokens}", "max_tokens")
    try:
        check_sampling_args(req.temperature, req.top_k, None if req.top_p == 1 else req.top_p)
    except ValueError as e:  # the message starts with the setting's name
        raise APIError(400, str(e), str(e).split()[0]) from None
    if not 1 <= req.n <= min(cfg.max_n, cfg.max_batch):
        raise APIError(400, f"n must be in 1..{min(cfg.max_n, cfg.max_batch)} on this server, got {req.n}", "n")
    for field in ("presence_penalty", "frequency_penalty"):
        if not -2 <= getattr(req, field) <= 2:
            raise APIError(400, f"{field} must be in [-2, 2], got {getattr(req, field)}", field)
    for key, value in (req.logit_bias or {}).items():
        if not key.isdigit() or not int(key) < sv.tok.vocab_size:
            raise APIError(400, f"logit_bias keys are token ids in 0..{sv.tok.vocab_size - 1}, got '{key}'",
                           "logit_bias")
        if not -100 <= value <= 100:
            raise APIError(400, f"logit_bias values must be in [-100, 100], got {value} for {key}", "logit_bias")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > 4 or any(s == "" for s in stops):
        raise APIError(400, "stop takes at most 4 non-empty strings", "stop")
    seed = req.seed if req.seed is not None else secrets.randbits(63)
    if not 0 <= seed < 2 ** 64:
        raise APIError(400, f"seed must be in 0..2**64-1, got {seed}", "seed")
    return max_tokens, stops, seed


def encode(tok: Tokenizer, text: str, param: str) -> list[int]:
    try:
        ids = tok.encode(text)
    except UserError as e:  # a char vocabulary names the characters it lacks
        raise APIError(400, f"the {param} cannot be encoded: {e}", param) from None
    if not ids:
        if tok.eot_token is None:
            raise APIError(400, f"the {param} is empty and this vocabulary has no <|endoftext|> to start from",
                           param)
        ids = [tok.eot_token]
    return ids


def check_length(sv: Served, ids: list[int], param: str) -> list[int]:
    if len(ids) > sv.block_size:
        raise APIError(400, f"the {param} is {len(ids)} tokens, longer than the model's context of "
                            f"{sv.block_size}; shorten it", param, "context_length_exceeded")
    if any(not 0 <= i < sv.tok.vocab_size for i in ids):
        raise APIError(400, f"the {param} holds token ids outside 0..{sv.tok.vocab_size - 1}", param)
    return ids


def prompts_of(sv: Served, req: CompletionRequest) -> list[list[int]]:
    p = req.prompt
    if isinstance(p, str):
        prompts = [encode(sv.tok, p, "prompt")]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [list(p)]
    elif p and all(isinstance(x, str) for x in p):
        prompts = [encode(sv.tok, x, "prompt") for x in p]
    elif p and all(isinstance(x, list) and x for x in p):
        prompts = [list(x) for x in p]
    else:
        raise APIError(400, "prompt must be a string, a list of strings, or token ids; got an empty list", "prompt")
    return [check_length(sv, ids, "prompt") for ids in prompts]


# -----------------------------------------------------------------------------
# replies


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


@dataclasses.dataclass
class Choice:
    """One choice being generated: its prompt, its row of text, and its prompt's scores (with echo)."""
    prompt: list[int]
    row: Row
    prompt_scores: list | None = None


async def pieces(sv: Served, reqs: list[EngineRequest], make_rows, choices: list[Choice]):
    """Every prompt's n rows, all submitted at once: (choice index, new text) as each grows; choices fills up.
    A choice's last piece comes when its finish reason is set (the piece may be empty)."""
    loop = asyncio.get_running_loop()
    handles = [sv.engine.submit(r, loop) for r in reqs]
    for r in reqs:
        sv.metrics.prompt_tokens.inc(len(r.prompt))
    streams = [h.events() for h in handles]
    try:
        for k, (r, h, events) in enumerate(zip(reqs, handles, streams)):
            its = [Choice(r.prompt, make_rows()) for _ in range(r.n)]
            choices += its
            held, ended = [""] * r.n, [False] * r.n  # text not yet yielded; whether the finish was
            async for event in events:
                if isinstance(event, PromptScores):
                    for c in its:
                        c.prompt_scores = event.scores
                    continue
                for i, (c, step) in enumerate(zip(its, event)):
                    if not c.row.finish:
                        held[i] += c.row.push(step.token, step.score)
                done = all(c.row.finish for c in its)
                if h.queued() and not done:
                    continue  # the engine is ahead of this client: the steps already queued go out as one piece
                for i, c in enumerate(its):
                    if held[i] or (c.row.finish and not ended[i]):
                        yield k * r.n + i, held[i]
                        held[i], ended[i] = "", bool(c.row.finish)
                if done:
                    break
            if r.max_tokens == 0:  # scored, not generated: the choice ends at once
                for i, c in enumerate(its):
                    c.row.finish = "length"
                    yield k * r.n + i, ""
    finally:
        for h, events in zip(handles, streams):
            await events.aclose()  # stops the generation when the rows are done early or the client left
            sv.metrics.done(h)


def reply(sv: Served, req: Common, reqs: list[EngineRequest], stops: list[str], stop_ids: set[int], chat: bool):
    tok = sv.tok
    kind = "chat.completion" if chat else "text_completion"
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
    prompt_tokens = sum(len(r.prompt) for r in reqs)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    want_logprobs = reqs[0].logprobs is not None
    echo = reqs[0].echo
    make_rows = lambda: Row(tok, stops, stop_ids, max(1, reqs[0].max_tokens))  # noqa: E731

    def logprobs_of(c: Choice, scored, offset: int = 0):
        if not want_logprobs:
            return None
        if chat:
            return {"content": chat_logprobs(tok, scored, stop_ids)}
        return completion_logprobs(tok, scored, offset)

    def choice(i: int, text: str, finish: str | None, c: Choice, first: bool = False) -> dict:
        if chat:
            delta = ({"role": "assistant", "content": text} if first else {"content": text}) if text or first else {}
            return {"index": i, "delta": delta, "logprobs": None if first else logprobs_of(c, c.row.take_scores()),
                    "finish_reason": finish}
        return {"index": i, "text": text, "logprobs": logprobs_of(c, c.row.take_scores()), "finish_reason": finish}

    created = int(time.time())  # one for the whole reply: OpenAI's chunks of one stream share it
    head = json.dumps({"id": rid, "object": kind + (".chunk" if chat else ""), "created": created,
                       "model": sv.name}, ensure_ascii=False)[:-1]  # without its "}": serialised once, not per chunk

    def event(choices: list[dict], used: dict | None = None) -> str:
        """One chunk of the stream as a server-sent event: the fields every chunk shares, then its own."""
        tail = f', "usage": {json.dumps(used)}}}' if include_usage else "}"
        return f'data: {head}, "choices": {json.dumps(choices, ensure_ascii=False)}{tail}\n\n'

    def whole_choice(i: int, c: Choice) -> dict:
        if chat:
            return {"index": i, "message": {"role": "assistant", "content": c.row.text},
                    "logprobs": logprobs_of(c, c.row.scored), "finish_reason": c.row.finish}
        text, scored = c.row.text, c.row.scored
        if echo:
            text = tok.decode(c.prompt) + text
            scored = list(zip(c.prompt, c.prompt_scores or [None] * len(c.prompt))) + scored
        return {"index": i, "text": text, "logprobs": logprobs_of(c, scored), "finish_reason": c.row.finish}

    if not req.stream:
        async def whole() -> dict:
            choices: list[Choice] = []
            async for _ in pieces(sv, reqs, make_rows, choices):
                pass
            return {"id": rid, "object": kind, "created": created, "model": sv.name,
                    "choices": [whole_choice(i, c) for i, c in enumerate(choices)],
                    "usage": usage(prompt_tokens, sum(c.row.tokens for c in choices if reqs[0].max_tokens))}
        return whole()

    async def events() -> AsyncIterator[str]:
        choices: list[Choice] = []
        try:
            if chat:  # OpenAI's first chunk of each choice names the role
                for i in range(sum(r.n for r in reqs)):
                    yield event([choice(i, "", None, None, first=True)])
            async for i, piece in pieces(sv, reqs, make_rows, choices):
                yield event([choice(i, piece, choices[i].row.finish, choices[i])])
            if include_usage:
                yield event([], usage(prompt_tokens, sum(c.row.tokens for c in choices)))
            yield "data: [DONE]\n\n"
        except ServerStopping:
            yield sse(error_body("the server is shutting down; the reply is incomplete", "server_error"))
        except Exception as e:  # the headers are sent: the error goes in the stream, as OpenAI's does
            yield sse(error_body(first_line(e), "server_error"))
    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# -----------------------------------------------------------------------------
# routes

router = APIRouter()
v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])


@router.get("/", response_class=HTMLResponse)
async def page():
    return HTMLResponse(PAGE.read_text(encoding="utf-8"), headers={
        # Everything the page needs comes from this server: nothing from another origin can run in it.
        "Content-Security-Policy": "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'"})


@router.get("/health")
async def health(request: Request):
    sv = served(request)
    return {"status": "ok", "model": sv.name, "chat": sv.template is not None, "auth": sv.api_key is not None,
            "context_length": sv.block_size, "running": sv.engine.running, "waiting": sv.engine.waiting_count(),
            "tokens_generated": sv.engine.tokens_generated}


@router.get("/metrics")
async def metrics(request: Request):
    sv = served(request)
    return Response(sv.metrics.render(sv.engine), media_type=CONTENT_TYPE_LATEST)


def model_card(sv: Served) -> dict:
    return {"id": sv.name, "object": "model", "created": sv.created, "owned_by": "nanogpt",
            "context_length": sv.block_size, "max_model_len": sv.block_size, "chat": sv.template is not None}


@v1.get("/models")
async def models(request: Request):
    return {"object": "list", "data": [model_card(served(request))]}


@v1.get("/models/{model_id:path}")
async def model_info(model_id: str, request: Request):
    sv = served(request)
    if model_id != sv.name:
        raise APIError(404, f"model '{model_id}' is not served here; this server serves '{sv.name}'", "model",
                       "model_not_found")
    return model_card(sv)


@router.get("/tokenizer_info", dependencies=[Depends(check_key)])
async def tokenizer_info(request: Request):
    """vLLM's: what a client (lm-eval's remote tokenizer) needs to tokenize as the server does."""
    sv = served(request)
    eot = sv.tok.eot_token
    return {"tokenizer_class": type(sv.tok).__name__, "eos_token": None if eot is None else sv.tok.decode([eot]),
            "eos_token_id": eot, "bos_token": None, "pad_token": None, "vocab_size": sv.tok.vocab_size,
            "model_max_length": sv.block_size}


@router.post("/tokenize", dependencies=[Depends(check_key)])
async def tokenize(req: TokenizeRequest, request: Request):
    sv = served(request)
    check_model(sv, req.model)
    try:
        ids = sv.tok.encode(req.prompt)
    except UserError as e:
        raise APIError(400, f"the prompt cannot be encoded: {e}", "prompt") from None
    return {"tokens": ids, "count": len(ids), "max_model_len": sv.block_size}


@router.post("/detokenize", dependencies=[Depends(check_key)])
async def detokenize(req: DetokenizeRequest, request: Request):
    sv = served(request)
    check_model(sv, req.model)
    if any(not 0 <= i < sv.tok.vocab_size for i in req.tokens):
        raise APIError(400, f"tokens holds ids outside 0..{sv.tok.vocab_size - 1}", "tokens")
    return {"prompt": sv.tok.decode(req.tokens)}


@v1.post("/completions")
async def completions(req: CompletionRequest, request: Request):
    sv = served(request)
    check_model(sv, req.model)
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise APIError(400, f"logprobs must be in 0..{MAX_LOGPROBS}, got {req.logprobs}", "logprobs")
    max_tokens, stops, seed = check_params(sv, req, default_max=16, allow_zero=req.echo)  # 16: OpenAI's default
    if req.echo and req.stream:
        raise APIError(400, "echo with stream is not supported; leave one out", "echo")
    eot = sv.tok.eot_token
    reqs = [engine_request(sv, req, p, max_tokens, eot, req.logprobs, req.echo, seed) for p in prompts_of(sv, req)]
    result = reply(sv, req, reqs, stops, set() if eot is None else {eot}, chat=False)
    return result if isinstance(result, StreamingResponse) else await result


@v1.post("/chat/completions")
async def chat_completions(req: ChatRequest, request: Request):
    sv = served(request)
    check_model(sv, req.model)
    if sv.template is None:
        raise APIError(400, f"model '{sv.name}' has no chat template (a base model, its tokenizer has no chat "
                            f"tokens); use /v1/completions", "messages", "no_chat_template")
    if req.top_logprobs is not None and not (req.logprobs and 0 <= req.top_logprobs <= MAX_LOGPROBS):
        raise APIError(400, f"top_logprobs must be in 0..{MAX_LOGPROBS}, and needs logprobs=true", "top_logprobs")
    try:
        prompt = sv.template.render_prompt(messages_of(req))
    except UserError as e:
        raise APIError(400, str(e), "messages") from None
    prompt = check_length(sv, prompt, "messages")
    default = max(1, min(sv.cfg.max_tokens_limit, sv.block_size - len(prompt)))
    max_tokens, stops, seed = check_params(sv, req, default_max=default)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    reqs = [engine_request(sv, req, prompt, max_tokens, sv.template.end_of_turn, logprobs, False, seed)]
    result = reply(sv, req, reqs, stops, sv.template.stop_tokens, chat=True)
    return result if isinstance(result, StreamingResponse) else await result


router.include_router(v1)


class BodyLimit:
    """413 for a request body over max_bytes, sent chunked or not. Plain ASGI: Starlette's BaseHTTPMiddleware
    would pass every chunk of a streamed reply through a task and a memory stream of its own."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"").decode("latin-1")
        if length.isdigit() and int(length) > self.max_bytes:
            return await self.too_large(f"the request body is {length} bytes, more than the {self.max_bytes} "
                                        f"this server accepts", scope, receive, send)
        if scope["method"] == "POST" and not length:  # chunked: count as it arrives, then hand it on whole
            body, more = b"", True
            while more:
                message = await receive()
                body += message.get("body", b"")
                more = message.get("more_body", False)
                if len(body) > self.max_bytes:
                    return await self.too_large(f"the request body is more than the {self.max_bytes} bytes this "
                                                f"server accepts", scope, receive, send)
            receive = replay(body, receive)
        await self.app(scope, receive, send)

    @staticmethod
    async def too_large(message: str, scope, receive, send):
        await JSONResponse(error_body(message, code="body_too_large"), status_code=413)(scope, receive, send)


def replay(body: bytes, receive):
    """An ASGI receive that gives body first, then whatever receive gives (the client's disconnect)."""
    sent = False

    async def again():
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}
    return again


@asynccontextmanager
async def lifespan(app):
    app.state.served.engine.start()
    yield
    app.state.served.engine.stop()


def build_app(model: GPT, tok: Tokenizer, cfg: ServeConfig, name: str, device: str) -> FastAPI:
    """The ASGI app over one engine (a BatchEngine in a thread, or in a process of its own: --engine): the routes
    above, errors in OpenAI's shape, the key, the body limit."""
    try:
        shift = window_shift(cfg.window_shift, model.config.block_size)
    except ValueError as e:
        raise UserError(f"--window_shift: {e}") from None
    metrics = Metrics()
    kind = cfg.engine if cfg.engine != "auto" else "process" if device == "cpu" else "thread"
    if kind == "process" and device != "cpu":
        raise UserError(f"--engine=process serves CPU models only (a forked process cannot use {device}); "
                        f"use --engine=thread")
    make = EngineProcess if kind == "process" else BatchEngine
    try:
        engine = make(model, cfg.max_batch, shift, tok.vocab_size, cfg.prefill_chunk, metrics)
    except RuntimeError as e:
        raise UserError(f"{first_line(e)}; try a smaller --max_batch, or --engine=thread") from None
    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.served = Served(engine, tok, ChatTemplate.for_tokenizer(tok), cfg, name, device,
                              model.config.block_size, shift, cfg.api_key or os.environ.get(API_KEY_ENV) or None,
                              int(time.time()), metrics)
    app.state.engine = engine
    for kind, handler in ((APIError, api_error), (RequestValidationError, invalid), (HTTPException, http_error),
                          (Exception, crash)):
        app.add_exception_handler(kind, handler)
    app.add_middleware(BodyLimit, max_bytes=cfg.max_body_bytes)
    app.include_router(router)
    return app


# -----------------------------------------------------------------------------
# the command


def check_port(host: str, port: int) -> None:
    """One line, before the model loads, when another program holds host:port (uvicorn would print its
    own traceback-like report after the start-up line and exit 3)."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a closing socket is no obstacle
        try:
            probe.bind((host, port))
        except OSError as e:
            raise UserError(f"cannot listen on {host}:{port} ({e.strerror}); another program may hold it: "
                            f"choose another with --port=N") from None


def serve(app, host: str, port: int) -> None:
    """Run uvicorn until Ctrl-C or SIGTERM; the engine stops first, so open streams end at once."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # uvicorn's own handler also re-raises the signal once shut down, so the process would die of
            # it (or print a KeyboardInterrupt): a requested, finished shutdown exits 0 instead.
            app.state.engine.stop()
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True  # a second Ctrl-C: stop waiting for open connections
            self.should_exit = True

    Server(uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=5, log_level="info")).run()


def main(argv: Sequence[str]) -> None:
    cfg = parse_args(ServeConfig, argv)
    check_port(cfg.host, cfg.port)
    rt = runtime.setup(cfg.device, cfg.dtype, threads=cfg.threads)
    model, tok, source = resolver.load_model(cfg.init_from, cfg.out_dir)
    model = runtime.inference_model(model, rt)  # as sample.py: weights cast once, float32 next-token logits
    name = cfg.model_name or (Path(cfg.out_dir).resolve().name if resolver.kind_of(cfg.init_from) == "resume" else cfg.init_from)
    app = build_app(model, tok, cfg, name, rt.device)
    has_key = bool(cfg.api_key or os.environ.get(API_KEY_ENV))
    print(f"serving {source} as '{name}': {model.get_num_params() / 1e6:.2f}M parameters, {rt.device} {rt.dtype}, "
          f"{'chat and completions' if ChatTemplate.for_tokenizer(tok) else 'completions only (no chat template)'}, "
          f"page at http://{cfg.host}:{cfg.port}/", file=sys.stderr)
    if not is_loopback(cfg.host) and not has_key:
        print(f"warning: serving on {cfg.host} without an API key: anyone who can reach it can use the model; "
              f"pass --api_key=... or set {API_KEY_ENV}", file=sys.stderr)
    serve(app, cfg.host, cfg.port)


if __name__ == "__main__":
    run_cli(main)
