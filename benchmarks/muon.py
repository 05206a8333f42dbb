"""Muon's step alone: one optimizer step on the hidden matrices of the loop section's recipe model.

The model: loop_config + recipe_config, with --muon_shape on top; fixed random gradients. Each row is one step:
torch.optim.Muon (bf16, one matrix at a time) against BatchedMuon in bf16 and float32 (each shape's matrices as one
batch); the row build_optimizer picks on this device is marked.
"""
import dataclasses

import torch

from benchmarks import markdown
from benchmarks.common import median_time, model_text, num, read_recipe, spec_list
from core import runtime
from core.training import optim
from model import GPT, GPTConfig


@dataclasses.dataclass
class Settings:
    muon_shape: str = ""       # key=value pairs on that model, e.g. "n_layer=2,n_head=12,n_embd=768" (GPT-2's width)


MUON_STEPS = {  # what core.training.optim.build_optimizer chooses between, per device
    "torch.optim.Muon, bf16": (torch.optim.Muon, {}),
    "BatchedMuon, bf16": (optim.BatchedMuon, {"ns_dtype": torch.bfloat16}),
    "BatchedMuon, float32": (optim.BatchedMuon, {"ns_dtype": torch.float32}),
}


def measure(cfg, rt: runtime.Runtime) -> dict:
    tcfg = read_recipe([cfg.loop_config, cfg.recipe_config, *spec_list(cfg.muon_shape)], "--muon_shape")
    torch.manual_seed(cfg.seed)
    model = GPT(GPTConfig(**tcfg.model_args(), vocab_size=65)).to(rt.device)  # the vocab only sizes wte and the head
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    chosen = optim.build_optimizer(model, "muon", tcfg.learning_rate, 0.0, (0.9, 0.95), rt.device_type).optimizers["muon"]
    hidden = [p for _, p in optim.split_params(model)["hidden"]]
    rows = []
    for name, (muon_class, kwargs) in MUON_STEPS.items():
        opt = muon_class(hidden, lr=tcfg.muon_lr, momentum=tcfg.muon_momentum, adjust_lr_fn="original",
                         ns_steps=tcfg.muon_ns_steps, **kwargs)
        rows.append({"muon": name, "step_ms": median_time(opt.step, cfg.warmup, cfg.repeats, rt.synchronize) * 1e3,
                     "chosen": type(chosen) is muon_class and getattr(chosen, "ns_dtype", None) == kwargs.get("ns_dtype")})
    return {"model": model_text(model.config, tcfg.batch_size), "matrices": len(hidden),
            "shapes": sorted({tuple(p.shape) for p in hidden}), "native_bf16": runtime.native_bf16(rt.device),
            "rows": rows}


def table(r: dict) -> str:
    rows = [[row["muon"] + (" (chosen here)" if row["chosen"] else ""), num(row["step_ms"], 2)] for row in r["rows"]]
    shapes = ", ".join("x".join(map(str, s)) for s in r["shapes"])
    return (f"### Muon's step alone\n{r['model']}: {r['matrices']} hidden matrices ({shapes}); bf16 native here: "
            f"{'yes' if r['native_bf16'] else 'no'}\n\n" + markdown.table(["Muon", "ms / step"], rows))
