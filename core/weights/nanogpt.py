"""nanoGPT's ckpt.pt read as this project's checkpoint (checkpoint.load_checkpoint calls from_nanogpt), so every
script loads a nanoGPT out_dir as it is; what maps to what: docs/from-nanogpt.md.
"""
import dataclasses
from pathlib import Path

import torch

from core.data.loader import read_meta_pkl
from core.data.tokenizer import GPT2_EOT, GPT2_VOCAB
from core.errors import UserError
from model import GPTConfig

KEYS = {"model", "optimizer", "model_args", "iter_num", "best_val_loss", "config"}
# nanoGPT's settings of the machine it ran on, decided again here: a resumed run resolves its own.
MACHINE_KEYS = ("device", "dtype", "compile", "backend")


def from_nanogpt(state: dict, path: Path) -> dict:
    """nanoGPT's checkpoint as load_checkpoint returns ours: {"meta", "model", "optimizer", ...}."""
    # torch.compile's wrapper prefixes every key; nanoGPT's fallback attention (torch < 2) saves its mask, attn.bias
    model = {k.removeprefix("_orig_mod."): v for k, v in state["model"].items() if not k.endswith(".attn.bias")}
    config = dict(state["config"])
    try:
        model_args = dataclasses.asdict(GPTConfig(**state["model_args"], gelu_approximate="none"))
    except (TypeError, ValueError) as e:
        raise UserError(f"{path} is nanoGPT's, but its model_args do not fit GPTConfig ({e})") from None
    tokenizer, found = _vocabulary(config.get("dataset"), model_args["vocab_size"], path)
    meta = {"iter_num": state["iter_num"], "best_val_loss": float(state["best_val_loss"]), "model_args": model_args,
            "config": {k: v for k, v in config.items() if k not in MACHINE_KEYS} | {"gelu_approximate": "none"},
            "tokenizer": tokenizer, "nanogpt": f"nanoGPT's, {found}"}
    return {"meta": meta, "model": model, "optimizer": _optimizer(state["optimizer"], model), "scaler": None,
            "rng": None}


def dataset_dirs(dataset: str, path: Path) -> list[Path]:
    """Where nanoGPT's run on data/<dataset> keeps it: beside the run (path's out_dir's parent, nanoGPT's own layout),
    then under the working directory, as nanoGPT's sample.py looks."""
    return list(dict.fromkeys([path.parent.parent / "data" / dataset, Path("data") / dataset]))


def _vocabulary(dataset: str | None, vocab_size: int, path: Path) -> tuple[dict, str]:
    """The tokenizer metadata of nanoGPT's run, and where it came from: its dataset's meta.pkl, else GPT-2's BPE
    (as nanoGPT's sample.py)."""
    places = [] if dataset is None else [d / "meta.pkl" for d in dataset_dirs(dataset, path)]
    found = next((p for p in places if p.is_file()), None)
    if found is not None:
        return {k: v for k, v in read_meta_pkl(found).items() if k != "dtype"}, f"vocabulary {found}"
    where = " or ".join(map(str, places)) or "nowhere (its config names no dataset)"
    if vocab_size < GPT2_VOCAB:  # a character vocabulary whose meta.pkl is elsewhere
        raise UserError(f"{path} is nanoGPT's run on data/{dataset}, whose meta.pkl is not at {where}; copy that "
                        f"dataset's meta.pkl to one of them")
    return {"tokenizer": "gpt2", "vocab_size": GPT2_VOCAB, "eot_token": GPT2_EOT}, f"GPT-2 BPE (no meta.pkl at {where})"


def _optimizer(saved: dict, model: dict) -> dict | None:
    """nanoGPT's AdamW state where it fits ours (core/training/optim.py), else None: nanoGPT's configure_optimizers
    makes the same two groups (>= 2-D weights decayed, then the rest) in the same named_parameters order."""
    params = [v for k, v in model.items() if k != "lm_head.weight"]  # tied to wte, listed once by named_parameters
    want = [[p.shape for p in params if p.dim() >= 2], [p.shape for p in params if p.dim() < 2]]
    state = saved.get("state", {})
    got = [[state.get(i, {}).get("exp_avg", torch.empty(0)).shape for i in g["params"]] for g in saved["param_groups"]]
    return saved if got == want else None
