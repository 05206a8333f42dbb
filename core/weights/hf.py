"""Our recipe variants <-> transformers architectures: which class computes exactly our function, and the config and
state-dict maps both ways (docs/interop.md: the table of switches and classes, and what each map relies on).

    from core.weights import hf
    hf.architecture(model.config)                  # 'LlamaForCausalLM', or a UserError naming what no class holds
    hf_model = hf.to_transformers(model)           # a transformers model with our weights, same logits
    model = hf.from_transformers(hf_model)         # and back

A class is listed only where its forward is ours, switch by switch (the tests compare logits to 1e-5).
"""
import itertools
import os
import re
from dataclasses import replace
from pathlib import Path

import torch

from core.data.hf_tokenizer import load_hf_tokenizer
from core.data.tokenizer import GPT2Tokenizer, Tokenizer
from core.errors import UserError, first_line
from model import CHOICES, GPT, GPT2_HUB_NAMES, RECIPE_SWITCHES, GPTConfig, swiglu_hidden

# transformers' names for our two GELUs; gelu_pytorch_tanh is the same function as gelu_new.
HF_ACTIVATIONS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}


class ConversionError(UserError, ValueError):
    """A checkpoint or variant that has no exact counterpart on the other side (one line, what to do)."""


LLAMA_FAMILY = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "ArceeForCausalLM", "NemotronForCausalLM")
GATED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")  # SwiGLU's silu(gate) * up
ARCHITECTURES = ("GPT2LMHeadModel",) + LLAMA_FAMILY
# Our ungated MLP nonlinearities under transformers' ACT2FN names (gelu_pytorch_tanh is tanh-GELU).
UNGATED_ACTS = {"relu2": "relu2", ("gelu", "tanh"): "gelu_pytorch_tanh", ("gelu", "none"): "gelu"}
# Llama 3's scaled RoPE: our fields and transformers' rope_parameters keys, read both ways.
LLAMA3_ROPE = {"rope_factor": "factor", "rope_low_freq_factor": "low_freq_factor", "rope_high_freq_factor":
               "high_freq_factor", "rope_original_max_positions": "original_max_position_embeddings"}
# The values the nearest-recipe search may give each recipe switch: every choice of a named one or a
# bool, else GPT-2's default (a flip that changes nothing is never part of a smallest set).
FLIPS = {name: list(CHOICES.get(name) or ([False, True] if isinstance(default, bool) else [default]))
         for name, default in ((n, getattr(GPTConfig(), n)) for n in RECIPE_SWITCHES)}


# -----------------------------------------------------------------------------
# which class holds a variant

# Switches whose other values transformers' GPT-2 holds too (zero biases, either GELU, any epsilon), or
# that leave the function unchanged (an initialisation; RoPE's base without RoPE).
GPT2_HOLDS = ("bias", "gelu_approximate", "norm_eps", "zero_init_proj", "rope_base", "rope_type", *LLAMA3_ROPE)


def non_gpt2_fields(c: GPTConfig) -> list[str]:
    """The recipe switches set away from GPT-2, as 'name=value': what transformers' GPT-2 cannot hold."""
    gpt2 = GPTConfig()
    same = {"n_kv_head": c.kv_heads == c.n_head, "mlp_hidden": c.mlp_hidden in (None, 4 * c.n_embd),
            "head_dim": c.head_size * c.n_head == c.n_embd, "qkv_bias": c.qkv_bias in (None, c.bias)}
    return [f"{name}={getattr(c, name)!r}" for name in RECIPE_SWITCHES
            if name not in GPT2_HOLDS and not same.get(name, getattr(c, name) == getattr(gpt2, name))]


def _holds(c: GPTConfig) -> str | None:
    """The transformers class that computes exactly this variant, or None."""
    if c.logit_softcap is not None or c.unet_skips or c.value_embeds:  # no class has skips or value embeddings
        return None
    qkv_only = c.qkv_bias is not None and c.qkv_bias != c.bias  # q/k/v biases apart from the rest (Qwen2's)
    if c.pos_embedding == "learned":
        return None if non_gpt2_fields(c) else "GPT2LMHeadModel"
    arch = _rope_class(c, qkv_only)
    # Llama 3's scaled RoPE is held by the class of the models that use it (transformers' rope_type "llama3")
    return arch if c.rope_type == "default" or arch == "LlamaForCausalLM" else None


def _rope_class(c: GPTConfig, qkv_only: bool) -> str | None:
    if c.mlp == "swiglu" and c.norm == "rmsnorm":
        if c.qk_norm:
            return None if c.bias or c.qkv_bias else "Qwen3ForCausalLM"
        if qkv_only:
            return "Qwen2ForCausalLM" if c.qkv_bias else None  # q/k/v biases, none on o_proj or the MLP
        return "LlamaForCausalLM"
    if c.qk_norm or c.mlp == "swiglu" or qkv_only:
        return None
    return "ArceeForCausalLM" if c.norm == "rmsnorm" else "NemotronForCausalLM"


def architecture(c: GPTConfig) -> str:
    """The transformers class for this variant; a ConversionError naming the switches no class holds
    and the nearest recipes that do export."""
    arch = _holds(c)
    if arch is not None:
        return arch
    switches = non_gpt2_fields(c) or ["these switches"]
    raise ConversionError(f"no transformers architecture computes {', '.join(switches)}"
                          f"{' together' if len(switches) > 1 else ''}; "
                          f"nearest that exports: {'; or '.join(nearest_exportable(c))}")


def nearest_exportable(c: GPTConfig) -> list[str]:
    """The smallest sets of switch changes that make c exportable, each as 'a=x, b=y (-> Class)'."""
    options = [(name, value) for name, values in FLIPS.items() for value in values if getattr(c, name) != value]
    for size in (1, 2, 3):
        found = []
        for combo in itertools.combinations(options, size):
            arch = _holds(replace(c, **dict(combo))) if len({name for name, _ in combo}) == size else None  # one each
            if arch is not None:
                found.append(", ".join(f"{n}={v!r}" for n, v in combo) + f" (-> {arch})")
        if found:
            return found
    return ["the GPT-2 defaults (-> GPT2LMHeadModel)"]


# -----------------------------------------------------------------------------
# our model -> transformers


def hf_config(c: GPTConfig, eos_token_id: int | None = None, bos_token_id: int | None = None):
    """The transformers config of the class architecture(c) names, for the same function."""
    import transformers

    arch = architecture(c)
    if arch == "GPT2LMHeadModel":
        return transformers.GPT2Config(
            vocab_size=c.vocab_size, n_positions=c.block_size, n_embd=c.n_embd, n_layer=c.n_layer,
            n_head=c.n_head, activation_function="gelu_new" if c.gelu_approximate == "tanh" else "gelu",
            resid_pdrop=c.dropout, embd_pdrop=c.dropout, attn_pdrop=c.dropout, layer_norm_epsilon=c.norm_eps,
            tie_word_embeddings=True, bos_token_id=bos_token_id, eos_token_id=eos_token_id, architectures=[arch],
            n_ctx=c.block_size)  # GPT-2's original name for n_positions; llama.cpp's converter reads only it
    hidden = c.mlp_hidden or (swiglu_hidden(c.n_embd) if c.mlp == "swiglu" else 4 * c.n_embd)
    rope = {"rope_type": c.rope_type, "rope_theta": c.rope_base}
    if c.rope_type == "llama3":
        rope |= {theirs: getattr(c, ours) for ours, theirs in LLAMA3_ROPE.items()}
    act = "silu" if c.mlp == "swiglu" else UNGATED_ACTS[c.mlp if c.mlp == "relu2" else (c.mlp, c.gelu_approximate)]
    common = dict(
        vocab_size=c.vocab_size, hidden_size=c.n_embd, intermediate_size=hidden, num_hidden_layers=c.n_layer,
        num_attention_heads=c.n_head, num_key_value_heads=c.kv_heads, head_dim=c.head_size,
        max_position_embeddings=c.block_size, rope_parameters=rope, hidden_act=act,
        attention_bias=c.bias, attention_dropout=c.dropout, tie_word_embeddings=c.tie_embeddings,
        bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=None, architectures=[arch])
    if arch not in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):  # Qwen's MLPs have no biases
        common["mlp_bias"] = c.bias
    if arch == "Qwen2ForCausalLM":  # its q/k/v biases are fixed, not a config field
        del common["attention_bias"]
    if arch == "NemotronForCausalLM":  # which rotates only half the head by default
        common["rope_parameters"]["partial_rotary_factor"] = 1.0
    eps = {"norm_eps" if arch == "NemotronForCausalLM" else "rms_norm_eps": c.norm_eps}
    return getattr(transformers, arch.removesuffix("ForCausalLM") + "Config")(**common, **eps)


# -----------------------------------------------------------------------------
# transformers -> our model


def config_from_hf(hf_config, override_args: dict | None = None) -> GPTConfig:
    """Our GPTConfig for a transformers config; ConversionError for anything we would compute differently."""
    override_args = dict(override_args or {})
    if unknown := set(override_args) - {"dropout", "attn_backend"}:
        raise ConversionError(f"override_args may set only dropout and attn_backend, got {sorted(unknown)}")
    arch = (getattr(hf_config, "architectures", None) or [type(hf_config).__name__])[0]
    if arch in ("GPT2LMHeadModel", "GPT2Config"):
        return _config_from_gpt2(hf_config, override_args)
    if arch not in LLAMA_FAMILY:
        raise ConversionError(f"architecture {arch!r} is not supported; this repository loads "
                              f"{', '.join(ARCHITECTURES)}")
    return _config_from_llama(hf_config, arch, override_args)


def _config_from_gpt2(h, override_args) -> GPTConfig:
    unsupported = {
        "activation_function": h.activation_function not in HF_ACTIVATIONS,
        "n_inner": h.n_inner not in (None, 4 * h.n_embd),
        "scale_attn_weights": not h.scale_attn_weights,
        "scale_attn_by_inverse_layer_idx": h.scale_attn_by_inverse_layer_idx,
        "reorder_and_upcast_attn": getattr(h, "reorder_and_upcast_attn", False),
        "tie_word_embeddings": not getattr(h, "tie_word_embeddings", True),
    }
    for field, bad in unsupported.items():
        if bad:
            raise ConversionError(f"unsupported GPT-2 variant: {field}={getattr(h, field)!r}")
    return GPTConfig(block_size=h.n_positions, vocab_size=h.vocab_size, n_layer=h.n_layer, n_head=h.n_head,
                     n_embd=h.n_embd, bias=True, norm_eps=h.layer_norm_epsilon,
                     gelu_approximate=HF_ACTIVATIONS[h.activation_function], **override_args)


def _config_from_llama(h, arch: str, override_args) -> GPTConfig:
    rope = dict(getattr(h, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", "default")
    head_dim = getattr(h, "head_dim", None) or h.hidden_size // h.num_attention_heads
    act = h.hidden_act
    mlp_bias = getattr(h, "mlp_bias", False)
    attention_bias = getattr(h, "attention_bias", False)  # Qwen2's q/k/v biases are not a field
    ungated = {v: k for k, v in UNGATED_ACTS.items()}
    gated = arch in GATED
    problems = [
        (rope_type not in ("default", "llama3"), f"rope_type={rope_type!r} (scaled RoPE)"),
        (rope_type == "llama3" and arch != "LlamaForCausalLM", "rope_type='llama3' outside LlamaForCausalLM"),
        (rope.get("partial_rotary_factor", 1.0) != 1.0, f"partial_rotary_factor={rope.get('partial_rotary_factor')}"),
        (act != "silu" if gated else act not in ungated, f"hidden_act={act!r}"),
        (arch not in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and attention_bias != mlp_bias,
         f"attention_bias={attention_bias} with mlp_bias={mlp_bias}"),
        (arch == "Qwen3ForCausalLM" and h.attention_bias, "attention_bias=True"),
        (getattr(h, "use_sliding_window", False), "use_sliding_window=True"),
        (getattr(h, "pretraining_tp", 1) != 1, f"pretraining_tp={getattr(h, 'pretraining_tp', 1)}"),
    ]
    for bad, what in problems:
        if bad:
            raise ConversionError(f"unsupported {arch} variant: {what}; this repository computes only the plain form")
    mlp, approx = ("swiglu", "tanh") if gated else (("relu2", "tanh") if act == "relu2" else ungated[act])
    eps = h.norm_eps if arch == "NemotronForCausalLM" else h.rms_norm_eps
    scaling = {} if rope_type == "default" else {"rope_type": "llama3"} | {  # each as our field's type
        ours: type(getattr(GPTConfig, ours))(rope[theirs]) for ours, theirs in LLAMA3_ROPE.items()}
    return GPTConfig(
        block_size=h.max_position_embeddings, vocab_size=h.vocab_size, n_layer=h.num_hidden_layers,
        n_head=h.num_attention_heads, n_embd=h.hidden_size, bias=bool(attention_bias),
        qkv_bias=True if arch == "Qwen2ForCausalLM" else None, **scaling,
        head_dim=None if head_dim * h.num_attention_heads == h.hidden_size else head_dim,
        n_kv_head=None if h.num_key_value_heads == h.num_attention_heads else h.num_key_value_heads,
        pos_embedding="rope", rope_base=float(rope.get("rope_theta", 10000.0)),
        norm="layernorm" if arch == "NemotronForCausalLM" else "rmsnorm", qk_norm=arch == "Qwen3ForCausalLM",
        mlp=mlp, gelu_approximate=approx, tie_embeddings=bool(getattr(h, "tie_word_embeddings", False)),
        norm_eps=float(eps), mlp_hidden=h.intermediate_size, **override_args)


@torch.no_grad()
def from_transformers(hf, override_args: dict | None = None) -> GPT:
    """Our GPT with the weights of a transformers model of one of ARCHITECTURES."""
    model = GPT(config_from_hf(hf.config, override_args))
    load_hf_state_dict(model, hf.state_dict())  # detached tensors
    return model


# -----------------------------------------------------------------------------
# the weights, both ways: transformers' names over views of our tensors

# GPT-2 stores these as Conv1D, an nn.Linear with the weight transposed: (in, out).
CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# The Llama family's names for our modules (in layer i: model.layers.i. for transformer.h.i.); a fused one's
# rows split into its list in order (an ungated MLP's c_fc is up_proj alone).
LLAMA_NAMES = {
    "transformer.wte": ["model.embed_tokens"], "transformer.ln_f": ["model.norm"], "lm_head": ["lm_head"],
    "ln_1": ["input_layernorm"], "ln_2": ["post_attention_layernorm"],
    "attn.c_attn": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], "attn.c_proj": ["self_attn.o_proj"],
    "attn.q_norm": ["self_attn.q_norm"], "attn.k_norm": ["self_attn.k_norm"],
    "mlp.c_fc": ["mlp.gate_proj", "mlp.up_proj"], "mlp.c_proj": ["mlp.down_proj"],
}


def _views(model: GPT) -> dict[str, torch.Tensor]:
    """transformers' name -> our tensor in its layout, a view of ours (so copying into it loads ours)."""
    c, arch = model.config, architecture(model.config)
    views = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_embeddings:
            continue  # transformers ties it on load
        if arch == "GPT2LMHeadModel":
            views[name] = t.t() if name.endswith(CONV1D_SUFFIXES) else t
            continue
        module, kind = name.rsplit(".", 1)
        layer, inner = re.fullmatch(r"(?:transformer\.h\.(\d+)\.)?(.+)", module).groups()
        parts = LLAMA_NAMES[inner][1:] if inner == "mlp.c_fc" and c.mlp != "swiglu" else LLAMA_NAMES[inner]
        sizes = [c.attn_width] + [c.kv_heads * c.head_size] * 2 if inner == "attn.c_attn" else t.size(0) // len(parts)
        for part, view in zip(parts, t.split(sizes)):
            views[f"model.layers.{layer}.{part}.{kind}" if layer else f"{part}.{kind}"] = view
    return views


def _shift(arch: str, name: str) -> float:
    """Nemotron's LayerNorm1P scales by (1 + weight): its weight is ours minus one."""
    return 1.0 if arch == "NemotronForCausalLM" and name.endswith("norm.weight") else 0.0


def to_transformers(model: GPT, eos_token_id: int | None = None, bos_token_id: int | None = None):
    """A transformers model (float32, eval mode) computing the same function as ours, with our weights."""
    import transformers

    config = hf_config(model.config, eos_token_id, bos_token_id)
    arch = config.architectures[0]
    hf = getattr(transformers, arch)(config)
    theirs = hf.state_dict()
    state = {name: t.float() - _shift(arch, name) for name, t in _views(model).items()}
    if not model.config.bias:  # GPT-2's Linears and LayerNorms, Nemotron's LayerNorm1P: always a bias
        state |= {n: torch.zeros_like(t) for n, t in theirs.items() if n.endswith(".bias") and n not in state}
    missing = [n for n in theirs if n not in state and not (n == "lm_head.weight" and config.tie_word_embeddings)]
    unexpected = [n for n in state if n not in theirs]
    if missing or unexpected:  # a map out of step with transformers: a bug here, never the user's
        raise RuntimeError(f"{arch} map: missing {missing[:3]}, unexpected {unexpected[:3]}")
    hf.load_state_dict(state, strict=False)
    return hf.float().eval()


@torch.no_grad()
def load_hf_state_dict(model: GPT, theirs: dict[str, torch.Tensor]) -> None:
    """Copy a transformers state dict (architecture(model.config)'s names) into our model, in place."""
    arch, views = architecture(model.config), _views(model)
    if missing := sorted(n for n in views if n not in theirs):
        raise ConversionError(f"{arch} checkpoint lacks {missing[:5]}")
    if unheld := [n for n, t in theirs.items() if n.endswith(".bias") and n not in views and t.any()]:
        raise ConversionError(f"{arch} checkpoint has biases where this model has none ({', '.join(unheld[:3])}); "
                              "this repository ties the norms' biases to the attention/MLP ones")
    for name, view in views.items():
        view.copy_(theirs[name] + _shift(arch, name))


def folder_config(directory: str | os.PathLike, override_args: dict | None = None) -> GPTConfig:
    """Our GPTConfig for a folder transformers' save_pretrained wrote (or export.py), read from its
    config.json alone; ConversionError, one line, for a missing, unreadable or unsupported one."""
    import transformers

    directory = str(directory)
    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise ConversionError(f"{directory} has no config.json; pass a folder written by save_pretrained "
                              "or export.py")
    try:
        config = transformers.AutoConfig.from_pretrained(directory)
    except (OSError, ValueError, KeyError) as e:
        raise ConversionError(f"{directory}/config.json cannot be read by transformers: {first_line(e)}") from None
    return config_from_hf(config, override_args)


def from_folder(directory: str | os.PathLike, override_args: dict | None = None, dtype=torch.float32) -> GPT:
    """Our GPT with the weights of a transformers folder; ConversionError, one line, for anything
    missing, damaged or unsupported."""
    import transformers

    folder_config(directory, override_args)  # refuse an unsupported architecture before reading any weights
    try:
        hf, info = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype,
                                                                     output_loading_info=True)
    except Exception as e:  # a missing or truncated weights file surfaces as OSError, SafetensorError, ...
        raise ConversionError(f"cannot load the weights in {directory}: {type(e).__name__}: {first_line(e)}; "
                              "the folder is incomplete or damaged, write it again") from None
    if info["missing_keys"]:  # transformers would start those from random values, with only a warning
        raise ConversionError(f"the weights in {directory} lack {sorted(info['missing_keys'])[:3]}; "
                              "the folder is incomplete or damaged, write it again")
    return from_transformers(hf, override_args)


def folder_tokenizer(directory: str | os.PathLike, config: GPTConfig) -> Tokenizer:
    """The tokenizer of a transformers folder of architecture `config`: its tokenizer.json, or GPT-2's BPE
    for a GPT-2 folder without one (hf.to_transformers(model).save_pretrained writes only the weights)."""
    directory = Path(directory)
    if (directory / "tokenizer.json").is_file():
        return load_hf_tokenizer(directory)
    if architecture(config) == "GPT2LMHeadModel":
        return GPT2Tokenizer()
    raise ConversionError(f"{directory} has no tokenizer.json; save the model's tokenizer beside it "
                          "(tokenizer.save_pretrained(folder) in transformers)")


def from_hub(name: str, override_args: dict | None = None) -> GPT:
    """GPT-2's weights from the Hugging Face hub's cache, or downloaded (check_hub first)."""
    if name not in GPT2_HUB_NAMES:
        raise ValueError(f"{name!r} is neither a directory nor one of {GPT2_HUB_NAMES}")
    cached = check_hub(name)
    from transformers import GPT2LMHeadModel

    return from_transformers(GPT2LMHeadModel.from_pretrained(name, local_files_only=cached), override_args)


def check_hub(name: str) -> bool:
    """Whether the hub model `name` is in the Hugging Face cache (then it loads from there, never asking the hub);
    if not, that the hub answers one request. A UserError at once otherwise (HF_HUB_OFFLINE set, or no network):
    transformers would first retry for half a minute, printing each try."""
    from huggingface_hub import constants, model_info, try_to_load_from_cache

    if all(isinstance(try_to_load_from_cache(name, f), str) for f in ("config.json", "model.safetensors")):
        return True
    missing = f"'{name}' is not in the Hugging Face cache ({constants.HF_HUB_CACHE})"
    use = "or pass a folder written by save_pretrained (--init_from=DIR)"
    if constants.HF_HUB_OFFLINE:
        raise UserError(f"{missing} and HF_HUB_OFFLINE is set: download it once with the network, {use}")
    try:
        model_info(name, timeout=10)
    except Exception as e:  # noqa: BLE001 - no network, a proxy's refusal, a hub error: one line
        raise UserError(f"{missing} and the hub at {constants.ENDPOINT} does not answer ({first_line(e)}); connect "
                        f"to the network, {use}") from None
    return False
