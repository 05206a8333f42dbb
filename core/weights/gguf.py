"""An exported folder as a GGUF file for llama.cpp, through llama.cpp's own converter (export.py --format=gguf;
bash scripts/fetch_llama_converter.sh unpacks it once). The converter knows a BPE's pre-tokenizer by a hash of one
probe's ids; a BPE trained here splits with Llama 3's regex, which this names "llama-bpe" in its place, refusing any
other (docs/interop.md, "Another byte-level BPE").
"""
import json
import os
import runpy
import sys
from pathlib import Path

from core.data.tokenizer import SPLIT_PATTERN
from core.errors import UserError

CONVERTER_VERSION = "0.3.36"  # llama-cpp-python's source package, as scripts/fetch_llama_converter.sh fetches it
# Llama 3's split regex (the one train_bpe uses), as its tokenizer.json spells it: llama.cpp's pre-tokenizer
# "llama-bpe" (src/llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_LLAMA3) implements it.
PRE_TOKENIZERS = {SPLIT_PATTERN: "llama-bpe"}


def converter_dir(given: str = "") -> Path:
    """Where convert_hf_to_gguf.py is unpacked: given, $LLAMA_CPP_CONVERTER_DIR, or the fetch script's cache."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nanogpt"
    return Path(given or os.environ.get("LLAMA_CPP_CONVERTER_DIR") or cache / f"llama.cpp-{CONVERTER_VERSION}")


def pre_tokenizer_name(hf_dir: Path) -> str | None:
    """llama.cpp's name for the split regex of the folder's tokenizer.json, or None to leave the converter's
    hash lookup be (GPT-2's BPE, whose ByteLevel pre-tokenizer holds no Split)."""
    path = hf_dir / "tokenizer.json"
    pre = (json.loads(path.read_text(encoding="utf-8")).get("pre_tokenizer") if path.is_file() else None) or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    regexes = [s["pattern"]["Regex"] for s in steps if s.get("type") == "Split" and "Regex" in (s.get("pattern") or {})]
    if not regexes:
        return None
    if len(regexes) == 1 and regexes[0] in PRE_TOKENIZERS:
        return PRE_TOKENIZERS[regexes[0]]
    raise UserError(f"{path} splits text with {regexes[0]!r}, which no llama.cpp pre-tokenizer here is known to "
                    "implement; only Llama 3's regex ('llama-bpe') converts")


def convert(hf_dir: Path, out: Path, outtype: str, converter: Path) -> None:
    """hf_dir -> the GGUF file out: convert_hf_to_gguf.py run in this process, with the pre-tokenizer named where
    the folder's regex is known."""
    script = converter / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise UserError(f"llama.cpp's converter is not at {converter}; run bash scripts/fetch_llama_converter.sh "
                        "(or set LLAMA_CPP_CONVERTER_DIR to its unpack)")
    name = pre_tokenizer_name(hf_dir)
    sys.path[:0] = [str(converter), str(converter / "gguf-py"), str(converter / "site")]
    if name is not None:
        from conversion import base  # the converter's package, now on the path

        base.TextModel.get_vocab_base_pre = lambda self, tokenizer: name
    if json.loads((hf_dir / "config.json").read_text()).get("bos_token_id") is None:
        # The GGUF says add_bos_token=false for a folder with no start token (a trained BPE's). Left unsaid,
        # llama.cpp's llama-bpe pre-tokenizer adds one by default, with its default id 11 (GPT-2's ","), before
        # every prompt; the converter writes the flag only where tokenizer_config.json or a post-processor sets it.
        import gguf  # the converter's gguf-py, now on the path

        add_to_gguf = gguf.SpecialVocab.add_to_gguf

        def add(self, gw, quiet: bool = False) -> None:
            self.add_special_token.setdefault("bos", False)
            add_to_gguf(self, gw, quiet)

        gguf.SpecialVocab.add_to_gguf = add
    sys.argv = [str(script), str(hf_dir), "--outfile", str(out), "--outtype", outtype]
    runpy.run_path(str(script), run_name="__main__")
    if not out.is_file():
        raise UserError(f"llama.cpp's converter wrote no {out}; its messages above say why")
