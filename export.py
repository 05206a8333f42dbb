"""Export a run as a transformers folder: config.json, model.safetensors, the tokenizer, generation_config.json.

    python export.py --out_dir=out-shakespeare-char --hf_dir=hf-shakespeare-char     # from out_dir/ckpt.pt (or ckpt.dcp)
    python export.py --out_dir=out-modern --hf_dir=hf-modern --dtype=bfloat16        # weights stored in bfloat16

The folder loads without trust_remote_code:

    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
    model = AutoModelForCausalLM.from_pretrained("hf-shakespeare-char")
    tok = AutoTokenizer.from_pretrained("hf-shakespeare-char")
    pipeline("text-generation", model="hf-shakespeare-char")("ROMEO:", max_new_tokens=40, do_sample=False)

The class is the one that computes exactly the run's recipe (core/weights/hf.py: GPT2LMHeadModel, LlamaForCausalLM,
Qwen3ForCausalLM, ArceeForCausalLM, NemotronForCausalLM); a recipe no class holds stops with one line naming
the switches and the nearest recipe that exports. A character vocabulary holds <|endoftext|>, the end-of-text
token lm_eval and generate need; one prepared without it gets it appended (resolver.with_end_of_text, as serve.py
serves it), the head grown by a row. Before writing, the exported model's logits are checked
against ours on a test sequence. A chat run's tokenizer carries the chat template (core/data/chat.py), so
tok.apply_chat_template(messages) gives the ids the model was fine-tuned on (docs/chat.md).
"""
from core.errors import quiet_start
quiet_start(__name__)  # as a script: Ctrl-C during the imports below (seconds) is one line

import dataclasses
import sys
from pathlib import Path
from typing import Sequence

import torch

from core.config import parse_args
from core.data.chat import JINJA_TEMPLATE, ChatTemplate
from core.data.hf_tokenizer import save_hf_tokenizer
from core.data.tokenizer import HFTokenizer, Tokenizer
from core.errors import UserError, run_cli
from core.fileio import atomic_dir, space_for
from core.runtime import DTYPES
from core.weights import hf, resolver
from model import GPT

CHECK_TOKENS = 1024  # the longest sequence check_logits compares


@dataclasses.dataclass
class ExportConfig:
    out_dir: str = "out"          # the run: out_dir/ckpt.pt, or out_dir/ckpt.dcp from --parallel=fsdp
    hf_dir: str = ""              # the folder to write; it must not exist or be empty
    dtype: str = "float32"        # float32, bfloat16 or float16: the stored weights' type
    check: bool = True            # compare the transformers model's logits with ours before writing

    def validate(self) -> None:
        if not self.hf_dir:
            raise UserError("pass --hf_dir=DIR, the folder to write the transformers model to")
        if self.dtype not in DTYPES:
            raise UserError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        path = Path(self.hf_dir)
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise UserError(f"{path} exists and is not an empty folder; pass a new --hf_dir")


def generation_config(model: GPT, tok: Tokenizer) -> dict:
    """What transformers' generate needs beyond the weights: the ids that end a reply (a chat model's
    <|end|> first, then the end-of-text id) and the context length."""
    eos, chat = tok.eot_token, ChatTemplate.for_tokenizer(tok)
    stop = eos if chat is None else [chat.end_of_turn] + ([] if eos is None else [eos])
    return {"eos_token_id": stop, "pad_token_id": eos, "bos_token_id": getattr(tok, "bos_token", None),
            "max_length": model.config.block_size}


@torch.no_grad()
def check_logits(model: GPT, hf_model, atol: float = 1e-4) -> float:
    """The largest logit difference on one sequence of the full context, or of CHECK_TOKENS where the context
    is longer (Llama 3.2's 131,072 positions would take minutes and gigabytes); a UserError past atol."""
    T = min(model.config.block_size, CHECK_TOKENS)
    idx = torch.randint(0, model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(0))
    diff = (model.float()(idx)[0] - hf_model(idx).logits).abs().max().item()
    if not diff <= atol:
        raise UserError(f"the exported model's logits differ from ours by {diff:.3g}; the folder was not written")
    return diff


def export(model: GPT, tok: Tokenizer, directory: str | Path, dtype: str = "float32", check: bool = True,
           extra_special_tokens: tuple[str, ...] = ()) -> str:
    """Write the transformers folder for model and tok; returns the class name."""
    from transformers import GenerationConfig

    arch = hf.architecture(model.config)  # a recipe no class holds stops here, before anything is written
    if tok.vocab_size > model.config.vocab_size:
        raise UserError(f"the tokenizer has {tok.vocab_size} ids but the model only {model.config.vocab_size}")
    if arch == "Qwen2ForCausalLM" and not isinstance(tok, HFTokenizer):
        # transformers 5's AutoTokenizer reads a qwen2 folder's tokenizer.json as Qwen2Tokenizer, which
        # splits with Qwen2's own regex (digits one by one): other ids than this run's tokenizer gives
        raise UserError("a Qwen2ForCausalLM folder's tokenizer is read by transformers as Qwen2's own, which "
                        "splits text differently from this run's; train with qkv_bias=None (exports as "
                        "LlamaForCausalLM), or export a model imported from a Qwen2 folder")
    model, tok = resolver.with_end_of_text(model, tok)
    gen = generation_config(model, tok)
    hf_model = hf.to_transformers(model.float(), tok.eot_token, gen["bos_token_id"])
    if check:
        check_logits(model, hf_model)
    hf_model.to(DTYPES[dtype])
    needed = sum(p.numel() * p.element_size() for p in hf_model.parameters())
    # Written whole or not at all: a full disk leaves no half folder that looks like a model.
    with space_for(directory, needed, "nothing was written there: free space and export again"), \
            atomic_dir(directory) as tmp:
        hf_model.save_pretrained(tmp)
        GenerationConfig(**gen).save_pretrained(tmp)
        chat = ChatTemplate.for_tokenizer(tok) is not None  # apply_chat_template then renders our ids
        save_hf_tokenizer(tok, tmp, model.config.block_size, extra_special_tokens,
                          chat_template=JINJA_TEMPLATE if chat else None)
    return arch


def main(argv: Sequence[str]) -> str:
    cfg = parse_args(ExportConfig, argv)  # validates
    model, tok, source = resolver.load_model("resume", cfg.out_dir)
    model.eval()
    arch = export(model, tok, cfg.hf_dir, cfg.dtype, cfg.check)
    files = ", ".join(sorted(p.name for p in Path(cfg.hf_dir).iterdir()))
    line = f"exported {source} as {arch} ({cfg.dtype}) to {cfg.hf_dir}: {files}"
    print(line, file=sys.stderr)
    return line


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    run_cli(main)
