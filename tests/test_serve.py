"""serve.py: real server processes on 127.0.0.1, driven by the official openai client (and httpx for
what a client library would refuse to send).

    python -m pytest tests/test_serve.py

The models are trained here, so greedy text is a real continuation rather than one token repeated:
a char model on a Shakespeare passage (a base model: completions only), a char model trained on chat
conversations (its tokenizer carries core/data/chat.py's tokens; served with a key from SERVE_API_KEY), and
a GPT-2 BPE model trained on text with multi-byte characters (skipped without tiktoken's BPE file).
"""
import asyncio
import concurrent.futures
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import typing
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

import serve  # noqa: E402
from core.data.chat import ChatTemplate, with_chat_tokens  # noqa: E402
from core.data.tokenizer import CharTokenizer, tokenizer_from_meta  # noqa: E402
from core.data.writer import write_dataset  # noqa: E402
from core.serving.engine import Handle, PromptScores, RowStep, TokenScore  # noqa: E402
from core.serving.openai import ChoiceText, completion_logprobs  # noqa: E402
from core.weights import resolver  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from tests.helpers import (ROMEO_JULIET, assert_user_error, ONE_THREAD_ENV, REPO_ROOT, make_char_dataset, make_gpt2_dataset, run_main, run_script,  # noqa: E402
                           run_scripts, train_tiny, use_gpt2_bpe)

TEXT = ROMEO_JULIET
BLOCK_SIZE = 32
KEY = "test-key-123"
CONVERSATIONS = [("who are you?", "Romeo, the son of Montague."), ("where is she?", "At the window, above."),
                 ("what light?", "It is the east.")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python serve.py ...` on a free loopback port; its output goes to a file (a pipe could fill up)."""

    def __init__(self, tmp: Path, *args: str, env: dict | None = None):
        for _ in range(3):  # free when chosen, but a client's ephemeral port may take it before serve.py binds
            if self.started(tmp, args, env):
                return
        raise AssertionError(f"serve.py did not start:\n{self.output()}")

    def started(self, tmp: Path, args: tuple, env: dict | None) -> bool:
        """serve.py up on a free port: True; False when the port was taken before it bound; else a test failure."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"serve-{self.port}.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "serve.py", *args, f"--port={self.port}", "--device=cpu",
                                          "--dtype=float32"],
                                         cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         env=os.environ | ONE_THREAD_ENV | (env or {}))
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return True
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                if "Address already in use" in self.output():
                    return False
                raise AssertionError(f"serve.py did not start:\n{self.output()}")
            time.sleep(0.2)

    def output(self) -> str:
        return self.log.read_text()

    def client(self, key: str = "unused", **kw) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, **kw)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def stop(self, sig=signal.SIGTERM, timeout: float = 30) -> int:
        """Send sig; return the exit code, once it has exited (a test failure if it has not in time)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"serve.py did not exit within {timeout}s of {sig!r}:\n{self.output()}")


@contextlib.contextmanager
def running(tmp: Path, *args: str, env: dict | None = None):
    server = Server(tmp, *args, env=env)
    try:
        yield server
    finally:
        code = server.stop()
        assert code == 0 and "Traceback" not in server.output(), server.output()


def chat_tokenizer():
    return tokenizer_from_meta(with_chat_tokens(CharTokenizer.from_text("".join(q + a for q, a in CONVERSATIONS)).meta()))


def train_chat_model(root: Path, block_size: int = 96, iters: int = 250) -> Path:
    """A char model trained on CONVERSATIONS rendered through the chat template, each followed by <|endoftext|>:
    it answers each question with its answer, then <|end|>, then <|endoftext|>."""
    tok = chat_tokenizer()
    meta, template = tok.meta(), ChatTemplate.for_tokenizer(tok)
    ids = []
    for q, a in CONVERSATIONS * 60:
        ids += template.render([{"role": "user", "content": q}, {"role": "assistant", "content": a}])[0]
        ids.append(tok.eot_token)
    write_dataset(root / "data", meta, {"train": ids, "val": ids})
    train_tiny(root / "out", root / "data", block_size=block_size, n_embd=48, max_iters=iters, lr_decay_iters=iters,
               eval_interval=iters)
    return root / "out"


@pytest.fixture(scope="module")
def char_out(tmp_path_factory):
    root = tmp_path_factory.mktemp("char")
    make_char_dataset(root / "data", TEXT)
    train_tiny(root / "out", root / "data", block_size=BLOCK_SIZE, n_layer=2, n_embd=48, max_iters=400,
               lr_decay_iters=400, eval_interval=400, log_interval=100)
    return root / "out"


@pytest.fixture(scope="module")
def base(char_out, tmp_path_factory):
    """The base model's server; max_tokens up to 100,000 so that a stream can outlast its client."""
    with running(tmp_path_factory.mktemp("base-server"), f"--out_dir={char_out}", "--model_name=romeo",
                 "--max_tokens_limit=100000", "--max_body_bytes=20000") as server:
        yield server


@pytest.fixture(scope="module")
def chat_out(tmp_path_factory):
    return train_chat_model(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module")
def chat(chat_out, tmp_path_factory):
    with running(tmp_path_factory.mktemp("chat-server"), f"--out_dir={chat_out}", "--model_name=chatty",
                 env={serve.API_KEY_ENV: KEY}) as server:
        yield server


def complete(server: Server, **kw):
    return server.client().completions.create(model="romeo", **kw)


def streamed(server: Server, **kw) -> tuple[list, str]:
    """The chunks of a streamed completion and the text they add up to (choice 0)."""
    chunks = list(server.client().completions.create(model="romeo", stream=True, **kw))
    return chunks, "".join(c.choices[0].text for c in chunks if c.choices)


def sample_py(char_out: Path, *args: str) -> list[str]:
    """What sample.py prints for each argument list (one sample each, its prompt included)."""
    results = run_scripts(*[["sample.py", f"--out_dir={char_out}", "--device=cpu", "--dtype=float32",
                             "--num_samples=1", *a] for a in args])
    for r in results:
        assert r.returncode == 0, r.stderr
    return [r.stdout.split("\n---------------\n")[0] for r in results]


def test_threads_reach_the_runtime(char_out, monkeypatch):
    seen, setup = [], serve.runtime.setup
    monkeypatch.setattr(serve.runtime, "setup", lambda *a, **k: seen.append(k.get("threads")) or setup(*a, **k))
    monkeypatch.setattr(serve, "serve", lambda app, host, port: None)
    assert run_main(serve.main, [f"--out_dir={char_out}", "--device=cpu", "--port=0", "--threads=1"]).returncode == 0
    assert seen == [1]


def test_the_engine_process_leaves_a_core_to_the_http_side_by_default(char_out, monkeypatch):
    """Unless --threads or OMP_NUM_THREADS says otherwise, the engine's process computes with one thread fewer than
    torch's default (one per core), and at least one: the HTTP side and the clients keep a core."""
    got = []
    monkeypatch.setattr(serve, "EngineProcess", lambda model, settings, metrics, n: got.append(n) or SimpleNamespace(failure=None))
    monkeypatch.setattr(serve, "serve", lambda app, host, port: None)
    monkeypatch.setattr(serve.runtime, "set_threads", lambda n: None)
    monkeypatch.setattr(serve.torch, "set_num_threads", lambda n: None)
    args = [f"--out_dir={char_out}", "--device=cpu", "--port=0"]
    for cores, env, flags, want in ((8, {}, [], 7), (1, {}, [], 1), (8, {"OMP_NUM_THREADS": "8"}, [], 8),
                                    (8, {}, ["--threads=8"], 8)):
        monkeypatch.setattr(serve.torch, "get_num_threads", lambda: cores)
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert run_main(serve.main, args + flags).returncode == 0
        assert got[-1] == want, (cores, env, flags)


def test_a_cpu_server_lays_its_tensors_in_huge_pages(monkeypatch):
    """On a CPU, serve.py asks torch's allocator for 2 MiB pages before its weights load (cpu.huge_pages); a 64 MiB
    tensor made so lies in them where Linux gives them on request (madvise), and a value the user set stands."""
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.is_file() or "[madvise]" not in mode.read_text():
        pytest.skip("huge pages on request need Linux's transparent huge pages in madvise mode")
    asked = []

    def load_model(*args):  # the server stops where its weights would load
        asked.append(os.environ.get("THP_MEM_ALLOC_ENABLE"))
        raise serve.UserError("no model here")
    monkeypatch.setattr(serve.resolver, "load_model", load_model)
    for preset in (None, "0"):
        monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
        if preset is not None:
            monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", preset)
        assert run_main(serve.main, ["--device=cpu", "--port=0"]).returncode != 0
    assert asked == ["1", "0"]
    probe = ("import torch; a = torch.ones(64 << 20, dtype=torch.uint8); "
             "print(*[line.split()[1] for line in open('/proc/self/smaps_rollup') if line.startswith('AnonHugePages')])")
    on, off = (subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                              env=os.environ | ONE_THREAD_ENV | {"THP_MEM_ALLOC_ENABLE": flag}) for flag in "10")
    assert int(on.stdout) >= 32 << 10 and int(off.stdout) == 0, (on, off)  # kB: at least half of it; none


def test_an_engine_process_of_several_threads_starts_and_serves(char_out, tmp_path, monkeypatch):
    """--threads=2 with the engine in a process of its own: the server keeps to one thread until the fork (OpenMP's
    pool does not survive one: a server that computed with two threads first hung at start, its engine waiting on
    threads it did not have), and the engine process gets the two."""
    threads = []
    monkeypatch.setattr(serve, "EngineProcess",
                        lambda model, settings, metrics, n: threads.append(n) or SimpleNamespace(failure=None))
    monkeypatch.setattr(serve.torch, "set_num_threads", lambda n: threads.append(("server", n)))
    monkeypatch.setattr(serve.runtime, "set_threads", lambda n: None)
    monkeypatch.setattr(serve.torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(serve, "serve", lambda app, host, port: None)
    assert run_main(serve.main, [f"--out_dir={char_out}", "--device=cpu", "--port=0", "--threads=2"]).returncode == 0
    before_fork = [n for n in threads[:threads.index(2)] if isinstance(n, tuple)]
    assert before_fork[-1] == ("server", 1), threads  # the server's last setting before the engine's fork
    monkeypatch.undo()
    # A real fork, of a model whose matrices are large enough that loading it runs OpenMP's parallel copies.
    make_char_dataset(tmp_path / "data", TEXT)
    train_tiny(tmp_path / "wide", tmp_path / "data", n_embd=256, max_iters=1, eval_interval=1)
    server = Server(tmp_path, f"--out_dir={tmp_path / 'wide'}", "--model_name=romeo", "--threads=2")
    try:
        # ignore_eos: a model trained one step draws <|endoftext|> at random too
        reply = complete(server, prompt="ROMEO:", max_tokens=5, extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 5
    finally:
        assert server.stop() == 0


def test_a_busy_port_is_one_line_naming_port_before_the_model_loads(char_out, monkeypatch):
    monkeypatch.setattr(resolver, "load_model", lambda *a: pytest.fail("loaded before the port check"))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = run_main(serve.main, [f"--out_dir={char_out}", "--device=cpu", f"--port={port}"])
    assert_user_error(result, f"127.0.0.1:{port}", "--port=N")
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_client_that_sends_its_body_slowly_holds_only_its_own_connection(base):
    """Slow clients (a body trickling in, or stalled half-way) each hold one connection and nothing else:
    uvicorn reads bodies as they arrive, on the event loop, so other requests are served meanwhile; the body
    limit (--max_body_bytes) bounds what one can send (docs/serving.md, "Slow clients")."""
    slow = []
    for _ in range(8):
        s = socket.create_connection(("127.0.0.1", base.port), timeout=10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"model\": \"romeo\", ")  # then nothing more
        slow.append(s)
    try:
        assert base.health()["status"] == "ok"
        assert complete(base, prompt="ROMEO:", max_tokens=5, temperature=0).choices[0].text
    finally:
        for s in slow:
            s.close()


def test_a_port_taken_while_the_model_loads_is_one_line(char_out, monkeypatch):
    """The port is free at the check and taken before uvicorn would bind it: serve.py binds it itself and says so
    in one line (uvicorn's bind would log its own report and exit 1)."""
    load, port, holder = resolver.load_model, free_port(), socket.socket()

    def load_then_take_the_port(*args):
        holder.bind(("127.0.0.1", port))
        holder.listen()
        return load(*args)

    monkeypatch.setattr(resolver, "load_model", load_then_take_the_port)
    with holder:
        result = run_main(serve.main, [f"--out_dir={char_out}", "--device=cpu", f"--port={port}", "--engine=thread"])
    assert_user_error(result, f"cannot listen on 127.0.0.1:{port}", "--port=N")
    assert [line for line in result.stderr.splitlines() if line.startswith("error")] == [
        result.stderr.strip().splitlines()[-1]]


# -----------------------------------------------------------------------------
# completions


def test_greedy_and_seeded_text_equal_sample_py(base, char_out):
    greedy = complete(base, prompt="ROMEO:", max_tokens=100, temperature=0)
    seeded = complete(base, prompt="JULIET:", max_tokens=100, temperature=0.8, seed=7, extra_body={"top_k": 200})
    want = sample_py(char_out, ["--start=ROMEO:", "--max_new_tokens=100", "--temperature=0"],
                     ["--start=JULIET:", "--max_new_tokens=100", "--temperature=0.8", "--top_k=200", "--seed=7"])
    assert "ROMEO:" + greedy.choices[0].text == want[0]
    assert "JULIET:" + seeded.choices[0].text == want[1]
    assert len(set(greedy.choices[0].text)) > 10  # a trained model: real text, not one token over and over
    assert greedy.choices[0].finish_reason == "length"
    assert (greedy.usage.prompt_tokens, greedy.usage.completion_tokens, greedy.usage.total_tokens) == (6, 100, 106)
    assert greedy.model == "romeo" and greedy.object == "text_completion"


def test_same_seed_same_text_and_stream_equals_whole(base):
    kw = dict(prompt="ROMEO:", max_tokens=60, temperature=1.0)
    a, b, c = (complete(base, seed=s, **kw).choices[0].text for s in (11, 11, 12))
    assert a == b != c
    chunks, text = streamed(base, seed=11, stream_options={"include_usage": True}, **kw)
    assert text == a
    assert chunks[-2].choices[0].finish_reason == "length"
    assert all(ch.choices[0].finish_reason is None for ch in chunks[:-2])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 60
    assert chunks[-1].usage.prompt_tokens == 6 and chunks[-1].usage.total_tokens == 66
    # every chunk of a stream names the same reply, as OpenAI's do
    assert {(ch.id, ch.created, ch.model, ch.object) for ch in chunks} == {
        (chunks[0].id, chunks[0].created, "romeo", "text_completion")}
    assert chunks[0].id.startswith("cmpl-") and abs(chunks[0].created - time.time()) < 600
    plain, _ = streamed(base, seed=11, **kw)
    assert all(ch.usage is None for ch in plain)  # no usage chunk unless asked for


def test_raw_stream_is_openai_server_sent_events(base):
    with httpx.stream("POST", base.url + "/v1/completions", timeout=30,
                      json={"model": "romeo", "prompt": "ROMEO:", "max_tokens": 5, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        body = r.read().decode()
    events = body.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: {") for e in events[:-2])


def test_prompt_list_and_n_choices(base):
    many = complete(base, prompt=["ROMEO:", "JULIET:"], n=3, max_tokens=20, seed=5)
    assert [c.index for c in many.choices] == list(range(6))
    for k, prompt in enumerate(["ROMEO:", "JULIET:"]):
        alone = complete(base, prompt=prompt, n=3, max_tokens=20, seed=5)
        assert [c.text for c in many.choices[3 * k:3 * k + 3]] == [c.text for c in alone.choices]
    assert len({c.text for c in many.choices[:3]}) == 3  # three draws, not one copied
    assert many.usage.prompt_tokens == 6 + 7 and many.usage.completion_tokens == 6 * 20
    ids = complete(base, prompt=[CharTokenizer.from_text(TEXT).encode("ROMEO:")], n=3, max_tokens=20, seed=5)
    assert [c.text for c in ids.choices] == [c.text for c in many.choices[:3]]  # token ids as the prompt


def test_stop_strings_cut_the_text_streamed_or_not(base):
    full = complete(base, prompt="ROMEO:", max_tokens=100, temperature=0).choices[0].text
    stop = full[30:33]  # a string the greedy text reaches after some way
    cut = full[:full.index(stop)]
    whole = complete(base, prompt="ROMEO:", max_tokens=100, temperature=0, stop=[stop, "never said"])
    assert whole.choices[0].text == cut and whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens == full.index(stop) + len(stop)  # char model: one token per character
    chunks, text = streamed(base, prompt="ROMEO:", max_tokens=100, temperature=0, stop=stop)
    assert text == cut and chunks[-1].choices[0].finish_reason == "stop"


def test_eight_concurrent_streams_each_get_what_a_lone_request_gets(base):
    requests = [dict(prompt=p, seed=s, max_tokens=150, temperature=1.0)
                for p, s in zip(["ROMEO:", "JULIET:"] * 4, range(8))]
    lone = [complete(base, **r).choices[0].text for r in requests]
    client = openai.AsyncOpenAI(base_url=base.url + "/v1", api_key="unused", max_retries=0)

    async def one(r):
        text, first = "", None
        async for chunk in await client.completions.create(model="romeo", stream=True, **r):
            first = first or time.monotonic()
            text += chunk.choices[0].text if chunk.choices else ""
        return text, first, time.monotonic()

    async def all_at_once():
        return await asyncio.gather(*(one(r) for r in requests))

    results = asyncio.run(all_at_once())
    assert [text for text, _, _ in results] == lone
    # Decoded in turn, not one after another: every stream had started before the first one ended.
    assert max(first for _, first, _ in results) < min(end for _, _, end in results)


def test_a_client_that_leaves_stops_its_generation(base):
    before = base.health()["tokens_generated"]
    with httpx.stream("POST", base.url + "/v1/completions", timeout=30,
                      json={"model": "romeo", "prompt": "ROMEO:", "max_tokens": 100000, "stream": True,
                            "ignore_eos": True}) as r:
        lines = r.iter_lines()
        for _ in range(10):
            next(lines)
    deadline = time.monotonic() + 10
    while base.health()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    stopped = base.health()
    assert stopped["running"] == 0
    time.sleep(0.5)
    assert base.health()["tokens_generated"] == stopped["tokens_generated"]
    assert stopped["tokens_generated"] - before < 50000  # far from the 100,000 asked for


def test_models_and_health(base):
    models = base.client().models.list()
    assert [m.id for m in models.data] == ["romeo"]
    health = base.health()
    assert health["status"] == "ok" and health["chat"] is False and health["context_length"] == BLOCK_SIZE


# -----------------------------------------------------------------------------
# bad requests: OpenAI's error shape, and the server goes on


BAD = {  # name: (body, status, param, a fragment of the message)
    "unknown model": ({"model": "gpt-4", "prompt": "ROMEO:"}, 404, "model", "not served here"),
    "prompt too long": ({"model": "romeo", "prompt": "ROMEO: " * 10}, 400, "prompt", "longer than the model's context"),
    "max_tokens 0": ({"model": "romeo", "prompt": "ROMEO:", "max_tokens": 0}, 400, "max_tokens", "1..100000"),
    "max_tokens over the cap": ({"model": "romeo", "prompt": "ROMEO:", "max_tokens": 100001}, 400, "max_tokens",
                                "1..100000"),
    "negative temperature": ({"model": "romeo", "prompt": "ROMEO:", "temperature": -0.5}, 400, "temperature", ">= 0"),
    "wrong type": ({"model": "romeo", "prompt": "ROMEO:", "max_tokens": "ten"}, 400, "max_tokens", "integer"),
    "prompt of the wrong type": ({"model": "romeo", "prompt": {"a": 1}}, 400, "prompt", "valid"),
    "missing prompt": ({"model": "romeo"}, 400, "prompt", "required"),
    "top_p 0": ({"model": "romeo", "prompt": "ROMEO:", "top_p": 0}, 400, "top_p", "(0, 1]"),
    "top_k 0": ({"model": "romeo", "prompt": "ROMEO:", "top_k": 0}, 400, "top_k", "at least 1"),
    "n 0": ({"model": "romeo", "prompt": "ROMEO:", "n": 0}, 400, "n", "1..16"),
    "five stops": ({"model": "romeo", "prompt": "ROMEO:", "stop": list("abcde")}, 400, "stop", "at most 4"),
    "character outside the vocabulary": ({"model": "romeo", "prompt": "ROMEO 🙂"}, 400, "prompt", "'🙂'"),
    "token id outside the vocabulary": ({"model": "romeo", "prompt": [5, 99999]}, 400, "prompt", "outside"),
    "chat with a base model": ({"model": "romeo", "messages": [{"role": "user", "content": "hi"}]}, 400, "messages",
                               "no chat template"),
}


def assert_error(r: "httpx.Response", status: int, param, fragment: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["param"] == param and fragment in error["message"], error
    assert "Traceback" not in r.text


@pytest.mark.parametrize("name", BAD)
def test_bad_request_gets_an_openai_error_and_the_server_goes_on(base, name):
    body, status, param, fragment = BAD[name]
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    assert_error(httpx.post(base.url + path, json=body, timeout=30), status, param, fragment)
    assert complete(base, prompt="ROMEO:", max_tokens=3).choices[0].text


BAD_BODIES = {  # name: (body, status, a fragment of the message)
    "malformed JSON": (b'{"model": "romeo", "prompt": ', 400, "not valid JSON"),
    "too large a body": (b'{"model": "romeo", "prompt": "' + b"R" * 30000 + b'"}', 413, "more than the 20000"),
}


@pytest.mark.parametrize("name", BAD_BODIES)
def test_bad_body_gets_an_openai_error_and_the_server_goes_on(base, name):
    content, status, fragment = BAD_BODIES[name]
    r = httpx.post(base.url + "/v1/completions", content=content, headers={"Content-Type": "application/json"})
    assert_error(r, status, None, fragment)
    # The same body without a Content-Length (chunked) is counted as it arrives.
    chunked = httpx.post(base.url + "/v1/completions", content=iter([content]),
                         headers={"Content-Type": "application/json"})
    assert chunked.status_code == status and chunked.json()["error"]["message"]
    good = httpx.post(base.url + "/v1/completions", content=iter([b'{"model": "romeo", ', b'"prompt": "ROMEO:"}']),
                      headers={"Content-Type": "application/json"})  # chunked, within the limit: read whole
    assert good.status_code == 200 and good.json()["choices"][0]["text"]


# Any body in: a 4xx in OpenAI's shape for every malformed kind, a 200 for any JSON whatever its content type,
# and never a 500 or a traceback in the server's log.

GARBAGE = [{"nested": [[{"x": None}], {"y": [1, "a"]}]}, [[1, "a"], {}], -10 ** 30, -1e308, float("inf"),
           float("nan"), True, "\ud800<|endoftext|>\x00\u202e"]  # JSON's Infinity and NaN, a lone surrogate
BODIES = {"raw bytes": b"\x00\xff\xfe\xfd\x80garbage", "not UTF-8": b'{"model": "romeo", "prompt": "\xff\xfe"}',
          "empty": b"", "an array": b'[{"model": "romeo", "prompt": "ROMEO:"}]', "a string": b'"ROMEO:"',
          "a number": b"42", "null": b"null", "too large a number": b"1e999", "too many digits": b"9" * 5000,
          "nested too deep": b"[" * 9000 + b"]" * 9000, "cut short": b'{"model": "romeo", "prompt": ',
          "nested garbage": json.dumps({"model": "romeo", "prompt": [[[[[["x"]]]]]], "stop": {"a": {"b": [None]}}}
                                       ).encode()}


def accepts(annotation, value) -> bool:
    """Whether a field of this type takes the value as it is (a bool field True, a str field a string)."""
    kinds = typing.get_args(annotation) or (annotation,)
    return (type(value) is bool and bool in kinds) or (isinstance(value, str) and str in kinds)


def assert_refused(r: "httpx.Response", what) -> None:
    assert 400 <= r.status_code < 500, (what, r.status_code, r.text)
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}, (what, r.text)


def test_no_request_can_make_a_500_or_a_traceback(base, chat):
    valid = {"/v1/completions": ({"model": "romeo", "prompt": "ROMEO:", "max_tokens": 2}, serve.CompletionRequest),
             "/v1/chat/completions": ({"model": "chatty", "messages": [{"role": "user", "content": "who are you?"}],
                                       "max_tokens": 2}, serve.ChatRequest),
             "/tokenize": ({"prompt": "ROMEO:"}, serve.TokenizeRequest),
             "/detokenize": ({"tokens": [1, 2]}, serve.DetokenizeRequest)}
    with httpx.Client(headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as client:
        for path, (body, model) in valid.items():
            server = chat if "chat" in path else base
            for name, annotation in ((k, f.annotation) for k, f in model.model_fields.items()):
                for value in GARBAGE:
                    if not accepts(annotation, value):
                        assert_refused(client.post(server.url + path, content=json.dumps({**body, name: value})),
                                       (path, name, value))
            for kind, raw in BODIES.items():
                assert_refused(client.post(server.url + path, content=raw), (path, kind))
            for quoted in ({**body, "model": GARBAGE[-1]}, {**body, GARBAGE[-1]: 1}):  # named in the message
                assert_refused(client.post(server.url + path, content=json.dumps(quoted)), (path, quoted))
            for content_type in (None, "text/plain", "application/x-www-form-urlencoded", "nonsense/; ;"):
                headers = {} if content_type is None else {"Content-Type": content_type}
                r = client.post(server.url + path, content=json.dumps(body), headers=headers)  # plain `curl -d`
                assert r.status_code == 200, (path, content_type, r.text)
    for server in (base, chat):
        assert "Traceback" not in server.output() and "Exception" not in server.output(), server.output()[-3000:]


def test_the_openai_client_raises_its_own_errors(base):
    with pytest.raises(openai.NotFoundError, match="not served here") as e:  # vLLM's 404, OpenAI's code
        base.client().completions.create(model="gpt-4", prompt="ROMEO:")
    assert e.value.code == "model_not_found"
    r = httpx.get(base.url + "/nowhere")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_no_cross_origin_access(base):
    r = httpx.get(base.url + "/v1/models", headers={"Origin": "https://elsewhere.example"})
    assert "access-control-allow-origin" not in r.headers
    pre = httpx.options(base.url + "/v1/completions", headers={
        "Origin": "https://elsewhere.example", "Access-Control-Request-Method": "POST"})
    assert pre.status_code >= 400 and "access-control-allow-origin" not in pre.headers


# -----------------------------------------------------------------------------
# chat, and the API key


def test_chat_streamed_and_not(chat):
    client = chat.client(KEY)
    for question, answer in CONVERSATIONS:
        messages = [{"role": "user", "content": question}]
        whole = client.chat.completions.create(model="chatty", messages=messages, temperature=0)
        assert whole.choices[0].message.content == answer and whole.choices[0].finish_reason == "stop"
        assert whole.choices[0].message.role == "assistant" and whole.object == "chat.completion"
        tok = CharTokenizer(sorted(set("".join(q + a for q, a in CONVERSATIONS))))
        assert whole.usage.prompt_tokens == len(tok.encode(question)) + 3  # <|user|> ... <|end|><|assistant|>
        assert whole.usage.completion_tokens == len(answer) + 1  # and <|end|>
        chunks = list(client.chat.completions.create(model="chatty", messages=messages, temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
        assert chunks[-2].choices[0].finish_reason == "stop"
        got, want = chunks[-1].usage, whole.usage  # the stream's prompt may now come from the prefix cache
        assert (got.prompt_tokens, got.completion_tokens, got.total_tokens) == (want.prompt_tokens,
                                                                                want.completion_tokens, want.total_tokens)


def test_chat_bad_messages(chat):
    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(chat.url + "/v1/chat/completions", headers=headers,
                   json={"model": "chatty", "messages": [{"role": "assistant", "content": "hi"}]})
    assert_error(r, 400, "messages", "roles out of order")
    r = httpx.post(chat.url + "/v1/chat/completions", headers=headers, json={"model": "chatty", "messages": []})
    assert_error(r, 400, "messages", "non-empty list")
    r = httpx.post(chat.url + "/v1/chat/completions", headers=headers,
                   json={"model": "chatty", "messages": [{"role": "user", "content": "where? " * 40}]})
    assert_error(r, 400, "messages", "longer than the model's context")


ROUTES = {  # every route serve.py has: (method, path) -> a body it takes
    ("GET", "/v1/models"): None, ("GET", "/v1/models/{model_id:path}"): None,
    ("POST", "/v1/completions"): {"prompt": "who?", "max_tokens": 2},
    ("POST", "/v1/chat/completions"): {"messages": [{"role": "user", "content": "who?"}], "max_tokens": 2},
    ("POST", "/v1/responses"): {"input": "who?", "max_output_tokens": 2},
    ("GET", "/tokenizer_info"): None, ("POST", "/tokenize"): {"prompt": "who?"}, ("POST", "/detokenize"): {"tokens": [1]},
    ("GET", "/metrics"): None, ("HEAD", "/metrics"): None, ("GET", "/health"): None, ("HEAD", "/health"): None,
    ("GET", "/"): None,
}


def test_the_key_guards_every_v1_route_and_no_other(chat):
    """vLLM's rule, as docs/serving.md states it: the key on /v1 (what generates), the rest open."""
    routes = [r for r in serve.router.routes + serve.v1.routes if hasattr(r, "methods")]  # v1 is included whole
    assert set(ROUTES) == {(m, r.path) for r in routes for m in r.methods}, "a route left untested"
    assert [m.id for m in chat.client(KEY).models.list().data] == ["chatty"]
    for key in ("wrong-key", KEY + "x"):  # no key at all: the client refuses to send that, httpx below does
        with pytest.raises(openai.AuthenticationError, match="API key"):
            chat.client(key).chat.completions.create(model="chatty", messages=[{"role": "user", "content": "hi"}])
    for (method, path), body in ROUTES.items():
        url = chat.url + path.replace("{model_id:path}", "chatty")
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}):
            r = httpx.request(method, url, headers=headers, json=body, timeout=60)
            if path.startswith("/v1"):
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
            else:
                assert r.status_code == 200, (method, path, r.text)
        assert httpx.request(method, url, headers={"Authorization": f"Bearer {KEY}"}, json=body,
                             timeout=60).status_code == 200, (method, path)
    assert chat.health()["auth"] is True


# -----------------------------------------------------------------------------
# whole characters, start-up, shut-down


@pytest.mark.slow
def test_stream_sends_whole_utf8_characters(tmp_path):
    """GPT-2's BPE splits 🙂 and 日本 into several byte tokens; no chunk may hold half of one."""
    use_gpt2_bpe()
    make_gpt2_dataset(tmp_path / "data", ["naïve café 🙂 日本語 ÿ"] * 40)
    train_tiny(tmp_path / "out", tmp_path / "data", vocab_size=50304, n_embd=16, block_size=16, batch_size=4,
               max_iters=200, lr_decay_iters=200, learning_rate=3e-2, min_lr=3e-3, eval_interval=200, log_interval=100)
    with running(tmp_path, f"--out_dir={tmp_path / 'out'}", "--model_name=bpe") as server:
        client = server.client()
        whole = client.completions.create(model="bpe", prompt="naïve", max_tokens=30, temperature=0)
        chunks = list(client.completions.create(model="bpe", prompt="naïve", max_tokens=30, temperature=0,
                                                stream=True))
    text = whole.choices[0].text
    assert "🙂" in text and "日本" in text and whole.choices[0].finish_reason == "stop"  # <|endoftext|>
    pieces = [c.choices[0].text for c in chunks]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_and_sigterm_shut_down_cleanly_mid_stream(char_out, tmp_path, sig):
    server = Server(tmp_path, f"--out_dir={char_out}", "--model_name=romeo", "--max_tokens_limit=100000")
    try:
        with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                          json={"model": "romeo", "prompt": "ROMEO:", "max_tokens": 100000, "stream": True,
                                "ignore_eos": True}) as r:
            lines = r.iter_lines()
            next(lines)
            t0 = time.monotonic()
            if sig == signal.SIGINT:  # as a terminal sends it: to the whole process group, the engine's process too
                os.killpg(server.proc.pid, sig)
            else:
                server.proc.send_signal(sig)
            rest = list(lines)
        assert server.proc.wait(15) == 0  # one signal: a second Ctrl-C would mean "stop waiting" (force exit)
        assert time.monotonic() - t0 < 10
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    assert "shutting down" in "".join(rest)  # the stream says why it ends early
    assert "Traceback" not in server.output() and "Finished server process" in server.output()


def children(pid: int) -> list[int]:
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]


def gone(pid: int, within: float = 15) -> bool:
    """Whether process pid has exited (or is a zombie left to its parent) within `within` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads processes from /proc (Linux)")
@pytest.mark.parametrize("engine", ["auto", "thread"])
def test_the_engine_is_a_process_of_its_own_on_a_cpu_and_ends_with_the_server(char_out, tmp_path, engine):
    """On a CPU the engine runs in a child process (--engine=auto), with --engine=thread in the server's; the
    text is the same either way; the child ends when the server does, stopped cleanly or killed."""
    with running(tmp_path, f"--out_dir={char_out}", "--model_name=romeo", f"--engine={engine}") as server:
        kids = children(server.proc.pid)
        assert len(kids) == (1 if engine == "auto" else 0)
        text = complete(server, prompt="ROMEO:", max_tokens=40, temperature=0).choices[0].text
    assert "ROMEO:" + text == sample_py(char_out, ["--start=ROMEO:", "--max_new_tokens=40", "--temperature=0"])[0]
    assert all(gone(k) for k in kids)  # stopped by SIGTERM with the server
    if engine == "auto":
        server = Server(tmp_path, f"--out_dir={char_out}", "--model_name=romeo")
        (kid,) = children(server.proc.pid)
        server.proc.kill()  # the server dies without a word: its engine must not be left behind
        server.proc.wait(15)
        assert gone(kid)


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads processes from /proc (Linux)")
@pytest.mark.parametrize("when", ["streaming", "idle"])
def test_a_dead_engine_is_503_then_the_server_exits_for_its_supervisor(char_out, tmp_path, when):
    """kill -9 of the engine process, during a stream or on an idle server: the stream ends with an error event,
    a whole request in flight gets a 503, /health and new requests answer 503 in OpenAI's shape naming the cause, and the server then exits 1 with
    one line (as vLLM's API server exits when its engine dies), for its supervisor to restart it."""
    server = Server(tmp_path, f"--out_dir={char_out}", "--model_name=romeo", "--max_tokens_limit=100000")
    try:
        (kid,) = children(server.proc.pid)
        if when == "streaming":
            stream = iter(server.client().completions.create(model="romeo", prompt="ROMEO:", max_tokens=100000,
                                                             extra_body={"ignore_eos": True},
                                                             stream=True))
            next(stream)  # generating
            with concurrent.futures.ThreadPoolExecutor(1) as pool:  # and a whole (unstreamed) request in flight
                whole = pool.submit(complete, server, prompt="JULIET:", max_tokens=100000,
                                    extra_body={"ignore_eos": True})
                time.sleep(0.5)
                os.kill(kid, signal.SIGKILL)
                with pytest.raises(openai.APIError, match=r"the engine process has ended \(exit code -9\)"):
                    list(stream)
                with pytest.raises(openai.InternalServerError) as in_flight:
                    whole.result(timeout=60)
            assert in_flight.value.status_code == 503 and "exit code -9" in in_flight.value.message
        else:
            os.kill(kid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while (health := httpx.get(server.url + "/health", timeout=10)).status_code == 200:
            assert time.monotonic() < deadline, "/health still answers 200"
            time.sleep(0.05)
        assert health.status_code == 503
        assert health.json()["error"]["code"] == "engine_dead"
        assert "the engine process has ended (exit code -9)" in health.json()["error"]["message"]
        with pytest.raises(openai.InternalServerError) as refused:
            complete(server, prompt="ROMEO:", max_tokens=5)
        assert refused.value.status_code == 503 and "exit code -9" in refused.value.message
        assert server.proc.wait(60) == 1
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    lines = [line for line in server.output().splitlines() if line.startswith("error:")]
    assert "Traceback" not in server.output() and len(lines) == 1, server.output()
    assert "the engine process has ended (exit code -9)" in lines[0] and "supervisor restarts it" in lines[0]


def test_engine_choice_is_checked(char_out):
    model, tok, _ = resolver.load_model("resume", str(char_out))
    cfg = serve.ServeConfig(engine="process")
    with pytest.raises(serve.UserError, match="--engine=process serves CPU models only .* use --engine=thread"):
        serve.build_app(model, tok, cfg, "romeo", "cuda")
    with pytest.raises(serve.UserError, match="--engine must be auto, process or thread, got 'fork'"):
        serve.ServeConfig(engine="fork").validate()


def test_ctrl_c_while_the_model_loads_stops_before_serving(char_out, monkeypatch):
    """Ctrl-C while the weights load (after the imports) ends there: one line, exit 130, and uvicorn never
    starts, so no second Ctrl-C is needed."""
    real_load = resolver.load_model

    def interrupted_load(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # Python's handler raises at the next bytecode, inside the load
        return real_load(*args, **kwargs)
    started = []
    monkeypatch.setattr(resolver, "load_model", interrupted_load)
    monkeypatch.setattr(serve, "serve", lambda app, host, port: started.append(port))
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # as a fresh process has it (not a stop
    try:                                                                # flag an earlier in-process main left)
        result = run_main(serve.main, [f"--out_dir={char_out}", "--device=cpu", "--port=0"])
    finally:
        signal.signal(signal.SIGINT, before)
    assert result.returncode == 128 + signal.SIGINT, result.stderr
    assert result.stderr.splitlines() == ["error: interrupted"] and started == []


def test_non_loopback_bind_without_a_key_warns_once(char_out, monkeypatch):
    """main() up to uvicorn (replaced here: the test binds nothing): one warning line without a key."""
    monkeypatch.setattr(serve, "serve", lambda app, host, port: None)
    monkeypatch.delenv(serve.API_KEY_ENV, raising=False)
    args = [f"--out_dir={char_out}", "--device=cpu", "--port=0", "--host=0.0.0.0"]
    warned = run_main(serve.main, args)
    assert warned.returncode == 0 and [line for line in warned.stderr.splitlines()
                                       if line.startswith("warning:")] == [warned.stderr.splitlines()[-1]]
    assert "0.0.0.0" in warned.stderr and "--api_key" in warned.stderr
    for quiet in (args + ["--api_key=s3cret"], args[:-1], args[:-1] + ["--host=::1"], args[:-1] + ["--host=localhost"]):
        assert "warning" not in run_main(serve.main, quiet).stderr
    assert "--api_key is empty" in run_main(serve.main, args + ["--api_key=''"]).stderr


# -----------------------------------------------------------------------------
# the page, in a real headless Chromium (Debian's package; .ci/run installs it)


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install -r requirements-dev.txt")
    path = shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(path).exists():
        pytest.skip("no chromium: apt-get install chromium (.ci/run does)")
    with sync_api.sync_playwright() as p:
        # --no-sandbox: Chromium's sandbox cannot start as root, which CI containers are.
        browser = p.chromium.launch(executable_path=path, args=["--no-sandbox"])
        yield browser
        browser.close()


WATCH_REPLY = """() => { window.lengths = [];
  new MutationObserver(() => { const r = document.querySelector('.turn:last-child .reply');
                               if (r) window.lengths.push(r.textContent.length); })
    .observe(document.getElementById('log'), { subtree: true, childList: true, characterData: true }); }"""


def test_page_streams_a_completion_and_stops(base, browser, tmp_path):
    page = browser.new_page(viewport={"width": 900, "height": 600})
    page.goto(base.url)
    page.wait_for_function("() => document.getElementById('mode').textContent.includes('plain completion')")
    assert not page.is_visible("#key")  # no key wanted: no key field
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "300")
    page.evaluate(WATCH_REPLY)
    page.fill("#input", "ROMEO:")
    page.press("#input", "Enter")
    page.wait_for_selector(".meta", timeout=60_000)
    shown = page.inner_text(".turn:last-child .reply")
    want = complete(base, prompt="ROMEO:", max_tokens=300, temperature=0).choices[0].text
    assert page.text_content(".turn:last-child .reply") == want
    assert shown.strip() and page.inner_text(".turn:last-child .meta") == "(max tokens reached)"
    # It streamed: the page showed part of the reply before the whole. Not a count of parts: under
    # load the browser reads many events at once (a loaded CI run saw lengths 0, 173, 300).
    assert any(0 < n < len(want) for n in page.evaluate("window.lengths")), page.evaluate("window.lengths")
    page.screenshot(path=tmp_path / "completion.png")
    assert (tmp_path / "completion.png").stat().st_size > 10_000

    page.fill("#max-tokens", "100000")  # far more than it will get before the stop button
    page.fill("#input", "JULIET:")
    page.press("#input", "Enter")
    # A long reply, and the page still answers a click: one that rewrote the whole reply at each piece took 15 s to
    # answer at 5,000 characters, longer at each piece after
    page.wait_for_function("() => document.querySelector('.turn:last-child .reply').textContent.length > 10000",
                           timeout=120_000)
    page.click("#stop")
    page.wait_for_selector(".turn:last-child .meta:text('(stopped)')", timeout=10_000)
    deadline = time.monotonic() + 10
    while base.health()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert base.health()["running"] == 0  # the server stopped generating for it
    assert page.is_enabled("#send") and not page.is_enabled("#stop")


def test_page_chats_with_history_and_a_key(chat, browser, tmp_path):
    page = browser.new_page(viewport={"width": 900, "height": 600})
    sent = []
    page.on("request", lambda r: sent.append(r) if r.url.endswith("/v1/chat/completions") else None)
    page.goto(chat.url)
    page.wait_for_function("() => document.getElementById('mode').textContent === 'chat'")
    assert page.is_visible("#key")  # the server wants a key: the page asks for it
    page.fill("#key", KEY)
    page.fill("#temperature", "0")
    (q1, a1), (q2, a2) = CONVERSATIONS[:2]
    for n, question in enumerate((q1, q2), 1):
        page.fill("#input", question)
        page.press("#input", "Enter")
        page.wait_for_selector(f".assistant:nth-of-type({2 * n}) .meta", state="attached", timeout=60_000)
    replies = page.locator(".assistant .reply").all_text_contents()
    assert replies == [a1, a2]
    assert page.locator(".user").all_text_contents() == [q1, q2]
    bodies = [json.loads(r.post_data) for r in sent]
    assert bodies[1]["messages"] == [{"role": "user", "content": q1}, {"role": "assistant", "content": a1},
                                     {"role": "user", "content": q2}]  # the history goes with each turn
    assert all(r.headers["authorization"] == f"Bearer {KEY}" for r in sent)
    page.screenshot(path=tmp_path / "chat.png")
    assert (tmp_path / "chat.png").stat().st_size > 10_000


# -----------------------------------------------------------------------------
# batching, logprobs and echo, every field honoured or refused, the tokenizer endpoints, /metrics


def test_sixteen_concurrent_streams_greedy_and_seeded_get_their_lone_text(base):
    requests = [dict(prompt=p, seed=s, max_tokens=80, temperature=t)
                for p, s, t in zip(["ROMEO:", "JULIET:", "O Romeo", "What"] * 4, range(16), [0, 1.0] * 8)]
    lone = [complete(base, **r).choices[0].text for r in requests]
    client = openai.AsyncOpenAI(base_url=base.url + "/v1", api_key="unused", max_retries=0)

    async def one(r):
        return "".join([c.choices[0].text async for c in await client.completions.create(model="romeo", stream=True,
                                                                                          **r) if c.choices])

    async def all_at_once():
        return await asyncio.gather(*(one(r) for r in requests))

    # a thread of its own: the page tests' Playwright (sync API) keeps an event loop running in this one
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert pool.submit(lambda: asyncio.run(all_at_once())).result() == lone
    metrics = httpx.get(base.url + "/metrics").text
    sizes = [line for line in metrics.splitlines() if line.startswith("nanogpt_batch_size_bucket")]
    le8 = next(float(line.split()[-1]) for line in sizes if 'le="8.0"' in line)
    total = next(float(line.split()[-1]) for line in sizes if 'le="+Inf"' in line)
    assert total > le8  # some decoding steps held more than 8 rows: the requests were batched


@pytest.mark.slow
def test_quantized_server_batches_the_int8_model_sample_py_decodes(base, char_out, tmp_path):
    """serve.py --quantize=int8: requests decoded at once (several rows a step) get sample.py --quantize=int8's
    greedy text, and their logprobs are not the float model's (an engine that kept the float weights)."""
    prompts = ["ROMEO:", "JULIET:", "O Romeo", "What"]
    with running(tmp_path, f"--out_dir={char_out}", "--model_name=romeo", "--quantize=int8") as server:
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: complete(server, prompt=p, max_tokens=80, temperature=0, n=2, logprobs=1),
                                prompts))
        assert "int8 weights" in server.output()
    want = sample_py(char_out, *[[f"--start={p}", "--max_new_tokens=80", "--temperature=0", "--quantize=int8"]
                                 for p in prompts])
    for p, g, w in zip(prompts, got, want):
        assert [p + c.text for c in g.choices] == [w, w]
    floats = complete(base, prompt="ROMEO:", max_tokens=80, temperature=0, logprobs=1).choices[0].logprobs
    assert got[0].choices[0].logprobs.token_logprobs != floats.token_logprobs


def test_echo_logprobs_are_lm_evals_request(base, char_out):
    """lm-eval's loglikelihood request: token ids, echo, max_tokens 1, logprobs 1."""
    tok = CharTokenizer.from_text(TEXT)
    ids = tok.encode("ROMEO: But soft, what light")
    r = httpx.post(base.url + "/v1/completions", timeout=30, json={
        "model": "romeo", "prompt": [ids], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
        "echo": True}).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None and lp["tokens"][:len(ids)] == list("ROMEO: But soft, what light")
    assert lp["text_offset"] == list(range(len(ids) + 1)) and r["choices"][0]["text"].startswith("ROMEO: But")
    import torch
    from core.weights.resolver import load_model
    model, _, _ = load_model("resume", str(char_out))
    with torch.no_grad():
        logits, _ = model.eval()(torch.tensor([ids + [tok.encode(lp["tokens"][-1])[0]]]))
    want = torch.log_softmax(logits[0, :-1].float(), -1)
    every = ids[1:] + tok.encode(lp["tokens"][-1])
    for i, (t, got) in enumerate(zip(every, lp["token_logprobs"][1:])):
        assert abs(got - want[i, t].item()) < 1e-5
    assert lp["token_logprobs"][-1] == max(lp["top_logprobs"][-1].values())  # greedy: lm-eval's is_greedy ==
    scored = httpx.post(base.url + "/v1/completions", timeout=30, json={
        "model": "romeo", "prompt": "ROMEO: But soft, what light", "max_tokens": 0, "echo": True, "logprobs": 0})
    choice = scored.json()["choices"][0]
    assert choice["text"] == "ROMEO: But soft, what light" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(lp["token_logprobs"][:len(ids)], abs=1e-5)
    assert scored.json()["usage"]["completion_tokens"] == 0


def test_logit_bias_forces_and_bans(base):
    tok = CharTokenizer.from_text(TEXT)
    z = tok.encode("z")[0] if "z" in TEXT else 0
    plain = complete(base, prompt="ROMEO:", max_tokens=40, temperature=0).choices[0].text
    forced = complete(base, prompt="ROMEO:", max_tokens=10, temperature=0, logit_bias={str(z): 100})
    assert forced.choices[0].text == tok.decode([z]) * 10  # +100 forces the token
    c = max(set(plain), key=plain.count)  # the greedy text's most common character
    banned = complete(base, prompt="ROMEO:", max_tokens=40, temperature=0,
                      logit_bias={str(i): -100 for i in tok.encode(c)}).choices[0].text
    assert c not in banned


REFUSED = {"best_of": 2, "suffix": "x", "response_format": {"type": "json_object"}, "foo": 1, "max_token": 5,
           "tools": [], "user": "me", "logprobs_": 1,  # OpenAI's, and misspellings; then vLLM's, meaningless here
           "use_beam_search": True, "guided_json": {}, "guided_regex": "a+", "guided_choice": ["a"],
           "structured_outputs": {"regex": "a"}, "lora_request": {}, "logits_processors": ["f"],
           "spaces_between_special_tokens": False, "prompt_embeds": "AAAA", "cache_salt": "s"}


@pytest.mark.parametrize("field", REFUSED)
def test_every_field_not_implemented_is_refused_by_name(base, field):
    body = {"model": "romeo", "prompt": "ROMEO:", field: REFUSED[field]}
    r = httpx.post(base.url + "/v1/completions", json=body, timeout=30)
    assert_error(r, 400, field, f"'{field}'")
    assert r.json()["error"]["code"] == "unsupported_field"


def test_min_p_stop_token_ids_allowed_token_ids_and_bad_words_change_what_is_drawn(base):
    """vLLM's sampling fields on the trained model, each against the text it changes: min_p=1 keeps only the
    likeliest token, so sampling draws the greedy text; a stop id ends the choice where that character comes;
    allowed ids draw from those alone; a bad word never appears (a one-character word anywhere, a longer one
    where its first characters were just drawn)."""
    tok = CharTokenizer.from_text(TEXT)
    greedy = complete(base, prompt="ROMEO:", max_tokens=60, temperature=0).choices[0].text
    sampled = complete(base, prompt="ROMEO:", max_tokens=60, temperature=1.0, seed=3).choices[0].text
    assert complete(base, prompt="ROMEO:", max_tokens=60, temperature=1.0, seed=3,
                    extra_body={"min_p": 1.0}).choices[0].text == greedy != sampled
    at = next(i for i, ch in enumerate(greedy) if i > 10 and ch not in greedy[:i])  # a character's first time
    cut = complete(base, prompt="ROMEO:", max_tokens=60, temperature=0, extra_body={"stop_token_ids": tok.encode(greedy[at])})
    assert cut.choices[0].text == greedy[:at] and cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens == at + 1  # the stop id counted, as vLLM counts it
    allowed = complete(base, prompt="ROMEO:", max_tokens=30, temperature=1.0, seed=3,
                       extra_body={"allowed_token_ids": tok.encode("ab")}).choices[0].text
    assert set(allowed) <= set("ab") and len(set(allowed)) == 2
    letter = next(ch for ch in greedy if ch.isalpha())
    word = next(greedy[i:i + 2] for i in range(len(greedy) - 1) if greedy[i:i + 2].isalpha() and letter not in greedy[i:i + 2])
    banned = complete(base, prompt="ROMEO:", max_tokens=60, temperature=0,
                      extra_body={"bad_words": [letter, word]}).choices[0].text
    assert letter not in banned and word not in banned and banned != greedy


def test_a_request_whose_rules_leave_no_token_fails_alone_and_a_tiny_temperature_is_greedy(base):
    """allowed_token_ids that bad_words all ban: a 400 for that request, while one decoding beside it in the same
    steps ends as it would alone (its NaN probabilities once failed every request of the step); a temperature too
    small for float32 is greedy, as vLLM's (it made NaN probabilities too)."""
    tok = CharTokenizer.from_text(TEXT)
    lone = complete(base, prompt="ROMEO:", max_tokens=1500, temperature=1.0, seed=5).choices[0].text
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        beside = pool.submit(lambda: complete(base, prompt="ROMEO:", max_tokens=1500, temperature=1.0, seed=5))
        time.sleep(0.2)
        for stream in (False, True):
            r = httpx.post(base.url + "/v1/completions", timeout=30, json={
                "prompt": "ROMEO:", "stream": stream, "allowed_token_ids": tok.encode("ab"), "bad_words": ["a", "b"]})
            assert ("no token to draw" in r.text) and (r.status_code == 200 if stream else r.status_code == 400), r.text
        assert beside.result().choices[0].text == lone
    greedy = complete(base, prompt="ROMEO:", max_tokens=30, temperature=0).choices[0].text
    assert complete(base, prompt="ROMEO:", max_tokens=30, temperature=1e-300, seed=1).choices[0].text == greedy


def test_prompt_logprobs_and_return_token_ids_are_vllms_fields(base, chat):
    """prompt_logprobs: each prompt token's logprob and rank and the k likeliest, the floats echo reports;
    return_token_ids: the prompt's ids and each choice's, whole and streamed (the prompt's in the first chunk)."""
    tok = CharTokenizer.from_text(TEXT)
    ids = tok.encode("ROMEO: But soft")
    echo = httpx.post(base.url + "/v1/completions", json={"prompt": "ROMEO: But soft", "max_tokens": 0, "echo": True,
                                                          "logprobs": 0}).json()["choices"][0]["logprobs"]
    got = httpx.post(base.url + "/v1/completions", json={
        "prompt": "ROMEO: But soft", "max_tokens": 5, "temperature": 0, "prompt_logprobs": 2, "return_token_ids": True}
    ).json()["choices"][0]
    assert got["prompt_token_ids"] == ids and got["prompt_logprobs"][0] is None and len(got["prompt_logprobs"]) == len(ids)
    for t, entry, want in zip(ids[1:], got["prompt_logprobs"][1:], echo["token_logprobs"][1:]):
        assert entry[str(t)]["logprob"] == pytest.approx(want, abs=1e-5) and entry[str(t)]["decoded_token"] == tok.decode([t])
        ranked = sorted(entry.values(), key=lambda e: e["rank"])
        assert ranked[0]["rank"] == 1 and ranked[0]["logprob"] == max(e["logprob"] for e in entry.values())
        lp = entry[str(t)]["logprob"]  # its rank counts the whole vocabulary's likelier tokens, these among them
        assert len(entry) in (2, 3) and entry[str(t)]["rank"] >= 1 + sum(e["logprob"] > lp for e in entry.values())
        assert (entry[str(t)]["rank"] <= 2) == (len(entry) == 2)
    assert tok.decode(got["token_ids"]) == got["text"] and len(got["token_ids"]) == 5
    events = stream_events(base, "/v1/completions", model="romeo", prompt="ROMEO: But soft", max_tokens=5,
                           temperature=0, return_token_ids=True)
    # Steps the client has not read yet go out as one chunk, so there may be a single one: the first has the ids.
    assert events[0]["choices"][0]["prompt_token_ids"] == ids
    assert not any("prompt_token_ids" in c for e in events[1:] for c in e["choices"])
    assert [t for e in events for t in e["choices"][0]["token_ids"]] == got["token_ids"]
    reply = post(chat, "/v1/chat/completions", messages=ASK, temperature=0, return_token_ids=True, prompt_logprobs=0)
    assert reply["prompt_token_ids"] == ChatTemplate.for_tokenizer(chat_tokenizer()).render_prompt(ASK)
    assert len(reply["prompt_logprobs"]) == len(reply["prompt_token_ids"]) == reply["usage"]["prompt_tokens"]
    assert len(reply["choices"][0]["token_ids"]) == reply["usage"]["completion_tokens"]
    events = stream_events(chat, "/v1/chat/completions", messages=ASK, temperature=0, return_token_ids=True)
    assert events[0]["prompt_token_ids"] == reply["prompt_token_ids"] and "prompt_token_ids" not in events[1]
    assert [t for e in events for t in e["choices"][0].get("token_ids", [])] == reply["choices"][0]["token_ids"]


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(base):
    long = "ROMEO: " * 10  # 70 tokens, past the context of 32
    assert_error(httpx.post(base.url + "/v1/completions", json={"prompt": long}), 400, "prompt", "longer")
    got = complete(base, prompt=long, max_tokens=20, temperature=0, extra_body={"truncate_prompt_tokens": 20})
    assert got.usage.prompt_tokens == 20
    assert got.choices[0].text == complete(base, prompt=long[-20:], max_tokens=20, temperature=0).choices[0].text
    assert complete(base, prompt=long, max_tokens=1, extra_body={"truncate_prompt_tokens": -1}).usage.prompt_tokens == 32
    assert_error(httpx.post(base.url + "/v1/completions", json={"prompt": long, "truncate_prompt_tokens": 33}), 400,
                 "truncate_prompt_tokens", "1..32")


def test_responses_create_and_stream_with_the_openai_client(chat):
    """OpenAI's Responses API through the official client: responses.create and responses.stream give the chat
    completion's text; previous_response_id continues a stored conversation (as the messages spelled out would),
    with the earlier turns' tokens from the prefix cache; instructions are a system message; max_output_tokens
    ends a response incomplete; an unstored or unknown id, a base model and a tool are refused by name."""
    client = chat.client(KEY)
    (q1, a1), (q2, a2) = CONVERSATIONS[:2]
    r = client.responses.create(model="chatty", input=q1, temperature=0)
    assert r.output_text == a1 and r.status == "completed" and r.id.startswith("resp_")
    assert r.usage.input_tokens == len(q1) + 3 and r.usage.output_tokens == len(a1) + 1  # and <|end|>
    with client.responses.stream(model="chatty", input=[{"role": "user", "content": q1}], temperature=0) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert final.output_text == a1 and kinds[:4] == ["response.created", "response.in_progress",
                                                      "response.output_item.added", "response.content_part.added"]
    assert kinds.count("response.output_text.delta") > 3 and kinds[-1] == "response.completed"
    nxt = client.responses.create(model="chatty", input=q2, previous_response_id=r.id, temperature=0)
    spelled = client.chat.completions.create(model="chatty", temperature=0, messages=[
        {"role": "user", "content": q1}, {"role": "assistant", "content": a1}, {"role": "user", "content": q2}])
    assert nxt.output_text == spelled.choices[0].message.content and nxt.previous_response_id == r.id
    assert nxt.usage.input_tokens_details.cached_tokens >= 32  # the first turn's whole blocks
    system = client.responses.create(model="chatty", input=q1, instructions="be terse", temperature=0)
    assert system.usage.input_tokens == r.usage.input_tokens + len("be terse") + 2 and system.instructions == "be terse"
    cut = client.responses.create(model="chatty", input=q1, max_output_tokens=3, temperature=0, store=False)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output_text == a1[:3] and cut.usage.output_tokens == 3
    for bad, param in (({"previous_response_id": cut.id}, "previous_response_id"),
                       ({"previous_response_id": "resp_nowhere"}, "previous_response_id"),
                       ({"tools": [{"type": "web_search"}]}, "tools"), ({"max_output_tokens": 0}, "max_output_tokens"),
                       ({"input": [{"type": "function_call_output", "output": "x"}]}, "input")):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="chatty", **({"input": q1} | bad))
        assert e.value.body["param"] == param, e.value.body
    assert_error(httpx.post(chat.url + "/v1/responses", json={"input": q1}), 401, None, "API key")


def test_responses_on_a_base_model_is_refused(base):
    assert_error(httpx.post(base.url + "/v1/responses", json={"input": "ROMEO:"}), 400, "input", "no chat template")


def test_add_special_tokens_wraps_the_prompt_as_its_tokenizer_json_says(monkeypatch):
    """A tokenizer.json whose post-processor starts a sequence with <s>: completions and /tokenize add it by
    default (vLLM's), not with add_special_tokens false; chat's default is false."""
    tokenizers = pytest.importorskip("tokenizers")
    from core.data.tokenizer import HFTokenizer
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<s>": 0, "h": 1, "i": 2, "?": 3}, unk_token="?"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    backend.add_special_tokens(["<s>"])
    backend.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok = HFTokenizer(backend.to_str(), eot_token=3)
    monkeypatch.setattr(serve, "BatchEngine", ScriptedEngine)
    model = GPT(GPTConfig(block_size=16, vocab_size=tok.vocab_size, n_layer=1, n_head=1, n_embd=8))
    with TestClient(serve.build_app(model, tok, serve.ServeConfig(engine="thread"), "m", "cpu")) as client:
        def ids(**body):
            r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "return_token_ids": True, **body})
            return r.json()["choices"][0]["prompt_token_ids"]
        assert ids() == [0, 1, 2] and ids(add_special_tokens=False) == [1, 2]
        assert client.post("/tokenize", json={"prompt": "hi"}).json()["tokens"] == [0, 1, 2]
        assert client.post("/tokenize", json={"prompt": "hi", "add_special_tokens": False}).json()["tokens"] == [1, 2]


def test_a_prompt_sent_again_reports_its_cached_tokens_and_vllms_counters(base):
    """usage.prompt_tokens_details.cached_tokens: none the first time, all but the last token's whole blocks the
    second, the same greedy text; vLLM's prefix-cache counters move by the tokens looked up and found."""
    m = lambda name: f'{name}{{model_name="romeo"}}'  # noqa: E731
    prompt = "O Romeo, Romeo! wherefore art"  # 29 tokens: one block of 16
    before = scrape(base)
    first, again = (complete(base, prompt=prompt, max_tokens=2, temperature=0) for _ in range(2))
    after = scrape(base)
    assert (first.usage.prompt_tokens_details.cached_tokens, again.usage.prompt_tokens_details.cached_tokens) == (0, 16)
    assert first.choices[0].text == again.choices[0].text
    assert after[m("vllm:prefix_cache_queries_total")] - before.get(m("vllm:prefix_cache_queries_total"), 0) == 2 * 29
    assert after[m("vllm:prefix_cache_hits_total")] - before.get(m("vllm:prefix_cache_hits_total"), 0) == 16


@pytest.fixture(scope="module")
def long_chat_out(tmp_path_factory):
    """The chat model with a context of 512 tokens: room for a conversation of eight turns."""
    return train_chat_model(tmp_path_factory.mktemp("long-chat"), block_size=512, iters=60)


def test_a_chat_of_eight_turns_prefills_only_each_turns_new_tokens(long_chat_out, tmp_path):
    """Eight turns through the openai client, each resending the history: each turn takes the last turn's prompt
    and reply from the prefix cache, to a whole block (all but the reply's last token, drawn and never fed), and
    its replies are those of a server without the cache, token for token."""
    questions = [q for q, _ in CONVERSATIONS] * 3
    turns = {}
    for cache in ("auto", "0"):
        flags = [f"--out_dir={long_chat_out}", "--model_name=chatty"] + (["--prefix_cache_tokens=0"] if cache == "0" else [])
        with running(tmp_path, *flags) as server:
            messages, turns[cache] = [], []
            for question in questions[:8]:
                messages.append({"role": "user", "content": question})
                r = server.client().chat.completions.create(model="chatty", messages=messages, temperature=0,
                                                            max_tokens=40)
                messages.append({"role": "assistant", "content": r.choices[0].message.content})
                turns[cache].append((r.choices[0].message.content, r.usage))
    assert [text for text, _ in turns["auto"]] == [text for text, _ in turns["0"]]
    assert all(u.prompt_tokens_details.cached_tokens == 0 for _, u in turns["0"])
    for (_, last), (text, now) in zip(turns["auto"], turns["auto"][1:]):
        assert now.prompt_tokens_details.cached_tokens == (last.prompt_tokens + last.completion_tokens - 1) // 16 * 16
    assert turns["auto"][-1][1].prompt_tokens > 300


def test_openapi_json_and_docs_describe_every_route_and_its_errors(base):
    """/openapi.json lists every route with its request fields and its errors in OpenAI's shape (the 400s
    included, never FastAPI's 422, which this server does not send); /docs is the page that reads it."""
    schema = httpx.get(base.url + "/openapi.json").json()
    operations = {(method.upper(), path) for path, ops in schema["paths"].items() for method in ops}
    assert operations == {(m, p.replace("{model_id:path}", "{model_id}")) for m, p in ROUTES}
    completions = schema["paths"]["/v1/completions"]["post"]
    assert set(completions["responses"]) == {"200", "400", "401", "404", "413", "500", "503"}
    assert completions["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody")
    assert not any("422" in op["responses"] for ops in schema["paths"].values() for op in ops.values())
    fields = schema["components"]["schemas"]["CompletionRequest"]
    assert {"prompt", "min_p", "prompt_logprobs", "return_token_ids"} <= set(fields["properties"])
    assert fields["additionalProperties"] is False and fields["required"] == ["prompt"]
    assert "/openapi.json" in httpx.get(base.url + "/docs").text


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_a_fuzzer_reading_openapi_json_gets_no_5xx_and_only_what_it_documents(char_out, tmp_path, mode):
    """schemathesis makes requests from /openapi.json for every route, valid by the schema and not (a few of
    each, for the suite's time): none is a 5xx, each status, content type and error body is one the route
    documents, and every request the schema forbids is refused."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    checks = [schemathesis.checks.not_a_server_error, schemathesis.checks.status_code_conformance,
              schemathesis.checks.content_type_conformance, schemathesis.checks.response_schema_conformance]
    if mode == "negative":
        checks.append(schemathesis.checks.negative_data_rejection)
    with running(tmp_path, f"--out_dir={char_out}", "--model_name=romeo", "--max_tokens_limit=4") as server:
        schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
        for operation in (result.ok() for result in schema.get_all_operations()):
            if mode == "negative" and not operation.body:
                continue  # nothing to get wrong: no body (a path's model id is any string)
            @given(case=operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode)))
            @settings(max_examples=25, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            def fuzz(case):
                case.call_and_validate(checks=checks)
            fuzz()


def test_chat_logprobs_and_refused_tools(chat):
    client = chat.client(KEY)
    question, answer = CONVERSATIONS[0]
    r = client.chat.completions.create(model="chatty", messages=[{"role": "user", "content": question}],
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert "".join(c.token for c in content) == answer
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == c.logprob for c in content)
    assert all(c.bytes == list(c.token.encode()) for c in content)
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(model="chatty", messages=[{"role": "user", "content": question}],
                                       tools=[{"type": "function", "function": {"name": "f"}}])


def test_model_retrieve_tokenizer_endpoints_and_metrics(base):
    assert base.client().models.retrieve("romeo").id == "romeo"
    with pytest.raises(openai.NotFoundError):
        base.client().models.retrieve("gpt-4")
    info = httpx.get(base.url + "/tokenizer_info").json()
    assert "eos_token" in info and info["model_max_length"] == BLOCK_SIZE
    tok = CharTokenizer.from_text(TEXT)
    t = httpx.post(base.url + "/tokenize", json={"prompt": "ROMEO:", "add_special_tokens": False}).json()
    assert t == {"tokens": tok.encode("ROMEO:"), "count": 6, "max_model_len": BLOCK_SIZE}
    assert httpx.post(base.url + "/detokenize", json={"tokens": t["tokens"]}).json() == {"prompt": "ROMEO:"}
    assert_error(httpx.post(base.url + "/tokenize", json={"prompt": "ROMEO 🙂"}), 400, "prompt", "cannot be encoded")
    assert complete(base, prompt="", max_tokens=1).usage.prompt_tokens == 1  # an empty prompt: <|endoftext|>


def scrape(server: Server) -> dict[str, float]:
    """/metrics as {'name{labels}': value}."""
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in r.text.splitlines() if not line.startswith("#"))}


def test_vllm_metrics_count_what_was_served(base):
    """vLLM's names with vLLM's model_name label, as its dashboards query them: the counters move by exactly the
    tokens served, each request lands once in the TTFT and end-to-end histograms and once per later token in
    the inter-token one, and the gauges show a request while it runs."""
    m = lambda name: f'{name}{{model_name="romeo"}}'  # noqa: E731
    before = scrape(base)
    replies = [complete(base, prompt="ROMEO:", max_tokens=k, temperature=0) for k in (3, 9)]
    chunks, _ = streamed(base, prompt="JULIET:", max_tokens=6, stream_options={"include_usage": True})
    used = [r.usage for r in replies] + [chunks[-1].usage]
    served = scrape(base)
    moved = lambda name, now=served, then=before: now[m(name)] - then.get(m(name), 0)  # noqa: E731
    assert moved("vllm:prompt_tokens_total") == sum(u.prompt_tokens for u in used)
    assert moved("vllm:generation_tokens_total") == sum(u.completion_tokens for u in used)
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
        assert moved(name + "_count") == 3 and moved(name + "_sum") > 0, name
    assert moved("vllm:inter_token_latency_seconds_count") == sum(u.completion_tokens - 1 for u in used)
    assert moved("vllm:inter_token_latency_seconds_sum") > 0 and moved("nanogpt_batch_size_count") > 0
    with base.client().completions.create(model="romeo", prompt="ROMEO:", max_tokens=100000, stream=True,
                                            extra_body={"ignore_eos": True}) as long:
        next(iter(long))
        during = scrape(base)
    time.sleep(0.5)  # the engine drops the stream that left at its next step
    after = scrape(base)
    assert during[m("vllm:num_requests_running")] == 1 and during[m("vllm:num_requests_waiting")] == 0
    assert during[m("vllm:kv_cache_usage_perc")] == 1 / 16  # one of --max_batch's 16 slots
    assert after[m("vllm:num_requests_running")] == 0 and after[m("vllm:kv_cache_usage_perc")] == 0
    assert moved("vllm:generation_tokens_total", after, served) >= 1  # what the engine drew for it counts
    assert moved("vllm:time_to_first_token_seconds_count", after, served) == 1  # not again for tokens drawn late
    assert moved("vllm:e2e_request_latency_seconds_count", after, served) == 1
    for path in ("/metrics", "/health"):  # a probe's HEAD
        r = httpx.head(base.url + path)
        assert r.status_code == 200 and r.content == b"", path


# -----------------------------------------------------------------------------
# vLLM's sampling extensions, each against a trained model where it shows


def post(server: Server, path: str, **body) -> dict:
    r = httpx.post(server.url + path, json={"model": "chatty", **body}, timeout=60,
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    return r.json()


def stream_events(server: Server, path: str, **body) -> list[dict]:
    with httpx.stream("POST", server.url + path, json={"model": "chatty", "stream": True, **body}, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


# The chat template spelled out as a completions prompt: the model answers, then <|end|>, then <|endoftext|>,
# which ends a completion.
QUESTION, ANSWER = CONVERSATIONS[0]
SPELLED = f"<|user|>{QUESTION}<|end|><|assistant|>"
ASK = [{"role": "user", "content": QUESTION}]


def test_ignore_eos_and_min_tokens_give_exactly_the_asked_length(chat):
    plain = post(chat, "/v1/completions", prompt=SPELLED, max_tokens=40, temperature=0)
    assert plain["choices"][0]["text"] == ANSWER and plain["choices"][0]["finish_reason"] == "stop"
    assert plain["usage"]["completion_tokens"] == len(ANSWER) + 2  # and <|end|> (hidden), <|endoftext|>
    reply = post(chat, "/v1/chat/completions", messages=ASK, max_tokens=40, temperature=0)
    assert reply["choices"][0]["finish_reason"] == "stop" and reply["usage"]["completion_tokens"] == len(ANSWER) + 1
    for extra in ({"ignore_eos": True}, {"min_tokens": 40}, {"min_tokens": 40, "ignore_eos": True}):
        for path, body in (("/v1/completions", {"prompt": SPELLED}), ("/v1/chat/completions", {"messages": ASK})):
            got = post(chat, path, **body, **extra, max_tokens=40, temperature=0)
            choice = got["choices"][0]
            text = choice["text"] if "text" in choice else choice["message"]["content"]
            assert got["usage"]["completion_tokens"] == 40 and choice["finish_reason"] == "length", (extra, path, got)
            assert text.startswith(ANSWER) and len(text) > len(ANSWER), (extra, path, text)
    # min_tokens short of the answer changes nothing; past it, the end waits for it
    short = post(chat, "/v1/completions", prompt=SPELLED, max_tokens=40, temperature=0, min_tokens=5)
    assert short["choices"] == plain["choices"] and short["usage"] == plain["usage"]
    longer = post(chat, "/v1/completions", prompt=SPELLED, max_tokens=40, temperature=0, min_tokens=len(ANSWER) + 5)
    assert len(ANSWER) + 5 <= longer["usage"]["completion_tokens"] <= 40
    assert longer["choices"][0]["text"].startswith(ANSWER)


def test_skip_special_tokens_and_include_stop_str_in_output(chat):
    ended = post(chat, "/v1/completions", prompt=SPELLED, max_tokens=40, temperature=0, skip_special_tokens=False)
    assert ended["choices"][0]["text"] == ANSWER + "<|end|>"  # <|endoftext|> ended it: not text
    shown, hidden = (post(chat, "/v1/completions", prompt=SPELLED, max_tokens=40, temperature=0, ignore_eos=True,
                          skip_special_tokens=skip)["choices"][0]["text"] for skip in (False, True))
    assert shown.startswith(ANSWER + "<|end|><|endoftext|>") and "<|" not in hidden
    for name in ("<|end|>", "<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>"):
        shown = shown.replace(name, "")
    assert shown == hidden
    stop = "son"
    for include, text in ((False, ANSWER[:ANSWER.index(stop)]), (True, ANSWER[:ANSWER.index(stop) + len(stop)])):
        got = post(chat, "/v1/chat/completions", messages=ASK, temperature=0, stop=[stop],
                   include_stop_str_in_output=include)["choices"][0]
        assert got["message"]["content"] == text and got["finish_reason"] == "stop"
        events = stream_events(chat, "/v1/chat/completions", messages=ASK, temperature=0, stop=[stop],
                               include_stop_str_in_output=include)
        assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == text
    # vLLM's rule: a stop string is looked for only past min_tokens
    assert post(chat, "/v1/chat/completions", messages=ASK, temperature=0, stop=["Romeo"])["choices"][0][
        "message"]["content"] == ""
    assert post(chat, "/v1/chat/completions", messages=ASK, temperature=0, stop=["Romeo"], min_tokens=8)["choices"][0][
        "message"]["content"] == ANSWER


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(chat):
    for path, body in (("/v1/completions", {"prompt": SPELLED}), ("/v1/chat/completions", {"messages": ASK})):
        whole = post(chat, path, **body, max_tokens=30, temperature=0, ignore_eos=True)
        events = stream_events(chat, path, **body, max_tokens=30, temperature=0, ignore_eos=True,
                               stream_options={"include_usage": True, "continuous_usage_stats": True})
        counts = [e["usage"]["completion_tokens"] for e in events]
        assert all(e["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"] for e in events)
        assert counts == sorted(counts) and counts[-1] == 30 and len(set(counts)) > 5, counts
        assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]
        # as vLLM's: only with include_usage
        events = stream_events(chat, path, **body, max_tokens=5, stream_options={"continuous_usage_stats": True})
        assert not any("usage" in e for e in events)


def vllm_greedy(model, prompt: list[int], n: int, repetition=1.0, frequency=0.0, presence=0.0) -> list[int]:
    """Greedy decoding with vLLM's penalties written out token by token (its sampler's formula): a token of the
    prompt or the output has its logit divided by repetition if positive, multiplied if not; an output token
    loses frequency per time generated and presence once."""
    ids, out = list(prompt), []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([ids]))[0][0, -1].tolist()
        for t in set(prompt) | set(out):
            logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
        for t in set(out):
            logits[t] -= frequency * out.count(t) + presence
        out.append(max(range(len(logits)), key=logits.__getitem__))
        ids.append(out[-1])
    return out


@pytest.mark.parametrize("penalties", [{"repetition_penalty": 1.5}, {"repetition_penalty": 0.8},
                                       {"frequency_penalty": 1.0}, {"presence_penalty": 1.5},
                                       {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.5}])
def test_penalties_are_vllms_formula(base, char_out, penalties):
    """The greedy text with penalties is what vLLM's formula gives, computed here from the model's logits, and
    not the plain greedy text (a passage the model loops through: repeats to penalise)."""
    model, tok, _ = resolver.load_model("resume", str(char_out))
    prompt, n = tok.encode("ROMEO:"), BLOCK_SIZE - len("ROMEO:")  # within the context: no window slides
    names = {"repetition_penalty": "repetition", "frequency_penalty": "frequency", "presence_penalty": "presence"}
    want = tok.decode(vllm_greedy(model.eval(), prompt, n, **{names[k]: v for k, v in penalties.items()}))
    got = complete(base, prompt="ROMEO:", max_tokens=n, temperature=0, extra_body=penalties).choices[0].text
    assert got == want and got != complete(base, prompt="ROMEO:", max_tokens=n, temperature=0).choices[0].text


# -----------------------------------------------------------------------------
# benchmark clients, as they ship: guidellm (vLLM's) and aiperf (NVIDIA's), on loopback, offline


@pytest.fixture(scope="module")
def chat_hf(chat_out, tmp_path_factory):
    """export.py's folder of the chat model: its tokenizer.json is the tokenizer the clients count tokens with."""
    hf = tmp_path_factory.mktemp("chat-hf") / "hf"
    result = run_script("export.py", f"--out_dir={chat_out}", f"--hf_dir={hf}")
    assert result.returncode == 0, result.stderr
    return hf


# Nothing may leave the machine: a client's request to anywhere but loopback meets a closed port.
LOOPBACK_ONLY = {"HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "NO_PROXY": "127.0.0.1",
                 "no_proxy": "127.0.0.1", "HF_HUB_DISABLE_TELEMETRY": "1"}
OUTPUT_TOKENS = 40  # more than any of the model's answers: without ignore_eos every reply would end sooner


def client_tool(name: str) -> str:
    path = Path(sys.executable).with_name(name)  # the venv's console script
    if not path.exists() and not shutil.which(name):
        pytest.skip(f"{name} is not installed: pip install -r requirements-dev.txt -c requirements-lock.txt")
    return str(path) if path.exists() else shutil.which(name)


@pytest.mark.slow
@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_guidellm_benchmarks_the_server_with_no_failed_request(chat, chat_hf, tmp_path, endpoint):
    """guidellm streams with stream_options.continuous_usage_stats and ignore_eos on every request."""
    out = tmp_path / "guidellm.json"
    run = subprocess.run(
        [client_tool("guidellm"), "run", "--disable-console",
         "--backend", f"kind=openai_http,target={chat.url},model=chatty,request_format={endpoint},api_key={KEY}",
         "--profile", "kind=concurrent,streams=4", "--constraint", "kind=max_requests,count=12",
         "--data", f"kind=synthetic_text,prompt_tokens=8,output_tokens={OUTPUT_TOKENS}",
         "--tokenizer", f"kind=huggingface_auto,model={chat_hf}", "--output", f"kind=json,path={out}"],
        cwd=tmp_path, env=os.environ | LOOPBACK_ONLY | {"HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
        timeout=300)
    assert run.returncode == 0 and out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    metrics = json.loads(out.read_text())["benchmarks"][0]["metrics"]
    assert metrics["request_totals"] == {"successful": 12, "errored": 0, "incomplete": 0, "total": 12}
    assert metrics["output_token_count"]["successful"]["mean"] == OUTPUT_TOKENS
    assert metrics["time_to_first_token_ms"]["successful"]["mean"] > 0
    assert metrics["inter_token_latency_ms"]["successful"]["mean"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_aiperf_benchmarks_the_server_with_no_failed_request(chat, chat_hf, tmp_path, endpoint):
    """aiperf streams; ignore_eos is its own --extra-inputs. It also reads /metrics: vLLM's names, as served."""
    out = tmp_path / "aiperf"
    # not HF_HUB_OFFLINE: aiperf 0.13 then looks a local tokenizer folder up in the hub's cache, and fails
    run = subprocess.run(
        [client_tool("aiperf"), "profile", "--ui", "none", "--model", "chatty", "--url", chat.url, "--api-key", KEY,
         "--endpoint-type", endpoint, "--streaming", "--tokenizer", str(chat_hf), "--request-count", "12",
         "--concurrency", "4", "--prompt-input-tokens-mean", "8", "--prompt-input-tokens-stddev", "0",
         "--prompt-output-tokens-mean", str(OUTPUT_TOKENS), "--prompt-output-tokens-stddev", "0",
         "--extra-inputs", "ignore_eos:true", "--use-server-token-count", "--output-artifact-dir", str(out)],
        cwd=tmp_path, env=os.environ | LOOPBACK_ONLY, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    got = json.loads((out / "profile_export_aiperf.json").read_text())
    assert got["error_summary"] == [] and got["request_error_rate"]["avg"] == 0, got["error_summary"]
    assert got["completed_request_count"]["avg"] == 12
    assert got["output_sequence_length"]["avg"] == OUTPUT_TOKENS
    assert got["time_to_first_token"]["avg"] > 0 and got["inter_token_latency"]["avg"] > 0
    scraped = json.loads((out / "server_metrics_export.json").read_text())["metrics"]
    assert {"vllm:generation_tokens", "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
            "vllm:num_requests_running", "vllm:kv_cache_usage_perc"} <= scraped.keys(), sorted(scraped)


# -----------------------------------------------------------------------------
# the text side, without a server


def pushed(text: ChoiceText, ids: list[int]) -> list[str]:
    return [text.push(i) for i in ids]


def test_choice_text_holds_back_a_possible_stop_string_and_cuts_at_it():
    tok = CharTokenizer.from_text("abcdefgh lowrd")
    choice = ChoiceText(tok, ["lo w", "zz"], set(), max_tokens=100)
    pieces = pushed(choice, tok.encode("hello world"))
    assert "".join(pieces) == "hel" and choice.text == "hel" and choice.finish == "stop"
    # "l" could start "lo w": held back; at "ll" the first is safe; "lo", "lo " wait; "lo w" is cut off
    assert pieces[:8] == ["h", "e", "", "l", "", "", "", ""]
    assert choice.tokens == 7  # the ids taken up to the end of the stop string, "hello w"


def test_choice_text_finish_reasons_length_and_stop_token():
    tok = CharTokenizer.from_text("abc")
    choice = ChoiceText(tok, [], {tok.encode("c")[0]}, max_tokens=3)
    assert pushed(choice, tok.encode("ab")) == ["a", "b"] and choice.finish is None
    assert choice.push(tok.encode("c")[0]) == "" and choice.finish == "stop" and choice.text == "ab"
    choice = ChoiceText(tok, [], set(), max_tokens=2)
    assert pushed(choice, tok.encode("aba")) == ["a", "b", ""] and choice.finish == "length" and choice.tokens == 2


def test_choice_text_sends_only_whole_utf8_characters():
    use_gpt2_bpe()
    from core.data.tokenizer import GPT2Tokenizer
    tok = GPT2Tokenizer()
    text = "naïve 🙂 日本語"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # several ids per character somewhere
    choice = ChoiceText(tok, [], set(), max_tokens=len(ids))
    pieces = pushed(choice, ids)
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces) and choice.finish == "length"
    assert "" in pieces  # some ids ended inside a character and were held back


def test_steps_queued_behind_a_lagging_client_go_out_as_one_piece():
    """A client that reads slower than the engine steps gets every step already queued in one piece (one
    stream chunk), the same text; one step at a time when it keeps up."""
    from types import SimpleNamespace

    from core.serving.engine import EngineRequest, Handle, RowStep
    from core.serving.metrics import Metrics
    from core.serving.openai import pieces
    tok = CharTokenizer.from_text("abcde")
    ids = tok.encode("abcde")

    class Engine:  # a stand-in whose steps arrive as the test says
        def submit(self, req, loop):
            self.handle = Handle(req, loop)
            return self.handle

    async def read(at_once: bool):
        served = SimpleNamespace(engine=Engine(), metrics=Metrics())
        req = EngineRequest(prompt=[0], n=1, max_tokens=len(ids), sampling=None)
        got = pieces(served, [req], lambda prompt: ChoiceText(tok, [], set(), len(ids)), choices := [])
        steps = [[RowStep(t, None)] for t in ids]
        first = asyncio.ensure_future(got.__anext__())
        await asyncio.sleep(0)  # pieces has submitted its request
        for step in steps if at_once else steps[:1]:
            served.engine.handle.out.put_nowait(step)
        out = [await first]
        while not at_once and len(out) < len(ids):  # a client that keeps up: each step once the last is read
            served.engine.handle.out.put_nowait(steps[len(out)])
            out.append(await got.__anext__())
        return out, choices[0].finish

    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # a loop of its own: Playwright's may hold this thread
        assert pool.submit(asyncio.run, read(at_once=True)).result() == ([(0, "abcde")], "length")
        assert pool.submit(asyncio.run, read(at_once=False)).result() == ([(0, c) for c in "abcde"], "length")


def test_completion_logprobs_shape_and_offsets():
    tok = CharTokenizer.from_text("abc")
    a, b = tok.encode("ab")
    got = completion_logprobs(tok, [(a, None), (b, TokenScore(-0.5, [(b, -0.5), (a, -1.5)]))])
    assert got == {"tokens": ["a", "b"], "token_logprobs": [None, -0.5], "top_logprobs": [None, {"b": -0.5, "a": -1.5}],
                   "text_offset": [0, 1]}


class ScriptedEngine:
    """A stand-in for BatchEngine: every row draws "h", "i", then the first id that ends its choice, a step each
    (each its own chunk), every token at logprob -0.5 (the alternative "i" at -1.5)."""
    failure = None

    def __init__(self, model, settings, metrics):
        self.settings = settings

    def start(self):
        pass

    def stop(self):
        pass

    def submit(self, req, loop):
        handle, (h, i) = Handle(req, loop), WIRE_TOK.encode("hi")
        handle.queued = lambda: 0

        def score(t):
            return None if req.logprobs is None else TokenScore(-0.5, [(t, -0.5), (i, -1.5)][:req.logprobs])
        scored = req.prompt_logprobs is not None
        handle.out.put_nowait(PromptScores([None] + [score(t) for t in req.prompt[1:]] if scored else None))
        for t in (h, i, req.stop_tokens[0])[:req.max_tokens]:
            handle.out.put_nowait([RowStep(t, score(t))] * req.n)
        handle.out.put_nowait(None)
        return handle


WIRE_TOK = tokenizer_from_meta(with_chat_tokens(CharTokenizer.from_text("hi").meta()))
ASK_HI = '"messages": [{"role": "user", "content": "hi"}]'
# a stream chunk's first fields, and a completion's logprobs of "h", "i", <|endoftext|>
CMPL = 'data: {"id": "cmpl-ID", "object": "text_completion", "created": T, "model": "m", "choices": ['
CHAT = 'data: {"id": "chatcmpl-ID", "object": "chat.completion.chunk", "created": T, "model": "m", "choices": ['
CACHED0 = '"prompt_tokens_details": {"cached_tokens": 0}'
HI = ('{"tokens":["h","i","<|endoftext|>"],"token_logprobs":[-0.5,-0.5,-0.5],'
      '"top_logprobs":[{"h":-0.5},{"i":-0.5},{"<|endoftext|>":-0.5}],"text_offset":[0,1,2]}')
WIRE = {  # (name, path, body) -> the reply's bytes, its id's random part and its time written ID and T
    ("completion", "/v1/completions", '{"prompt": "ih", "n": 2, "logprobs": 1}'):
        '{"id":"cmpl-ID","object":"text_completion","created":T,"model":"m","choices":['
        '{"index":0,"text":"hi","logprobs":' + HI + ',"finish_reason":"stop"},'
        '{"index":1,"text":"hi","logprobs":' + HI + ',"finish_reason":"stop"}],'
        '"usage":{"prompt_tokens":2,"completion_tokens":6,"total_tokens":8,'
        '"prompt_tokens_details":{"cached_tokens":0}}}',
    ("completion echo", "/v1/completions", '{"prompt": "ih", "echo": true, "logprobs": 1, "max_tokens": 1}'):
        '{"id":"cmpl-ID","object":"text_completion","created":T,"model":"m","choices":[{"index":0,"text":"ihh",'
        '"logprobs":{"tokens":["i","h","h"],"token_logprobs":[null,-0.5,-0.5],"top_logprobs":[null,{"h":-0.5},'
        '{"h":-0.5}],"text_offset":[0,1,2]},"finish_reason":"length"}],'
        '"usage":{"prompt_tokens":2,"completion_tokens":1,"total_tokens":3,"prompt_tokens_details":{"cached_tokens":0}}}',
    ("completion streamed", "/v1/completions",
     '{"prompt": "ih", "stream": true, "logprobs": 0, "stream_options": {"include_usage": true}}'):
        CMPL + '{"index": 0, "text": "h", "logprobs": {"tokens": ["h"], "token_logprobs": [-0.5], '
               '"top_logprobs": [{}], "text_offset": [0]}, "finish_reason": null}], "usage": null}\n\n'
        + CMPL + '{"index": 0, "text": "i", "logprobs": {"tokens": ["i"], "token_logprobs": [-0.5], '
                 '"top_logprobs": [{}], "text_offset": [0]}, "finish_reason": null}], "usage": null}\n\n'
        + CMPL + '{"index": 0, "text": "", "logprobs": {"tokens": ["<|endoftext|>"], "token_logprobs": [-0.5], '
                 '"top_logprobs": [{}], "text_offset": [0]}, "finish_reason": "stop"}], "usage": null}\n\n'
        + CMPL + '], "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5, '
                 '"prompt_tokens_details": {"cached_tokens": 0}}}\n\n'
        'data: [DONE]\n\n',
    ("chat", "/v1/chat/completions", "{" + ASK_HI + ', "logprobs": true, "top_logprobs": 1}'):
        '{"id":"chatcmpl-ID","object":"chat.completion","created":T,"model":"m","choices":[{"index":0,'
        '"message":{"role":"assistant","content":"hi"},"logprobs":{"content":['
        '{"token":"h","logprob":-0.5,"bytes":[104],"top_logprobs":[{"token":"h","logprob":-0.5,"bytes":[104]}]},'
        '{"token":"i","logprob":-0.5,"bytes":[105],"top_logprobs":[{"token":"i","logprob":-0.5,"bytes":[105]}]}]},'
        '"finish_reason":"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8,'
        '"prompt_tokens_details":{"cached_tokens":0}}}',
    ("chat streamed", "/v1/chat/completions", "{" + ASK_HI + ', "stream": true, "logprobs": true, '
     '"stream_options": {"include_usage": true, "continuous_usage_stats": true}}'):
        CHAT + '{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}'
               '], "usage": {"prompt_tokens": 5, "completion_tokens": 0, "total_tokens": 5, ' + CACHED0 + '}}\n\n'
        + CHAT + '{"index": 0, "delta": {"content": "h"}, "logprobs": {"content": [{"token": "h", "logprob": -0.5, '
                 '"bytes": [104], "top_logprobs": []}]}, "finish_reason": null}], '
                 '"usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6, ' + CACHED0 + '}}\n\n'
        + CHAT + '{"index": 0, "delta": {"content": "i"}, "logprobs": {"content": [{"token": "i", "logprob": -0.5, '
                 '"bytes": [105], "top_logprobs": []}]}, "finish_reason": null}], '
                 '"usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7, ' + CACHED0 + '}}\n\n'
        + CHAT + '{"index": 0, "delta": {}, "logprobs": {"content": []}, "finish_reason": "stop"}], '
                 '"usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8, ' + CACHED0 + '}}\n\n'
        + CHAT + '], "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8, ' + CACHED0 + '}}\n\n'
        'data: [DONE]\n\n',
    ("chat streamed n=2", "/v1/chat/completions", "{" + ASK_HI + ', "stream": true, "n": 2}'):  # roles first
        "".join(CHAT + f'{{"index": {i}, "delta": {delta}, "logprobs": null, "finish_reason": {finish}}}]}}\n\n'
                for delta, finish in (('{"role": "assistant", "content": ""}', "null"), ('{"content": "h"}', "null"),
                                      ('{"content": "i"}', "null"), ("{}", '"stop"')) for i in (0, 1))
        + 'data: [DONE]\n\n',
}


@pytest.mark.parametrize("name, path, body", [pytest.param(*key, id=key[0]) for key in WIRE])
def test_each_reply_shape_is_openais_byte_for_byte(name, path, body, monkeypatch):
    """Whole and streamed, completion and chat, through the app: key order, spacing, every chunk."""
    monkeypatch.setattr(serve, "BatchEngine", ScriptedEngine)
    model = GPT(GPTConfig(block_size=16, vocab_size=WIRE_TOK.vocab_size, n_layer=1, n_head=1, n_embd=8))
    with TestClient(serve.build_app(model, WIRE_TOK, serve.ServeConfig(engine="thread"), "m", "cpu")) as client:
        got = client.post(path, content=body).text
    assert re.sub(r'("created": ?)\d+', r"\1T", re.sub(r"(cmpl-)[0-9a-f]{24}", r"\1ID", got)) == WIRE[name, path, body]


# -----------------------------------------------------------------------------
# lm-evaluation-harness, the outside client: the same scores through the server as on the exported weights

LM_EVAL_TASKS = REPO_ROOT / "tests" / "lm_eval_tasks"
LM_EVAL_TASK_NAMES = ("romeo_mc", "romeo_ll", "romeo_gen", "romeo_rolling")


def lm_eval_run(model: str, model_args: dict) -> dict:
    lm_eval = pytest.importorskip("lm_eval", reason="pip install -r requirements-dev.txt")
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(LM_EVAL_TASK_NAMES),
                                   task_manager=TaskManager(include_path=str(LM_EVAL_TASKS)), log_samples=True,
                                   batch_size=1, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                   fewshot_random_seed=0,
                                   # no bootstrapped stderr: it forks a multiprocessing pool from this
                                   # process, whose threads (tqdm's, the client's) can leave a child locked
                                   bootstrap_iters=0)


def per_item(result: dict, task: str) -> list:
    return [s["filtered_resps"] for s in sorted(result["samples"][task], key=lambda s: s["doc_id"])]


@pytest.mark.slow
def test_lm_eval_scores_through_the_server_equal_the_exported_weights(char_out, base, tmp_path, monkeypatch):
    """lm-eval's local-completions against serve.py, and its hf model on export.py's folder of the same run:
    every loglikelihood agrees to 1e-4, every generation and metric is equal; then with no tokenizer given,
    lm-eval finds the server's tokenizer endpoints and scores the same. The char vocabulary holds
    <|endoftext|>, which the rolling task's windows start from: without it at /tokenizer_info lm-eval crashes
    (no prefix token), and an export that grew the head by a row would score every token differently."""
    hf_dir = tmp_path / "hf"
    exported = run_scripts(["export.py", f"--out_dir={char_out}", f"--hf_dir={hf_dir}"])[0]
    assert exported.returncode == 0, exported.stderr
    monkeypatch.chdir(LM_EVAL_TASKS)  # the task files name their data files relative to themselves
    url = base.url + "/v1/completions"
    local = dict(model="romeo", base_url=url, tokenizer=str(hf_dir), tokenizer_backend="huggingface",
                 tokenized_requests=True, num_concurrent=1, max_retries=1, max_length=BLOCK_SIZE)
    server = lm_eval_run("local-completions", local)
    # lm-eval's API model keeps one of max_length's tokens for generation and scores rolling windows of
    # max_length - 2 tokens, its hf model windows of max_length: this gives hf the API's windows
    hf = lm_eval_run("hf", dict(pretrained=str(hf_dir), device="cpu", dtype="float32", max_length=BLOCK_SIZE - 2))
    remote = lm_eval_run("local-completions", {k: v for k, v in local.items()
                                               if k not in ("tokenizer", "tokenizer_backend")})
    # each passage's whole log-likelihood (windows of 30 tokens, the first from <|endoftext|>): the server's
    # two tokenizers send the same ids, so the same sum; the folder's sums differ by float rounding only
    (ours, theirs, far) = [[float(r[0]) for r in per_item(run, "romeo_rolling")] for run in (server, hf, remote)]
    assert len(ours) == 4 and ours == far and ours == pytest.approx(theirs, abs=1e-3), (ours, theirs, far)
    for task in ("romeo_mc", "romeo_ll"):
        for ours, theirs, far in zip(per_item(server, task), per_item(hf, task), per_item(remote, task)):
            for (ll, greedy), (hf_ll, hf_greedy), (r_ll, r_greedy) in zip(ours, theirs, far):
                assert abs(float(ll) - float(hf_ll)) < 1e-4 and abs(float(r_ll) - float(ll)) < 1e-4, task
                assert greedy == hf_greedy == r_greedy, task
    assert per_item(server, "romeo_gen") == per_item(hf, "romeo_gen") == per_item(remote, "romeo_gen")
    for task in LM_EVAL_TASK_NAMES:
        metrics = {k: v for k, v in server["results"][task].items() if "stderr" not in k and isinstance(v, float)}
        # equal, up to the float rounding of perplexity's exp of a summed 1e-4-close loglikelihood
        for other in (hf, remote):
            assert metrics == pytest.approx({k: other["results"][task][k] for k in metrics}, rel=1e-5, abs=1e-6)
        assert metrics, task
    lls = [float(ll) for item in per_item(server, "romeo_mc") for ll, _ in item]
    assert len(set(lls)) == len(lls)  # a trained model: every choice scored apart, not one value over and over
