"""Bad input: every mistake below is one clear `error:` line naming the problem, exit 2, no traceback.

    python -m pytest tests/test_bad_input.py

CASES run the real scripts as a user would (`python train.py ...`, `python sample.py ...`,
`python data/<name>/prepare.py ...`), a subprocess each: torch's import is most of each run. IN_PROCESS_CASES
are more of the same kind, run through core.errors.run_cli in this process. Also the security guarantees: every
torch.load is weights_only=True, a file carrying pickled Python objects is refused before any of it runs, and
command-line values are literals, never evaluated.
"""
import ast
import json
import shutil
from pathlib import Path

import pytest
import torch

from core.errors import UserError
from core.weights.checkpoint import load_checkpoint
from tests.helpers import (REPO_ROOT, TINY_TRAIN, assert_user_error, cli_args, flip_a_weight_bit, make_char_dataset,
                           run_main, run_script, train_tiny)

TEXT = "First Citizen: Before we proceed any further, hear me speak.\nAll: Speak, speak.\n" * 60
ALPHABET = sorted(set(TEXT))
# The same text in another alphabet of the same size: a dataset whose vocab_size matches, but not its tokens.
OTHER_ALPHABET = "".join(chr(ord("A") + i) for i in range(len(ALPHABET)))
MARKER = "pwned"  # a file that only unsafe code would create


class Exploit:
    """A custom class whose code runs when it is unpickled: it would create MARKER in its folder."""

    def __init__(self, where: Path):
        self.where = str(where)

    def __setstate__(self, state):
        Path(state["where"], MARKER).touch()


def make_world(root: Path) -> dict[str, Path]:
    """Datasets, run directories and files, each broken in one way."""
    w = {name: root / name for name in ("data", "data_other_vocab", "data_same_size", "data_short", "data_empty",
                                        "data_odd", "data_bad_meta", "data_no_vocab", "out", "file")}
    make_char_dataset(w["data"], TEXT)
    make_char_dataset(w["data_other_vocab"], "a quite different text, with other letters\n" * 40)
    make_char_dataset(w["data_same_size"], TEXT.translate(str.maketrans("".join(ALPHABET), OTHER_ALPHABET)))
    make_char_dataset(w["data_short"], "too short for one block\n", val_fraction=0.5)
    for broken in ("data_empty", "data_odd", "data_bad_meta", "data_no_vocab"):
        shutil.copytree(w["data"], w[broken])
    meta = json.loads((w["data"] / "meta.json").read_text())
    (w["data_no_vocab"] / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "vocab_size"}))
    (w["data_empty"] / "train.bin").write_bytes(b"")
    with open(w["data_odd"] / "train.bin", "ab") as f:
        f.write(b"\x00")
    (w["data_bad_meta"] / "meta.json").write_text("{not json")
    train_tiny(w["out"], w["data"], max_iters=2)
    for name in ("resume_vocab", "resume_same_size", "resume_block", "resume_n_layer"):  # one run dir each
        w[name] = root / name
        shutil.copytree(w["out"], w[name])
    w["file"].write_text("a regular file, not a directory\n")

    for name in ("out_empty", "out_not_ours", "out_truncated", "out_pickle", "out_bit_flipped"):
        w[name] = root / name
        w[name].mkdir()
    good = (w["out"] / "ckpt.pt").read_bytes()
    torch.save({"model": {"w": torch.zeros(2)}, "iter_num": 3}, w["out_not_ours"] / "ckpt.pt")
    (w["out_truncated"] / "ckpt.pt").write_bytes(good[: len(good) // 2])
    shutil.copyfile(w["out"] / "ckpt.pt", w["out_bit_flipped"] / "ckpt.pt")
    flip_a_weight_bit(w["out_bit_flipped"] / "ckpt.pt")
    state = torch.load(w["out"] / "ckpt.pt", weights_only=True)
    torch.save(state | {"rng": Exploit(root)}, w["out_pickle"] / "ckpt.pt")

    w["config_unknown"] = root / "config_unknown.py"
    w["config_unknown"].write_text("batch_size = 4\nlearning_rat = 1e-3  # misspelled\n")
    w["config_fails"] = root / "config_fails.py"
    w["config_fails"].write_text("max_iters = 10 // 0\n")
    w["not_utf8"] = root / "not_utf8.txt"
    w["not_utf8"].write_bytes(b"\xff\xfe caf\xe9\n")
    w["empty_txt"] = root / "empty.txt"
    w["empty_txt"].write_text("")
    w["marker"] = root / MARKER
    return w


def train(w, **overrides) -> list[str]:
    """A new run into an out_dir of its own (w["out"] holds the trained run the sample cases read, which a
    new run would refuse to replace before it saw its mistake)."""
    args = TINY_TRAIN | {"out_dir": w["out"].parent / "new_run", "data_dir": w["data"], "max_iters": 2} | overrides
    return ["train.py", *cli_args(args)]


def resume(w, run: str, **overrides) -> list[str]:
    return train(w, out_dir=w[run], init_from="resume", **overrides)


def sample(w, *args, out="out") -> list[str]:
    return ["sample.py", f"--out_dir={w[out]}", "--device=cpu", "--max_new_tokens=3", *args]


def prepare(name: str, *args) -> list[str]:
    return [f"data/{name}/prepare.py", *args]


# name: (command, fragments of the one error line), given the paths of make_world. Each runs as a subprocess,
# `python script ...`, as a user would (torch's import costs ~3 s of CPU each): at least one per script, so that
# each script's own __main__ (run_cli) and its imports are checked too; more of the same kind are IN_PROCESS_CASES.
CASES = {
    # train.py
    "unknown_key_cli": lambda w: (train(w, learning_rat=0.1), ["unknown config key 'learning_rat' (command line)",
                                                                "did you mean 'learning_rate'"]),
    "expression_on_command_line": lambda w: (
        train(w, max_iters=f"__import__('pathlib').Path('{w['marker']}').touch()"), ["'max_iters' expects int"]),
    "unwritable_out_dir": lambda w: (train(w, out_dir=w["file"] / "out"), ["cannot write to out_dir", "writable --out_dir"]),
    # sample.py
    "sample_bit_flipped_checkpoint": lambda w: (sample(w, out="out_bit_flipped"), ["ckpt.pt is truncated or corrupt",
                                                                                   "CRC-32"]),
    # prepare.py (no torch: quick)
    "prepare_missing_input": lambda w: (prepare("shakespeare_char", "--input=/nonexistent/input.txt",
                                                f"--out_dir={w['file'].parent / 'prepared'}"),
                                        ["--input file '/nonexistent/input.txt' not found"]),
    "prepare_not_utf8": lambda w: (prepare("shakespeare_char", f"--input={w['not_utf8']}",
                                           f"--out_dir={w['file'].parent / 'prepared'}"), ["is not UTF-8 text"]),
    "prepare_empty_input": lambda w: (prepare("shakespeare_char", f"--input={w['empty_txt']}",
                                              f"--out_dir={w['file'].parent / 'prepared'}"),
                                      ["holds no text; nothing written"]),
    "prepare_out_dir_under_a_file": lambda w: (prepare("shakespeare_char", f"--input={w['config_fails']}",
                                                       f"--out_dir={w['file'] / 'prepared'}"),
                                               ["cannot write to the output folder", "is a file"]),
    "prepare_unknown_key": lambda w: (prepare("shakespeare_char", "--inptu=x"), ["unknown config key 'inptu'"]),
    "prepare_web_bad_fraction": lambda w: (prepare("fineweb", "--val_fraction=2"), ["val_fraction must be between 0 and 1"]),
}

# More of the same kind, run in this process through core.errors.run_cli (what each script's __main__
# does): the same exit code and stderr, without a torch import per case.
IN_PROCESS_CASES = {
    "unknown_key_file": lambda w: (train(w)[:1] + [str(w["config_unknown"])] + train(w)[1:],
                                   ["unknown config key 'learning_rat'", "config_unknown.py"]),
    "wrong_type": lambda w: (train(w, max_iters="ten"), ["config key 'max_iters' expects int, got 'ten'"]),
    "n_embd_not_divisible": lambda w: (train(w, n_embd=33, n_head=2), ["n_embd (33) must be divisible by n_head (2)"]),
    "unknown_init_from": lambda w: (train(w, init_from="gpt3"), ["unknown init_from 'gpt3'"]),
    "absent_device": lambda w: (train(w, device="cuda:99"), ["device 'cuda:99'"]),  # no GPU, or not 100 of them
    "missing_dataset": lambda w: (train(w, data_dir=w["file"].parent / "nowhere"), ["meta.json not found",
                                                                                     "prepare.py"]),
    "empty_dataset": lambda w: (train(w, data_dir=w["data_empty"]), ["train.bin is empty"]),
    "dataset_shorter_than_block": lambda w: (train(w, data_dir=w["data_short"]), ["fewer than block_size + 1 = 33"]),
    "odd_byte_length": lambda w: (train(w, data_dir=w["data_odd"]), ["not a whole number of 2-byte uint16 tokens"]),
    "resume_vocab_mismatch": lambda w: (resume(w, "resume_vocab", data_dir=w["data_other_vocab"]),
                                        ["uses tokenizer 'char' with vocab", "use the same dataset"]),
    "resume_block_size_larger": lambda w: (resume(w, "resume_block", block_size=64),
                                           ["block_size 64 is larger than the checkpoint's 32"]),
    "resume_not_our_checkpoint": lambda w: (resume(w, "out_not_ours"), ["not a checkpoint written by this project"]),
    "sample_prompt_outside_vocab": lambda w: (sample(w, "--start=Ω"), ["outside this", "'Ω'"]),
    "sample_prompt_too_long": lambda w: (sample(w, f"--start={TEXT[:40]}"), ["40 tokens, longer than the model's "
                                                                             "context of 32"]),
    "sample_top_p": lambda w: (sample(w, "--top_p=1.5"), ["top_p must be in (0, 1]"]),
    "sample_pickled_objects": lambda w: (sample(w, out="out_pickle"), ["holds pickled Python objects", "Exploit"]),
    "config_file_missing": lambda w: (["train.py", "config/nonexistent.py"], ["config file 'config/nonexistent.py' not found"]),
    "config_file_fails": lambda w: (["train.py", str(w["config_fails"])], ["failed to run: ZeroDivisionError"]),
    "float_for_int": lambda w: (train(w, batch_size=2.5), ["config key 'batch_size' expects int, got 2.5"]),
    "no_value": lambda w: (["train.py", "--max_iters"], ["expected --max_iters=VALUE"]),
    "zero_batch_size": lambda w: (train(w, batch_size=0), ["'batch_size' must be at least 1, got 0"]),
    "dropout_out_of_range": lambda w: (train(w, dropout=1.5), ["dropout must be in [0, 1), got 1.5"]),
    "beta_out_of_range": lambda w: (train(w, beta2=1.5), ["need 0 <= beta1, beta2 < 1"]),
    "infinite_learning_rate": lambda w: (train(w, learning_rate="1e999"), ["need 0 < learning_rate", "got inf"]),
    "unknown_dtype": lambda w: (train(w, dtype="float64"), ["unknown dtype 'float64'"]),
    "float16_on_cpu": lambda w: (train(w, dtype="float16"), ["dtype float16 is not supported on cpu"]),
    "unknown_device": lambda w: (train(w, device="tpu"), ["unknown device 'tpu'"]),
    "meta_not_json": lambda w: (train(w, data_dir=w["data_bad_meta"]), ["meta.json is not valid JSON"]),
    "meta_without_vocab_size": lambda w: (train(w, data_dir=w["data_no_vocab"]), ["has no integer vocab_size"]),
    "dist_timeout_zero": lambda w: (train(w, dist_timeout_s=0), ["dist_timeout_s must be positive"]),
    "resume_without_checkpoint": lambda w: (resume(w, "out_empty"), ["no checkpoint in", "train first"]),
    "resume_same_size_other_vocab": lambda w: (resume(w, "resume_same_size", data_dir=w["data_same_size"]),
                                               ["maps tokens differently from the checkpoint's"]),
    "resume_other_architecture": lambda w: (resume(w, "resume_n_layer", n_layer=2),
                                            ["n_layer=2 differs from the checkpoint's 1"]),
    "resume_truncated": lambda w: (resume(w, "out_truncated"), ["ckpt.pt is truncated or corrupt"]),
    "resume_pickled_objects": lambda w: (resume(w, "out_pickle"), ["holds pickled Python objects", "Exploit",
                                                                  "never loaded"]),
    "sample_negative_temperature": lambda w: (sample(w, "--temperature=-1"), ["temperature must be >= 0"]),
    "sample_not_our_checkpoint": lambda w: (sample(w, out="out_not_ours"), ["not a checkpoint written by this project"]),
    "export_unknown_format": lambda w: (["export.py", "--hf_dir=hf", "--format=onnx"], ["format must be hf or gguf"]),
    "export_gguf_without_its_file": lambda w: (["export.py", "--hf_dir=hf", "--format=gguf"], ["--gguf=FILE"]),
    "export_gguf_flags_without_gguf": lambda w: (["export.py", "--hf_dir=hf", "--outtype=q8_0"],
                                                 ["--gguf, --outtype and --converter_dir go with --format=gguf"]),
}

TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return make_world(tmp_path_factory.mktemp("bad_input"))


@pytest.fixture(scope="module")
def results(world):
    """results(name): that CASES command's CompletedProcess ("torchrun_accumulation": train.py under torchrun), run
    when a test first asks for it: a worker runs only the cases of its own tests."""
    done = {}

    def result(name: str):
        if name not in done:
            command = (TORCHRUN + train(world, gradient_accumulation_steps=3) if name == "torchrun_accumulation"
                       else CASES[name](world)[0])
            done[name] = run_script(*command, timeout=300)
        return done[name]
    return result


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_clear_line(results, world, name):
    _, fragments = CASES[name](world)
    result = results(name)
    assert_user_error(result, *fragments)
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr  # nothing else on stderr
    assert not world["marker"].exists()  # nothing was evaluated or unpickled


@pytest.mark.parametrize("name", list(IN_PROCESS_CASES))
def test_bad_input_in_process_is_one_clear_line(world, name):
    import export
    import sample
    import train as trainlib

    command, fragments = IN_PROCESS_CASES[name](world)
    result = run_main({"train.py": trainlib.main, "sample.py": sample.main, "export.py": export.main}[command[0]],
                      command[1:])
    assert_user_error(result, *fragments)
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not world["marker"].exists()


@pytest.mark.slow
def test_accumulation_not_divisible_by_world_size_under_torchrun(results):
    """torchrun reports the failed workers in its own summary (and exits 1); the workers' own output is
    our one line, printed once (by local rank 0: every rank has the same setting), exit 2, and no
    traceback from train.py."""
    result = results("torchrun_accumulation")
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert lines == ["error: gradient_accumulation_steps (3) must be divisible by the number of processes (2); it "
                     "counts micro-steps across all processes"], result.stderr
    assert "exitcode  : 2" in result.stderr
    assert 'train.py", line' not in result.stderr  # torchrun's traceback is its own, never one through train.py


@pytest.mark.slow
def test_no_training_started_for_an_unwritable_out_dir(results):
    result = results("unwritable_out_dir")
    assert result.stdout == ""  # not even the model was built


# --- security ----------------------------------------------------------------------------------

def python_sources() -> list[Path]:
    return [p for p in REPO_ROOT.rglob("*.py") if not any(part.startswith(".") for part in p.relative_to(REPO_ROOT).parts)]


def test_every_torch_load_is_weights_only():
    """torch.load with weights_only=False unpickles arbitrary objects: loading a file could run any code."""
    calls = []
    for path in python_sources():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                owner = getattr(func.value, "id", None) if isinstance(func, ast.Attribute) else None
                if name == "load" and owner in ("torch", "serialization"):
                    weights_only = {k.arg: k.value for k in node.keywords}.get("weights_only")
                    calls.append((f"{path.relative_to(REPO_ROOT)}:{node.lineno}",
                                  isinstance(weights_only, ast.Constant) and weights_only.value is True))
                if owner in ("pickle", "cPickle", "dill") and name in ("load", "loads", "Unpickler"):
                    calls.append((f"{path.relative_to(REPO_ROOT)}:{node.lineno} ({owner}.{name})", False))
    assert calls, "no torch.load found at all: the scan is broken"
    assert [where for where, safe in calls if not safe] == []


def test_pickled_objects_are_refused_before_they_run(world, tmp_path, monkeypatch):
    """A file shaped like our checkpoint but carrying a pickled object, whether among the tensors or as
    the metadata, is refused with one line; the object's code never runs."""
    monkeypatch.chdir(tmp_path)
    state = torch.load(world["out"] / "ckpt.pt", weights_only=True)
    for name, smuggled in {"extra": state | {"extra": Exploit(tmp_path)},
                           "meta": state | {"meta": Exploit(tmp_path)}}.items():
        torch.save(smuggled, tmp_path / f"{name}.pt")
        with pytest.raises(UserError, match=r"holds pickled Python objects \([\w.]*Exploit\), which are never loaded"):
            load_checkpoint(tmp_path / f"{name}.pt")
    torch.save(state | {"meta": {"iter_num": 3}}, tmp_path / "meta_not_json.pt")  # metadata is JSON text only
    with pytest.raises(UserError, match="unreadable metadata"):
        load_checkpoint(tmp_path / "meta_not_json.pt")
    assert not (tmp_path / MARKER).exists()


def test_command_line_values_are_literals_never_evaluated(tmp_path):
    """An expression after --key= is text: for a str key the string itself, for any other type an error
    (the case expression_on_command_line runs it through train.py, too)."""
    from core.config import parse_args
    from train import TrainConfig

    expression = f"__import__('pathlib').Path('{tmp_path / MARKER}').touch()"
    assert parse_args(TrainConfig, [f"--out_dir={expression}"]).out_dir == expression
    for key in ("max_iters", "learning_rate", "bias", "vocab_size"):
        with pytest.raises(UserError, match=f"config key '{key}' expects"):
            parse_args(TrainConfig, [f"--{key}={expression}"])
    assert not (tmp_path / MARKER).exists()


def test_config_files_are_documented_as_python_programs():
    """Config files run as Python (like nanoGPT's): that power is the user's own, and it is said so."""
    from core import config

    assert "Python programs" in config.__doc__ and "never evaluated" in config.__doc__
