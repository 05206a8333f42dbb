"""sample.py: tiny char-level and GPT-2 BPE checkpoints trained here, sampled from the command line.

    python -m pytest tests/test_sample.py

The main paths run `python sample.py ...` in a subprocess, as a user would. The many variations
(bad inputs above all) call sample.main through core.errors.run_cli in this process, which is what
the script's `__main__` does, without paying ~3 s of torch import per case; a few bad inputs also
go through a real subprocess to pin the exit code and the absence of a traceback end to end.
"""
import shutil
import subprocess
import sys

import pytest
import torch

import sample
from core import cpu
from core.data.tokenizer import CharTokenizer, GPT2Tokenizer, StreamDecoder
from core.weights.hf import to_transformers
from model import GPT, GPTConfig
from tests.helpers import (ROMEO_JULIET, assert_user_error, make_char_dataset, make_gpt2_dataset, run_main,
                           run_scripts, train_tiny, use_gpt2_bpe)

TEXT = ROMEO_JULIET
VOCAB = set(TEXT)
BLOCK_SIZE = 32
SEP = sample.SEPARATOR
EOT = "<|endoftext|>"


SHOWN_EOT = f"\n{sample.DOCUMENT_END}\n"  # how a sample that goes on past an end of text shows it


def tokens_of(text: str) -> list[str]:
    """A char model's sample, run with --stop_at_eot=False, as its tokens: characters, and the end of text (the
    vocabulary's last id, never in the training text, but a 20-step model still draws it now and then) as one."""
    return [piece for part in text.split(SHOWN_EOT) for piece in [SHOWN_EOT, *part]][1:]


def samples_of(stdout: str) -> list[str]:
    """The samples printed by sample.py, each without its trailing newline and separator."""
    parts = stdout.split("\n" + SEP + "\n")
    assert parts[-1] == "", f"output does not end with the separator: {stdout[-80:]!r}"
    return parts[:-1]


def sample_here(*args: str) -> tuple[int, str, str]:
    """sample.main run in this process as the command line runs it: (exit code, stdout, stderr)."""
    result = run_main(sample.main, ["--device=cpu", *args])
    return result.returncode, result.stdout, result.stderr


def check_user_error(code: int, err: str, fragments: list[str]) -> None:
    """What run_cli does with a UserError: exit 2, and one line `error: ...` holding every fragment."""
    assert_user_error(subprocess.CompletedProcess([], code, "", err), *fragments)
    assert err.count("\n") == 1, err


@pytest.fixture(scope="module")
def char_out(tmp_path_factory):
    """out_dir of a tiny char-level model. Its vocabulary is padded past the tokenizer's (as GPT-2 pads
    50257 to 50304), so every sample drawn from it also checks that padded ids never reach decode."""
    root = tmp_path_factory.mktemp("char")
    meta = make_char_dataset(root / "data", TEXT)
    train_tiny(root / "out", root / "data", block_size=BLOCK_SIZE, vocab_size=meta["vocab_size"] + 20)
    return root / "out"


@pytest.fixture(scope="module")
def bpe_out(tmp_path_factory):
    """out_dir of a tiny GPT-2 BPE model, its vocabulary padded to 50304, trained on 'hello world<|endoftext|>'
    over and over: after 20 iterations it says hello, world and <|endoftext|> about equally often, and
    after anything else (such as 'café 🙂') almost any of the 50257 tokens, byte pieces included."""
    use_gpt2_bpe()
    root = tmp_path_factory.mktemp("bpe")
    make_gpt2_dataset(root / "data", ["hello world"] * 40)
    train_tiny(root / "out", root / "data", vocab_size=50304, n_embd=16, block_size=16, batch_size=4,
               max_iters=20, lr_decay_iters=20, learning_rate=3e-2, min_lr=3e-3)
    return root / "out"


# --- end to end, char-level ----------------------------------------------------------------------

CLI_RUNS = {  # name: sample.py arguments after --out_dir=<the char model> --device=cpu
    "seed7": ("--start=ROMEO:", "--num_samples=3", "--max_new_tokens=40", "--stop_at_eot=False", "--seed=7"),
    "seed7_again": ("--start=ROMEO:", "--num_samples=3", "--max_new_tokens=40", "--stop_at_eot=False", "--seed=7"),
    "stream": ("--start=JULIET:", "--num_samples=1", "--max_new_tokens=60", "--seed=3", "--stream=True"),
    "batch": ("--start=JULIET:", "--num_samples=1", "--max_new_tokens=60", "--seed=3", "--stream=False"),
    "no_checkpoint": ("--out_dir=/nonexistent/run",),
    "bad_top_p": ("--top_p=1.5",),
}


@pytest.fixture(scope="module")
def cli(char_out):
    """The result of every CLI_RUNS command, run as subprocesses all at once (see run_scripts)."""
    commands = [["sample.py", f"--out_dir={char_out}", "--device=cpu", *args] for args in CLI_RUNS.values()]
    results = run_scripts(*commands)
    return dict(zip(CLI_RUNS, results))


@pytest.mark.slow
def test_samples_are_decoded_in_one_batch(cli):
    result = cli["seed7"]
    assert result.returncode == 0, result.stderr
    samples = samples_of(result.stdout)
    assert len(samples) == 3
    for text in samples:
        assert text.startswith("ROMEO:") and len(tokens_of(text)) == len("ROMEO:") + 40
        assert set(tokens_of(text)) <= VOCAB | {SHOWN_EOT} and EOT not in text
    assert len(set(samples)) == 3  # one batch, three different draws
    assert "tokens/s" in result.stderr and "tokens/s" not in result.stdout


@pytest.mark.slow
def test_seed_makes_output_reproducible(cli, char_out):
    assert cli["seed7"].returncode == 0 and cli["seed7_again"].returncode == 0
    assert cli["seed7_again"].stdout == cli["seed7"].stdout
    runs = [sample_here(f"--out_dir={char_out}", *CLI_RUNS["seed7"][:-1], f"--seed={seed}")[1] for seed in (7, 8)]
    assert runs[0] == cli["seed7"].stdout  # in this process too
    assert runs[1] != runs[0]


@pytest.mark.slow
def test_streaming_output_equals_batch_output(cli):
    streamed, batched = cli["stream"], cli["batch"]
    assert streamed.returncode == 0 and batched.returncode == 0, streamed.stderr + batched.stderr
    assert streamed.stdout == batched.stdout
    assert len(samples_of(streamed.stdout)[0]) == len("JULIET:") + 60


@pytest.mark.slow
@pytest.mark.parametrize("name, fragments", [
    ("no_checkpoint", ["no checkpoint in /nonexistent/run"]),
    ("bad_top_p", ["top_p must be in (0, 1]"]),
])
def test_bad_input_from_the_command_line(cli, name, fragments):
    assert_user_error(cli[name], *fragments)


# --- in process: options and bad inputs --------------------------------------------------------

def test_num_samples_one_streams_token_by_token(char_out, monkeypatch):
    # Each time the model is asked for the next token, the one before it is already on stdout.
    printed = []
    generate_stream = sample.generate_stream

    def spy(model, *args, **kwargs):
        for token in generate_stream(model, *args, **kwargs):
            yield token
            printed.append(sys.stdout.getvalue())  # run_main's captured stdout, after sample.py's turn

    monkeypatch.setattr(sample, "generate_stream", spy)
    args = (f"--out_dir={char_out}", "--start=ROMEO:", "--num_samples=1", "--max_new_tokens=30")
    code, streamed, err = sample_here(*args)
    assert code == 0, err
    assert [len(text) for text in printed] == [len("ROMEO:") + k for k in range(1, 31)]
    code, batched, batch_err = sample_here(*args, "--stream=False")
    assert code == 0 and streamed == batched
    assert "30 tokens (1 x 30) in" in err and "30 tokens (1 x 30) in" in batch_err  # the timing counts each token once


def test_padded_vocab_ids_never_reach_decode(char_out):
    # Temperature 100 makes the draws nearly uniform over the model's whole vocabulary: unrestricted,
    # about a third of them would be padded ids, and decoding one would crash.
    code, out, err = sample_here(f"--out_dir={char_out}", "--start=ROMEO:", "--num_samples=4",
                                 "--max_new_tokens=100", "--temperature=100", "--top_k=None", "--stop_at_eot=False")
    assert code == 0, err
    assert all(set(tokens_of(s)) <= VOCAB | {SHOWN_EOT} and len(tokens_of(s)) == len("ROMEO:") + 100 for s in samples_of(out))


def test_greedy_ignores_the_seed_and_cache_changes_nothing(char_out):
    base = (f"--out_dir={char_out}", "--start=ROMEO:", "--num_samples=2", "--max_new_tokens=50")
    greedy = [sample_here(*base, "--temperature=0", f"--seed={s}")[1] for s in (1, 2)]
    assert greedy[0] == greedy[1]
    # Past block_size (6 + 50 > 32) the window slides; with and without the cache, the same tokens.
    cached = sample_here(*base, "--top_p=0.9")[1]
    uncached = sample_here(*base, "--top_p=0.9", "--use_cache=False")[1]
    assert cached == uncached


def test_prompt_from_file_truncation_and_zero_new_tokens(char_out, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("JULIET:\nO Romeo")
    code, out, _ = sample_here(f"--out_dir={char_out}", f"--start=FILE:{prompt}", "--num_samples=1",
                               "--max_new_tokens=0")
    assert code == 0 and out == "JULIET:\nO Romeo\n" + SEP + "\n"
    long = TEXT[:BLOCK_SIZE + 10]
    code, out, err = sample_here(f"--out_dir={char_out}", f"--start={long}", "--truncate_prompt=True",
                                 "--num_samples=1", "--max_new_tokens=5")
    assert code == 0 and samples_of(out)[0].startswith(long[-BLOCK_SIZE:]) and len(samples_of(out)[0]) == BLOCK_SIZE + 5
    assert f"kept the prompt's last {BLOCK_SIZE} tokens" in err


@pytest.fixture(scope="module")
def broken_dirs(char_out, tmp_path_factory):
    """out_dirs holding no checkpoint, a truncated one (with and without ckpt.prev.pt), and files not ours."""
    root = tmp_path_factory.mktemp("broken")
    good = (char_out / "ckpt.pt").read_bytes()
    dirs = {name: root / name for name in ("empty", "truncated", "truncated_with_prev", "plain_dict", "random")}
    for d in dirs.values():
        d.mkdir()
    (dirs["truncated"] / "ckpt.pt").write_bytes(good[: len(good) // 2])
    (dirs["truncated_with_prev"] / "ckpt.pt").write_bytes(good[: len(good) // 2])
    shutil.copyfile(char_out / "ckpt.pt", dirs["truncated_with_prev"] / "ckpt.prev.pt")
    torch.save({"model": {"w": torch.zeros(2)}, "iter_num": 3}, dirs["plain_dict"] / "ckpt.pt")
    (dirs["random"] / "ckpt.pt").write_bytes(torch.randint(0, 256, (4096,), dtype=torch.uint8).numpy().tobytes())
    return dirs


BAD_CHECKPOINTS = [
    ("empty", ["no checkpoint in", "ckpt.pt not found"]),
    ("truncated", ["truncated or corrupt"]),
    ("truncated_with_prev", ["truncated or corrupt", "ckpt.prev.pt"]),
    ("plain_dict", ["not a checkpoint written by this project"]),
    ("random", ["truncated or corrupt"]),
]


@pytest.mark.parametrize("name, fragments", BAD_CHECKPOINTS, ids=[b[0] for b in BAD_CHECKPOINTS])
def test_bad_checkpoints_are_one_line_errors(broken_dirs, name, fragments):
    code, out, err = sample_here(f"--out_dir={broken_dirs[name]}")
    check_user_error(code, err, fragments)


BAD_OPTIONS = [
    (["--start=ROMEO€ and Ω"], ["2 character(s) outside", "'Ω'", "'€'"]),
    ([f"--start={'a' * (BLOCK_SIZE + 1)}"], [f"{BLOCK_SIZE + 1} tokens, longer than the model's context of "
                                             f"{BLOCK_SIZE}", "--truncate_prompt=True"]),
    (["--start=FILE:/nonexistent/prompt.txt"], ["cannot read prompt file '/nonexistent/prompt.txt'"]),
    (["--temperature=-0.5"], ["temperature must be >= 0"]),
    (["--top_k=0"], ["top_k must be at least 1"]),
    (["--top_p=0"], ["top_p must be in (0, 1]"]),
    (["--top_p=1.5"], ["top_p must be in (0, 1]"]),
    (["--num_samples=0"], ["num_samples must be at least 1"]),
    (["--max_new_tokens=-1"], ["max_new_tokens must be >= 0"]),
    (["--window_shift=0"], ["window_shift must be at least 1"]),
    (["--window_shift=999"], ["window_shift 999 is larger than the model's block_size"]),
    (["--stream=True", "--num_samples=2"], ["stream=True prints one sample"]),
    (["--init_from=nowhere"], ["unknown init_from 'nowhere'"]),
    (["--tempreature=1"], ["unknown config key 'tempreature'", "did you mean 'temperature'"]),
    (["--top_k=many"], ["config key 'top_k' expects int"]),
    (["--device=cuda"], ["no CUDA GPU"]),
    (["--dtype=bfloat16"], ["dtype bfloat16 is not supported on this CPU", "use --dtype=float32"]),  # faked AVX2
]


@pytest.mark.parametrize("args, fragments", BAD_OPTIONS, ids=[" ".join(b[0])[:40] for b in BAD_OPTIONS])
def test_bad_options_are_one_line_errors(char_out, args, fragments, monkeypatch):
    if "--device=cuda" in args and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    monkeypatch.setattr(cpu, "cpu_native_bf16", lambda: False)  # an AVX2 CPU, whatever this one is
    code, out, err = sample_here(f"--out_dir={char_out}", *args)
    check_user_error(code, err, fragments)


# --- GPT-2 BPE -------------------------------------------------------------------------------------

@pytest.mark.slow
def test_bpe_streaming_equals_batch(bpe_out):
    # Past the out-of-distribution prompt the model draws from nearly all 50257 tokens, byte pieces of
    # multi-byte characters among them: the streamed text must still be exactly the batch decode.
    args = ["sample.py", f"--out_dir={bpe_out}", "--device=cpu", "--start=café 🙂", "--num_samples=1",
            "--max_new_tokens=40", "--temperature=1.0", "--top_k=None"]
    streamed, batched = run_scripts([*args, "--stream=True"], [*args, "--stream=False"])
    assert streamed.returncode == 0 and batched.returncode == 0, streamed.stderr + batched.stderr
    assert streamed.stdout == batched.stdout and streamed.stdout.startswith("café 🙂")
    assert len(samples_of(streamed.stdout)[0]) > len("café 🙂") + 40  # 40 tokens, not 40 bytes


@pytest.mark.parametrize("num_samples", [4, 1], ids=["batch", "stream"])
def test_a_sample_ends_at_its_first_eot(bpe_out, num_samples):
    # top_k=3 keeps hello, world and <|endoftext|>: every row meets an eot within a few tokens. With
    # the same seed, each stopped sample is the unstopped one cut just before its first eot.
    args = (f"--out_dir={bpe_out}", "--start=hello world", f"--num_samples={num_samples}",
            "--max_new_tokens=30", "--temperature=1", "--top_k=3", "--seed=5")
    code, full, err = sample_here(*args, "--stop_at_eot=False")
    assert code == 0, err
    code, stopped, err = sample_here(*args)  # the default where the vocabulary has an end of text
    assert code == 0, err
    for whole, cut in zip(samples_of(full), samples_of(stopped), strict=True):
        assert EOT not in whole + cut and whole.startswith(cut + SHOWN_EOT)
    if num_samples > 1:
        assert len({len(s) for s in samples_of(stopped)}) > 1  # rows stop at different tokens


def test_empty_bpe_prompt_starts_from_endoftext(bpe_out):
    # GPT-2 samples unconditionally from <|endoftext|>; that start is not printed as the prompt.
    code, out, err = sample_here(f"--out_dir={bpe_out}", "--start=", "--num_samples=2", "--max_new_tokens=0")
    assert code == 0 and samples_of(out) == ["", ""], err
    code, out, err = sample_here(f"--out_dir={bpe_out}", "--start=", "--num_samples=2", "--max_new_tokens=3")
    assert code == 0 and len(samples_of(out)) == 2, err


def test_stream_decoder_never_splits_a_character():
    use_gpt2_bpe()
    tok = GPT2Tokenizer()
    text = "naïve café 🙂 日本語 👩‍👩‍👧 ok"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # the text really has split characters
    decoder = StreamDecoder(tok)
    pieces = [decoder.push(i) for i in ids] + [decoder.flush()]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    chars = CharTokenizer.from_text("ab\ufffd")
    decoder = StreamDecoder(chars)
    assert [decoder.push(i) for i in chars.encode("a\ufffdb")] + [decoder.flush()] == ["a", "", "\ufffdb", ""]


def test_save_pretrained_directory_as_init_from(tmp_path):
    use_gpt2_bpe()
    torch.manual_seed(0)
    to_transformers(GPT(GPTConfig(vocab_size=50257, block_size=32, n_layer=1, n_head=2, n_embd=16))).save_pretrained(tmp_path)
    code, out, err = sample_here(f"--init_from={tmp_path}", "--start=Hello", "--num_samples=2",
                                 "--max_new_tokens=8")
    assert code == 0, err
    assert [s.startswith("Hello") for s in samples_of(out)] == [True, True]
    assert f"sampling from {tmp_path}" in err


def test_a_char_model_that_learned_the_end_of_text_ends_its_samples_there(tmp_path):
    """Trained on 'hello world' and <|endoftext|> over and over, the greedy sample after 'hello world\\n' is the end of
    text: the sample ends there, or with --stop_at_eot=False goes on with the end shown as a line, never the
    literal token; streamed as batched. --help says the same."""
    from core.data.writer import write_dataset

    tok = CharTokenizer.from_text("hello world\n")
    ids = (tok.encode("hello world\n") + [tok.eot_token]) * 100
    write_dataset(tmp_path / "data", tok.meta(), {"train": ids, "val": ids[:200]})
    train_tiny(tmp_path / "out", tmp_path / "data", block_size=16, max_iters=60, lr_decay_iters=60)
    base = (f"--out_dir={tmp_path / 'out'}", "--start=hello world\n", "--temperature=0", "--max_new_tokens=30")
    for stream in ("True", "False"):
        code, out, err = sample_here(*base, "--num_samples=1", f"--stream={stream}")
        assert code == 0 and samples_of(out) == ["hello world\n"], err
        code, out, err = sample_here(*base, "--num_samples=1", f"--stream={stream}", "--stop_at_eot=False")
        assert code == 0 and samples_of(out)[0].startswith("hello world\n" + SHOWN_EOT + "hello world\n"), out
        assert EOT not in out
    help_text = subprocess.run([sys.executable, "sample.py", "--help"], capture_output=True, text=True).stdout
    line = next(line for line in help_text.splitlines() if "--stop_at_eot" in line)
    assert "a char vocabulary prepared here has one too" in line and sample.DOCUMENT_END in line
