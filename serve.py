"""Serve a trained model over OpenAI's HTTP API (completions, chat completions, models), with a chat page at /.

    python serve.py --out_dir=out-shakespeare-char                  # http://127.0.0.1:8000, the page at /
    python serve.py --init_from=gpt2 --port=8080                    # GPT-2 weights (needs transformers)
    python serve.py --out_dir=RUN --host=0.0.0.0 --api_key=SECRET   # or SERVE_API_KEY=SECRET in the environment

    curl http://127.0.0.1:8000/v1/completions -d '{"prompt": "ROMEO:", "max_tokens": 50, "temperature": 0}'

Any OpenAI client works, and vLLM's request extensions and metrics: OpenAI(base_url="http://127.0.0.1:8000/v1",
api_key=...). The model's name is its out_dir's folder name (or init_from), unless --model_name says otherwise.

Requests are batched continuously by core/serving/engine.py's BatchEngine (on a CPU in a process of its own,
core/serving/process.py's EngineProcess); the request models, their checks and errors, and the replies are
core/serving/openai.py's. Here: ServeConfig, the routes over app.state.served, build_app, and the command.
"""
from core.errors import quiet_start
quiet_start(__name__)  # as a script: Ctrl-C during the imports below (seconds) is one line

import asyncio
import dataclasses
import hmac
import ipaddress
import os
import signal
import socket
import sys
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Sequence

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST
import torch

from core import cpu, runtime
from core.config import at_least, parse_args
from core.data.chat import ChatTemplate
from core.data.tokenizer import Tokenizer
from core.decoding.decode import inference_model, window_shift
from core.decoding.quantize import check_quantize, quantized_note
from core.errors import UserError, first_line, run_cli
from core.serving.engine import BatchEngine, EngineDied, EngineSettings
from core.serving.metrics import Metrics
from core.serving.openai import (CHAT, COMPLETION, HANDLERS, APIError, ChatRequest, CompletionRequest,
                                 DetokenizeRequest, Reply, Response, ResponsesRequest, ServedModel, TokenizeRequest,
                                 chat_requests, check_model, completion_requests, encode, errors, response_requests)
from core.serving.process import EngineProcess
from core.weights import resolver
from model import GPT

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
    step_tokens: int = 512           # tokens computed per step: one per decoding row, prompt chunks the rest
    prefix_cache_tokens: int | None = None  # KV kept for later prompts; None: as many as the slots hold, 0: none
    device: str = "auto"             # auto, cpu, cuda, cuda:N, mps
    dtype: str = "auto"              # auto, float32, bfloat16, float16
    threads: int = 0                 # the engine's torch threads; 0: torch's default (one per core), less one for HTTP
    quantize: str = "none"           # int8 | int4: the weights quantized once, CPU only (core/decoding/quantize.py)
    engine: str = "auto"             # process: the engine in a process of its own (CPU); thread: in this one; auto: process on a CPU

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise UserError(f"port must be in 0..65535, got {self.port}")
        at_least(self, 1, "max_tokens_limit", "max_n", "max_body_bytes", "max_batch", "step_tokens")
        if self.prefix_cache_tokens is not None and self.prefix_cache_tokens < 0:
            raise UserError(f"prefix_cache_tokens must be at least 0 (0: no prefix cache), got {self.prefix_cache_tokens}")
        if self.api_key == "":
            raise UserError("--api_key is empty; pass a secret, or leave it out to serve without one")
        resolver.check_init_from(self.init_from)
        check_quantize(self.quantize)
        if self.engine not in ("auto", "process", "thread"):
            raise UserError(f"--engine must be auto, process or thread, got {self.engine!r}")


# -----------------------------------------------------------------------------
# the key


def served_model(request: Request) -> ServedModel:
    return request.app.state.served


Served = Annotated[ServedModel, Depends(served_model)]  # each route's model


async def check_key(served: Served, request: Request) -> None:  # async: a plain def would run in a worker thread
    """On the /v1 routes only, as vLLM's --api-key: they generate. The tokenizer's routes, /metrics, /health and
    the page stay open (docs/serving.md, "Errors and access")."""
    if served.api_key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), served.api_key.encode()):
        raise APIError(401, "missing or wrong API key: send the header `Authorization: Bearer KEY`",
                       code="invalid_api_key")


# -----------------------------------------------------------------------------
# routes

router = APIRouter()
v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)], responses=errors(401))
# what the routes that generate answer: the reply (streamed as server-sent events), or an error
GENERATES = errors(400, 404, 413, 500, 503) | {200: {"description": "the reply; with stream, server-sent events",
                                                     "content": {"text/event-stream": {"schema": {"type": "string"}}}}}


@router.get("/", response_class=HTMLResponse)
async def page():
    return HTMLResponse(PAGE.read_text(encoding="utf-8"), headers={
        # Everything the page needs comes from this server: nothing from another origin can run in it.
        "Content-Security-Policy": "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'"})


@router.get("/health", responses=errors(503))
@router.head("/health", responses=errors(503))
async def health(served: Served):
    if served.engine.failure is not None:  # a load balancer stops sending here; the server is about to exit
        raise EngineDied(served.engine.failure)
    return {"status": "ok", "model": served.name, "chat": served.template is not None,
            "auth": served.api_key is not None, "context_length": served.block_size,
            "running": served.engine.running, "waiting": served.engine.waiting_count(),
            "tokens_generated": served.engine.tokens_generated}


@router.get("/metrics", response_class=PlainTextResponse)  # Prometheus' text format
@router.head("/metrics", response_class=PlainTextResponse)
async def metrics(served: Served):
    return PlainTextResponse(served.metrics.render(served.engine), media_type=CONTENT_TYPE_LATEST)


def model_card(served: ServedModel) -> dict:
    return {"id": served.name, "object": "model", "created": served.created, "owned_by": "nanogpt",
            "context_length": served.block_size, "max_model_len": served.block_size,
            "chat": served.template is not None}


@v1.get("/models")
async def models(served: Served):
    return {"object": "list", "data": [model_card(served)]}


@v1.get("/models/{model_id:path}", responses=errors(404))
async def model_info(model_id: str, served: Served):
    check_model(served, model_id)
    return model_card(served)


@router.get("/tokenizer_info")
async def tokenizer_info(served: Served):
    """vLLM's: what a client (lm-eval's remote tokenizer) needs to tokenize as the server does."""
    name = lambda i: None if i is None else served.tok.decode([i])  # noqa: E731
    eot, bos = served.tok.eot_token, served.tok.bos_token
    return {"tokenizer_class": type(served.tok).__name__, "eos_token": name(eot), "eos_token_id": eot,
            "bos_token": name(bos), "bos_token_id": bos, "pad_token": None, "vocab_size": served.tok.vocab_size,
            "model_max_length": served.block_size}


@router.post("/tokenize", responses=errors(400, 404, 413))
async def tokenize(req: TokenizeRequest, served: Served):
    check_model(served, req.model)
    ids = encode(served.tok, req.prompt, req.add_special_tokens)  # as vLLM: lm_eval reads eos_token_id from this
    return {"tokens": ids, "count": len(ids), "max_model_len": served.block_size}


@router.post("/detokenize", responses=errors(400, 404, 413))
async def detokenize(req: DetokenizeRequest, served: Served):
    check_model(served, req.model)
    if any(not 0 <= i < served.tok.vocab_size for i in req.tokens):
        raise APIError(400, f"tokens holds ids outside 0..{served.tok.vocab_size - 1}", "tokens")
    return {"prompt": served.tok.decode(req.tokens)}


@v1.post("/completions", responses=GENERATES)
async def completions(req: CompletionRequest, served: Served):
    return await Reply(served, req, *completion_requests(served, req), COMPLETION).answer()


@v1.post("/chat/completions", responses=GENERATES)
async def chat_completions(req: ChatRequest, served: Served):
    return await Reply(served, req, *chat_requests(served, req), CHAT).answer()


@v1.post("/responses", responses=GENERATES)
async def responses(req: ResponsesRequest, served: Served):
    return await Response(served, req, *response_requests(served, req)).answer()


router.include_router(v1)


class RequestBody:
    """413 for a request body over max_bytes, sent chunked or not; and every POST body read as JSON whatever its
    Content-Type (plain `curl -d` sends a form's, others text/plain): FastAPI would hand such a body to the
    request model as bytes. Plain ASGI: Starlette's BaseHTTPMiddleware would pass every chunk of a streamed reply
    through a task and a memory stream of its own."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["method"] == "POST":  # every POST route here takes JSON
            scope = dict(scope, headers=[(k, v) for k, v in scope["headers"] if k != b"content-type"]
                         + [(b"content-type", b"application/json")])
        length = dict(scope["headers"]).get(b"content-length", b"").decode("latin-1")
        if length.isdigit() and int(length) > self.max_bytes:
            return await APIError(413, f"the request body is {length} bytes, more than the {self.max_bytes} this "
                                       f"server accepts", code="body_too_large").response()(scope, receive, send)
        if scope["method"] == "POST" and not length:  # chunked: count as it arrives, then hand it on whole
            body, more = b"", True
            while more:
                message = await receive()
                body += message.get("body", b"")
                more = message.get("more_body", False)
                if len(body) > self.max_bytes:
                    return await APIError(413, f"the request body is more than the {self.max_bytes} bytes this "
                                               f"server accepts", code="body_too_large").response()(
                        scope, receive, send)
            first, client = [{"type": "http.request", "body": body, "more_body": False}], receive

            async def receive():  # the body once, then what the client sends (its disconnect)
                return first.pop() if first else await client()
        await self.app(scope, receive, send)


# How long a server whose engine died goes on answering 503 (to /health and to requests) before it exits
# non-zero: long enough for a probe to see why, short enough that its supervisor restarts it soon.
ENGINE_DEATH_EXIT_S = 5.0


async def exit_when_the_engine_dies(app) -> None:
    """As vLLM's API server does: once the engine is dead, say so in one line, then stop uvicorn (main exits 1)."""
    engine = app.state.served.engine
    while engine.failure is None:
        await asyncio.sleep(0.2)
    print(f"error: {engine.failure}; /health answers 503, and the server exits in {ENGINE_DEATH_EXIT_S:.0f} s "
          f"so that its supervisor restarts it", file=sys.stderr, flush=True)
    await asyncio.sleep(ENGINE_DEATH_EXIT_S)
    if (server := getattr(app.state, "server", None)) is not None:
        server.should_exit = True


@asynccontextmanager
async def lifespan(app):
    app.state.served.engine.start()
    watch = asyncio.create_task(exit_when_the_engine_dies(app))
    yield
    watch.cancel()
    app.state.served.engine.stop()


def engine_kind(cfg: ServeConfig, device: str) -> str:
    """--engine resolved: auto is a process of its own on a CPU, a thread elsewhere (a fork cannot carry CUDA)."""
    kind = cfg.engine if cfg.engine != "auto" else "process" if torch.device(device).type == "cpu" else "thread"
    if kind == "process" and torch.device(device).type != "cpu":
        raise UserError(f"--engine=process serves CPU models only (a forked process cannot use {device}); "
                        f"use --engine=thread")
    return kind


def build_app(model: GPT, tok: Tokenizer, cfg: ServeConfig, name: str, device: str,
              threads: int | None = None) -> FastAPI:
    """The routes above over one engine (--engine). A character vocabulary prepared without <|endoftext|> is
    served with it appended, as export.py writes it (lm_eval needs an end-of-text id)."""
    model, tok = resolver.with_end_of_text(model, tok)
    try:
        shift = window_shift(cfg.window_shift, model.config.block_size)
    except ValueError as e:
        raise UserError(f"--window_shift: {e}") from None
    metrics = Metrics(name)
    settings = EngineSettings(cfg.max_batch, shift, tok.vocab_size, cfg.step_tokens, cfg.prefix_cache_tokens)
    try:  # threads: the engine process's own (main keeps this process to one)
        engine = (EngineProcess(model, settings, metrics, threads) if engine_kind(cfg, device) == "process"
                  else BatchEngine(model, settings, metrics))
    except RuntimeError as e:
        raise UserError(f"{first_line(e)}; try a smaller --max_batch, or --engine=thread") from None
    app = FastAPI(title="serve.py", version="1", summary=__doc__.splitlines()[0], lifespan=lifespan, redoc_url=None,
                  exception_handlers=HANDLERS)
    app.openapi = lambda: openapi(app)
    app.state.served = ServedModel(engine, tok, ChatTemplate.for_tokenizer(tok), name, device, model.config.block_size,
                                   cfg.max_tokens_limit, cfg.max_n, cfg.api_key or os.environ.get(API_KEY_ENV) or None,
                                   int(time.time()), metrics)
    app.add_middleware(RequestBody, max_bytes=cfg.max_body_bytes)
    app.include_router(router)
    return app


def openapi(app: FastAPI) -> dict:
    """/openapi.json (and /docs): FastAPI's schema of the routes, without the 422 it gives each route that takes
    a body: this server answers a body it cannot read with 400 in OpenAI's shape, as each route declares."""
    if app.openapi_schema is None:
        app.openapi_schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        for operation in (op for path in app.openapi_schema["paths"].values() for op in path.values()):
            operation["responses"].pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            app.openapi_schema["components"]["schemas"].pop(name, None)
    return app.openapi_schema


# -----------------------------------------------------------------------------
# the command


def bind_port(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, or one line when another program holds it (also when it was taken while the
    model loaded): uvicorn's own bind would print its log's report and exit 1."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a closing socket is no obstacle
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror}); another program may hold it: "
                        f"choose another with --port=N") from None
    return sock


def serve(app, host: str, port: int) -> None:
    """Run uvicorn until Ctrl-C or SIGTERM; the engine stops first, so open streams end at once."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # uvicorn's own handler also re-raises the signal once shut down, so the process would die of
            # it (or print a KeyboardInterrupt): a requested, finished shutdown exits 0 instead.
            app.state.served.engine.stop()
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True  # a second Ctrl-C: stop waiting for open connections
            self.should_exit = True

    sock = bind_port(host, port)  # here, after the engine's fork: its process must not hold the port too
    app.state.server = Server(uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=5, log_level="info"))
    app.state.server.run(sockets=[sock])


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: Sequence[str]) -> None:
    cfg = parse_args(ServeConfig, argv)
    if cfg.port != 0:  # one line, before the model loads, when another program holds the port
        bind_port(cfg.host, cfg.port).close()
    rt = runtime.setup(cfg.device, cfg.dtype, threads=cfg.threads)
    threads = torch.get_num_threads()  # what the engine computes with: --threads, OMP_NUM_THREADS, or one per core
    if engine_kind(cfg, rt.device) == "process":
        if not cfg.threads and "OMP_NUM_THREADS" not in os.environ:
            # A core left to the HTTP side and the clients, as vLLM's CPU build leaves one: with all of them, the
            # engine's threads wait for each other whenever another process runs (docs/serving.md, "Threads").
            threads = max(1, threads - 1)
        # The engine process is forked from this one, and OpenMP's thread pool does not survive a fork: a pool of
        # several threads made here would leave the child waiting on threads it does not have. This process
        # only loads the model and speaks HTTP, so it keeps to one thread and the child gets the pool.
        torch.set_num_threads(1)
    if rt.device_type == "cpu":
        cpu.huge_pages()
    model, tok, source = resolver.load_model(cfg.init_from, cfg.out_dir)
    model, tok = resolver.with_end_of_text(model, tok)  # before quantizing: an old char run's head grows a row
    # weights cast once (and quantized) as sample.py's; a float32 batch's matrices packed (docs/serving.md)
    model, _ = inference_model(model, rt, quantize=cfg.quantize, batched=cfg.max_batch > 1)
    name = cfg.model_name or (Path(cfg.out_dir).resolve().name if resolver.kind_of(cfg.init_from) == "resume" else cfg.init_from)
    app = build_app(model, tok, cfg, name, rt.device, threads)
    print(f"serving {source} as '{name}': {model.get_num_params() / 1e6:.2f}M parameters, {rt.device} {rt.dtype}{quantized_note(cfg.quantize)}, "
          f"{'chat and completions' if ChatTemplate.for_tokenizer(tok) else 'completions only (no chat template)'}, "
          f"page at http://{cfg.host}:{cfg.port}/", file=sys.stderr)
    if not is_loopback(cfg.host) and app.state.served.api_key is None:
        print(f"warning: serving on {cfg.host} without an API key: anyone who can reach it can use the model; "
              f"pass --api_key=... or set {API_KEY_ENV}", file=sys.stderr)
    serve(app, cfg.host, cfg.port)
    if app.state.served.engine.failure is not None:  # said in one line when it died (exit_when_the_engine_dies)
        sys.exit(1)


if __name__ == "__main__":
    run_cli(main)
