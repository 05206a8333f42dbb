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
from core.errors import UserError, run_cli
from core.runtime import DTYPES
from core.weights import resolver
from core.weights.hf_export import export


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
