"""A chat model's replies: the chat template's prompts (core/data/chat.py) through generate and generate_stream.

sample.py streams a reply (stream_reply), eval.py's held-out conversations take it whole (reply), and rl.py's
samples and eval.py's checked tasks are n replies from one batched generate (sample_replies).
"""
import torch

from core.data.chat import ChatTemplate
from core.decoding.decode import generate, generate_stream


def stream_reply(model, template: ChatTemplate, prompt: list[int], max_new_tokens: int, **sampling):
    """Yield the reply's token ids to `prompt` (render_prompt's ids) as they are sampled, stopping
    before <|end|> (or any role token) or after max_new_tokens. `sampling`: decode.generate_stream's
    temperature, top_k, top_p, generator, use_cache. Ids past the tokenizer's (a padded vocabulary's
    unused rows) are never drawn."""
    device = model.transformer.wte.weight.device
    idx = torch.tensor([prompt], dtype=torch.long, device=device)  # (1, T)
    for token in generate_stream(model, idx, max_new_tokens, eot_token=template.end_of_turn,
                                 vocab_size=template.tok.vocab_size, **sampling):
        token_id = token.item()
        if token_id in template.stop_tokens:
            return
        yield token_id


def reply(model, template: ChatTemplate, messages, max_new_tokens: int, **sampling) -> str:
    """The assistant's whole reply to `messages` (ending in a user turn), as text."""
    prompt, _ = template.fit_prompt(messages, model.config.block_size - 1)
    budget = min(max_new_tokens, model.config.block_size - len(prompt))
    return template.tok.decode(list(stream_reply(model, template, prompt, budget, **sampling)))


def sample_replies(model, template: ChatTemplate, prompt: list[int], n: int, max_new_tokens: int,
                   **sampling) -> list[list[int]]:
    """n replies to `prompt` (render_prompt's ids) in one batched generate with the KV cache: each reply's ids
    up to and including the token that ended it (<|end|>, a role token, <|endoftext|>), or max_new_tokens ids
    when none did. `sampling`: decode.Sampling's temperature, top_k, top_p, generator."""
    device = model.transformer.wte.weight.device
    idx = torch.tensor([prompt] * n, dtype=torch.long, device=device)  # (n, T)
    rows = generate(model, idx, max_new_tokens, eot_token=template.end_of_turn, vocab_size=template.tok.vocab_size,
                    **sampling)[:, len(prompt):].tolist()  # (n, <= max_new_tokens)
    return [_through_stop(row, template.stop_tokens) for row in rows]


def sample_seed(seed: int, *path: int) -> int:
    """The seed of one batch of replies, from the run's seed and where the batch is (an iteration, a problem's
    index): the same replies on any number of processes and after any resume, with nothing to save. A seed the
    server takes too (its `seed` field), so one reply can be asked of it and compared."""
    mixed = seed
    for part in path:
        mixed = (mixed * 1_000_003 + part) % (1 << 62)
    return mixed


def sampler(seed: int, *path: int, device="cpu") -> torch.Generator:
    """A generator seeded with sample_seed(seed, *path)."""
    return torch.Generator(device=device).manual_seed(sample_seed(seed, *path))


def _through_stop(ids: list[int], stop: set[int]) -> list[int]:
    end = next((i for i, t in enumerate(ids) if t in stop), None)
    return ids if end is None else ids[:end + 1]


def reply_text(template: ChatTemplate, ids: list[int]) -> str:
    """A sampled reply's text: its ids without the token that ended it."""
    return template.tok.decode(ids[:-1] if ids and ids[-1] in template.stop_tokens else ids)
