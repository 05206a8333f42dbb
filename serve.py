"""Serve a trained model over OpenAI's HTTP API (completions, chat completions, models), with a chat page at /.

    python serve.py --out_dir=out-shakespeare-char                  # http://127.0.0.1:8000, the page at /
    python serve.py --init_from=gpt2 --port=8080                    # GPT-2 weights (needs transformers)
    python serve.py --out_dir=RUN --host=0.0.0.0 --api_key=SECRET   # or SERVE_API_KEY=SECRET in the environment

    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "out-shakespeare-char", "prompt": "ROMEO:", "max_tokens": 50, "temperature": 0}'

Any OpenAI client works: OpenAI(base_url="http://127.0.0.1:8000/v1", api_key=...). The model's name is
its out_dir's folder name (or init_from), unless --model_name says otherwise.

Requests are queued, not batched: one worker thread decodes every running request in turn, one token
each (each with its own KV cache and its own seeded generator, through model.generate_stream), so a
request's text is exactly what it would be alone, and a new request starts at once rather than after
the others. A client that goes away stops its generation at the next token.
"""
import asyncio
import dataclasses
import hmac
import ipaddress
import json
import os
import queue
import secrets
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator, Sequence

import torch

from core import runtime, weights
from core.chat import ChatTemplate
from core.config import parse_args
from core.errors import UserError, first_line, run_cli
from core.tokenizer import StreamDecoder, Tokenizer
from model import GPT, Sampling, check_sampling_args, window_shift

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
    device: str = "auto"             # auto, cpu, cuda, cuda:N, mps
    dtype: str = "auto"              # auto, float32, bfloat16, float16

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise UserError(f"port must be in 0..65535, got {self.port}")
        for key in ("max_tokens_limit", "max_n", "max_body_bytes"):
            if getattr(self, key) < 1:
                raise UserError(f"{key} must be at least 1, got {getattr(self, key)}")
        if self.api_key == "":
            raise UserError("--api_key is empty; pass a secret, or leave it out to serve without one")
        weights.check_init_from(self.init_from)


# -----------------------------------------------------------------------------
# the engine: one worker thread decoding every running request in turn


@dataclasses.dataclass
class Params:
    """One request's generation settings, checked."""
    max_tokens: int
    temperature: float
    top_k: int | None
    top_p: float | None
    seed: int


class Job:
    """One prompt's generation: n rows decoded together, their ids handed to the event loop step by step."""

    def __init__(self, tokens, loop: asyncio.AbstractEventLoop):
        self.tokens = tokens  # model.generate_stream's iterator of (n, 1) tensors
        self.loop = loop
        self.out: asyncio.Queue = asyncio.Queue()  # list[int] per step; then None (the end) or an exception
        self.cancelled = threading.Event()

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)
        except RuntimeError:  # the event loop has closed (shutting down): nobody is waiting for this any more
            pass

    async def steps(self) -> AsyncIterator[list[int]]:
        """Each step's new ids, one per row, until the generation ends; stops it when the caller leaves."""
        try:
            while (item := await self.out.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.cancelled.set()


class ServerStopping(Exception):
    pass


class Engine:
    def __init__(self, model: GPT, device: str, window_shift: int, vocab_size: int):
        self.model, self.device, self.window_shift, self.vocab_size = model, device, window_shift, vocab_size
        self.pending: queue.Queue[Job] = queue.Queue()
        self.stopping = threading.Event()
        self.running = 0            # requests being decoded now (for /health)
        self.tokens_generated = 0   # decoding steps taken (one token for each of a request's n rows) (for /health)
        self.thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()

    def submit(self, prompt: list[int], n: int, s: Params, eot: int | None) -> Job:
        """Queue n rows continuing prompt; generate_stream ends them early once each has produced eot."""
        idx = torch.tensor([prompt] * n, dtype=torch.long, device=self.device)  # (n, T)
        generator = torch.Generator(device=self.device).manual_seed(s.seed)
        sampling = Sampling(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, generator=generator,
                            eot_token=eot, window_shift=self.window_shift, vocab_size=self.vocab_size)
        tokens = self.model.generate_stream(idx, s.max_tokens, sampling)
        job = Job(tokens, asyncio.get_running_loop())
        if self.stopping.is_set():
            raise ServerStopping()
        self.pending.put(job)
        return job

    def _run(self) -> None:
        running: list[Job] = []
        while not self.stopping.is_set():
            try:  # wait for work only when there is none; otherwise just pick up what arrived
                while True:
                    running.append(self.pending.get(timeout=0.1) if not running else self.pending.get_nowait())
            except queue.Empty:
                pass
            self.running = len(running)
            running = [job for job in running if self._step(job)]
        for job in running + list(self.pending.queue):
            job.put(ServerStopping())

    def _step(self, job: Job) -> bool:
        """Decode one token of job; False once it is over (finished, failed or cancelled)."""
        if job.cancelled.is_set():
            return False
        try:
            token = next(job.tokens)  # (n, 1)
        except StopIteration:
            job.put(None)
            return False
        except Exception as e:  # out of memory, a broken model: this request fails, the server goes on
            job.put(RuntimeError(f"generation failed: {first_line(e)}"))
            return False
        self.tokens_generated += 1
        job.put(token[:, 0].tolist())
        return True


# -----------------------------------------------------------------------------
# text: whole characters, stop strings, finish reasons


class Row:
    """One choice's text as its ids arrive: only whole UTF-8 characters, cut at a stop string."""

    def __init__(self, tok: Tokenizer, stops: list[str], stop_ids: set[int], max_tokens: int):
        self.decoder, self.stops, self.stop_ids, self.max_tokens = StreamDecoder(tok), stops, stop_ids, max_tokens
        self.text, self.sent, self.tokens = "", 0, 0
        self.finish: str | None = None

    def push(self, token: int) -> str:
        """Take one id; return the text that is now safe to send (held back: a possible stop string's start)."""
        if self.finish:
            return ""
        self.tokens += 1
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

    def _held_back(self) -> int:
        """Length of the longest end of text that begins a stop string."""
        for k in range(min(len(self.text), max(map(len, self.stops), default=1) - 1), 0, -1):
            if any(s.startswith(self.text[-k:]) for s in self.stops):
                return k
        return 0


def generate(engine: Engine, tok: Tokenizer, prompt: list[int], n: int, s: Params, stops: list[str],
             stop_ids: set[int], eot: int | None) -> tuple[list[Row], AsyncIterator[tuple[int, str]]]:
    """Queue the prompt's n rows now; return them and an iterator of (row index, new text) as they grow.
    A row's last piece comes when its finish reason is set (the piece may be empty)."""
    rows = [Row(tok, stops, stop_ids, s.max_tokens) for _ in range(n)]
    job = engine.submit(prompt, n, s, eot)

    async def pieces():
        steps = job.steps()
        try:
            async for ids in steps:
                for i, (row, token) in enumerate(zip(rows, ids)):
                    if not row.finish:
                        piece = row.push(token)
                        if piece or row.finish:
                            yield i, piece
                if all(row.finish for row in rows):
                    break
        finally:
            await steps.aclose()  # stops the generation when the rows are done early or the client left
    return rows, pieces()


# -----------------------------------------------------------------------------
# the HTTP API


class APIError(Exception):
    """A request the server refuses, sent as OpenAI's {"error": {...}} with this status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_app(model: GPT, tok: Tokenizer, cfg: ServeConfig, name: str, device: str):
    """The ASGI app: routes, errors in OpenAI's shape, the key check, the body limit, the engine's lifetime."""
    from contextlib import asynccontextmanager

    from fastapi import Depends, FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
    from pydantic import BaseModel, ConfigDict
    from starlette.exceptions import HTTPException

    block_size = model.config.block_size
    try:
        shift = window_shift(cfg.window_shift, block_size)
    except ValueError as e:
        raise UserError(f"--window_shift: {e}") from None
    engine = Engine(model, device, shift, tok.vocab_size)
    template = ChatTemplate.for_tokenizer(tok)
    api_key = cfg.api_key or os.environ.get(API_KEY_ENV) or None
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        engine.stop()

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine

    # --- errors: every one in OpenAI's shape -------------------------------------------------

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, e: RequestValidationError):
        err = e.errors()[0]
        if err["type"] == "json_invalid":
            return JSONResponse(error_body(f"the body is not valid JSON: {err.get('ctx', {}).get('error', '')}"),
                                status_code=400)
        loc = [str(part) for part in err["loc"] if part != "body"]
        param = loc[0] if loc else None  # the request's field; deeper parts name union members or list items
        got = json.dumps(err.get("input"))[:80] if err["type"] != "missing" else "nothing"
        message = f"{param}: {err['msg']} (got {got})" if param else f"the body: {err['msg']}"
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return JSONResponse(error_body(str(e.detail), code=str(e.status_code)), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def crash(request, e: Exception):
        return JSONResponse(error_body(f"internal error: {first_line(e)}", "server_error"), status_code=500)

    # --- access -----------------------------------------------------------------------------

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
            raise APIError(401, "missing or wrong API key: send the header `Authorization: Bearer KEY`",
                           code="invalid_api_key")

    @app.middleware("http")
    async def limit_body(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > cfg.max_body_bytes:
            return JSONResponse(error_body(f"the request body is {length} bytes, more than the "
                                           f"{cfg.max_body_bytes} this server accepts", code="body_too_large"),
                                status_code=413)
        if request.method == "POST" and length is None:  # chunked: count as it arrives
            body = b""
            async for chunk in request.stream():
                body += chunk
                if len(body) > cfg.max_body_bytes:
                    return JSONResponse(error_body(f"the request body is more than the {cfg.max_body_bytes} bytes "
                                                   f"this server accepts", code="body_too_large"), status_code=413)
            request._body = body
        return await call_next(request)

    # --- requests ---------------------------------------------------------------------------

    class Strict(BaseModel):
        model_config = ConfigDict(strict=True, extra="ignore")

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

    class CompletionRequest(Common):
        prompt: str | list[str] | list[int] | list[list[int]]

    class ChatRequest(Common):
        messages: list[dict[str, Any]]  # checked by the template, whose errors name the message

    def messages_of(req: ChatRequest) -> list[dict]:
        """{role, content} dicts; content given as OpenAI's list of text parts is joined into one string."""
        def text(content):
            if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                return "".join(str(p.get("text", "")) for p in content)
            return content
        return [{"role": m.get("role"), "content": text(m.get("content"))} if "content" in m else m
                for m in req.messages]

    def check_model(req: Common) -> None:
        if req.model != name:
            raise APIError(400, f"model '{req.model}' is not served here; this server serves '{name}' "
                                f"(GET /v1/models)", "model", "model_not_found")

    def params(req: Common, default_max: int) -> tuple[Params, list[str]]:
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = default_max if max_tokens is None else max_tokens
        if not 1 <= max_tokens <= cfg.max_tokens_limit:
            raise APIError(400, f"max_tokens must be in 1..{cfg.max_tokens_limit} on this server, got {max_tokens}",
                           "max_tokens")
        top_p = None if req.top_p == 1 else req.top_p
        try:
            check_sampling_args(req.temperature, req.top_k, top_p)
        except ValueError as e:  # the message starts with the setting's name
            raise APIError(400, str(e), str(e).split()[0]) from None
        if not 1 <= req.n <= cfg.max_n:
            raise APIError(400, f"n must be in 1..{cfg.max_n} on this server, got {req.n}", "n")
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stops) > 4 or any(s == "" for s in stops):
            raise APIError(400, "stop takes at most 4 non-empty strings", "stop")
        seed = req.seed if req.seed is not None else secrets.randbits(63)
        if not 0 <= seed < 2 ** 64:
            raise APIError(400, f"seed must be in 0..2**64-1, got {seed}", "seed")
        return Params(max_tokens, req.temperature, req.top_k, top_p, seed), stops

    def encode(text: str, param: str) -> list[int]:
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

    def check_length(ids: list[int], param: str) -> list[int]:
        if len(ids) > block_size:
            raise APIError(400, f"the {param} is {len(ids)} tokens, longer than the model's context of {block_size}; "
                                f"shorten it", param, "context_length_exceeded")
        if any(not 0 <= i < tok.vocab_size for i in ids):
            raise APIError(400, f"the {param} holds token ids outside 0..{tok.vocab_size - 1}", param)
        return ids

    def prompts_of(req: CompletionRequest) -> list[list[int]]:
        p = req.prompt
        if isinstance(p, str):
            prompts = [encode(p, "prompt")]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]
        elif p and all(isinstance(x, str) for x in p):
            prompts = [encode(x, "prompt") for x in p]
        elif p and all(isinstance(x, list) and x for x in p):
            prompts = [list(x) for x in p]
        else:
            raise APIError(400, "prompt must be a string, a list of strings, or token ids; got an empty list", "prompt")
        return [check_length(ids, "prompt") for ids in prompts]

    def usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def sse(obj: Any) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def pieces(prompts: list[list[int]], n: int, s: Params, stops: list[str], stop_ids: set[int],
                     eot: int | None, rows: list[Row]) -> AsyncIterator[tuple[int, str, Row]]:
        """Every prompt's n rows, all queued at once: (choice index, new text, its row); rows fills up."""
        started = [generate(engine, tok, p, n, s, stops, stop_ids, eot) for p in prompts]
        try:
            for k, (its_rows, its_pieces) in enumerate(started):
                rows += its_rows
                async for i, piece in its_pieces:
                    yield k * n + i, piece, its_rows[i]
        finally:
            for _, its_pieces in started:
                await its_pieces.aclose()

    def reply(req: Common, prompts: list[list[int]], s: Params, stops: list[str], stop_ids: set[int],
              eot: int | None, chat: bool):
        kind = "chat.completion" if chat else "text_completion"
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
        prompt_tokens = sum(map(len, prompts))
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def choice(i: int, text: str, finish: str | None, first: bool = False) -> dict:
            if chat:
                delta = ({"role": "assistant", "content": text} if first else {"content": text}) if text or first else {}
                return {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {"index": i, "text": text, "logprobs": None, "finish_reason": finish}

        def chunk(choices: list[dict], **extra) -> dict:
            return {"id": rid, "object": kind + (".chunk" if chat else ""), "created": int(time.time()),
                    "model": name, "choices": choices, **({"usage": None} if include_usage else {}), **extra}

        if not req.stream:
            async def whole() -> dict:
                rows: list[Row] = []
                async for _ in pieces(prompts, req.n, s, stops, stop_ids, eot, rows):
                    pass
                if chat:
                    choices = [{"index": i, "message": {"role": "assistant", "content": r.text}, "logprobs": None,
                                "finish_reason": r.finish} for i, r in enumerate(rows)]
                else:
                    choices = [{"index": i, "text": r.text, "logprobs": None, "finish_reason": r.finish}
                               for i, r in enumerate(rows)]
                return {"id": rid, "object": kind, "created": int(time.time()), "model": name, "choices": choices,
                        "usage": usage(prompt_tokens, sum(r.tokens for r in rows))}
            return whole()

        async def events() -> AsyncIterator[str]:
            rows: list[Row] = []
            try:
                if chat:  # OpenAI's first chunk of each choice names the role
                    for i in range(len(prompts) * req.n):
                        yield sse(chunk([choice(i, "", None, first=True)]))
                async for i, piece, row in pieces(prompts, req.n, s, stops, stop_ids, eot, rows):
                    yield sse(chunk([choice(i, piece, row.finish)]))
                if include_usage:
                    yield sse(chunk([], usage=usage(prompt_tokens, sum(r.tokens for r in rows))))
                yield "data: [DONE]\n\n"
            except ServerStopping:
                yield sse(error_body("the server is shutting down; the reply is incomplete", "server_error"))
            except Exception as e:  # the headers are sent: the error goes in the stream, as OpenAI's does
                yield sse(error_body(first_line(e), "server_error"))
        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # --- routes -----------------------------------------------------------------------------

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return HTMLResponse(PAGE.read_text(encoding="utf-8"), headers={
            # Everything the page needs comes from this server: nothing from another origin can run in it.
            "Content-Security-Policy": "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'"})

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": name, "chat": template is not None, "auth": api_key is not None,
                "context_length": block_size, "running": engine.running,
                "tokens_generated": engine.tokens_generated}

    @app.get("/v1/models", dependencies=[Depends(check_key)])
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "nanogpt",
                                            "context_length": block_size, "chat": template is not None}]}

    @app.post("/v1/completions", dependencies=[Depends(check_key)])
    async def completions(req: CompletionRequest):
        check_model(req)
        s, stops = params(req, default_max=16)  # OpenAI's default for completions
        prompts = prompts_of(req)
        eot = tok.eot_token
        result = reply(req, prompts, s, stops, set() if eot is None else {eot}, eot, chat=False)
        return result if isinstance(result, StreamingResponse) else await result

    @app.post("/v1/chat/completions", dependencies=[Depends(check_key)])
    async def chat_completions(req: ChatRequest):
        check_model(req)
        if template is None:
            raise APIError(400, f"model '{name}' has no chat template (a base model, its tokenizer has no chat "
                                f"tokens); use /v1/completions", "messages", "no_chat_template")
        try:
            prompt = template.render_prompt(messages_of(req))
        except UserError as e:
            raise APIError(400, str(e), "messages") from None
        prompt = check_length(prompt, "messages")
        s, stops = params(req, default_max=max(1, min(cfg.max_tokens_limit, block_size - len(prompt))))
        result = reply(req, [prompt], s, stops, template.stop_tokens, template.end_of_turn, chat=True)
        return result if isinstance(result, StreamingResponse) else await result

    return app


# -----------------------------------------------------------------------------
# the command


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
    rt = runtime.setup(cfg.device, cfg.dtype)
    model, tok, source = weights.load_model(cfg.init_from, cfg.out_dir)
    model = runtime.inference_model(model, rt)  # as sample.py: weights cast once, float32 next-token logits
    name = cfg.model_name or (Path(cfg.out_dir).resolve().name if cfg.init_from == "resume" else cfg.init_from)
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
