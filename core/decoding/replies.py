"""A chat model's replies: the chat template's prompts (core/data/chat.py) through generate and generate_stream.

sample.py streams a reply (stream_reply), eval.py's held-out conversations take it whole (reply), and rl.py's
samples and eval.py's checked tasks are n replies to each of many prompts from one batched decode (sample_replies).
"""
import torch

from core.data.chat import ChatTemplate
from core.decoding.cache import RowCache, Segments
from core.decoding.decode import draw, generate_stream, sampling_probs


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


@torch.no_grad()
def sample_replies(model, template: ChatTemplate, prompts: list[list[int]], n: int, max_new_tokens: int,
                   temperature: float = 1.0, top_k: int | None = None,
                   generators: list[torch.Generator] | None = None) -> list[list[list[int]]]:
    """n replies to each of `prompts` (render_prompt's ids, of any lengths), all in one batched decode with the KV
    cache (core/decoding/cache.py's Segments, as the server batches): per prompt, n replies, each its ids up to
    and including the token that ended it (<|end|>, a role token, <|endoftext|>), or max_new_tokens ids (fewer
    where the prompt leaves less of block_size) when none did. Each prompt is prefilled once, in its first row, and
    its keys copied to its other rows (as the server's engine shares a prompt among a request's n choices). Prompt
    i's rows draw their noise from generators[i] (decode.sample_next's exponential race), so its replies follow from
    that generator and not from the other prompts' draws; temperature 0 is greedy. A row that ends leaves the batch."""
    device, V = model.transformer.wte.weight.device, template.tok.vocab_size
    lengths = [len(p) for p in prompts for _ in range(n)]  # (B,)
    budgets = [min(max_new_tokens, model.config.block_size - length) for length in lengths]
    cache = RowCache(model.new_kv_cache(len(lengths), max(t + b for t, b in zip(lengths, budgets))))
    first = list(range(0, len(lengths), n))  # each prompt's first row
    joined = torch.tensor([[t for prompt in prompts for t in prompt]], device=device)  # (1, all the prompts' tokens)
    parts = [(cache.rows(row, row + 1), len(prompt)) for row, prompt in zip(first, prompts)]
    logits = model(joined, kv_cache=Segments(parts), last_only=True)[0][:, -1, :V]  # (P, V)
    for row, T in zip(first, lengths[::n]):  # the prompt's keys to its other rows
        cache.k[:, row + 1:row + n, :, :T] = cache.k[:, row:row + 1, :, :T]
        cache.v[:, row + 1:row + n, :, :T] = cache.v[:, row:row + 1, :, :T]
        cache.pos[row + 1:row + n] = T
    logits = logits.repeat_interleave(n, dim=0)  # (B, V)
    replies, active = [[] for _ in lengths], list(range(len(lengths)))
    while True:
        if temperature == 0:
            drawn = logits.argmax(dim=-1)
        else:  # every row's noise is drawn, ended or not, as generate draws it: a row's draws follow its generator
            noise = torch.cat([torch.empty(n, V, device=device).exponential_(1, generator=g) for g in generators])
            drawn = draw(sampling_probs(logits, temperature, top_k), noise[active])[:, 0]  # (rows,)
        for row, token in zip(active, drawn.tolist()):
            replies[row].append(token)
        active = [r for r in active if replies[r][-1] not in template.stop_tokens and len(replies[r]) < budgets[r]]
        if not active:
            return [replies[i * n:(i + 1) * n] for i in range(len(prompts))]
        idx = torch.tensor([[replies[r][-1] for r in active]], device=device)  # (1, rows)
        parts = [(cache.rows(start, stop), 1) for start, stop in runs(active)]  # each run of rows still going
        logits = model(idx, kv_cache=Segments(parts), last_only=True)[0][:, -1, :V]


def runs(rows: list[int]) -> list[tuple[int, int]]:
    """Ascending rows as (start, stop) runs of consecutive ones: [0, 1, 2, 5, 6] -> [(0, 3), (5, 7)]."""
    spans = []
    for r in rows:
        if spans and spans[-1][1] == r:
            spans[-1] = (spans[-1][0], r + 1)
        else:
            spans.append((r, r + 1))
    return spans


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


def reply_text(template: ChatTemplate, ids: list[int]) -> str:
    """A sampled reply's text: its ids without the token that ended it."""
    return template.tok.decode(ids[:-1] if ids and ids[-1] in template.stop_tokens else ids)
