"""OpenAI's API as serve.py speaks it: the request models, their checks and errors, the replies.

Every field OpenAI documents, and each of vLLM's extensions that means something here, is implemented; any other
is a 400 that names it (extra="forbid"). A request's checks raise APIError; what passes becomes EngineRequests
(core/serving/engine.py), whose steps become the reply: whole characters, cut at a stop string, whole or streamed.
"""
import asyncio
import collections
import contextlib
import dataclasses
import itertools
import json
import secrets
import time
from typing import Any, AsyncIterator, Callable

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException

from core.data.chat import ChatTemplate
from core.data.tokenizer import StreamDecoder, Tokenizer
from core.decoding.decode import check_sampling_args
from core.errors import UserError, first_line
from core.serving.engine import (MAX_LOGPROBS, BatchEngine, EngineDied, EngineRequest, NothingToDraw, PromptScores,
                                 ServerStopping, TokenScore, engine_sampling)
from core.serving.metrics import Metrics
from core.serving.process import EngineProcess

# -----------------------------------------------------------------------------
# requests: every field is implemented here or refused (extra="forbid" names it)


class StrictModel(BaseModel):
    """Strict types, finite numbers (JSON's 1e999 reads as infinity, and Python's reads NaN), and no field but those
    declared: any other is a 400 that names it (unreadable, below)."""
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, the usage so far on every chunk


class Generating(StrictModel):
    """What every request that generates takes: OpenAI's fields, and vLLM's stop and ignore_eos."""
    model: str | None = None  # None: the one served (vLLM's)
    temperature: float = 1.0
    top_p: float = 1.0
    stream: bool = False
    stop: str | list[str] | None = None
    ignore_eos: bool = False


class RequestBase(Generating):
    """What completions and chat completions share: OpenAI's fields, then vLLM's (the openai client's extra_body)."""
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    top_k: int | None = None  # not OpenAI's; vLLM's extra field (extra_body={"top_k": ...})
    n: int = 1
    seed: int | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    min_p: float = 0.0
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    return_token_ids: bool = False
    truncate_prompt_tokens: int | None = None


class CompletionRequest(RequestBase):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    add_special_tokens: bool = True  # vLLM's default for completions


class ChatRequest(RequestBase):
    messages: list[dict[str, Any]]  # checked by the template, whose errors name the message
    logprobs: bool = False
    top_logprobs: int | None = None
    add_special_tokens: bool = False  # vLLM's default for chat: the template has placed what it needs


class ResponsesRequest(Generating):
    """OpenAI's Responses API, text in and text out (guidellm sends vLLM's stop and ignore_eos)."""
    input: str | list[dict[str, Any]]  # a user message's text, or messages (checked by respond)
    instructions: str | None = None  # a system message before the input; not carried to the next response
    previous_response_id: str | None = None  # the conversation so far: a response this server stored
    store: bool = True  # kept for a later previous_response_id
    max_output_tokens: int | None = None


class TokenizeRequest(StrictModel):
    prompt: str
    add_special_tokens: bool = True
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

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> "ErrorResponse":
        return ErrorResponse(self.body(), status_code=self.status)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None  # the request's field at fault
    code: str | None


class ErrorBody(BaseModel):
    """Every error's body (OpenAI's shape), as /openapi.json declares it."""
    error: ErrorDetail


# Each status a route may answer besides 200, why, and its body: what the routes declare (serve.py's ERRORS).
WHY = {400: "the body, a field or the prompt refused: `param` names the field", 401: "no API key, or a wrong one "
       "(with --api_key)", 404: "a model not served here", 413: "a body over --max_body_bytes", 500: "generation "
       "failed (out of memory, say)", 503: "the engine's process has died (the server exits, for its supervisor), or "
       "the server is shutting down"}


def errors(*statuses: int) -> dict:
    return {status: {"model": ErrorBody, "description": WHY[status]} for status in statuses}


class ErrorResponse(JSONResponse):
    """In ASCII: what a message quotes back from a request (a lone surrogate, say) cannot fail to encode."""

    def render(self, content) -> bytes:
        return json.dumps(content).encode()


def as_api_error(e: Exception) -> APIError:
    """What an exception tells the client: a status, and the body sent whole or, once a stream has started, in it."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, RequestValidationError):
        return unreadable(e.errors()[0])
    if isinstance(e, HTTPException):
        return APIError(e.status_code, str(e.detail), code=str(e.status_code))
    if isinstance(e, EngineDied):  # also /health's (docs/serving.md, "When the engine dies")
        return APIError(503, f"{e}; the server cannot generate and is exiting, to be restarted by its supervisor",
                        code="engine_dead", type="server_error")
    if isinstance(e, NothingToDraw):
        return APIError(400, f"{e}; allow more tokens or ban fewer")
    if isinstance(e, ServerStopping):
        return APIError(503, "the server is shutting down; the reply is incomplete", type="server_error")
    return APIError(500, f"internal error: {first_line(e)}", type="server_error")


def unreadable(err: dict) -> APIError:
    """A body the request model refused (pydantic's first error): not JSON, a field it lacks, a wrong value."""
    if err["type"] == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {err.get('ctx', {}).get('error', '')}")
    loc = [str(part) for part in err["loc"] if part != "body"]
    param = loc[0] if loc else None  # the request's field; deeper parts name union members or list items
    if err["type"] == "extra_forbidden":
        where = f" (in {'.'.join(loc[:-1])})" if len(loc) > 1 else ""
        return APIError(400, f"{loc[-1]}: this server does not support the field '{loc[-1]}'{where}; leave it out "
                             f"(docs/serving.md lists the fields it takes)", param, "unsupported_field")
    got = json.dumps(err.get("input"), default=repr)[:80] if err["type"] != "missing" else "nothing"
    return APIError(400, f"{param}: {err['msg']} (got {got})" if param else f"the body: {err['msg']}", param)


async def refuse(request, e: Exception) -> ErrorResponse:
    return as_api_error(e).response()


# The app's exception handlers: every error a JSON body in OpenAI's shape (the ones named here without a traceback).
HANDLERS = dict.fromkeys((APIError, RequestValidationError, HTTPException, EngineDied, NothingToDraw, ServerStopping,
                          Exception), refuse)


# -----------------------------------------------------------------------------
# checking a request


@dataclasses.dataclass
class ServedModel:
    """The model behind the API (serve.py's app.state.served): what the checks and replies below read."""
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
    stored: collections.OrderedDict = dataclasses.field(default_factory=collections.OrderedDict)  # Responses' memory


def check_model(served: ServedModel, model: str | None) -> None:
    if model is not None and model != served.name:
        raise APIError(404, f"model '{model}' is not served here; this server serves '{served.name}' (GET /v1/models)",
                       "model", "model_not_found")


def text_of(content, kinds: tuple[str, ...] = ("text",)):
    """content given as OpenAI's list of text parts (of these kinds) joined into one string; else as it is."""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in kinds for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    return content


def bad_word_ids(tok: Tokenizer, words: list[str]) -> tuple[tuple[int, ...], ...]:
    """vLLM's reading of bad_words: each word's ids, and those of the word after a space where that is another
    spelling of as many ids (a BPE's word inside a sentence)."""
    ids = []
    for word in words:
        try:
            ids.append(plain := tuple(tok.encode(word.lstrip())))
        except UserError as e:  # a char vocabulary names the characters it lacks
            raise APIError(400, f"bad_words: {e}", "bad_words") from None
        with contextlib.suppress(UserError):  # a vocabulary without the space has no other spelling
            if (spaced := tuple(tok.encode(" " + word.lstrip())))[0] != plain[0] and len(spaced) == len(plain):
                ids.append(spaced)
    return tuple(ids)


def engine_requests(served: ServedModel, req: RequestBase, prompts: list[list[int]], default_max: int,
                    logprobs: int | None = None, prompt_logprobs: int | None = None,
                    echo: bool = False) -> tuple[list[EngineRequest], list[str]]:
    """(an EngineRequest per prompt, req's stop strings), every field checked first: APIError names the first that
    is wrong."""
    max_tokens = next(m for m in (req.max_completion_tokens, req.max_tokens, default_max) if m is not None)
    if not (0 if echo else 1) <= max_tokens <= served.max_tokens_limit:
        raise APIError(400, f"max_tokens must be in 1..{served.max_tokens_limit} on this server (0 only with echo), "
                            f"got {max_tokens}", "max_tokens")
    most_n = min(served.max_n, served.engine.settings.max_batch)  # n rows take n of the engine's slots
    check_ranges(req, ("min_tokens", 0, max_tokens, f"0..max_tokens ({max_tokens})"),
                 ("n", 1, most_n, f"1..{most_n} on this server"), ("seed", 0, 2 ** 64 - 1, "0..2**64-1"),
                 ("presence_penalty", -2, 2, "[-2, 2]"), ("frequency_penalty", -2, 2, "[-2, 2]"),
                 ("min_p", 0, 1, "[0, 1] (0: none)"), ("prompt_logprobs", 0, MAX_LOGPROBS, f"0..{MAX_LOGPROBS}"))
    if not req.repetition_penalty > 0:
        raise APIError(400, f"repetition_penalty must be greater than 0 (1: none), got {req.repetition_penalty}",
                       "repetition_penalty")
    top_p = None if req.top_p == 1 else req.top_p
    try:
        check_sampling_args(req.temperature, req.top_k, top_p)
    except ValueError as e:  # the message starts with the setting's name
        raise APIError(400, str(e), str(e).split()[0]) from None
    for key, value in (req.logit_bias or {}).items():
        if not (key.isascii() and key.isdigit()) or not int(key) < served.tok.vocab_size:
            raise APIError(400, f"logit_bias keys are token ids in 0..{served.tok.vocab_size - 1}, got '{key}'",
                           "logit_bias")
        if not -100 <= value <= 100:
            raise APIError(400, f"logit_bias values must be in [-100, 100], got {value} for {key}", "logit_bias")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > 4 or any(s == "" for s in stops):
        raise APIError(400, "stop takes at most 4 non-empty strings", "stop")
    for field, ids in (("stop_token_ids", req.stop_token_ids), ("allowed_token_ids", req.allowed_token_ids)):
        if ids is not None and not all(0 <= i < served.tok.vocab_size for i in ids):
            raise APIError(400, f"{field} takes token ids in 0..{served.tok.vocab_size - 1}", field)
    if req.allowed_token_ids == []:
        raise APIError(400, "allowed_token_ids must hold at least one id (leave it out for any)", "allowed_token_ids")
    if any(not w.strip() for w in req.bad_words or ()):
        raise APIError(400, "bad_words takes words, not empty or blank strings", "bad_words")
    if req.prompt_logprobs is not None and req.stream:
        raise APIError(400, "prompt_logprobs with stream is not supported (as vLLM's); leave one out", "prompt_logprobs")
    # the id that ends a row in the engine, and every id that ends a choice (the chat template's others too)
    eot, ends = ((served.template.end_of_turn, served.template.stop_tokens) if isinstance(req, ChatRequest)
                 else (served.tok.eot_token, {served.tok.eot_token} - {None}))
    if req.prompt_logprobs is not None:  # echo's and vLLM's prompt logprobs share the engine's scores
        prompt_logprobs = max(req.prompt_logprobs, prompt_logprobs or 0)
    rules = dict(logit_bias={int(k): v for k, v in (req.logit_bias or {}).items()},  # EngineRequest's logit rules
                 stop_tokens=tuple(sorted(ends | set(req.stop_token_ids or ()))),
                 allowed_token_ids=None if req.allowed_token_ids is None else tuple(req.allowed_token_ids),
                 bad_words=bad_word_ids(served.tok, req.bad_words or []), **req.model_dump(
                     include={"presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "min_p"}))
    temperature = 0.0 if req.temperature < 1e-5 else req.temperature  # vLLM's: greedy (its logits would overflow)
    settings = served.engine.settings
    return [EngineRequest(prompt, req.n, max_tokens, engine_sampling(  # each prompt's generator, seeded alike
        temperature, req.top_k, top_p, req.seed, served.device, None if req.ignore_eos else eot, settings.window_shift,
        settings.vocab_size), logprobs, prompt_logprobs, **rules) for prompt in prompts], stops


def check_ranges(req: StrictModel, *ranges: tuple[str, float, float, str]) -> None:
    """Each (field, lo, hi, how the range reads) that req gives, in lo..hi: else a 400 naming the first that is not."""
    for field, lo, hi, shown in ranges:
        if (value := getattr(req, field)) is not None and not lo <= value <= hi:
            raise APIError(400, f"{field} must be in {shown}, got {value}", field)


def encode(tok: Tokenizer, text: str, add_special_tokens: bool = False) -> list[int]:
    """text's ids, "<|endoftext|>" in it the token (as vLLM), with the special tokens wrapped around it."""
    try:
        ids = tok.encode_with_specials(text)
    except UserError as e:  # a char vocabulary names the characters it lacks
        raise APIError(400, f"the prompt cannot be encoded: {e}", "prompt") from None
    return with_special_tokens(tok, ids) if add_special_tokens else ids


def with_special_tokens(tok: Tokenizer, ids: list[int]) -> list[int]:
    """ids wrapped as transformers' add_special_tokens wraps them: by a tokenizer.json's post-processor (a BOS,
    say); GPT-2's vocabulary and ours have none, as transformers' GPT-2 tokenizer adds none."""
    backend = getattr(tok, "backend", None)  # an HFTokenizer's tokenizers.Tokenizer
    if backend is None or backend.post_processor is None:
        return ids
    bare, wrapped = backend.encode("a", add_special_tokens=False).ids, backend.encode("a").ids
    at = next(i for i in range(len(wrapped)) if wrapped[i:i + len(bare)] == bare)
    return wrapped[:at] + ids + wrapped[at + len(bare):]


def checked_prompt(served: ServedModel, req: RequestBase, ids: list[int], param: str) -> list[int]:
    """ids cut to vLLM's truncate_prompt_tokens (the last k; -1: the model's context), then checked."""
    k = req.truncate_prompt_tokens
    if k is not None and not (k == -1 or 1 <= k <= served.block_size):
        raise APIError(400, f"truncate_prompt_tokens must be -1 (the context) or in 1..{served.block_size}, got {k}",
                       "truncate_prompt_tokens")
    ids = ids if k is None else ids[-(served.block_size if k == -1 else k):]
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
    prompts = [encode(served.tok, x, req.add_special_tokens) if isinstance(x, str) else list(x) for x in p]
    if [] in prompts and served.tok.eot_token is None:
        raise APIError(400, "the prompt is empty and this vocabulary has no <|endoftext|> to start from", "prompt")
    return [checked_prompt(served, req, ids or [served.tok.eot_token], "prompt") for ids in prompts]  # "": from eot


def completion_requests(served: ServedModel, req: CompletionRequest) -> tuple[list[EngineRequest], list[str]]:
    """A completion's request checked: (an EngineRequest per prompt, the stop strings)."""
    check_model(served, req.model)
    check_ranges(req, ("logprobs", 0, MAX_LOGPROBS, f"0..{MAX_LOGPROBS}"))
    if req.echo and req.stream:
        raise APIError(400, "echo with stream is not supported; leave one out", "echo")
    return engine_requests(served, req, prompts_of(served, req), 16, req.logprobs,  # 16: OpenAI's default max_tokens
                           (req.logprobs or 0) if req.echo else None, echo=req.echo)


def chat_requests(served: ServedModel, req: ChatRequest, param="messages") -> tuple[list[EngineRequest], list[str]]:
    """A chat completion's request checked, its messages rendered by the chat template (errors naming param):
    ([its EngineRequest], the stop strings)."""
    check_model(served, req.model)
    if served.template is None:
        raise APIError(400, f"model '{served.name}' has no chat template (a base model, its tokenizer has no chat "
                            f"tokens); use /v1/completions", param, "no_chat_template")
    if req.top_logprobs is not None and not (req.logprobs and 0 <= req.top_logprobs <= MAX_LOGPROBS):
        raise APIError(400, f"top_logprobs must be in 0..{MAX_LOGPROBS}, and needs logprobs=true", "top_logprobs")
    messages = [{"role": m.get("role"), "content": text_of(m.get("content"))} if "content" in m else m
                for m in req.messages]
    try:
        prompt = served.template.render_prompt(messages)
    except UserError as e:
        raise APIError(400, str(e), param) from None
    if req.add_special_tokens:
        prompt = with_special_tokens(served.tok, prompt)
    prompt = checked_prompt(served, req, prompt, param)
    default = max(1, min(served.max_tokens_limit, served.block_size - len(prompt)))  # the rest of the context
    return engine_requests(served, req, [prompt], default, (req.top_logprobs or 0) if req.logprobs else None)


# -----------------------------------------------------------------------------
# text: whole characters, stop strings, finish reasons


class ChoiceText:
    """One choice's text as its ids arrive: only whole UTF-8 characters, cut at a stop string; and its prompt,
    with the prompt's scores (echo).

    As vLLM's: hidden ids (the special tokens, with skip_special_tokens) add no text; a stop string is looked for
    once more than min_tokens ids have come (one that ends past them counts), and is kept with include_stop.
    Each id taken is kept with its score (for logprobs) up to the one that finished the choice."""

    def __init__(self, tok: Tokenizer, stops: list[str], stop_ids: set[int], max_tokens: int, min_tokens: int = 0,
                 include_stop: bool = False, hidden: set[int] = frozenset(), prompt: list[int] = ()):
        self.decoder, self.stops, self.stop_ids, self.max_tokens = StreamDecoder(tok), stops, stop_ids, max_tokens
        self.min_tokens, self.include_stop, self.hidden = min_tokens, include_stop, hidden
        self.prompt, self.prompt_scores, self.cached = prompt, None, 0  # cached: the prompt's ids the prefix cache held
        self.text, self.sent, self.tokens, self.floor = "", 0, 0, 0  # floor: the text of the first min_tokens ids
        self.finish: str | None = None
        self.scored: list[tuple[int, TokenScore | None]] = []  # every id taken, with its score
        self.sent_scores = 0  # how many of them a chunk has carried

    def push(self, token: int, score: TokenScore | None = None) -> str:
        """Take one id; return the text that is now safe to send (held back: a possible stop string's start)."""
        if self.finish:
            return ""
        self.tokens += 1
        self.scored.append((token, score))
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
        new, self.sent_scores = self.scored[self.sent_scores:], len(self.scored)
        return new

    def _held_back(self) -> int:
        """Length of the longest end of text that begins a stop string."""
        longest = min(len(self.text), max(map(len, self.stops), default=1) - 1)
        return next((k for k in range(longest, 0, -1) if any(s.startswith(self.text[-k:]) for s in self.stops)), 0)


def completion_logprobs(tok: Tokenizer, scored: list[tuple[int, TokenScore | None]]) -> dict:
    """OpenAI's completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens = [tok.decode([token]) for token, _ in scored]
    return {"tokens": tokens, "token_logprobs": [None if sc is None else sc.logprob for _, sc in scored],
            "top_logprobs": [None if sc is None else {tok.decode([i]): lp for i, lp in sc.top} for _, sc in scored],
            "text_offset": list(itertools.accumulate(map(len, tokens), initial=0))[:-1]}


def prompt_logprobs(tok: Tokenizer, prompt: list[int], scores: list[TokenScore | None], k: int) -> list[dict | None]:
    """vLLM's prompt_logprobs: for each prompt token but the first, {id: {logprob, rank, decoded_token}} of the
    token and of the k most likely there."""
    def entry(i: int, lp: float, rank: int) -> dict:
        return {"logprob": lp, "rank": rank, "decoded_token": tok.decode([i])}
    return [None] + [{t: entry(t, s.logprob, s.rank)} | {i: entry(i, lp, r + 1) for r, (i, lp) in enumerate(s.top[:k])}
                     for t, s in zip(prompt[1:], scores[1:])]


def chat_logprobs(tok: Tokenizer, scored: list[tuple[int, TokenScore | None]], stop_ids: set[int]) -> list[dict]:
    """OpenAI's chat logprobs.content: one entry per token of the reply (the end-of-turn token left out)."""
    def entry(i: int, lp: float) -> dict:
        text = tok.decode([i])
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
    return [{**entry(t, sc.logprob), "top_logprobs": [entry(i, lp) for i, lp in sc.top]}
            for t, sc in scored if sc is not None and t not in stop_ids]


# -----------------------------------------------------------------------------
# replies


@dataclasses.dataclass(frozen=True)
class Shape:
    """What a completions reply and a chat completions reply differ in: their names, how a choice carries its
    text (whole, or a stream chunk's piece) and its logprobs, and where vLLM's prompt fields go (each choice's,
    or the reply's once)."""
    id_prefix: str
    object: str
    chunk_object: str
    whole_text: Callable[[str], dict]
    chunk_text: Callable[[str], dict]
    logprobs: Callable[[Tokenizer, list, set[int]], dict]
    opening: dict | None  # each choice's first chunk, before its text: chat's names the role
    prompt_per_choice: bool


COMPLETION = Shape("cmpl", "text_completion", "text_completion", lambda text: {"text": text},
                   lambda text: {"text": text}, lambda tok, scored, stop_ids: completion_logprobs(tok, scored), None,
                   True)
CHAT = Shape("chatcmpl", "chat.completion", "chat.completion.chunk",
             lambda text: {"message": {"role": "assistant", "content": text}},
             lambda text: {"delta": {"content": text} if text else {}},
             lambda tok, scored, stop_ids: {"content": chat_logprobs(tok, scored, stop_ids)},
             {"delta": {"role": "assistant", "content": ""}}, False)


async def pieces(served: ServedModel, reqs: list[EngineRequest], make_text, choices: list[ChoiceText]):
    """Every prompt's n rows, all submitted at once: (choice index, new text) as each grows; choices fills up.
    A choice's last piece comes when its finish reason is set (the piece may be empty)."""
    handles = [served.engine.submit(r, asyncio.get_running_loop()) for r in reqs]
    served.metrics.prompt_tokens.inc(sum(len(r.prompt) for r in reqs))
    streams = [h.events() for h in handles]
    try:
        for k, (r, h, events) in enumerate(zip(reqs, handles, streams)):
            its = [make_text(r.prompt) for _ in range(r.n)]
            choices += its
            held, ended = [""] * r.n, [False] * r.n  # text not yet yielded; whether the finish was
            async for event in events:
                if isinstance(event, PromptScores):
                    for c in its:
                        c.prompt_scores, c.cached = event.scores, event.cached
                    served.metrics.prefix(len(r.prompt), event.cached)
                    continue
                for i, (c, step) in enumerate(zip(its, event)):
                    if not c.finish:
                        held[i] += c.push(step.token, step.score)
                done = all(c.finish for c in its)
                if h.queued() and not done:
                    continue  # the engine is ahead of this client: the steps already queued go out as one piece
                for i, c in enumerate(its):
                    if held[i] or (c.finish and not ended[i]):
                        yield k * r.n + i, held[i]
                        held[i], ended[i] = "", bool(c.finish)
                if done:
                    break
            if r.max_tokens == 0:  # scored, not generated: the choice ends at once
                for i, c in enumerate(its):
                    c.finish = "length"
                    yield k * r.n + i, ""
    finally:
        for h, events in zip(handles, streams):
            await events.aclose()  # stops the generation when the rows are done early or the client left
            served.metrics.done(h)


class Reply:
    """One reply: its id and time, its choices' text rules (stop strings; stop ids unless ignore_eos; special
    tokens hidden with skip_special_tokens), and its choices as they grow."""

    def __init__(self, served: ServedModel, req: RequestBase, reqs: list[EngineRequest], stops: list[str],
                 shape: Shape):
        tok = served.tok
        self.served, self.req, self.reqs, self.shape = served, req, reqs, shape
        self.stop_ids = set() if req.ignore_eos else set(reqs[0].stop_tokens)
        hidden = ({tok.eot_token} | set(tok.special_tokens.values())) - {None} if req.skip_special_tokens else set()
        self.make_text = lambda prompt: ChoiceText(tok, stops, self.stop_ids, max(1, reqs[0].max_tokens),  # noqa: E731
                                                   req.min_tokens, req.include_stop_str_in_output, hidden, prompt)
        self.id, self.created = f"{shape.id_prefix}-{secrets.token_hex(12)}", int(time.time())
        self.prompt_tokens = sum(len(r.prompt) for r in reqs)
        self.choices: list[ChoiceText] = []  # filled by pieces

    async def answer(self) -> dict | StreamingResponse:
        """The reply streamed as server-sent events, or whole once every choice is."""
        if self.req.stream:
            return StreamingResponse(self.events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        async for _ in pieces(self.served, self.reqs, self.make_text, self.choices):
            pass
        return self.whole()

    def usage(self) -> dict:
        done = sum(c.tokens for c in self.choices)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": done, "total_tokens": self.prompt_tokens + done,
                "prompt_tokens_details": {"cached_tokens": sum(c.cached for c in self.choices[::self.reqs[0].n])}}

    def choice(self, i: int, text: dict, scored: list, finish: str | None, ids: list[int]) -> dict:
        logprobs = None if self.reqs[0].logprobs is None else self.shape.logprobs(self.served.tok, scored,
                                                                                  self.stop_ids)
        choice = {"index": i, **text, "logprobs": logprobs, "finish_reason": finish}
        return choice | ({"token_ids": ids} if self.req.return_token_ids else {})

    def prompt_fields(self, c: ChoiceText) -> dict:
        """vLLM's fields of a choice's prompt, as asked for: its ids, its scores."""
        fields = {"prompt_token_ids": list(c.prompt)} if self.req.return_token_ids else {}
        if self.req.prompt_logprobs is not None:
            fields["prompt_logprobs"] = prompt_logprobs(self.served.tok, c.prompt, c.prompt_scores,
                                                        self.req.prompt_logprobs)
        return fields

    def whole(self) -> dict:
        """Every choice whole; with echo (completions), its prompt's text and scores first."""
        choices, per_choice = [], self.shape.prompt_per_choice
        for i, c in enumerate(self.choices):
            text, scored = c.text, c.scored
            if getattr(self.req, "echo", False):
                text = self.served.tok.decode(c.prompt) + text
                scored = [(t, s and s.cut(self.reqs[0].logprobs or 0)) for t, s in
                          zip(c.prompt, c.prompt_scores or [None] * len(c.prompt))] + scored
            choices.append(self.choice(i, self.shape.whole_text(text), scored, c.finish, [t for t, _ in c.scored])
                           | (self.prompt_fields(c) if per_choice else {}))
        return ({"id": self.id, "object": self.shape.object, "created": self.created, "model": self.served.name,
                 "choices": choices, "usage": self.usage()} | ({} if per_choice else self.prompt_fields(self.choices[0])))

    async def events(self) -> AsyncIterator[str]:
        """Each choice's opening chunk (chat's), a chunk per piece of text, with include_usage a last chunk of
        the usage (with continuous_usage_stats every chunk carries it so far), then "data: [DONE]"."""
        options = self.req.stream_options or StreamOptions()
        include_usage, continuous = options.include_usage, options.continuous_usage_stats
        # the fields every chunk shares, serialised once, without their "}"
        head = json.dumps({"id": self.id, "object": self.shape.chunk_object, "created": self.created,
                           "model": self.served.name}, ensure_ascii=False)[:-1]

        def chunk(choices: list[dict], last: bool = False, prompt: dict = {}) -> str:
            tail = f', "usage": {json.dumps(self.usage() if continuous or last else None)}}}' if include_usage else "}"
            more = "".join(f', "{k}": {json.dumps(v)}' for k, v in prompt.items())  # vLLM's, the first chunk's
            return f'data: {head}, "choices": {json.dumps(choices, ensure_ascii=False)}{more}{tail}\n\n'
        prompts = ({"prompt_token_ids": list(r.prompt)} if self.req.return_token_ids else {} for r in self.reqs)
        try:
            if self.shape.opening:
                for i in range(sum(r.n for r in self.reqs)):
                    yield chunk([{"index": i, **self.shape.opening, "logprobs": None, "finish_reason": None}],
                                prompt=next(prompts, {}))
            started = set()
            async for i, piece in pieces(self.served, self.reqs, self.make_text, self.choices):
                c, scored = self.choices[i], self.choices[i].take_scores()
                choice = self.choice(i, self.shape.chunk_text(piece), scored, c.finish, [t for t, _ in scored])
                if self.shape.prompt_per_choice and i not in started:
                    started.add(i)
                    choice |= self.prompt_fields(c)
                yield chunk([choice])
            if include_usage:
                yield chunk([], last=True)
            yield "data: [DONE]\n\n"
        except Exception as e:  # the headers are sent: the error goes in the stream, as OpenAI's does
            yield f"data: {json.dumps(as_api_error(e).body(), ensure_ascii=False)}\n\n"


# -----------------------------------------------------------------------------
# the Responses API: a chat completion's one choice, as a response object or its events

STORED_RESPONSES = 1000  # conversations kept for previous_response_id, the oldest forgotten first: a bound on memory


def response_requests(served: ServedModel, req: ResponsesRequest) -> tuple[ChatRequest, list[EngineRequest],
                                                                            list[str], list[dict]]:
    """A response's request checked as a chat completion of one choice, of the instructions, the stored conversation
    and the input: (that chat request, its EngineRequests, the stop strings, the conversation to store)."""
    history = [] if req.previous_response_id is None else served.stored.get(req.previous_response_id)
    if history is None:
        raise APIError(400, f"previous_response_id '{req.previous_response_id}' is not a response this server "
                            f"stored (it keeps the last {STORED_RESPONSES}, until it restarts)",
                       "previous_response_id", "previous_response_not_found")
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    turns = []
    for i, item in enumerate(items):
        content = text_of(item.get("content"), ("input_text", "output_text"))
        if item.get("type", "message") != "message" or not isinstance(content, str):
            raise APIError(400, f"input[{i}]: only messages of text are served here (input_text, output_text), got "
                                f"{json.dumps(item)[:80]}", "input")
        turns.append({"role": {"developer": "system"}.get(item.get("role"), item.get("role")), "content": content})
    system = [] if req.instructions is None else [{"role": "system", "content": req.instructions}]
    chat = ChatRequest(messages=system + history + turns, max_tokens=req.max_output_tokens,
                       **req.model_dump(include=set(Generating.model_fields)))
    try:
        return chat, *chat_requests(served, chat, "input"), history + turns
    except APIError as e:  # named as this API names it
        e.param = "max_output_tokens" if e.param == "max_tokens" else e.param
        e.message = e.message.replace("max_tokens", "max_output_tokens")
        raise


class Response(Reply):
    """A response: Reply's one choice (its text rules, usage, pieces), as the Responses API's object, whole or as
    its events; stored, with its conversation, for a later previous_response_id."""

    def __init__(self, served: ServedModel, request: ResponsesRequest, chat: ChatRequest, reqs: list[EngineRequest],
                 stops: list[str], conversation: list[dict]):
        super().__init__(served, chat, reqs, stops, CHAT)
        self.request, self.conversation = request, conversation
        self.id, self.message_id = f"resp_{secrets.token_hex(24)}", f"msg_{secrets.token_hex(24)}"

    def message(self, status: str) -> dict:
        return {"id": self.message_id, "type": "message", "status": status, "role": "assistant", "content": [] if
                status == "in_progress" else [{"type": "output_text", "text": self.choices[0].text, "annotations": []}]}

    def body(self, status: str) -> dict:
        """The response object: in_progress (no output yet), completed, or incomplete (max_output_tokens)."""
        r, usage = self.request, self.usage()
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "model": self.served.name,
                "output": [] if status == "in_progress" else [self.message(status)], "parallel_tool_calls": False,
                "previous_response_id": r.previous_response_id, "store": r.store, "temperature": r.temperature,
                "text": {"format": {"type": "text"}}, "tool_choice": "none", "tools": [], "top_p": r.top_p,
                "truncation": "disabled", "usage": None if status == "in_progress" else {
                    "input_tokens": usage["prompt_tokens"], "input_tokens_details": usage["prompt_tokens_details"],
                    "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                    "total_tokens": usage["total_tokens"]}}

    def finished(self) -> str:
        """The final status; a completed response stored with its conversation (the oldest forgotten first)."""
        status = "incomplete" if self.choices[0].finish == "length" else "completed"
        if self.request.store:
            self.served.stored[self.id] = self.conversation + [{"role": "assistant", "content": self.choices[0].text}]
            while len(self.served.stored) > STORED_RESPONSES:
                self.served.stored.popitem(last=False)
        return status

    def whole(self) -> dict:
        return self.body(self.finished())

    async def events(self) -> AsyncIterator[str]:
        """The Responses API's events, each named and numbered: created, in_progress, the message and its text
        part added, a delta per piece of text, then each done, then completed (or incomplete)."""
        numbers = itertools.count()

        def event(kind: str, **fields) -> str:
            body = {"type": kind, "sequence_number": next(numbers), **fields}
            return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"
        at = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        part = {"type": "output_text", "text": "", "annotations": []}
        yield event("response.created", response=self.body("in_progress"))
        yield event("response.in_progress", response=self.body("in_progress"))
        yield event("response.output_item.added", output_index=0, item=self.message("in_progress"))
        yield event("response.content_part.added", **at, part=part)
        try:
            async for _, piece in pieces(self.served, self.reqs, self.make_text, self.choices):
                if piece:
                    yield event("response.output_text.delta", **at, delta=piece, logprobs=[])
        except Exception as e:  # the headers are sent: the error is an event, as OpenAI's
            err = as_api_error(e)
            yield event("error", code=err.code or "server_error", message=err.message, param=err.param)
            return
        status, text = self.finished(), self.choices[0].text
        yield event("response.output_text.done", **at, text=text, logprobs=[])
        yield event("response.content_part.done", **at, part=part | {"text": text})
        yield event("response.output_item.done", output_index=0, item=self.message(status))
        yield event(f"response.{status}", response=self.body(status))
