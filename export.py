"""Export a run as a transformers folder: config.json, model.safetensors, the tokenizer, generation_config.json;
or as a GGUF file for llama.cpp.

    python export.py --out_dir=out-shakespeare-char --hf_dir=hf-shakespeare-char     # from out_dir/ckpt.pt (or ckpt.dcp)
    python export.py --out_dir=out-modern --hf_dir=hf-modern --dtype=bfloat16        # weights stored in bfloat16
    python export.py --format=gguf --hf_dir=hf-modern --gguf=modern-f32.gguf         # a folder as a GGUF

The folder loads without trust_remote_code (docs/interop.md): its class computes exactly the run's recipe, its
logits are checked against ours before writing, and a recipe no class holds is one line naming the switches.
--format=gguf converts the folder with llama.cpp's converter (bash scripts/fetch_llama_converter.sh fetches it),
exporting the run into it first when the folder is new.
"""
from core.errors import UserError, quiet_start, run_cli
quiet_start(__name__)  # as a script: Ctrl-C during the imports below (seconds) is one line

import dataclasses
import sys
from pathlib import Path
from typing import Sequence

import torch

from core.config import parse_args
from core.runtime import DTYPES
from core.weights import gguf, resolver
from core.weights.hf_export import export


@dataclasses.dataclass
class ExportConfig:
    out_dir: str = "out"          # the run: out_dir/ckpt.pt, or out_dir/ckpt.dcp from --parallel=fsdp
    hf_dir: str = ""              # the folder to write; it must not exist or be empty (gguf: or an export to convert)
    dtype: str = "float32"        # float32, bfloat16 or float16: the stored weights' type
    check: bool = True            # compare the transformers model's logits with ours before writing
    format: str = "hf"            # hf: the folder; gguf: also the folder as the GGUF file --gguf
    gguf: str = ""                # gguf: the file to write
    outtype: str = "f32"          # gguf: the converter's --outtype: f32, f16, bf16, q8_0, auto
    converter_dir: str = ""       # gguf: the converter's unpack; "": $LLAMA_CPP_CONVERTER_DIR, else the fetch script's

    def validate(self) -> None:
        if not self.hf_dir:
            raise UserError("pass --hf_dir=DIR, the folder to write the transformers model to")
        if self.dtype not in DTYPES:
            raise UserError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.format not in ("hf", "gguf"):
            raise UserError(f"format must be hf or gguf, got {self.format!r}")
        if self.format == "gguf" and not self.gguf:
            raise UserError("--format=gguf writes the GGUF file --gguf=FILE: pass it")
        if self.format == "hf" and (self.gguf or self.outtype != "f32" or self.converter_dir):
            raise UserError("--gguf, --outtype and --converter_dir go with --format=gguf")
        path = Path(self.hf_dir)
        exported = self.format == "gguf" and (path / "config.json").is_file()
        if path.exists() and (not path.is_dir() or any(path.iterdir())) and not exported:
            raise UserError(f"{path} exists and is not an empty folder; pass a new --hf_dir")


def main(argv: Sequence[str]) -> str:
    cfg = parse_args(ExportConfig, argv)  # validates
    hf_dir, lines = Path(cfg.hf_dir), []
    if not (hf_dir / "config.json").is_file():  # --format=hf, or a gguf from a new folder
        model, tok, source = resolver.load_model("resume", cfg.out_dir)
        arch = export(model.eval(), tok, hf_dir, cfg.dtype, cfg.check)
        files = ", ".join(sorted(p.name for p in hf_dir.iterdir()))
        lines.append(f"exported {source} as {arch} ({cfg.dtype}) to {hf_dir}: {files}")
    if cfg.format == "gguf":
        gguf.convert(hf_dir, Path(cfg.gguf), cfg.outtype, gguf.converter_dir(cfg.converter_dir))
        lines.append(f"wrote {cfg.gguf} from {hf_dir}")
    print("\n".join(lines), file=sys.stderr)
    return "\n".join(lines)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    run_cli(main)
