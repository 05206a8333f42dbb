"""A run as a transformers folder (export.py's): the class that computes its recipe, its weights checked against
ours, the tokenizer, generation_config.json; written whole or not at all.
"""
from pathlib import Path

import torch

from core.data.chat import JINJA_TEMPLATE, ChatTemplate
from core.data.hf_tokenizer import save_hf_tokenizer
from core.data.tokenizer import HFTokenizer, Tokenizer
from core.errors import UserError
from core.fileio import atomic_dir, space_for
from core.runtime import DTYPES
from core.weights import hf, resolver
from model import GPT

CHECK_TOKENS = 1024  # the longest sequence the logits are compared on (Llama 3.2's 131,072 would take minutes)


def export(model: GPT, tok: Tokenizer, directory: str | Path, dtype: str = "float32", check: bool = True) -> str:
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
    # What transformers' generate needs beyond the weights: the ids that end a reply (a chat model's <|end|>
    # first, then the end-of-text id) and the context length.
    eos, chat = tok.eot_token, ChatTemplate.for_tokenizer(tok)
    gen = {"eos_token_id": eos if chat is None else [chat.end_of_turn] + ([] if eos is None else [eos]),
           "pad_token_id": eos, "bos_token_id": getattr(tok, "bos_token", None), "max_length": model.config.block_size}
    hf_model = hf.to_transformers(model.float(), eos, gen["bos_token_id"])
    if check:  # on one sequence of the full context, or of CHECK_TOKENS
        idx = torch.randint(0, model.config.vocab_size, (1, min(model.config.block_size, CHECK_TOKENS)),
                            generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            diff = (model.float()(idx)[0] - hf_model(idx).logits).abs().max().item()
        if not diff <= 1e-4:
            raise UserError(f"the exported model's logits differ from ours by {diff:.3g}; the folder was not written")
    hf_model.to(DTYPES[dtype])
    needed = sum(p.numel() * p.element_size() for p in hf_model.parameters())
    # Written whole or not at all: a full disk leaves no half folder that looks like a model.
    with space_for(directory, needed, "nothing was written there: free space and export again"), \
            atomic_dir(directory) as tmp:
        hf_model.save_pretrained(tmp)
        GenerationConfig(**gen).save_pretrained(tmp)
        # a chat tokenizer carries the template, so apply_chat_template renders our ids
        save_hf_tokenizer(tok, tmp, model.config.block_size, chat_template=None if chat is None else JINJA_TEMPLATE)
    return arch
