"""Checkpoints, read: loaded with weights_only=True, every byte checked first, metadata as JSON; nanoGPT's ckpt.pt
read as ours. Writing them (a training run's side): core/training/checkpointing.py.

A checkpoint is one torch file holding only tensors and plain containers:
    {"format": FORMAT, "meta": "<JSON text>", "model": state_dict,
     "optimizer": state_dict | None, "scaler": state_dict | None, "rng": {...} | None}
"meta" carries the model arguments, the run config, the tokenizer metadata, the iteration and the best val loss.
The model saved is always the plain (uncompiled, unwrapped) module: no '_orig_mod.' or 'module.' prefixes.

out_dir holds ckpt.pt and ckpt.prev.pt, both complete at every instant. Loading checks every record's CRC-32, which
torch.load does not: a damaged file is an error, never wrong weights; a resume falls back to ckpt.prev.pt.
Sharded checkpoints (fsdp), ckpt.dcp and ckpt.prev.dcp, are directories with the same guarantees (docs/sharding.md);
they load into any number of processes, or into one plain GPT.
"""
import contextlib
import dataclasses
import functools
import io
import json
import os
import pickle
import re
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from core.data.loader import read_meta_pkl
from core.data.tokenizer import GPT2_EOT, GPT2_VOCAB
from core.errors import UserError, first_line
from model import GPT, GPTConfig

FORMAT = "nanogpt-checkpoint/1"
CKPT_NAME = "ckpt.pt"
PREV_NAME = "ckpt.prev.pt"


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint (or nanoGPT's ckpt.pt, in the same shape) on the CPU, `state["meta"]` a dict; a UserError for a
    missing file, a truncated or corrupt one, or one that is not a checkpoint of this project or nanoGPT's."""
    path = Path(path)
    if path.is_dir():  # a sharded checkpoint, e.g. out/ckpt.dcp
        return load_sharded_full(path)
    if not path.is_file():
        raise UserError(f"no checkpoint at {path}; train one first (python train.py ... --out_dir={path.parent})")
    _verify_archive(path)
    try:
        # mmap: tensors are read from the file as they are used, not all copied into host RAM at once
        # (every rank loads the checkpoint on resume).
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        if "Weights only load failed" not in str(e):
            raise UserError(f"checkpoint {path} is truncated or corrupt ({first_line(e)})") from None
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = found.group(1) if found else "objects other than tensors and plain containers"
        raise UserError(f"{path} holds pickled Python objects ({what}), which are never loaded: unpickling them "
                        f"could run any code. It is not a checkpoint written by this project's train.py") from None
    except Exception as e:  # anything else torch.load rejects
        raise UserError(f"checkpoint {path} is truncated or corrupt ({first_line(e)})") from None
    if isinstance(state, dict) and NANOGPT_KEYS <= state.keys():
        return {"format": FORMAT} | from_nanogpt(state, path)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UserError(f"{path} is not a checkpoint written by this project's train.py or nanoGPT's")
    try:
        state["meta"] = json.loads(state["meta"])
    except (KeyError, TypeError, json.JSONDecodeError):
        raise UserError(f"checkpoint {path} has unreadable metadata") from None
    return state


def _verify_archive(path: Path) -> None:
    """Check that `path` is a complete zip archive (what torch.save writes) whose records match their CRC-32s,
    reading the file once more, at disk or page-cache speed."""
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                if info.CRC == 0 and info.file_size:
                    continue  # written with torch.serialization.set_crc32_options(False): nothing to check
                with archive.open(info) as record:
                    while record.read(1 << 24):  # zipfile raises BadZipFile at the end on a CRC mismatch
                        pass
    except (zipfile.BadZipFile, EOFError, ValueError, OSError) as e:
        raise UserError(f"checkpoint {path} is truncated or corrupt ({first_line(e)}); it cannot be loaded") from None


def find_checkpoint(out_dir: str | os.PathLike, prev: bool = False) -> Path | None:
    """The checkpoint a run's out_dir holds (ckpt.pt, else fsdp's ckpt.dcp; prev: else ckpt.prev.pt, ckpt.prev.dcp)."""
    names = (CKPT_NAME, SHARDED_NAME) + ((PREV_NAME, PREV_SHARDED_NAME) if prev else ())
    return next((Path(out_dir) / name for name in names if (Path(out_dir) / name).exists()), None)


def load_latest(out_dir: str | os.PathLike, log=print, sharded: bool = False) -> tuple[dict[str, Any], Path]:
    """(state, path) of out_dir's ckpt.pt; if that is damaged or missing and ckpt.prev.pt exists, of that one with a
    warning, so a kill or a damaged file never costs more than the newest checkpoint. sharded: ckpt.dcp, else
    ckpt.prev.dcp (a kill between two renames), whose state is its metadata alone: the weights load after sharding."""
    out_dir = Path(out_dir)
    name, prev_name, kind, other, parallel = ((SHARDED_NAME, PREV_SHARDED_NAME, "sharded ", CKPT_NAME, "a ddp")
                                              if sharded else (CKPT_NAME, PREV_NAME, "", SHARDED_NAME, "an fsdp"))
    path, prev = out_dir / name, out_dir / prev_name
    if not path.exists() and not prev.exists():
        held = (f" (it holds {parallel} checkpoint, {other}: resume it with --parallel={parallel.split()[1]})"
                if (out_dir / other).exists() else "")
        raise UserError(f"no {kind}checkpoint in {out_dir} (expected {name}){held}; train first or check --out_dir")

    def load(p: Path) -> dict[str, Any]:
        return {"meta": read_sharded_meta(p), "model": None} if sharded else load_checkpoint(p)

    try:
        return load(path), path
    except UserError as e:
        if not prev.exists():
            raise
        try:
            state = load(prev)
        except UserError as e_prev:
            raise UserError(f"no intact checkpoint in {path.parent}: {e}; and {e_prev}") from None
        log(f"warning: {e}; using the older complete checkpoint {prev} (iter {state['meta'].get('iter_num')})")
        return state, prev


def model_from_checkpoint(state: dict[str, Any], **overrides) -> GPT:
    """Rebuild the saved GPT (on the CPU) from a loaded checkpoint; overrides such as
    dropout or attn_backend change how it runs, not its weights."""
    model = GPT(GPTConfig(**(state["meta"]["model_args"] | overrides)))
    if state["model"] is not None:  # None: a sharded checkpoint, loaded after sharding (load_sharded)
        model.load_state_dict(state["model"])
    return model


# -----------------------------------------------------------------------------
# nanoGPT's ckpt.pt read as this project's checkpoint, so every script loads a nanoGPT out_dir as it is; what maps
# to what: docs/from-nanogpt.md

NANOGPT_KEYS = {"model", "optimizer", "model_args", "iter_num", "best_val_loss", "config"}
# nanoGPT's settings of the machine it ran on, decided again here: a resumed run resolves its own.
NANOGPT_MACHINE_KEYS = ("device", "dtype", "compile", "backend")


def from_nanogpt(state: dict, path: Path) -> dict:
    """nanoGPT's checkpoint as load_checkpoint returns ours: {"meta", "model", "optimizer", ...}."""
    # torch.compile's wrapper prefixes every key; nanoGPT's fallback attention (torch < 2) saves its mask, attn.bias
    model = {k.removeprefix("_orig_mod."): v for k, v in state["model"].items() if not k.endswith(".attn.bias")}
    config = dict(state["config"])
    try:
        model_args = dataclasses.asdict(GPTConfig(**state["model_args"], gelu_approximate="none"))
    except (TypeError, ValueError) as e:
        raise UserError(f"{path} is nanoGPT's, but its model_args do not fit GPTConfig ({e})") from None
    tokenizer, found = _nanogpt_vocabulary(config.get("dataset"), model_args["vocab_size"], path)
    meta = {"iter_num": state["iter_num"], "best_val_loss": float(state["best_val_loss"]), "model_args": model_args,
            "config": {k: v for k, v in config.items() if k not in NANOGPT_MACHINE_KEYS} | {"gelu_approximate": "none"},
            "tokenizer": tokenizer, "nanogpt": f"nanoGPT's, {found}"}
    return {"meta": meta, "model": model, "optimizer": _nanogpt_optimizer(state["optimizer"], model), "scaler": None,
            "rng": None}


def nanogpt_dataset_dirs(dataset: str, path: Path) -> list[Path]:
    """Where nanoGPT's run on data/<dataset> keeps it: beside the run (path's out_dir's parent, nanoGPT's own layout),
    then under the working directory, as nanoGPT's sample.py looks."""
    return list(dict.fromkeys([path.parent.parent / "data" / dataset, Path("data") / dataset]))


def _nanogpt_vocabulary(dataset: str | None, vocab_size: int, path: Path) -> tuple[dict, str]:
    """The tokenizer metadata of nanoGPT's run, and where it came from: its dataset's meta.pkl, else GPT-2's BPE
    (as nanoGPT's sample.py)."""
    places = [] if dataset is None else [d / "meta.pkl" for d in nanogpt_dataset_dirs(dataset, path)]
    found = next((p for p in places if p.is_file()), None)
    if found is not None:
        return {k: v for k, v in read_meta_pkl(found).items() if k != "dtype"}, f"vocabulary {found}"
    where = " or ".join(map(str, places)) or "nowhere (its config names no dataset)"
    if vocab_size < GPT2_VOCAB:  # a character vocabulary whose meta.pkl is elsewhere
        raise UserError(f"{path} is nanoGPT's run on data/{dataset}, whose meta.pkl is not at {where}; copy that "
                        f"dataset's meta.pkl to one of them")
    return {"tokenizer": "gpt2", "vocab_size": GPT2_VOCAB, "eot_token": GPT2_EOT}, f"GPT-2 BPE (no meta.pkl at {where})"


def _nanogpt_optimizer(saved: dict, model: dict) -> dict | None:
    """nanoGPT's AdamW state where it fits ours (core/training/optim.py), else None: nanoGPT's configure_optimizers
    makes the same two groups (>= 2-D weights decayed, then the rest) in the same named_parameters order."""
    params = [v for k, v in model.items() if k != "lm_head.weight"]  # tied to wte, listed once by named_parameters
    want = [[p.shape for p in params if p.dim() >= 2], [p.shape for p in params if p.dim() < 2]]
    state = saved.get("state", {})
    got = [[state.get(i, {}).get("exp_avg", torch.empty(0)).shape for i in g["params"]] for g in saved["param_groups"]]
    return saved if got == want else None


# -----------------------------------------------------------------------------
# sharded checkpoints (parallel="fsdp"): torch.distributed.checkpoint

SHARDED_FORMAT = "nanogpt-sharded-checkpoint/1"
SHARDED_NAME = "ckpt.dcp"
PREV_SHARDED_NAME = "ckpt.prev.dcp"
META_NAME = "meta.json"
RNG_NAME = "rng.pt"


@contextlib.contextmanager
def one_process_quietly():
    """DCP warns on every save and load without a process group; one process is a case we mean."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def crc32(path: Path) -> int:
    """The CRC-32 of a file, read in chunks, as meta.json records it for each file of a sharded checkpoint."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def read_sharded_meta(path: str | os.PathLike) -> dict[str, Any]:
    """meta.json of the sharded checkpoint directory `path`, after checking every file against its CRC-32; a
    UserError for a missing or incomplete directory, a changed file, or one not of this project."""
    path = Path(path)
    if not (path / META_NAME).is_file():
        raise UserError(f"no sharded checkpoint at {path} (no {META_NAME}); train one first with --parallel=fsdp")
    try:
        record = json.loads((path / META_NAME).read_text())
        files, meta = record["files"], record["meta"]
        assert record["format"] == SHARDED_FORMAT and isinstance(files, dict) and isinstance(meta, dict)
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        raise UserError(f"{path} is not a sharded checkpoint written by this project's train.py") from None
    for name, crc in files.items():
        try:
            if crc32(path / name) != crc:
                raise UserError(f"checkpoint {path} is corrupt ({name} does not match its CRC-32); it cannot be loaded")
        except OSError as e:
            raise UserError(f"checkpoint {path} is incomplete ({name}: {e.strerror}); it cannot be loaded") from None
    try:  # before DCP reads it: DCP would log the refusal as a traceback and go on to another error
        shards = {info.relative_path for info in _check_metadata(path / ".metadata").storage_data.values()}
    except pickle.UnpicklingError as e:
        raise UserError(f"{path}/.metadata {e}: unpickling it could run any code. It is not a checkpoint written "
                        f"by this project's train.py") from None
    except (OSError, EOFError, ValueError, AttributeError) as e:
        raise UserError(f"checkpoint {path} has an unreadable .metadata ({first_line(e)})") from None
    if missing := sorted(shards - set(files)):
        raise UserError(f"checkpoint {path} is incomplete (no {', '.join(missing)}); it cannot be loaded")
    return meta


def read_shards(path: Path, state: dict[str, Any]) -> None:
    """Fill `state` ({"model": ..., "optimizer": ...} as get_state_dict returns them) from the sharded
    checkpoint `path`, in place, through the allowlist below; every process calls it."""
    import torch.distributed.checkpoint as dcp

    reader, planner = _safe_reader_and_planner()
    try:
        with one_process_quietly():
            dcp.load(state, storage_reader=reader(path), planner=planner(), no_dist=not dist.is_initialized())
    except (pickle.UnpicklingError, dcp.api.CheckpointException, RuntimeError) as e:
        raise UserError(f"checkpoint {path} cannot be loaded into this model ({first_line(e)})") from None


def load_sharded_full(path: str | os.PathLike) -> dict[str, Any]:
    """A sharded checkpoint as load_checkpoint returns a ckpt.pt (model weights, no optimizer), in one
    process: what sample.py and hf.to_transformers(model).save_pretrained need."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_state_dict

    path = Path(path)
    meta = read_sharded_meta(path)
    model = GPT(GPTConfig(**meta["model_args"]))
    state = {"model": get_model_state_dict(model)}
    read_shards(path, state)
    set_state_dict(model, (), model_state_dict=state["model"], optim_state_dict={})
    return {"format": FORMAT, "meta": meta, "model": model.state_dict(), "optimizer": None, "scaler": None, "rng": None}


# DCP would pickle.load .metadata and torch.load(weights_only=False) non-tensor values (the optimizer's
# hyperparameters): either could run any code from a crafted checkpoint (docs/sharding.md, "Unpickling, honestly").
_SAFE_GLOBALS = {
    "torch.distributed.checkpoint.metadata": None,  # any class of that module: dataclasses and enums
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"} | {n for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        allowed = _SAFE_GLOBALS.get(module, set())
        if module in _SAFE_GLOBALS and (allowed is None or name in allowed):
            found = super().find_class(module, name)
            if allowed is not None or isinstance(found, type):
                return found
        raise pickle.UnpicklingError(f"holds a pickled {module}.{name}, which is never loaded")


def _check_metadata(path: Path):
    """DCP's Metadata, unpickled through the allowlist; raises pickle.UnpicklingError on any other global."""
    with open(path, "rb") as f:
        return _MetadataUnpickler(f).load()


@functools.cache
def _safe_reader_and_planner() -> tuple[type, type]:
    """DCP's reader and load planner, each checking what it unpickles first. Built at the first sharded load:
    torch.distributed.checkpoint (with DTensor) is 0.7 s of every start that never reads one."""
    import torch.distributed.checkpoint as dcp

    class SafeReader(dcp.FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            rank = kwargs.get("rank")  # DCP first asks for per-rank metadata files, which we never write
            _check_metadata(Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata"))
            return super().read_metadata(*args, **kwargs)  # now known to hold only allowed globals

    class SafePlanner(dcp.DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            torch.load(value, weights_only=True)  # raises on anything but plain values; then DCP's load is safe
            value.seek(0)
            super().load_bytes(read_item, value)

    return SafeReader, SafePlanner
