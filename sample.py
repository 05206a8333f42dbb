"""Sample from a trained model: a checkpoint in out_dir, or GPT-2 weights. Decodes with the KV cache.

    python sample.py --out_dir=out-shakespeare-char                           # 10 samples from its ckpt.pt
    python sample.py --out_dir=out-shakespeare-char --start="ROMEO:" --num_samples=1   # streams as it decodes
    python sample.py --out_dir=out-shakespeare-char --start=FILE:prompt.txt --temperature=0   # greedy
    python sample.py --init_from=gpt2 --start="Hello, I'm a language model," --top_p=0.9
    python sample.py --init_from=path/to/dir   # a transformers folder: GPT-2, Llama, Qwen3, ... (docs/interop.md)
    python sample.py --out_dir=out-sft-tasks-char --chat           # talk to a chat fine-tune, turn by turn
    python sample.py --out_dir=out-sft-tasks-char --chat --system="Be brief." --prompt="reverse: abc" --temperature=0

The samples go to stdout, each followed by a line of dashes; what was loaded and the tokens/s go to stderr, so
`> samples.txt` keeps only the text. --chat needs a chat fine-tune (docs/chat.md): the reply streams until the model
ends its turn; Ctrl-C stops a reply (what was said stays), Ctrl-D or Ctrl-C at the prompt quits. With --prompt= it
answers that one message on stdout and exits.
"""
from core.errors import quiet_start
quiet_start(__name__)  # as a script: Ctrl-C during the imports below (seconds) is one line

import dataclasses
import os
import sys
import time
from typing import Sequence

import torch

from core import runtime
from core.config import parse_args
from core.data.chat import ChatTemplate
from core.data.tokenizer import StreamDecoder, Tokenizer, encode_prompt, read_prompt
from core.decoding.decode import check_sampling_args, generate, generate_stream, inference_model, window_shift
from core.decoding.quantize import check_quantize, quantized_note
from core.decoding.replies import stream_reply
from core.errors import UserError, run_cli
from core.weights import resolver
from model import GPT

SEPARATOR = "---------------"
DOCUMENT_END = "[end of text]"  # an end-of-text id inside a sample that goes on past it (--stop_at_eot=False)


@dataclasses.dataclass
class SampleConfig:
    init_from: str = "resume"        # 'resume' (out_dir/ckpt.pt), a GPT-2 name, or a transformers folder
    out_dir: str = "out"             # where init_from=resume finds ckpt.pt
    start: str = "\n"                # the prompt, or FILE:path to read it from a file
    num_samples: int = 10            # decoded together, as one batch
    max_new_tokens: int = 500
    temperature: float = 0.8         # < 1 sharper, > 1 more random; 0 is greedy (always the most likely token)
    top_k: int | None = 200          # sample among the k most likely tokens; None: all
    top_p: float | None = None       # then among the fewest tokens holding this probability; None: all
    seed: int = 1337                 # the same seed, model, prompt, flags and device give the same text
    stop_at_eot: bool | None = None  # end a sample at the vocabulary's end of text (<|endoftext|>; a char vocabulary
                                     # prepared here has one too); False: go on, each shown as a line [end of text];
                                     # None: True where the vocabulary has one
    truncate_prompt: bool = False    # a prompt longer than the context keeps its last block_size tokens
    use_cache: bool = True           # False recomputes the whole context for every token (slow; for checks)
    window_shift: int | None = None  # past block_size the window slides this many tokens at once (decode.generate);
                                     # None: block_size // 2, so the cache stays fast; 1: nanoGPT's exact sliding
    stream: bool | None = None       # print tokens as they are produced; None: only when num_samples == 1
    device: str = "auto"             # auto, cpu, cuda, cuda:N, mps
    dtype: str = "auto"              # auto, float32, bfloat16, float16
    threads: int = 0                 # torch's CPU threads; 0: torch's default, one per core (docs/performance.md)
    quantize: str = "none"           # int8 | int4: the weights quantized once, CPU only (core/decoding/quantize.py)
    compile: bool = False            # torch.compile the model (recompiles for each new input shape at first)
    chat: bool = False               # a conversation with a chat fine-tune (core/data/chat.py's template)
    system: str | None = None        # chat: the system message
    prompt: str | None = None        # chat: answer this one user message (or FILE:path) and exit

    def validate(self) -> None:
        check_quantize(self.quantize)
        try:
            check_sampling_args(self.temperature, self.top_k, self.top_p)
        except ValueError as e:
            raise UserError(str(e)) from None
        if self.num_samples < 1:
            raise UserError(f"num_samples must be at least 1, got {self.num_samples}")
        if self.max_new_tokens < 0:
            raise UserError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.stream and self.num_samples != 1:
            raise UserError(f"stream=True prints one sample as it is decoded; use --num_samples=1 "
                            f"(got {self.num_samples}) or --stream=False")
        resolver.check_init_from(self.init_from)
        if not self.chat and (self.system is not None or self.prompt is not None):
            raise UserError("--system and --prompt are for chat; add --chat (or use --start= for plain text)")


def text_of(ids: list[int], tok: Tokenizer, stop: bool) -> str:
    """A sample's text: up to its first end-of-text id when it stops there, else each one as a line DOCUMENT_END."""
    ends = [-1] + [i for i, t in enumerate(ids) if t == tok.eot_token] + [len(ids)]
    docs = [tok.decode(ids[a + 1:b]) for a, b in zip(ends, ends[1:])]
    return docs[0] if stop else f"\n{DOCUMENT_END}\n".join(docs)


def write_stream(tokens, tok: Tokenizer, prompt: str, stop: bool) -> int:
    """Print one sample as `tokens` yields its ids, each (1, 1); returns how many were generated."""
    print(prompt, end="", flush=True)
    decoder, steps = StreamDecoder(tok), 0
    for steps, token in enumerate(tokens, 1):
        token_id = token.item()
        if token_id == tok.eot_token and stop:
            break
        text = (decoder.flush() + f"\n{DOCUMENT_END}\n") if token_id == tok.eot_token else decoder.push(token_id)
        print(text, end="", flush=True)
    print(decoder.flush() + "\n" + SEPARATOR, flush=True)
    return steps


def run_chat(cfg: SampleConfig, model: GPT, tok: Tokenizer, source: str, rt: runtime.Runtime) -> None:
    """One reply to --prompt, or a conversation in the terminal."""
    template = ChatTemplate.for_tokenizer(tok)
    if template is None:
        raise UserError(f"{source} has no chat tokens: it is a base model. Fine-tune it on a chat set first "
                        f"(data/chat/prepare.py, then train.py --init_from=its out_dir; see docs/chat.md)")
    model, fixed = inference_model(model, rt, cfg.compile, cfg.quantize)
    sampling = dict(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, use_cache=cfg.use_cache,
                    generator=torch.Generator(device=rt.device).manual_seed(cfg.seed), steps=fixed)
    messages = [{"role": "system", "content": cfg.system}] if cfg.system is not None else []
    if cfg.prompt is not None:
        chat_turn(model, template, messages + [{"role": "user", "content": read_prompt(cfg.prompt)}], cfg, sampling)
        return
    print(f"chatting with {source}: Enter sends a message; Ctrl-C stops a reply; Ctrl-D or Ctrl-C here quits",
          file=sys.stderr)
    while True:
        try:
            text = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return
        if not text.strip():
            continue
        turn = messages + [{"role": "user", "content": text}]
        try:
            answer = chat_turn(model, template, turn, cfg, sampling)
        except UserError as e:  # e.g. a character outside a char vocabulary: this message only
            print(f"error: {e}", file=sys.stderr)
            continue
        if answer:  # an empty reply leaves the exchange out: a conversation cannot hold an empty assistant turn
            messages = turn + [{"role": "assistant", "content": answer}]


def chat_turn(model: GPT, template: ChatTemplate, messages: list[dict], cfg: SampleConfig, sampling: dict) -> str:
    """Stream the assistant's reply to `messages` on stdout; Ctrl-C stops it early. Returns its text."""
    block_size = model.config.block_size
    prompt, dropped = template.fit_prompt(messages, block_size - 1)  # room for at least one token of reply
    if dropped:
        print(f"note: the conversation is longer than the model's {block_size}-token context; "
              f"left out its first {dropped} message(s)", file=sys.stderr)
    decoder, ids = StreamDecoder(template.tok), []
    try:
        for token_id in stream_reply(model, template, prompt, min(cfg.max_new_tokens, block_size - len(prompt)),
                                     **sampling):
            ids.append(token_id)
            print(decoder.push(token_id), end="", flush=True)
    except KeyboardInterrupt:  # stops this reply only
        print(" [stopped]", end="", file=sys.stderr)
    print(decoder.flush(), flush=True)
    return template.tok.decode(ids)


def main(argv: Sequence[str]) -> None:
    cfg = parse_args(SampleConfig, argv)
    rt = runtime.setup(cfg.device, cfg.dtype, threads=cfg.threads)
    model, tok, source = resolver.load_model(cfg.init_from, cfg.out_dir)
    if cfg.chat:
        return run_chat(cfg, model, tok, source, rt)
    stop = tok.eot_token is not None if cfg.stop_at_eot is None else cfg.stop_at_eot
    if stop and tok.eot_token is None:
        raise UserError("stop_at_eot=True needs an end-of-text token, and this checkpoint's char vocabulary has "
                        "none; use --stop_at_eot=False")
    text = read_prompt(cfg.start)
    context = encode_prompt(tok, text, model.config.block_size, cfg.truncate_prompt)
    try:
        shift = window_shift(cfg.window_shift, model.config.block_size)
    except ValueError as e:
        raise UserError(str(e)) from None
    if len(tok.encode(text)) > len(context):
        print(f"note: kept the prompt's last {len(context)} tokens (--truncate_prompt=True)", file=sys.stderr)
    shown_prompt = tok.decode(context) if text else ""  # not the <|endoftext|> an empty prompt starts from

    model, fixed = inference_model(model, rt, cfg.compile, cfg.quantize)
    print(f"sampling from {source}: {model.get_num_params() / 1e6:.2f}M parameters, "
          f"{tok.meta()['tokenizer']} tokenizer, {rt.device} {rt.dtype}{quantized_note(cfg.quantize)}", file=sys.stderr)

    torch.manual_seed(cfg.seed)
    generator = torch.Generator(device=rt.device).manual_seed(cfg.seed)
    idx = torch.tensor([context] * cfg.num_samples, dtype=torch.long, device=rt.device)  # (B, T)
    args = dict(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                use_cache=cfg.use_cache, generator=generator, eot_token=tok.eot_token if stop else None,
                window_shift=shift, vocab_size=tok.vocab_size,  # a padded vocabulary's extra ids are never drawn
                steps=fixed)
    stream = cfg.stream if cfg.stream is not None else cfg.num_samples == 1
    warmup = ""
    if cfg.compile and cfg.max_new_tokens:
        # Compiling takes seconds to minutes; a short run with its own generator does it before the clock starts.
        t0 = time.perf_counter()
        generate(model, idx, **(args | dict(max_new_tokens=min(3, cfg.max_new_tokens),
                                     generator=torch.Generator(device=rt.device).manual_seed(0))))
        rt.synchronize()
        warmup = f"; compiling took {time.perf_counter() - t0:.1f}s before, not counted"
    try:
        t0 = time.perf_counter()
        if stream:
            steps = write_stream(generate_stream(model, idx, **args), tok, shown_prompt, stop)
        else:
            rows = generate(model, idx, **args)[:, idx.size(1):].tolist()  # (B, steps)
            print("".join(f"{shown_prompt}{text_of(r, tok, stop)}\n{SEPARATOR}\n" for r in rows), end="", flush=True)
            steps = len(rows[0])
        rt.synchronize()
        dt = time.perf_counter() - t0
    except BrokenPipeError:
        # The reader went away (`python sample.py | head`): stop quietly, and point stdout at
        # /dev/null so that Python's own flush at exit does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return
    total = cfg.num_samples * steps
    print(f"{total} tokens ({cfg.num_samples} x {steps}) in {dt:.2f}s: {total / max(dt, 1e-9):.1f} tokens/s "
          f"({'KV cache' if cfg.use_cache else 'no cache'}{warmup})", file=sys.stderr)


if __name__ == "__main__":
    run_cli(main)
