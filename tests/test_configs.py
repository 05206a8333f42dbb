"""Every shipped config/*.py: it parses and validates, and it trains (or evaluates) a few steps.

    python -m pytest tests/test_configs.py

Each file runs as written, with only its sizes shrunk on the command line (a tiny model, a short
run, CPU float32) and its data_dir replaced by a small prepared set of the kind it names: character
Shakespeare or GPT-2 BPE. init_from=gpt2* goes through a save_pretrained folder of a tiny random
transformers GPT-2 with GPT-2's 1024 positions, cropped to the tiny block_size as a real fine-tune
crops it.
"""
import dataclasses
import json
from pathlib import Path

import pytest
import torch

import train
from core import config as configlib
from core.weights.checkpoint import load_checkpoint
from tests.helpers import (REPO_ROOT, cli_args, make_char_dataset, make_chat_dataset, make_gpt2_dataset,
                           needs_transformers, records, run_main, use_gpt2_bpe)

RL_CONFIGS = {p.name for p in (REPO_ROOT / "config").glob("rl_*.py")}  # rl.py's, not train.py's
CONFIGS = sorted(p for p in (REPO_ROOT / "config").glob("*.py") if p.name not in RL_CONFIGS)
# The tokenizer of each dataset a config may name (what its data/<name>/prepare.py writes).
DATA_KINDS = {"data/shakespeare_char": "char", "data/shakespeare": "gpt2", "data/fineweb": "gpt2",
              "data/openwebtext": "gpt2", "data/chat": "chat"}
TINY = dict(n_layer=1, n_head=2, n_embd=32, block_size=16, batch_size=2, max_iters=2, eval_interval=2,
            eval_iters=2, log_interval=1, device="cpu", dtype="float32", compile=False)
TEXT = "O Romeo, Romeo! wherefore art thou Romeo?\nDeny thy father and refuse thy name.\n" * 20


# Overlays change a recipe, not a run: they compose after a base config, and are tested that way.
OVERLAYS = {"modern.py", "sft_tasks_char.py"}
FINE_TUNES = {"sft_tasks_char.py"}  # init_from names a base run's out_dir
OVERLAY_BASE = REPO_ROOT / "config" / "train_shakespeare_char_cpu.py"


def config_files(path: Path) -> list[str]:
    return [str(f) for f in ([OVERLAY_BASE, path] if path.name in OVERLAYS else [path])]


def config_of(path: Path, tmp_path: Path) -> train.TrainConfig:
    # A fine-tune of a base run names that run's out_dir, which exists only once the base has trained.
    base = [f"--init_from={tmp_path}"] if path.name in FINE_TUNES else []
    return configlib.parse_args(train.TrainConfig, config_files(path) + base)


def test_there_are_configs():
    assert len(CONFIGS) >= 9, CONFIGS


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_parses_and_validates(path, tmp_path):
    cfg = config_of(path, tmp_path)  # a UserError here is the bug a new user would meet first
    assert cfg.data_dir in DATA_KINDS, f"{path.name}: add {cfg.data_dir} to DATA_KINDS with its tokenizer"
    assert cfg.out_dir != train.TrainConfig.out_dir, f"{path.name} should write to its own out_dir"


@pytest.mark.parametrize("name", sorted(RL_CONFIGS))
def test_rl_config_parses_and_validates(name, tmp_path):
    import rl
    # init_from names an SFT run's out_dir, which exists only once it has trained; tests/test_rl.py trains one
    cfg = configlib.parse_args(rl.RLConfig, [str(REPO_ROOT / "config" / name), f"--init_from={tmp_path}"])
    assert cfg.out_dir != rl.RLConfig.out_dir, f"{name} should write to its own out_dir"


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """A small prepared dataset per tokenizer kind, made on first use."""
    root, made = tmp_path_factory.mktemp("data"), {}

    def get(kind: str) -> Path:
        if kind not in made:
            if kind == "char":
                make_char_dataset(root / kind, TEXT)
            elif kind == "chat":  # conversations in a base run's character vocabulary, and that base run
                base = root / "chat_base"
                result = run_main(train.main, [str(OVERLAY_BASE), *cli_args(TINY),
                                               f"--data_dir={get('char')}", f"--out_dir={base}"])
                assert result.returncode == 0, result.stderr[-2000:]
                chats = [[{"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": w}]
                         for w in ("Romeo", "father", "name", "thou") * 5]
                make_chat_dataset(root / kind, chats, tokenizer_from=base, block_size=TINY["block_size"])
            else:
                use_gpt2_bpe()
                make_gpt2_dataset(root / kind, [TEXT])
            made[kind] = root / kind
        return made[kind]

    return get


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    """A save_pretrained folder standing in for OpenAI's GPT-2: its vocabulary and 1024 positions, tiny width."""
    transformers = needs_transformers()
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, n_positions=1024))
    path = tmp_path_factory.mktemp("gpt2")
    hf.save_pretrained(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_runs_a_few_steps(path, tmp_path, datasets, request):
    cfg = config_of(path, tmp_path)
    overrides = TINY | {"out_dir": str(tmp_path / "out"), "data_dir": str(datasets(DATA_KINDS[cfg.data_dir]))}
    if cfg.gradient_accumulation_steps > 4:
        overrides["gradient_accumulation_steps"] = 4  # the same code path, fewer micro-steps
    if cfg.value_embeds:  # each table serves a first and a last Block: the fewest Blocks that hold them
        overrides["n_layer"] = 2 * cfg.value_embeds
    if cfg.data_dir == "data/chat":
        overrides["init_from"] = str(Path(overrides["data_dir"]).parent / "chat_base")
    elif cfg.init_from != "scratch":
        overrides["init_from"] = str(request.getfixturevalue("gpt2_dir"))
    result = run_main(train.main, [*config_files(path), *cli_args(overrides)])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]

    logged = records(tmp_path / "out")
    evals = [r for r in logged if "val_loss" in r]
    assert evals and all(torch.isfinite(torch.tensor(r["val_loss"])) for r in evals)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    for key, value in dataclasses.asdict(cfg).items():  # the file's own settings survive, only sizes changed
        if key == "vocab_size" and value is None:  # None: the data's (or the weights'), recorded resolved
            assert isinstance(written[key], int), written[key]
        elif key not in overrides and not (key == "init_from" and path.name in FINE_TUNES):
            assert written[key] == value, key
    if cfg.eval_only:
        assert [r["iter"] for r in logged] == [0] and not (tmp_path / "out" / "ckpt.pt").exists()
        return
    assert [r["iter"] for r in logged if "loss" in r] == [0, 1]
    meta = load_checkpoint(tmp_path / "out" / "ckpt.pt")["meta"]
    assert meta["iter_num"] == 2 and meta["model_args"]["block_size"] == 16
    if cfg.data_dir == "data/chat":  # the base's characters and the four chat tokens appended
        assert meta["model_args"]["vocab_size"] == json.loads((Path(overrides["data_dir"]) / "meta.json").read_text())["vocab_size"]
    elif cfg.init_from != "scratch":
        assert meta["model_args"]["vocab_size"] == 50257  # GPT-2's own, from the folder
