"""Where a model's weights come from, in two steps: locate what init_from names (everything but the weights), then
build the model; a script checks the architecture between the two, before any weight is read. init_from names one of

    scratch    new weights for the config train.py makes (Weights("scratch", config, "scratch"); train.py only)
    resume     the checkpoint in out_dir (training: also its optimizer, RNG and iteration)
    run        a training run's out_dir: its checkpoint's weights, e.g. for a chat fine-tune
    folder     a transformers folder (GPT-2, Llama, Qwen3, ...: core/weights/hf.py), with its tokenizer.json
    hub        a GPT-2 hub name (gpt2, gpt2-medium, gpt2-large, gpt2-xl), with GPT-2's BPE

    w = resolver.locate("resume", "out-shakespeare-char")       # w.config, w.tokenizer, w.source, w.state
    model = resolver.build(w)                                    # on the CPU
    model, tok, source = resolver.load_model(init_from, out_dir) # both steps, as sample.py, eval.py, ... use it

For training, resume reads the newest intact checkpoint (sharded: only its metadata) and the tokenizer stays
metadata. Every problem is a UserError, in one line.
"""
import copy
import dataclasses
from pathlib import Path
from typing import Any, Callable

from core.weights import checkpoint, hf  # hf imports transformers only inside its functions
from core.data.tokenizer import END_OF_TEXT, CharTokenizer, GPT2Tokenizer, Tokenizer, tokenizer_from_meta
from core.errors import UserError, first_line
from model import GPT, GPT2_HUB_NAMES, GPT2_SHAPES, GPTConfig


@dataclasses.dataclass
class Weights:
    """What init_from names, everything but the weights: build() reads them."""
    kind: str                            # scratch | resume | run | folder | hub
    config: GPTConfig                    # the architecture, known before any weight is read
    source: str                          # one line naming where the weights come from
    tokenizer: Tokenizer | None = None   # the one they came with (training reads only a checkpoint's metadata)
    tokenizer_meta: dict | None = None   # resume, run: the checkpoint's saved tokenizer metadata
    state: dict[str, Any] | None = None  # resume, run: the loaded checkpoint (its "model" None when sharded)
    path: Path | None = None             # resume, run: the checkpoint file or directory
    overrides: dict[str, Any] = dataclasses.field(default_factory=lambda: {"dropout": 0.0})  # how the model runs
    name: str = ""                       # folder, hub: what init_from said


def kind_of(init_from: str) -> str | None:
    """Which of the five sources init_from names, or None. A directory wins over a hub name."""
    if init_from in ("scratch", "resume"):
        return init_from
    if checkpoint.find_checkpoint(init_from) is not None:
        return "run"
    if Path(init_from).is_dir():
        return "folder"
    return "hub" if init_from in GPT2_HUB_NAMES else None


def check_init_from(init_from: str, scratch: bool = False) -> None:
    """The one init_from check of every config: train.py's (scratch=True) and the scripts'."""
    if scratch and init_from == "auto":  # train.py decides it first: resume or scratch (loop.auto_init_from)
        return
    kind = kind_of(init_from)
    if kind is None or (kind == "scratch" and not scratch):
        raise UserError(f"unknown init_from '{init_from}'; use {'scratch, auto, ' if scratch else ''}resume (the "
                        f"checkpoint in out_dir), a training run's out_dir, {', '.join(GPT2_HUB_NAMES)}, or a "
                        f"directory written by save_pretrained")


def locate(init_from: str, out_dir, overrides: dict[str, Any] | None = None, training: bool = False,
           sharded: bool = False, log: Callable[[str], None] = print) -> Weights:
    """Everything init_from names but the weights: architecture, tokenizer, a line naming the source and, for a
    checkpoint, its contents. overrides (dropout, attn_backend) say how the model will run, never its weights."""
    check_init_from(init_from)
    kind, out_dir = kind_of(init_from), Path(out_dir)
    overrides = {"dropout": 0.0} if overrides is None else overrides
    if kind in ("resume", "run"):
        w = _checkpoint(kind, out_dir if kind == "resume" else Path(init_from), training, sharded, log)
    elif kind == "folder":
        config = hf.folder_config(init_from, overrides if training else None)
        w = Weights(kind, config, init_from, tokenizer=hf.folder_tokenizer(init_from, config))
    else:  # hub. Whether its weights can be had, then the tokenizer: without the BPE file nothing decodes.
        hf.check_hub(init_from)
        w = Weights(kind, GPTConfig(**GPT2_SHAPES[init_from]), init_from, tokenizer=None if training else GPT2Tokenizer())
    w.overrides, w.name = overrides, init_from
    if w.tokenizer is not None and w.tokenizer.vocab_size > w.config.vocab_size:
        raise UserError(f"{w.source}: the tokenizer has {w.tokenizer.vocab_size} ids but the model only "
                        f"{w.config.vocab_size}; they do not belong together")
    return w


def build(w: Weights) -> GPT:
    """The model of w, its weights read (a sharded checkpoint's load after sharding: checkpointing.restore)."""
    if w.kind == "scratch":
        return GPT(w.config)
    if w.kind in ("resume", "run"):
        try:
            return checkpoint.model_from_checkpoint(w.state, **w.overrides)
        except (TypeError, ValueError, KeyError, RuntimeError) as e:
            raise UserError(f"checkpoint {w.path} does not fit this model.py ({first_line(e)})") from None
    if w.kind == "folder":
        return hf.from_folder(w.name, w.overrides)
    try:
        return hf.from_hub(w.name, w.overrides)
    except (OSError, ValueError) as e:  # offline, or no such model on the hub
        raise UserError(f"could not load GPT-2 weights '{w.name}': {first_line(e)}") from None


def load_model(init_from: str, out_dir) -> tuple[GPT, Tokenizer, str]:
    """Both steps, as the scripts use them: (model, tokenizer, one line naming the source)."""
    w = locate(init_from, out_dir)
    return build(w), w.tokenizer, w.source


def with_end_of_text(model: GPT, tok: Tokenizer) -> tuple[GPT, Tokenizer]:
    """(model, tok), with <|endoftext|> appended as the next id to a character vocabulary that lacks one (lm_eval and
    generate need it; export.py and serve.py both take this pair, so they agree); a model without a row for it gets
    a copy grown by the mean row (its logit the mean logit, so greedy text is unchanged)."""
    if tok.eot_token is not None or not isinstance(tok, CharTokenizer):
        return model, tok
    meta = tok.meta()
    special = dict(meta.get("special_tokens") or {}) | {END_OF_TEXT: tok.vocab_size}
    tok = tokenizer_from_meta(meta | {"special_tokens": special, "vocab_size": tok.vocab_size + 1})
    if tok.vocab_size > model.config.vocab_size:
        model = copy.deepcopy(model)
        model.grow_vocab(tok.vocab_size)
    return model, tok


def _checkpoint(kind: str, directory: Path, training: bool, sharded: bool, log) -> Weights:
    if not training:
        state, path = _exact(directory)
    elif kind == "run":  # only the weights are taken, so whichever file the run holds
        path = checkpoint.find_checkpoint(directory)
        state = checkpoint.load_checkpoint(path)
    else:  # sharded: the weights and optimizer load after sharding (checkpointing.restore)
        state, path = checkpoint.load_latest(directory, log, sharded)
    meta = state["meta"]
    if not isinstance(meta.get("tokenizer"), dict):
        use = "it cannot be fine-tuned on a dataset" if training else "it cannot be decoded"
        raise UserError(f"checkpoint {path} has no tokenizer metadata; {use}")
    try:
        config = GPTConfig(**meta["model_args"])
    except (TypeError, ValueError, KeyError) as e:
        raise UserError(f"checkpoint {path} does not fit this model.py ({first_line(e)})") from None
    tokenizer = None if training else tokenizer_from_meta(meta["tokenizer"], source=f"checkpoint {path}")
    source = f"{path} (iter {meta.get('iter_num')}" + (f"; {meta['nanogpt']})" if "nanogpt" in meta else ")")
    return Weights(kind, config, source, tokenizer, meta["tokenizer"], state, path)


def _exact(out_dir: Path) -> tuple[dict, Path]:
    """out_dir's ckpt.pt (or the fsdp run's ckpt.dcp), exactly that file: a damaged one is an error."""
    path = checkpoint.find_checkpoint(out_dir) or out_dir / checkpoint.CKPT_NAME
    prev = out_dir / (checkpoint.PREV_NAME if path.name == checkpoint.CKPT_NAME else checkpoint.PREV_SHARDED_NAME)
    # ckpt.prev.pt is the complete checkpoint saved before ckpt.pt; name it rather than silently
    # loading an older model than the user thinks.
    hint = f"; {prev} holds the checkpoint saved before it: copy it to {path} to use it" if prev.exists() else ""
    if not path.exists():
        raise UserError(f"no checkpoint in {out_dir}: {path} not found; train one first "
                        f"(python train.py ... --out_dir={out_dir}) or pass --out_dir=...{hint}")
    try:
        return checkpoint.load_checkpoint(path), path
    except UserError as e:
        raise UserError(f"{e}{hint}") from None
