"""EngineProcess: a BatchEngine (core/serving/engine.py) in a process of its own, with BatchEngine's side for the
caller (start, stop, submit, the counters); serve.py's default on a CPU (docs/serving.md, "The engine's process").

Here the server's side (EngineProcess, ProcessHandle), the child's (_child: a BatchEngine whose event loop and
metrics are a PipeLoop), and how a request crosses the pipe (packed, unpacked).
"""
import asyncio
import contextlib
import dataclasses
import multiprocessing
import signal
import threading

import torch

from core.errors import first_line
from core.serving.engine import (BatchEngine, EngineDied, EngineRequest, EngineSettings, Handle, ServerStopping,
                                 check_submission)
from model import GPT


def ends(item) -> bool:
    """Whether an event ends its request: None (done) or an exception (failed, stopping)."""
    return item is None or isinstance(item, BaseException)


class PipeLoop:
    """In the child, the 'event loop' of every request and the engine's metrics: BatchEngine._flush hands it a
    step's events, which go to the server in one message with the engine's counters and what the step told the
    metrics (batch, token)."""

    def __init__(self, conn, handles: dict[int, Handle]):
        self.conn, self.handles, self.engine = conn, handles, None
        self.batches: list[int] = []  # rows in each decoding forward
        self.tokens: list[tuple[int, int]] = []  # (request id, rows drawn) per request per step

    def batch(self, rows: int) -> None:
        self.batches.append(rows)

    def token(self, handle, rows: int) -> None:
        self.tokens.append((handle.id, rows))

    def call_soon_threadsafe(self, _deliver, events: list[tuple[Handle, object]]) -> None:
        for handle, item in events:
            if ends(item):
                self.handles.pop(handle.id, None)
        e, metrics = self.engine, (self.batches, self.tokens)
        self.batches, self.tokens = [], []
        try:
            self.conn.send(("step", [(h.id, item) for h, item in events],
                            (e.running, e.waiting_count(), e.tokens_generated, e.slots_used), metrics))
        except OSError:  # the server has gone
            e.stop()


def packed(req: EngineRequest) -> tuple[EngineRequest, bytes | None]:
    """req without its generator, and the generator's state as bytes: pickled as it is, the state tensor would
    cross the pipe as shared memory, a file descriptor passed per request (its cost: docs/serving.md,
    "Throughput")."""
    g = req.sampling.generator
    return (dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, generator=None)),
            None if g is None else g.get_state().numpy().tobytes())


def unpacked(req: EngineRequest, state: bytes | None) -> EngineRequest:
    """packed's inverse, in the engine process (a CPU generator: the process engine serves CPU models)."""
    if state is None:
        return req
    generator = torch.Generator()
    generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    return dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, generator=generator))


def _child(conn, parent_end, stop, model: GPT, settings: EngineSettings, threads: int) -> None:
    """The engine process: a BatchEngine whose events go down the pipe; a thread takes submissions from it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the whole group: the server stops us
    parent_end.close()
    torch.set_num_threads(threads)
    handles: dict[int, Handle] = {}
    loop = PipeLoop(conn, handles)
    try:
        engine = loop.engine = BatchEngine(model, settings, metrics=loop)
    except Exception as e:  # no memory for the KV cache, say
        conn.send(("error", first_line(e)))
        return
    engine.stopping = stop  # the server sets it, from its signal handler as well

    def receive() -> None:
        try:
            while True:
                kind, rid, *rest = conn.recv()
                if kind == "submit":
                    handle = handles[rid] = Handle(unpacked(*rest), loop)
                    handle.id = rid
                    engine.pending.put(handle)
                elif rid in handles:  # cancel
                    handles[rid].cancelled.set()
        except (EOFError, OSError):  # the server has gone: nobody is left to serve
            stop.set()

    threading.Thread(target=receive, name="engine-receive", daemon=True).start()
    conn.send(("ready",))
    engine._run()


class ProcessHandle(Handle):
    """The server's side of a request that the engine process generates."""

    def __init__(self, req: EngineRequest, loop, engine: "EngineProcess", rid: int):
        super().__init__(req, loop)
        self.engine, self.id = engine, rid

    def cancel(self) -> None:
        if not self.cancelled.is_set() and self.id in self.engine.handles:  # not ended yet
            self.engine.send(("cancel", self.id))
        self.cancelled.set()


class EngineProcess:
    """A BatchEngine in a process of its own, so that the engine's Python and the event loop's do not take turns
    under one GIL. Forked once the model is loaded (shared, never written; a fork cannot carry CUDA: CPU models
    only); one pipe each way: submissions and cancellations down, one message per engine step up, which a
    reader thread turns into one call on the server's event loop."""

    def __init__(self, model: GPT, settings: EngineSettings, metrics=None, threads: int | None = None):
        """threads: the engine process's torch threads (default this process's). A fork keeps no OpenMP pool: a
        caller that wants several should keep to one thread itself until the fork (serve.py's main does)."""
        self.settings, self.metrics = settings, metrics
        ctx = multiprocessing.get_context("fork")
        self.conn, child_end = ctx.Pipe()
        self.stopping = ctx.Event()
        self.process = ctx.Process(target=_child, name="engine", daemon=True, args=(
            child_end, self.conn, self.stopping, model, settings, threads or torch.get_num_threads()))
        self.process.start()
        child_end.close()
        reply = self._recv()
        if reply[0] != "ready":
            self.process.join()
            raise RuntimeError(f"the engine process did not start: {reply[1]}")
        self.handles: dict[int, ProcessHandle] = {}
        self.next_id = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self.running = self.waiting = self.tokens_generated = self.slots_used = 0
        self.failure: str | None = None  # why the process ended, once it has ended on its own (serve.py's /health)
        self.send_lock = threading.Lock()
        self.reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)

    def _recv(self):
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            self.process.join(5)  # its pipe closes as it dies: wait for its exit code
            return ("error", f"the process ended (exit code {self.process.exitcode})")

    def start(self) -> None:
        self.reader.start()

    def stop(self) -> None:
        self.stopping.set()

    def send(self, message: tuple) -> None:
        with self.send_lock:
            self.conn.send(message)

    def submit(self, req: EngineRequest, loop: asyncio.AbstractEventLoop) -> Handle:
        check_submission(req, self.settings, self.stopping)
        if self.failure is not None or not self.process.is_alive():
            raise EngineDied(self.failure or f"the engine process has ended (exit code {self.process.exitcode})")
        self.loop = loop  # one server, one event loop
        self.next_id += 1
        handle = self.handles[self.next_id] = ProcessHandle(req, loop, self, self.next_id)
        self.send(("submit", handle.id, *packed(req)))
        return handle

    def waiting_count(self) -> int:
        return self.waiting

    def _read(self) -> None:
        """The reader thread: each message from the engine process, handed to the event loop in one call."""
        while (message := self._recv())[0] == "step":
            if self.loop is not None:
                try:
                    self.loop.call_soon_threadsafe(self._deliver, *message[1:])
                except RuntimeError:  # the event loop has closed (shutting down)
                    return
        if not self.stopping.is_set():
            self.failure = f"the engine process has ended (exit code {self.process.exitcode})"
        end = ServerStopping() if self.failure is None else EngineDied(self.failure)
        if self.loop is not None:
            with contextlib.suppress(RuntimeError):  # the event loop has closed
                self.loop.call_soon_threadsafe(self._fail_all, end)

    def _deliver(self, events: list, counters: tuple, step_metrics: tuple) -> None:
        """On the event loop: one step's events to their handles, its counters and metrics to the server's."""
        self.running, self.waiting, self.tokens_generated, self.slots_used = counters
        if self.metrics is not None:
            batches, tokens = step_metrics
            for rows in batches:
                self.metrics.batch(rows)
            for rid, rows in tokens:
                if rid in self.handles:
                    self.metrics.token(self.handles[rid], rows)
        for rid, item in events:
            handle = self.handles.pop(rid, None) if ends(item) else self.handles.get(rid)  # the last: out of the table
            if handle is not None:
                handle.out.put_nowait(item)

    def _fail_all(self, end: BaseException) -> None:
        for handle in self.handles.values():
            handle.out.put_nowait(end)
        self.handles.clear()
        self.running = self.waiting = self.slots_used = 0

    def join(self, timeout: float | None = None) -> None:
        self.process.join(timeout)
        if self.reader.is_alive():
            self.reader.join(timeout)
