"""Small helpers shared by the tests: tiny datasets, tiny training runs, running the scripts.

    from tests.helpers import make_char_dataset, train_tiny, cli_args, run_script, run_scripts, assert_user_error

    data = make_char_dataset(tmp / "data", "some text to learn\\n" * 50)
    ckpt = train_tiny(tmp / "out", tmp / "data", max_iters=10)     # train.main in-process, a ~20k-param model
    result = run_script("sample.py", f"--out_dir={tmp / 'out'}", "--device=cpu")
    result = run_script("train.py", *cli_args(TINY_TRAIN, out_dir=tmp / "run", data_dir=tmp / "data"))  # --key=value
    assert_user_error(run_script("sample.py", "--top_k=0"), "top_k")

GPT-2 BPE needs tiktoken's r50k_base file; offline it comes from a tiktoken cache folder (TIKTOKEN_CACHE_DIR, or
the copy beside the repository that use_gpt2_bpe() finds). It fails where a cache is present but does not load,
and skips (saying how to provide one) only where none exists; needs_transformers() likewise. Tiny Shakespeare
(SHAKESPEARE) is where data/shakespeare_char/prepare.py keeps its download, or the copy beside the repository.
"""
import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_TIKTOKEN_CACHE = REPO_ROOT.parent / "shared" / "tiktoken_cache"
# Tiny Shakespeare for the tests that train on real text: where prepare.py keeps its download, else the copy beside.
SHAKESPEARE = next((p for p in (REPO_ROOT / "data" / "shakespeare_char" / "input.txt",
                                REPO_ROOT.parent / "shared" / "data" / "tinyshakespeare.txt") if p.is_file()),
                   REPO_ROOT / "data" / "shakespeare_char" / "input.txt")
NO_SHAKESPEARE = ("needs tiny Shakespeare: run python data/shakespeare_char/prepare.py once with the network (it keeps "
                  "data/shakespeare_char/input.txt), or copy the text there")

# Tiny models gain nothing from a second thread, and on a busy two-core machine OpenMP threads
# spinning for each other make them many times slower (docs/performance.md#threads-torchs-default-and-when---threads1-wins).
ONE_THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

# A model that trains in well under a second per 10 iterations on two CPU cores.
# The signals train.py's stop flag takes (core/runtime.StopFlag): restored after a run in this process.
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))

TINY_TRAIN = dict(
    n_layer=1, n_head=2, n_embd=32, block_size=32, dropout=0.0, bias=True,
    batch_size=8, gradient_accumulation_steps=1, max_iters=20,
    eval_interval=20, eval_iters=2, log_interval=10,
    learning_rate=1e-2, min_lr=1e-3, warmup_iters=0, lr_decay_iters=20,
    device="cpu", dtype="float32", compile=False, seed=1337,
)


@contextlib.contextmanager
def one_thread():
    """Run torch on one thread inside the block (see ONE_THREAD_ENV), then restore the count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def use_gpt2_bpe() -> None:
    """Make GPT-2's BPE loadable offline (here and in subprocesses).

    Where a cache folder is present (TIKTOKEN_CACHE_DIR, or the copy beside the repository), a tokenizer that
    does not load is a test failure, not a skip: a broken BPE must not turn its tests into skips.
    Only with no cache folder at all, and no network to fetch the file, does the test skip, saying why.
    """
    if "TIKTOKEN_CACHE_DIR" not in os.environ and SHARED_TIKTOKEN_CACHE.is_dir():
        os.environ["TIKTOKEN_CACHE_DIR"] = str(SHARED_TIKTOKEN_CACHE)
    from core.errors import UserError
    from core.data.tokenizer import GPT2Tokenizer

    cache = os.environ.get("TIKTOKEN_CACHE_DIR")
    try:
        GPT2Tokenizer()
    except UserError as e:
        if cache and Path(cache).is_dir():
            pytest.fail(f"GPT-2 BPE does not load although TIKTOKEN_CACHE_DIR={cache} exists: {e}")
        pytest.skip(f"GPT-2 BPE unavailable (no network, no tiktoken cache): set TIKTOKEN_CACHE_DIR to a folder that "
                    f"holds tiktoken's r50k_base file (tiktoken writes it there on its first use online): {e}")


def needs_transformers():
    """The transformers module, or a skip saying it is not installed. Installed but broken (an import
    error from inside it) is a failure, never a skip."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        pytest.skip("GPT-2 interop needs transformers (pip install -r requirements-dev.txt); not installed")
    import transformers

    return transformers


def make_char_dataset(data_dir, text: str, val_fraction: float = 0.1) -> dict:
    """A character-level dataset of `text` in data_dir (train.bin, val.bin, meta.json); returns meta."""
    from core.data.writer import write_dataset
    from core.data.tokenizer import CharTokenizer

    tok = CharTokenizer.from_text(text)
    n = int(len(text) * (1 - val_fraction))
    return write_dataset(data_dir, tok.meta(), {"train": tok.encode(text[:n]), "val": tok.encode(text[n:])})


def make_gpt2_dataset(data_dir, documents: list[str], val_documents: list[str] | None = None) -> dict:
    """A GPT-2 BPE dataset, <|endoftext|> after each document as prepare.py writes it; returns meta.

    val_documents defaults to the training documents. Call use_gpt2_bpe() first.
    """
    from core.data.writer import write_dataset
    from core.data.tokenizer import GPT2Tokenizer

    tok = GPT2Tokenizer()

    def ids(docs):
        return [i for doc in docs for i in tok.encode(doc) + [tok.eot_token]]

    return write_dataset(data_dir, tok.meta(), {"train": ids(documents), "val": ids(val_documents or documents)})


def char_data_fixture(text: str):
    """A module-scoped fixture named data_dir: a char dataset of `text` in a temporary folder.

        data_dir = char_data_fixture(TEXT)   # in a test module; tests then take data_dir as usual
    """
    @pytest.fixture(scope="module")
    def data_dir(tmp_path_factory):
        d = tmp_path_factory.mktemp("data")
        make_char_dataset(d, text)
        return d
    return data_dir


def cli_args(settings: dict | None = None, /, **more) -> list[str]:
    """A command line's --key=value for each setting (a dict, then keywords over it), in order:
    cli_args(TINY_TRAIN, out_dir=tmp, max_iters=20) -> ["--n_layer=1", ..., "--out_dir=/tmp/...", "--max_iters=20"]."""
    return [f"--{key}={value}" for key, value in ((settings or {}) | more).items()]


def train_tiny(out_dir, data_dir, **overrides) -> Path:
    """Run train.main in-process on a tiny model (TINY_TRAIN, then overrides); returns out_dir/ckpt.pt.

    Any TrainConfig key can be overridden, e.g. vocab_size=80, max_iters=50, init_from="resume".
    train.py installs SIGINT/SIGTERM/SIGHUP handlers; they are restored afterwards so Ctrl-C still stops pytest.
    """
    import train

    cfg = TINY_TRAIN | {"out_dir": str(out_dir), "data_dir": str(data_dir)} | overrides
    argv = cli_args(cfg)
    handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        with one_thread():
            train.main(argv)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return Path(out_dir) / "ckpt.pt"


def sharpen(ckpt: Path, factor: float = 3.0) -> None:
    """Scale q and k up in place in a checkpoint: scores factor^2 larger, attention far from uniform.
    With qk_norm, q and k are normalised after the projection, so their gains are scaled instead."""
    state = torch.load(ckpt, weights_only=True)
    for name, w in state["model"].items():
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            w.mul_(factor)
        if name.endswith("attn.c_attn.weight"):
            C = w.size(1)
            w[:C + (w.size(0) - C) // 2].mul_(factor)  # q rows, then k rows; v unchanged
    torch.save(state, ckpt)


def run_script(script: str, *args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `python script args...` from the repo root, as a user would; text stdout/stderr captured.

    env: extra environment variables on top of this process's own and ONE_THREAD_ENV.
    """
    return run_scripts([script, *args], env=env, timeout=timeout)[0]


def run_scripts(*commands: list[str], env: dict | None = None, timeout: float = 120) -> list[subprocess.CompletedProcess]:
    """Like run_script for each command ([script, *args]), all at once: with torch's import taking
    seconds per process, two at a time on two cores take about the wall time of one."""
    procs = [subprocess.Popen([sys.executable, *map(str, cmd)], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=os.environ | ONE_THREAD_ENV | (env or {}))
             for cmd in commands]
    results = []
    try:
        for proc, cmd in zip(procs, commands):
            out, err = proc.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def assert_user_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    """A user error as core.errors.run_cli reports it: exit 2, no traceback, and one stderr line
    `error: ...` that contains every fragment."""
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 2, f"exit {result.returncode}\nstdout: {result.stdout}\nstderr: {result.stderr}"
    last = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ""
    assert last.startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in last, f"{fragment!r} not in {last!r}"


def run_many(commands: list[list[str]], parallel: int = 3, env: dict | None = None,
             timeout: float = 120) -> list[subprocess.CompletedProcess]:
    """run_script for each command ([script, *args]), `parallel` at a time, results in order: many
    short runs finish in about (count / parallel) times the wall time of one."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(parallel) as pool:
        return list(pool.map(lambda cmd: run_script(*cmd, env=env, timeout=timeout), commands))


def run_main(main, argv: list[str]) -> subprocess.CompletedProcess:
    """A script's main(argv) run in-process through core.errors.run_cli, as the command line would run
    it: exit code, stdout and stderr come back as a CompletedProcess (for assert_user_error). Faster
    than a subprocess, and monkeypatches apply. Signal handlers are restored as in train_tiny."""
    import io
    from core.errors import run_cli

    out, err = io.StringIO(), io.StringIO()
    handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    code = None
    try:
        with one_thread(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            run_cli(main, [str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def child_pids(pid: int) -> list[int]:
    """The ids of the processes whose parent is `pid`, read from /proc (Linux): e.g. torchrun's workers."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited meanwhile
            continue
        # /proc/PID/stat is "pid (comm) state ppid ...", and comm may itself hold spaces or ')'.
        if int(stat.rpartition(")")[2].split()[1]) == pid:
            children.append(int(entry.name))
    return children


def process_env(pid: int) -> dict[str, str]:
    """The environment `pid` was started with (Linux /proc), e.g. a torchrun worker's RANK."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").partition("=")[::2] for item in raw if b"=" in item)


def flip_a_weight_bit(path) -> None:
    """Flip one bit in the middle of the largest tensor of a torch.save file (a zip archive): the
    damage torch.load alone would not notice, loading a wrong weight."""
    import struct
    import zipfile

    data = bytearray(Path(path).read_bytes())
    with zipfile.ZipFile(path) as archive:
        record = max(archive.infolist(), key=lambda info: info.file_size)
    # A zip local header is 30 bytes, then the file name and the extra field, then the data.
    name_len, extra_len = struct.unpack("<HH", data[record.header_offset + 26: record.header_offset + 30])
    data[record.header_offset + 30 + name_len + extra_len + record.file_size // 2] ^= 0x10
    Path(path).write_bytes(data)


TIMINGS = ("ms", "tok_per_s", "mfu", "time", "elapsed_s", "peak_mib")  # fields of a log record the clock (or device) sets


def records(out_dir, timings: bool = True) -> list[dict]:
    """Every record of out_dir/log.jsonl in file order; timings=False leaves out TIMINGS."""
    lines = (Path(out_dir) / "log.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if timings or k not in TIMINGS} for line in lines]


def losses(out_dir) -> list[tuple[int, float]]:
    """(iter, training loss) of each training record in out_dir/log.jsonl, in file order: an iteration logged
    twice (log.jsonl not trimmed on resume) shows twice; dict(losses(d)) keeps the later record."""
    return [(r["iter"], r["loss"]) for r in records(out_dir) if "loss" in r]


def spy_optimizer_steps(monkeypatch, after=None) -> list:
    """Record each AdamW update train.py's loop makes (its `scaler.step(optimizer)`): returns a list that
    gets one entry (the optimizer) per update; `after(optimizer, n)` then runs with n updates done."""
    real_step, steps = torch.optim.AdamW.step, []

    def step(self, *args, **kwargs):
        result = real_step(self, *args, **kwargs)
        steps.append(self)
        if after is not None:
            after(self, len(steps))
        return result
    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    return steps


def make_chat_dataset(data_dir, conversations: list[list[dict]], tokenizer_from=None, block_size: int = 64,
                      val_fraction: float = 0.1) -> dict:
    """A chat dataset in data_dir through data/chat/prepare.py (JSONL written beside it); returns meta.
    tokenizer_from: a dataset folder or run out_dir (default: GPT-2 BPE, after use_gpt2_bpe())."""
    import importlib.util
    import json

    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    jsonl = data_dir / "conversations.jsonl"
    jsonl.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    spec = importlib.util.spec_from_file_location("chat_prepare", REPO_ROOT / "data" / "chat" / "prepare.py")
    prepare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare)
    args = [f"--input={jsonl}", f"--out_dir={data_dir}", f"--block_size={block_size}", f"--val_fraction={val_fraction}"]
    with contextlib.redirect_stdout(None):
        return prepare.main(args + ([f"--tokenizer_from={tokenizer_from}"] if tokenizer_from else []))


# The scene test_sample and test_serve train their small models on.
ROMEO_JULIET = """ROMEO:
But, soft! what light through yonder window breaks?
It is the east, and Juliet is the sun.
Arise, fair sun, and kill the envious moon,
Who is already sick and pale with grief.

JULIET:
O Romeo, Romeo! wherefore art thou Romeo?
Deny thy father and refuse thy name;
Or, if thou wilt not, be but sworn my love,
And I'll no longer be a Capulet.

""" * 8


def fake_cpu(monkeypatch, capability: str, flags: set[str], isa: str | None = None) -> None:
    """A CPU as cpu_native_bf16 sees it: torch's kernel capability, /proc/cpuinfo's flags, oneDNN's cap."""
    from core import cpu
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(cpu, "_cpu_flags", lambda: flags)
    if isa is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
