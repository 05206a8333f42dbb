"""OpenAI's API as serve.py speaks it: the request models, their checks and errors, the replies.

Requests are pydantic models, as vLLM's protocol.py has them: every field OpenAI documents, and those of vLLM's
extensions that mean something here, is implemented; any other is refused with a 400 that names it
(extra="forbid"), never silently dropped.
A request's checks raise APIError, sent as OpenAI's {"error": {...}}; what passes becomes EngineRequests for
the engine (core/serving/engine.py). A reply is OpenAI's completion or chat completion, whole or as
server-sent events, built from the engine's steps: only whole characters, cut at a stop string, with
logprobs in each endpoint's own shape. serve.py holds the routes over these; docs/serving.md the fields.
"""
import asyncio
import dataclasses
import json
import math
import secrets
import time
from typing import Any, AsyncIterator

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException

from core.data.chat import ChatTemplate
from core.data.tokenizer import StreamDecoder, Tokenizer
from core.decoding.decode import check_sampling_args
from core.errors import UserError, first_line
from core.serving.engine import (BatchEngine, EngineDied, EngineRequest, PromptScores, ServerStopping, TokenScore,
                                 engine_sampling)
from core.serving.metrics import Metrics
from core.serving.process import EngineProcess

# -----------------------------------------------------------------------------
# requests: every field is implemented here or refused (extra="forbid" names it)


class StrictModel(BaseModel):
    """Strict types, and no field but those declared: any other is a 400 that names it (invalid, below)."""
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, the usage so far on every chunk


class RequestBase(StrictModel):
    """What completions and chat completions share: the model, the length, the sampling, the stream; OpenAI's
    fields first, then vLLM's extensions (sent as extra_body with the openai client)."""
    model: str | None = None  # None: the one served (vLLM's)
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
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


class CompletionRequest(RequestBase):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None


class ChatRequest(RequestBase):
    messages: list[dict[str, Any]]  # checked by the template, whose errors name the message
    logprobs: bool = False
    top_logprobs: int | None = None


class TokenizeRequest(StrictModel):
    prompt: str
    add_special_tokens: bool = True  # vLLM's field; this tokenizer adds no special tokens either way
    model: str | None = None


class DetokenizeRequest(StrictModel):
    tokens: list[int]
    model: str | None = None


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


class ErrorResponse(JSONResponse):
    """An error's JSON in ASCII: whatever a request spelled that the message quotes back (a lone surrogate in a
    field's name, say) cannot fail to encode."""

    def render(self, content) -> bytes:
        return json.dumps(content).encode()


# The app's exception handlers (serve.py's build_app installs them): each error a JSON body in OpenAI's shape.


def error(status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
          code: str | None = None) -> ErrorResponse:
    return ErrorResponse(error_body(message, type, param, code), status_code=status)


async def api_error(request, e: APIError):
    return error(e.status, e.message, e.type, e.param, e.code)


async def invalid(request, e: RequestValidationError):
    err = e.errors()[0]
    if err["type"] == "json_invalid":
        return error(400, f"the body is not valid JSON: {err.get('ctx', {}).get('error', '')}")
    loc = [str(part) for part in err["loc"] if part != "body"]
    param = loc[0] if loc else None  # the request's field; deeper parts name union members or list items
    if err["type"] == "extra_forbidden":
        where = f" (in {'.'.join(loc[:-1])})" if len(loc) > 1 else ""
        return error(400, f"{loc[-1]}: this server does not support the field '{loc[-1]}'{where}; leave it out "
                          f"(docs/serving.md lists the fields it takes)", param=param, code="unsupported_field")
    got = json.dumps(err.get("input"), default=repr)[:80] if err["type"] != "missing" else "nothing"
    return error(400, f"{param}: {err['msg']} (got {got})" if param else f"the body: {err['msg']}", param=param)


async def http_error(request, e: HTTPException):
    return error(e.status_code, str(e.detail), code=str(e.status_code))


def engine_dead_body(failure: str) -> dict:
    """What /health and every request answer (503) once the engine process has died: serve.py then exits
    non-zero so that its supervisor restarts it (docs/serving.md, "When the engine dies")."""
    return error_body(f"{failure}; the server cannot generate and is exiting, to be restarted by its supervisor",
                      "server_error", code="engine_dead")


async def engine_died(request, e: EngineDied):
    return ErrorResponse(engine_dead_body(str(e)), status_code=503)


async def crash(request, e: Exception):
    return error(500, f"internal error: {first_line(e)}", "server_error")


# -----------------------------------------------------------------------------
# the served model


@dataclasses.dataclass
class ServedModel:
    """The model behind the API, on serve.py's app.state.served: its engine, tokenizer, chat template, name and
    limits; what the checks and replies below read."""
    engine: BatchEngine | EngineProcess
    tok: Tokenizer
    template: ChatTemplate | None
    name: str
    device: str
    block_size: int
    max_tokens_limit: int  # the most new tokens one request may ask for
    max_n: int  # the most choices one request may ask for
    api_key: str | None
    created: int
    metrics: Metrics


# -----------------------------------------------------------------------------
# checking a request


def check_model(served: ServedModel, model: str | None) -> None:
    if model is not None and model != served.name:
        raise APIError(404, f"model '{model}' is not served here; this server serves '{served.name}' (GET /v1/models)",
                       "model", "model_not_found")


def messages_of(req: ChatRequest) -> list[dict]:
    """{role, content} dicts; content given as OpenAI's list of text parts is joined into one string."""
    def text(content):
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            return "".join(str(p.get("text", "")) for p in content)
        return content
    return [{"role": m.get("role"), "content": text(m.get("content"))} if "content" in m else m
            for m in req.messages]


def stop_ids_of(served: ServedModel, chat: bool) -> tuple[int | None, set[int]]:
    """(the id that ends a row in the engine, every id that ends a choice): the end of a chat turn (and the chat
    template's other tokens), or the end of text."""
    if chat:
        return served.template.end_of_turn, served.template.stop_tokens
    return served.tok.eot_token, {served.tok.eot_token} - {None}


def engine_request(served: ServedModel, req: RequestBase, prompt: list[int], max_tokens: int, chat: bool,
                   logprobs: int | None, echo: bool, seed: int) -> EngineRequest:
    top_p = None if req.top_p == 1 else req.top_p
    settings = served.engine.settings
    eot, ends = stop_ids_of(served, chat)
    sampling = engine_sampling(req.temperature, req.top_k, top_p, seed, served.device, None if req.ignore_eos else eot,
                               settings.window_shift, settings.vocab_size)
    bias = {int(k): v for k, v in (req.logit_bias or {}).items()}
    return EngineRequest(prompt, req.n, max_tokens, sampling, logprobs, echo, req.presence_penalty,
                         req.frequency_penalty, bias, req.repetition_penalty, req.min_tokens, tuple(sorted(ends)))


def check_params(served: ServedModel, req: RequestBase, default_max: int,
                 allow_zero: bool = False) -> tuple[int, list[str], int]:
    """(max_tokens, stop strings, seed), each checked; APIError names the first field that is wrong."""
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = default_max if max_tokens is None else max_tokens
    if not (0 if allow_zero else 1) <= max_tokens <= served.max_tokens_limit:
        raise APIError(400, f"max_tokens must be in 1..{served.max_tokens_limit} on this server (0 only with echo), "
                            f"got {max_tokens}", "max_tokens")
    if not 0 <= req.min_tokens <= max_tokens:
        raise APIError(400, f"min_tokens must be in 0..max_tokens ({max_tokens}), got {req.min_tokens}", "min_tokens")
    for field in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        if not math.isfinite(getattr(req, field)):  # JSON's 1e999 reads as infinity, and Python's reads NaN
            raise APIError(400, f"{field} must be a finite number, got {getattr(req, field)}", field)
    if not req.repetition_penalty > 0:
        raise APIError(400, f"repetition_penalty must be greater than 0 (1: none), got {req.repetition_penalty}",
                       "repetition_penalty")
    try:
        check_sampling_args(req.temperature, req.top_k, None if req.top_p == 1 else req.top_p)
    except ValueError as e:  # the message starts with the setting's name
        raise APIError(400, str(e), str(e).split()[0]) from None
    try:
        served.engine.settings.check_n(req.n, served.max_n)  # n rows take n of the engine's slots
    except ValueError as e:
        raise APIError(400, str(e), "n") from None
    for field in ("presence_penalty", "frequency_penalty"):
        if not -2 <= getattr(req, field) <= 2:
            raise APIError(400, f"{field} must be in [-2, 2], got {getattr(req, field)}", field)
    for key, value in (req.logit_bias or {}).items():
        if not (key.isascii() and key.isdigit()) or not int(key) < served.tok.vocab_size:
            raise APIError(400, f"logit_bias keys are token ids in 0..{served.tok.vocab_size - 1}, got '{key}'",
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
        ids = tok.encode_with_specials(text)  # as /tokenize and vLLM: "<|endoftext|>" in a prompt is the token
    except UserError as e:  # a char vocabulary names the characters it lacks
        raise APIError(400, f"the {param} cannot be encoded: {e}", param) from None
    if not ids:
        if tok.eot_token is None:
            raise APIError(400, f"the {param} is empty and this vocabulary has no <|endoftext|> to start from",
                           param)
        ids = [tok.eot_token]
    return ids


def check_length(served: ServedModel, ids: list[int], param: str) -> list[int]:
    if len(ids) > served.block_size:
        raise APIError(400, f"the {param} is {len(ids)} tokens, longer than the model's context of "
                            f"{served.block_size}; shorten it", param, "context_length_exceeded")
    if any(not 0 <= i < served.tok.vocab_size for i in ids):
        raise APIError(400, f"the {param} holds token ids outside 0..{served.tok.vocab_size - 1}", param)
    return ids


def prompts_of(served: ServedModel, req: CompletionRequest) -> list[list[int]]:
    p = req.prompt
    if isinstance(p, str) or p and all(isinstance(x, int) for x in p):
        p = [p]  # one prompt: text or token ids
    if not p or not all(isinstance(x, str) or x for x in p):  # the model's types allow no other mix
        raise APIError(400, "prompt must be a string, a list of strings, or token ids; got an empty list", "prompt")
    prompts = [encode(served.tok, x, "prompt") if isinstance(x, str) else list(x) for x in p]
    return [check_length(served, ids, "prompt") for ids in prompts]


# -----------------------------------------------------------------------------
# text: whole characters, stop strings, finish reasons


class ChoiceText:
    """One choice's text as its ids arrive: only whole UTF-8 characters, cut at a stop string.

    As vLLM's: hidden ids (the special tokens, with skip_special_tokens) add no text; a stop string is looked for
    once more than min_tokens ids have come (one that ends past them counts), and is kept with include_stop.
    Each id taken is kept with its score (for logprobs) up to the one that finished the choice."""

    def __init__(self, tok: Tokenizer, stops: list[str], stop_ids: set[int], max_tokens: int, min_tokens: int = 0,
                 include_stop: bool = False, hidden: set[int] = frozenset()):
        self.decoder, self.stops, self.stop_ids, self.max_tokens = StreamDecoder(tok), stops, stop_ids, max_tokens
        self.min_tokens, self.include_stop, self.hidden = min_tokens, include_stop, hidden
        self.text, self.sent, self.tokens, self.floor = "", 0, 0, 0  # floor: the text of the first min_tokens ids
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
            self.text += "" if token in self.hidden else self.decoder.push(token)
            if self.tokens <= self.min_tokens:
                self.floor = len(self.text)
            hits = [(i, s) for s in self.stops if self.tokens > self.min_tokens and
                    (i := self.text.find(s, max(0, self.sent - len(s), self.floor - len(s) + 1))) >= 0]
            if hits:
                i, s = min(hits)
                self.text, self.finish = self.text[:i + len(s) * self.include_stop], "stop"
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


def completion_logprobs(tok: Tokenizer, scored: list[tuple[int, TokenScore | None]]) -> dict:
    """OpenAI's completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
    out, offset = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}, 0
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
# replies


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


@dataclasses.dataclass
class Choice:
    """One choice being generated: its prompt, its text so far, and its prompt's scores (with echo)."""
    prompt: list[int]
    generated: ChoiceText  # its text so far, cut at a stop string, and the ids taken
    prompt_scores: list | None = None


async def pieces(served: ServedModel, reqs: list[EngineRequest], make_text, choices: list[Choice]):
    """Every prompt's n rows, all submitted at once: (choice index, new text) as each grows; choices fills up.
    A choice's last piece comes when its finish reason is set (the piece may be empty)."""
    loop = asyncio.get_running_loop()
    handles = [served.engine.submit(r, loop) for r in reqs]
    served.metrics.prompt_tokens.inc(sum(len(r.prompt) for r in reqs))
    streams = [h.events() for h in handles]
    try:
        for k, (r, h, events) in enumerate(zip(reqs, handles, streams)):
            its = [Choice(r.prompt, make_text()) for _ in range(r.n)]
            choices += its
            held, ended = [""] * r.n, [False] * r.n  # text not yet yielded; whether the finish was
            async for event in events:
                if isinstance(event, PromptScores):
                    for c in its:
                        c.prompt_scores = event.scores
                    continue
                for i, (c, step) in enumerate(zip(its, event)):
                    if not c.generated.finish:
                        held[i] += c.generated.push(step.token, step.score)
                done = all(c.generated.finish for c in its)
                if h.queued() and not done:
                    continue  # the engine is ahead of this client: the steps already queued go out as one piece
                for i, c in enumerate(its):
                    if held[i] or (c.generated.finish and not ended[i]):
                        yield k * r.n + i, held[i]
                        held[i], ended[i] = "", bool(c.generated.finish)
                if done:
                    break
            if r.max_tokens == 0:  # scored, not generated: the choice ends at once
                for i, c in enumerate(its):
                    c.generated.finish = "length"
                    yield k * r.n + i, ""
    finally:
        for h, events in zip(handles, streams):
            await events.aclose()  # stops the generation when the rows are done early or the client left
            served.metrics.done(h)


async def reply(served: ServedModel, req: RequestBase, reqs: list[EngineRequest], stops: list[str],
                chat: bool) -> dict | StreamingResponse:
    """The reply to a completions request (chat=False) or a chat completions one (chat=True), generated by reqs
    (one per prompt, each with its n choices): OpenAI's text_completion or chat.completion as a dict, or, with
    req.stream, a StreamingResponse of server-sent events (each a ".chunk" object, then "data: [DONE]").

    The two shapes differ in each choice alone: a completion's carries text and the logprobs lists (with echo,
    the prompt's first); a chat reply's a message (streamed: a delta, the first chunk naming the role) and
    logprobs.content. A choice's text is cut at stops, never sent in part; stop_ids end it (<|endoftext|>, or
    the end of a chat turn), unless req.ignore_eos. With stream_options.continuous_usage_stats every chunk
    carries the usage so far."""
    tok = served.tok
    stop_ids = set() if req.ignore_eos else stop_ids_of(served, chat)[1]
    hidden = ({tok.eot_token} | set(tok.special_tokens.values())) - {None} if req.skip_special_tokens else set()
    kind = "chat.completion" if chat else "text_completion"
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
    prompt_tokens = sum(len(r.prompt) for r in reqs)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous = include_usage and req.stream_options.continuous_usage_stats
    want_logprobs = reqs[0].logprobs is not None
    make_text = lambda: ChoiceText(tok, stops, stop_ids, max(1, reqs[0].max_tokens), req.min_tokens,  # noqa: E731
                                   req.include_stop_str_in_output, hidden)

    def logprobs_of(scored):
        if not want_logprobs:
            return None
        return {"content": chat_logprobs(tok, scored, stop_ids)} if chat else completion_logprobs(tok, scored)

    def choice(i: int, text: str, finish: str | None, c: Choice, first: bool = False) -> dict:
        if chat:
            delta = ({"role": "assistant", "content": text} if first else {"content": text}) if text or first else {}
            return {"index": i, "delta": delta,
                    "logprobs": None if first else logprobs_of(c.generated.take_scores()), "finish_reason": finish}
        return {"index": i, "text": text, "logprobs": logprobs_of(c.generated.take_scores()),
                "finish_reason": finish}

    created = int(time.time())  # one for the whole reply: OpenAI's chunks of one stream share it
    # without its "}": serialised once, not per chunk
    head = json.dumps({"id": rid, "object": kind + (".chunk" if chat else ""), "created": created,
                       "model": served.name}, ensure_ascii=False)[:-1]

    choices: list[Choice] = []  # filled by pieces

    def event(parts: list[dict], used: dict | None = None) -> str:
        """One chunk of the stream as a server-sent event: the fields every chunk shares, then its own."""
        used = usage(prompt_tokens, sum(c.generated.tokens for c in choices)) if continuous else used
        tail = f', "usage": {json.dumps(used)}}}' if include_usage else "}"
        return f'data: {head}, "choices": {json.dumps(parts, ensure_ascii=False)}{tail}\n\n'

    def whole_choice(i: int, c: Choice) -> dict:
        if chat:
            return {"index": i, "message": {"role": "assistant", "content": c.generated.text},
                    "logprobs": logprobs_of(c.generated.scored), "finish_reason": c.generated.finish}
        text, scored = c.generated.text, c.generated.scored
        if reqs[0].echo:
            text = tok.decode(c.prompt) + text
            scored = list(zip(c.prompt, c.prompt_scores or [None] * len(c.prompt))) + scored
        return {"index": i, "text": text, "logprobs": logprobs_of(scored), "finish_reason": c.generated.finish}

    if not req.stream:
        async for _ in pieces(served, reqs, make_text, choices):
            pass
        return {"id": rid, "object": kind, "created": created, "model": served.name,
                "choices": [whole_choice(i, c) for i, c in enumerate(choices)],
                "usage": usage(prompt_tokens, sum(c.generated.tokens for c in choices if reqs[0].max_tokens))}

    async def events() -> AsyncIterator[str]:
        try:
            if chat:  # OpenAI's first chunk of each choice names the role
                for i in range(sum(r.n for r in reqs)):
                    yield event([choice(i, "", None, None, first=True)])
            async for i, piece in pieces(served, reqs, make_text, choices):
                yield event([choice(i, piece, choices[i].generated.finish, choices[i])])
            if include_usage:
                yield event([], usage(prompt_tokens, sum(c.generated.tokens for c in choices)))
            yield "data: [DONE]\n\n"
        except ServerStopping:
            yield sse(error_body("the server is shutting down; the reply is incomplete", "server_error"))
        except EngineDied as e:
            yield sse(engine_dead_body(str(e)))
        except Exception as e:  # the headers are sent: the error goes in the stream, as OpenAI's does
            yield sse(error_body(first_line(e), "server_error"))
    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

