"""What a nanoGPT user already has works here: its checkpoints, its prepared data, its names, its model API.

    python -m pytest tests/test_nanogpt.py

The yardstick is nanoGPT's own model code (tests/nanogpt_model.py, vendored unchanged), trained here by nanoGPT's
loop (its configure_optimizers, AdamW steps and get_batch) on a folder written by nanoGPT's
data/shakespeare_char/prepare.py logic, and saved as nanoGPT's train.py saves it (compiled: `_orig_mod.` keys).
sample.py, eval.py, export.py and train.py --init_from=resume then run on that folder in nanoGPT's layout.
"""
import json
import pickle
import shlex
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import eval as eval_script
import export
import sample
import train
from core import config as configlib
from core.data.loader import TokenData, batch_generator, read_meta
from core.errors import UserError
from core.training import optim
from core.training.train_config import TrainConfig
from core.weights import checkpoint, resolver
from model import GPT, GPTConfig
from tests import nanogpt_model
from tests.helpers import (REPO_ROOT, ROMEO_JULIET, assert_user_error, losses, run_main, run_scripts, train_tiny,
                           use_gpt2_bpe)

TEXT = ROMEO_JULIET
ITERS = 40  # nanoGPT's run: its checkpoint holds iter_num 40
# nanoGPT's train.py globals (its `config` dict) for a small run of config/train_shakespeare_char.py, as it saves
# them; device, dtype and backend as nanoGPT sets them on a machine without CUDA.
CONFIG = dict(out_dir="out", eval_interval=250, log_interval=1, eval_iters=20, eval_only=False,
              always_save_checkpoint=False, init_from="scratch", wandb_log=False, wandb_project="shakespeare-char",
              wandb_run_name="mini-gpt", dataset="shakespeare_char", gradient_accumulation_steps=1, batch_size=8,
              block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.0, bias=False, learning_rate=1e-2,
              max_iters=ITERS, weight_decay=1e-1, beta1=0.9, beta2=0.99, grad_clip=1.0, decay_lr=False,
              warmup_iters=0, lr_decay_iters=ITERS, min_lr=1e-3, backend="nccl", device="cpu", dtype="float16",
              compile=False)
MODEL_ARGS = {k: CONFIG[k] for k in ("n_layer", "n_head", "n_embd", "block_size", "bias", "dropout")}


def nanogpt_prepare(folder, text: str) -> None:
    """nanoGPT's data/shakespeare_char/prepare.py on `text`, its lines after the download."""
    folder.mkdir(parents=True)
    chars = sorted(list(set(text)))
    stoi = {ch: i for i, ch in enumerate(chars)}
    itos = {i: ch for i, ch in enumerate(chars)}
    n = len(text)
    np.array([stoi[c] for c in text[:int(n * 0.9)]], dtype=np.uint16).tofile(folder / "train.bin")
    np.array([stoi[c] for c in text[int(n * 0.9):]], dtype=np.uint16).tofile(folder / "val.bin")
    with open(folder / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": itos, "stoi": stoi}, f)


def nanogpt_batch(data_dir, split="train"):
    """nanoGPT's get_batch (torch's global RNG)."""
    data = np.memmap(data_dir / f"{split}.bin", dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - CONFIG["block_size"], (CONFIG["batch_size"],))
    x = torch.stack([torch.from_numpy((data[i:i + CONFIG["block_size"]]).astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy((data[i + 1:i + 1 + CONFIG["block_size"]]).astype(np.int64)) for i in ix])
    return x, y


def nanogpt_resume(ckpt):
    """nanoGPT's train.py --init_from=resume: its model and AdamW from ckpt.pt, as it loads them."""
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    model = nanogpt_model.GPT(nanogpt_model.GPTConfig(**state["model_args"]))
    model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in state["model"].items()})
    optimizer = model.configure_optimizers(CONFIG["weight_decay"], CONFIG["learning_rate"],
                                           (CONFIG["beta1"], CONFIG["beta2"]), "cpu")
    optimizer.load_state_dict(state["optimizer"])
    return model, optimizer


@pytest.fixture(scope="module")
def nanogpt_dir(tmp_path_factory):
    """nanoGPT's folder after a run: data/shakespeare_char (train.bin, val.bin, meta.pkl) and out/ckpt.pt, saved
    from a compiled model as nanoGPT's train.py saves it."""
    root = tmp_path_factory.mktemp("nanoGPT")
    nanogpt_prepare(root / "data" / "shakespeare_char", TEXT)
    model_args = MODEL_ARGS | {"vocab_size": len(set(TEXT))}  # what nanoGPT's train.py reads from meta.pkl
    torch.manual_seed(1337)
    model = nanogpt_model.GPT(nanogpt_model.GPTConfig(**model_args))
    optimizer = model.configure_optimizers(CONFIG["weight_decay"], CONFIG["learning_rate"],
                                           (CONFIG["beta1"], CONFIG["beta2"]), "cpu")
    for _ in range(ITERS):
        _, loss = model(*nanogpt_batch(root / "data" / "shakespeare_char"))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CONFIG["grad_clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    raw_model = torch.compile(model, backend="eager")  # nanoGPT saves the compiled module: `_orig_mod.` keys
    (root / "out").mkdir()
    torch.save({"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(), "model_args": model_args,
                "iter_num": ITERS, "best_val_loss": loss.detach(), "config": CONFIG}, root / "out" / "ckpt.pt")
    return root


@pytest.fixture
def in_nanogpt_dir(nanogpt_dir, monkeypatch):
    monkeypatch.chdir(nanogpt_dir)  # as nanoGPT's scripts run: data/<dataset> under the working directory
    return nanogpt_dir


def test_the_checkpoint_is_nanogpts_own_format(nanogpt_dir):
    state = torch.load(nanogpt_dir / "out" / "ckpt.pt", weights_only=True)
    assert set(state) == {"model", "optimizer", "model_args", "iter_num", "best_val_loss", "config"}
    assert all(k.startswith("_orig_mod.") for k in state["model"])


@pytest.mark.parametrize("compiled", [True, False])
def test_logits_equal_nanogpts_on_the_same_weights(in_nanogpt_dir, compiled):
    theirs, _ = nanogpt_resume(in_nanogpt_dir / "out" / "ckpt.pt")
    out = "out"
    if not compiled:  # nanoGPT's train.py with --compile=False: the plain module's keys, no `_orig_mod.`
        state = torch.load("out/ckpt.pt", weights_only=True)
        state["model"] = {k.removeprefix("_orig_mod."): v for k, v in state["model"].items()}
        out = "plain"
        (in_nanogpt_dir / out).mkdir(exist_ok=True)
        torch.save(state, in_nanogpt_dir / out / "ckpt.pt")
    ours, tok, source = resolver.load_model("resume", out)
    assert "nanoGPT's" in source and "data/shakespeare_char/meta.pkl" in source
    assert ours.config.gelu_approximate == "none" and not ours.config.bias  # nanoGPT's nn.GELU(), its bias=False
    theirs.eval(), ours.eval()
    torch.manual_seed(0)
    x, y = nanogpt_batch(in_nanogpt_dir / "data" / "shakespeare_char", "val")
    with torch.no_grad():
        expected, their_loss = theirs(x, y)  # with targets: every position's logits
        logits, loss = ours(x, y)
    assert (logits - expected).abs().max().item() < 1e-6
    assert abs(loss.item() - their_loss.item()) < 1e-6
    assert tok.decode(x[0].tolist()) in TEXT  # the vocabulary is its meta.pkl's


def test_a_resumed_adamw_takes_nanogpts_next_step(in_nanogpt_dir):
    """The optimizer state carries: one more step from the checkpoint, theirs and ours, lands on the same weights."""
    theirs, their_opt = nanogpt_resume(in_nanogpt_dir / "out" / "ckpt.pt")
    state = checkpoint.load_checkpoint("out/ckpt.pt")
    ours = checkpoint.model_from_checkpoint(state)
    our_opt = optim.build_optimizer(ours, "adamw", CONFIG["learning_rate"], CONFIG["weight_decay"],
                                    (CONFIG["beta1"], CONFIG["beta2"]), "cpu")
    optim.load_state(our_opt, state["optimizer"])
    torch.manual_seed(1)
    x, y = nanogpt_batch(in_nanogpt_dir / "data" / "shakespeare_char")
    for model, opt in ((theirs, their_opt), (ours, our_opt)):
        model(x, y)[1].backward()
        opt.step()
    for (name, p), q in zip(theirs.named_parameters(), ours.parameters(), strict=True):
        assert (p - q).abs().max().item() < 1e-6, name
    assert our_opt.state[ours.transformer.wte.weight]["step"].item() == ITERS + 1


def test_sample_eval_and_export_read_the_nanogpt_folder(in_nanogpt_dir):
    sampled = run_main(sample.main, ["--out_dir=out", "--device=cpu", "--start=ROMEO:", "--num_samples=2",
                                     "--max_new_tokens=30"])
    assert sampled.returncode == 0, sampled.stderr
    assert "nanoGPT's, vocabulary data/shakespeare_char/meta.pkl" in sampled.stderr
    assert sampled.stdout.startswith("ROMEO:") and set(sampled.stdout) <= set(TEXT) | {"-"}
    scored = run_main(eval_script.main, ["--out_dir=out", "--device=cpu", "--dtype=float32"])  # its dataset's own
    assert scored.returncode == 0 and scored.stdout.startswith("data/shakespeare_char val: loss"), scored.stderr
    exported = run_main(export.main, ["--out_dir=out", "--hf_dir=hf"])  # its logits are checked against ours first
    assert exported.returncode == 0, exported.stderr
    config = json.loads((in_nanogpt_dir / "hf" / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["activation_function"] == "gelu"


def test_eval_finds_a_nanogpt_runs_dataset_beside_it_or_says_where_it_looked(nanogpt_dir, tmp_path, monkeypatch):
    """eval.py with no --data_dir scores the dataset nanoGPT's config names, found as sample.py finds its vocabulary:
    data/<dataset> beside the run (here, from another working directory); where there is none, one line naming both
    places."""
    monkeypatch.chdir(tmp_path)
    scored = run_main(eval_script.main, [f"--out_dir={nanogpt_dir / 'out'}", "--device=cpu", "--dtype=float32"])
    assert scored.returncode == 0, scored.stderr
    assert scored.stdout.startswith(f"{nanogpt_dir / 'data' / 'shakespeare_char'} val: loss"), scored.stdout
    # A run on GPT-2's BPE (no meta.pkl to find) whose dataset is in neither place: refused before the weights load.
    use_gpt2_bpe()
    state = torch.load(nanogpt_dir / "out" / "ckpt.pt", weights_only=True)
    state["model_args"] = state["model_args"] | {"vocab_size": 50304}
    state["config"] = state["config"] | {"dataset": "openwebtext"}
    (tmp_path / "run" / "out").mkdir(parents=True)
    torch.save(state, tmp_path / "run" / "out" / "ckpt.pt")
    failed = run_main(eval_script.main, ["--out_dir=run/out", "--device=cpu"])
    assert_user_error(failed, "no dataset to evaluate on")
    assert "run/data/openwebtext or data/openwebtext; pass --data_dir=" in failed.stderr, failed.stderr


def test_train_resumes_nanogpts_run_with_its_iteration_optimizer_and_config(in_nanogpt_dir, tmp_path):
    """`python train.py --init_from=resume --out_dir=out` in nanoGPT's folder: its config (from ckpt.pt, dataset
    -> data_dir), its iteration count and its AdamW state go on."""
    (in_nanogpt_dir / "resumed").mkdir()
    shutil.copy(in_nanogpt_dir / "out" / "ckpt.pt", in_nanogpt_dir / "resumed" / "ckpt.pt")
    result = run_main(train.main, ["--init_from=resume", "--out_dir=resumed", f"--max_iters={ITERS + 4}",
                                   "--dtype=float32", "--eval_interval=4", "--eval_iters=2"])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert f"resuming from resumed/ckpt.pt at iter {ITERS}" in result.stdout
    assert "dataset='shakespeare_char'" in result.stderr and "data_dir='data/shakespeare_char'" in result.stderr
    assert [i for i, _ in losses(in_nanogpt_dir / "resumed")] == list(range(ITERS, ITERS + 4))
    saved = checkpoint.load_checkpoint(in_nanogpt_dir / "resumed" / "ckpt.pt")
    assert saved["meta"]["iter_num"] == ITERS + 4 and saved["meta"]["config"]["n_embd"] == CONFIG["n_embd"]
    steps = {s["step"].item() for s in saved["optimizer"]["state"].values()}
    assert steps == {ITERS + 4}  # nanoGPT's 40 AdamW steps and 4 more: its moments went on, not a fresh start


def test_an_optimizer_of_other_shapes_starts_fresh_with_a_note(in_nanogpt_dir):
    state = torch.load(in_nanogpt_dir / "out" / "ckpt.pt", weights_only=True)
    groups = state["optimizer"]["param_groups"]
    groups[0]["params"], groups[1]["params"] = groups[1]["params"], groups[0]["params"]  # not our order
    (in_nanogpt_dir / "other").mkdir()
    torch.save(state, in_nanogpt_dir / "other" / "ckpt.pt")
    assert checkpoint.load_checkpoint("other/ckpt.pt")["optimizer"] is None
    result = run_main(train.main, ["--init_from=resume", "--out_dir=other", f"--max_iters={ITERS + 1}",
                                   "--dtype=float32", "--eval_interval=100"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "holds no optimizer state this model's parameters fit; the optimizer starts fresh" in result.stdout


def test_a_character_run_without_its_meta_pkl_says_where_it_looked(nanogpt_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "ckpt.pt").write_bytes((nanogpt_dir / "out" / "ckpt.pt").read_bytes())
    result = run_main(sample.main, ["--out_dir=run", "--device=cpu"])
    assert_user_error(result, "nanoGPT's run on data/shakespeare_char, whose meta.pkl is not at "
                              "data/shakespeare_char/meta.pkl", "copy that dataset's meta.pkl")


# --- its data folders ---------------------------------------------------------------------------------------------


def test_train_reads_a_nanogpt_folder_as_ours_prepared_from_the_same_text(tmp_path):
    """nanoGPT's prepare.py and ours on the same text: the same token files, the same batches, the same run."""
    nanogpt_prepare(tmp_path / "theirs", TEXT)
    (tmp_path / "input.txt").write_text(TEXT)
    ours = run_scripts(["data/shakespeare_char/prepare.py", f"--input={tmp_path / 'input.txt'}",
                        f"--out_dir={tmp_path / 'ours'}"])[0]
    assert ours.returncode == 0, ours.stderr
    for split in ("train", "val"):
        assert (tmp_path / "theirs" / f"{split}.bin").read_bytes() == (tmp_path / "ours" / f"{split}.bin").read_bytes()
    theirs_meta, ours_meta = read_meta(tmp_path / "theirs"), read_meta(tmp_path / "ours")
    assert theirs_meta["itos"] == ours_meta["itos"][:theirs_meta["vocab_size"]]
    data = {name: TokenData(tmp_path / name, "train", 16) for name in ("theirs", "ours")}
    for k in range(3):
        batches = [d.get_batch(4, batch_generator(1337, "train", k, 0)) for d in data.values()]
        assert all(torch.equal(a, b) for a, b in zip(*batches))
    for name in ("theirs", "ours"):  # one vocab_size for both models: the same weights from the same seed
        train_tiny(tmp_path / f"out-{name}", tmp_path / name, vocab_size=ours_meta["vocab_size"], max_iters=6,
                   eval_interval=6, log_interval=1)
    assert losses(tmp_path / "out-theirs") == losses(tmp_path / "out-ours")


@pytest.mark.parametrize("payload, fragment", [
    (b"cos\nsystem\n(S'echo hi'\ntR.", "it names os.system"),  # a crafted pickle: any code would run
    (pickle.dumps({"vocab_size": 2, "itos": {0: "a", 1: "b"}, "stoi": {"a": 0, "b": 1}, "x": 1.5}),
     "it holds other objects"),
    (pickle.dumps({"vocab_size": 3, "itos": {0: "a", 1: "b"}, "stoi": {"a": 0, "b": 1}}), "do not agree"),
    (b"not a pickle", "is not read"),
])
def test_a_meta_pkl_holding_anything_else_is_refused_in_one_line(tmp_path, payload, fragment):
    (tmp_path / "meta.pkl").write_bytes(payload)
    with pytest.raises(UserError) as e:
        read_meta(tmp_path)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_a_gpt2_folder_without_meta_names_the_line_that_describes_it(tmp_path):
    np.zeros(100, dtype=np.uint16).tofile(tmp_path / "train.bin")
    with pytest.raises(UserError) as e:
        read_meta(tmp_path)
    command = str(e.value).split("describe them: ")[1]
    subprocess.run(command, shell=True, check=True)  # the line as printed, pasted into a shell
    meta = read_meta(tmp_path)
    assert (meta["tokenizer"], meta["vocab_size"], meta["dtype"]) == ("gpt2", 50257, "uint16")


# --- its names ----------------------------------------------------------------------------------------------------


def test_nanogpts_config_keys_all_work_here():
    """Every global of nanoGPT's train.py is a key here (dataset as data_dir), taking nanoGPT's values."""
    cfg = configlib.parse_args(TrainConfig, [f"--{k}={v}" for k, v in CONFIG.items() if k not in ("dtype", "device")])
    assert cfg.data_dir == "data/shakespeare_char" and cfg.backend == "nccl"
    with pytest.raises(UserError, match="backend must be one of auto, nccl, gloo, got 'mpi'"):
        configlib.parse_args(TrainConfig, ["--backend=mpi"])


def test_an_unknown_key_names_at_most_five_close_ones():
    with pytest.raises(UserError) as e:
        configlib.parse_args(TrainConfig, ["--n_embed=64"])
    hint = str(e.value).split("did you mean one of ")[1]
    assert "'n_embd'" in hint and 2 <= hint.count("'") // 2 <= 5
    with pytest.raises(UserError, match="--help lists every key$"):
        configlib.parse_args(TrainConfig, ["--zzzz=1"])


def test_backend_picks_the_process_group_backend(monkeypatch):
    from core import runtime
    made = {}
    monkeypatch.setattr(runtime, "dist_env", lambda: (0, 0, 2))
    monkeypatch.setattr(runtime.dist, "init_process_group", lambda **kw: made.update(kw))
    monkeypatch.setattr(runtime.dist, "new_group", lambda **kw: None)
    runtime.setup("cpu", "float32", backend="auto")
    assert made["backend"] == "gloo"
    with pytest.raises(UserError, match="backend nccl runs on CUDA GPUs only"):
        runtime.setup("cpu", "float32", backend="nccl")
    # On a GPU (faked: no CUDA here) auto is nccl, and gloo is what --backend=gloo asks for.
    monkeypatch.setattr(runtime, "resolve_device", lambda name, local_rank=None: "cuda:0")
    monkeypatch.setattr(runtime, "resolve_dtype", lambda name, device: "float32")
    monkeypatch.setattr(runtime, "local_gpu", lambda local_rank, count: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for backend, expected in (("auto", "nccl"), ("gloo", "gloo")):
        runtime.setup("cuda", "float32", backend=backend)
        assert made["backend"] == expected and (made["device_id"] is None) == (expected == "gloo")


# README commands of nanoGPT (its README at the vendored commit) that must parse here as they are.
README_TRAIN = [
    "python train.py config/train_shakespeare_char.py",
    "python train.py config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20 --log_interval=1 "
    "--block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000 --lr_decay_iters=2000 "
    "--dropout=0.0",
    "python train.py config/finetune_shakespeare.py",
    "torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2.py",
    "python train.py config/eval_gpt2.py",
    "python train.py config/eval_gpt2_medium.py",
    "python train.py config/eval_gpt2_large.py",
    "python train.py config/eval_gpt2_xl.py",
]


@pytest.mark.parametrize("command", README_TRAIN)
def test_nanogpts_readme_train_commands_parse_as_they_are(command):
    args = shlex.split(command)
    args = args[args.index("train.py") + 1:]
    cfg = configlib.parse_args(TrainConfig, [str(REPO_ROOT / a) if a.endswith(".py") else a for a in args])
    if "train_gpt2" in command:  # nanoGPT's meaning: OpenWebText, 124M, 12 x 1024 x 40 = 491,520 tokens a step
        assert cfg.data_dir == "data/openwebtext" and (cfg.n_layer, cfg.n_embd) == (12, 768)
        assert cfg.batch_size * cfg.block_size * cfg.gradient_accumulation_steps == 491_520


@pytest.mark.slow
def test_nanogpts_cpu_quick_start_runs_here_as_written(tmp_path):
    """nanoGPT's README CPU run, word for word but for --max_iters (6 of its 2,000 iterations), then its sample."""
    use = tmp_path / "data" / "shakespeare_char"
    nanogpt_prepare(use, TEXT)
    (tmp_path / "config").symlink_to(REPO_ROOT / "config")
    command = shlex.split(README_TRAIN[1])[1:] + ["--max_iters=6", "--eval_interval=3"]
    result = subprocess.run([sys.executable, str(REPO_ROOT / command[0]), *command[1:]], cwd=tmp_path,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    sampled = subprocess.run([sys.executable, str(REPO_ROOT / "sample.py"), "--out_dir=out-shakespeare-char",
                              "--device=cpu", "--max_new_tokens=20", "--num_samples=2"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=600)
    assert sampled.returncode == 0 and sampled.stdout.count(sample.SEPARATOR) == 2, sampled.stderr[-2000:]


def test_an_unreachable_hub_is_one_line_without_retries(tmp_path, monkeypatch):
    """--init_from=gpt2 with no network and an empty cache: one line at once, not the hub client's retries."""
    result = run_scripts(["sample.py", "--init_from=gpt2", "--device=cpu"],
                         env={"HF_HOME": str(tmp_path), "HF_ENDPOINT": "http://127.0.0.1:9"})[0]
    assert_user_error(result, f"'gpt2' is not in the Hugging Face cache ({tmp_path}/hub)",
                      "the hub at http://127.0.0.1:9 does not answer")
    assert result.stderr.count("\n") == 1 and "Retry" not in result.stderr
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    result = run_main(sample.main, ["--init_from=gpt2", "--device=cpu"])
    assert_user_error(result, "'gpt2' is not in the Hugging Face cache", "HF_HUB_OFFLINE is set")


# --- its model API: GPT.generate and GPT.configure_optimizers -------------------------------------------------------


def twins(ckpt):
    """nanoGPT's model and ours on the same trained weights, both in eval mode."""
    theirs, _ = nanogpt_resume(ckpt)
    ours = checkpoint.model_from_checkpoint(checkpoint.load_checkpoint(ckpt))
    return theirs.eval(), ours.eval()


def test_generate_draws_nanogpts_tokens_from_the_same_seed(nanogpt_dir):
    theirs, ours = twins(nanogpt_dir / "out" / "ckpt.pt")
    idx = torch.tensor([[5, 6, 7], [8, 9, 10]])
    for temperature, top_k in ((1.0, None), (0.8, 5), (1.0, 1)):
        outs = []
        for model in (theirs, ours):
            torch.manual_seed(42)
            # past block_size (32): both crop the context to its last 32 tokens
            outs.append(model.generate(idx, 50, temperature=temperature, top_k=top_k))
        assert outs[1].shape == (2, 53) and torch.equal(outs[0], outs[1]), (temperature, top_k)


def test_configure_optimizers_makes_nanogpts_groups_and_step(nanogpt_dir):
    theirs, ours = twins(nanogpt_dir / "out" / "ckpt.pt")
    args = (0.1, 3e-3, (0.9, 0.95), "cpu")
    opts = [model.configure_optimizers(*args) for model in (theirs, ours)]
    assert all(isinstance(o, torch.optim.AdamW) for o in opts)
    names = {id(p): n for n, p in theirs.named_parameters()} | {id(p): n for n, p in ours.named_parameters()}
    groups = [[([names[id(p)] for p in g["params"]], g["weight_decay"]) for g in o.param_groups] for o in opts]
    assert groups[0] == groups[1] and [wd for _, wd in groups[1]] == [0.1, 0.0]
    torch.manual_seed(3)
    x, y = nanogpt_batch(nanogpt_dir / "data" / "shakespeare_char")
    for model, opt in zip((theirs, ours), opts):
        model(x, y)[1].backward()
        opt.step()
    for (name, p), q in zip(theirs.named_parameters(), ours.parameters(), strict=True):
        assert (p - q).abs().max().item() < 1e-6, name


def test_gpt_has_nanogpts_methods_with_its_signatures():
    import inspect
    for name in ("generate", "configure_optimizers", "crop_block_size", "get_num_params"):
        theirs = list(inspect.signature(getattr(nanogpt_model.GPT, name)).parameters)
        ours = list(inspect.signature(getattr(GPT, name)).parameters)
        assert ours == theirs, (name, theirs, ours)
    assert GPTConfig().vocab_size == nanogpt_model.GPTConfig().vocab_size
