"""core/serving/engine.py's BatchEngine (and core/serving/process.py's EngineProcess): continuous batching equals
decode.generate row for row, one forward per step for every row, logprobs, penalties and logit_bias, the cap on
rows in flight.

    python -m pytest tests/test_engine.py
"""
import asyncio
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from core.serving.engine import (BatchEngine, EngineDied, EngineRequest, EngineSettings, PromptScores, ServerStopping,
                                 adjust_logits, engine_sampling)
from core.decoding.decode import Sampling, draw_by_sum, generate
from core.evaluation.perplexity import token_losses
from core.serving.process import EngineProcess
from core.weights.resolver import load_model
from model import GPT, GPTConfig
from tests.helpers import ROMEO_JULIET, make_char_dataset, one_thread, train_tiny

VARIANTS = {"learned": dict(), "rope+gqa": dict(pos_embedding="rope", n_kv_head=2),
            "naive+rmsnorm": dict(attn_backend="naive", norm="rmsnorm", mlp="swiglu")}
SHIFT = 16



def stop_and_join(engine) -> None:
    """Stop an engine and wait a bounded time: an engine process stuck inside a step (a fork taken while another
    thread of this test process held a lock) fails its test instead of hanging the suite."""
    engine.stop()
    engine.join(60)
    process = getattr(engine, "process", None)
    if process is not None and process.is_alive():
        process.kill()
        pytest.fail("the engine process did not stop within 60 s of stop()")

def sharp_model(**overrides) -> GPT:
    """A random model made peaked (embeddings and attention scaled up), so its tokens depend on the context."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**dict(block_size=32, vocab_size=50, n_layer=2, n_head=4, n_embd=32) | overrides)).eval()
    with torch.no_grad():
        model.transformer.wte.weight.mul_(20)
        for block in model.transformer.h:
            block.attn.c_attn.weight.mul_(5)
    return model


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A char model trained on a Shakespeare passage: greedy text is text, not one token repeated."""
    root = tmp_path_factory.mktemp("engine")
    make_char_dataset(root / "data", ROMEO_JULIET)
    train_tiny(root / "out", root / "data", block_size=32, n_layer=2, n_embd=48, max_iters=300,
               lr_decay_iters=300, eval_interval=300, log_interval=100)
    model, tok, _ = load_model("resume", str(root / "out"))
    return model.eval(), tok


def alone(model, prompt, n, max_tokens, temperature, seed, eot=None):
    """What decode.generate gives this request by itself, as lists of new ids per row."""
    s = Sampling(temperature=temperature, generator=torch.Generator().manual_seed(seed), window_shift=SHIFT,
                 vocab_size=model.config.vocab_size, eot_token=eot)
    return generate(model, torch.tensor([prompt] * n), max_tokens, s)[:, len(prompt):].tolist()


def request(model, prompt, n, max_tokens, temperature, seed, eot=None, **kw) -> EngineRequest:
    V = model.config.vocab_size
    return EngineRequest(prompt, n, max_tokens, engine_sampling(temperature, None, None, seed, "cpu", eot, SHIFT, V),
                         **kw)


def run(engine: BatchEngine, reqs: list[EngineRequest]) -> list[dict]:
    """Submit every request at once; each one's rows' ids, its steps, its prompt scores and its prompt's tokens
    taken from the prefix cache."""
    async def one(req, loop):
        handle = engine.submit(req, loop)
        got = {"rows": [[] for _ in range(req.n)], "steps": [], "prompt": None, "cached": None}
        async for event in handle.events():
            if isinstance(event, PromptScores):
                got["prompt"], got["cached"] = event.scores, event.cached
                continue
            got["steps"].append(event)
            for r, step in enumerate(event):
                got["rows"][r].append(step.token)
        return got

    async def every():
        loop = asyncio.get_running_loop()
        return await asyncio.gather(*(one(r, loop) for r in reqs))

    engine.start()
    try:
        with one_thread():
            return asyncio.run(every())
    finally:
        stop_and_join(engine)


# (prompt, n, max_tokens, temperature, seed): greedy and seeded, past block_size (32), n > 1, a prompt that
# fills the context, prompts longer than the prefill chunk (7)
REQUESTS = [([1, 2, 3], 1, 60, 0.0, 1), ([4] * 20, 2, 45, 1.0, 2), ([5, 6], 1, 70, 0.9, 3),
            ([7] * 32, 3, 10, 1.0, 4), ([9], 1, 80, 0.0, 5), ([3, 3], 2, 33, 1.0, 6), ([8, 1] * 6, 1, 40, 0.7, 7)]


ENGINES = {"thread": BatchEngine, "process": EngineProcess}


@pytest.mark.parametrize("kind", [*ENGINES, "stepped"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_request_gets_what_generate_gives_it_alone(variant, kind):
    """stepped: every request queued before the first step, so prompts of many lengths share prefill forwards
    (ragged, chunked at 7 tokens), and windows of many lengths refill together."""
    model = sharp_model(**VARIANTS[variant])
    settings = EngineSettings(max_batch=8, window_shift=SHIFT, vocab_size=50, step_tokens=7)
    engine = ENGINES.get(kind, BatchEngine)(model, settings)
    reqs = [request(model, *r) for r in REQUESTS]  # 11 rows for 8 slots: some wait their turn
    got = stepped(engine, reqs) if kind == "stepped" else run(engine, reqs)
    for r, g in zip(REQUESTS, got):
        assert g["rows"] == alone(model, *r), r
    assert len({tuple(g["rows"][0]) for g in got}) == len(REQUESTS)  # not one token over and over
    if kind != "process":
        assert engine.free and sorted(engine.free) == list(range(8)) and not engine.active  # every slot back
    else:
        assert engine.running == 0 and engine.waiting_count() == 0 and not engine.handles


def test_requests_with_different_cuts_drawn_in_one_step_each_get_their_own(trained):
    """The engine draws every request with one setting in one call: requests at one temperature but other
    top_k or top_p, decoding side by side, still each get generate's text under their own settings."""
    model, tok = trained
    settings = [(None, None), (3, None), (None, 0.6), (None, None), (2, 0.9)]  # (top_k, top_p), all at 1.0
    prompt, V = tok.encode("ROMEO:"), model.config.vocab_size

    def sampling(top_k, top_p, seed):
        return engine_sampling(1.0, top_k, top_p, seed, "cpu", None, SHIFT, V)

    engine = BatchEngine(model, EngineSettings(max_batch=8, window_shift=SHIFT, vocab_size=tok.vocab_size))
    got = run(engine, [EngineRequest(prompt, 1, 40, sampling(k, p, seed)) for seed, (k, p) in enumerate(settings)])
    for seed, ((k, p), g) in enumerate(zip(settings, got)):
        expected = generate(model, torch.tensor([prompt]), 40, sampling(k, p, seed))[:, len(prompt):].tolist()
        assert g["rows"] == expected, (k, p)
    loose = generate(model, torch.tensor([prompt]), 40, sampling(None, None, 1))[:, len(prompt):].tolist()
    assert got[1]["rows"] != loose  # the cut changes the text: the test can tell one setting from another

def test_a_request_with_no_seed_draws_by_sum_from_the_engines_generator(trained):
    """A request with no seed (no generator) draws each step's rows with draw_by_sum from the engine's own
    generator: its text is a plain loop's (whole context forward, softmax, draw_by_sum from a generator in the
    engine's state); sent to another engine (its generator seeded at random), the same request gets other text."""
    model, tok = trained
    prompt, V = tok.encode("ROMEO:"), model.config.vocab_size
    req = EngineRequest(prompt, 2, 20, engine_sampling(1.0, None, None, None, "cpu", None, SHIFT, V))
    engines = [BatchEngine(model, EngineSettings(max_batch=4, window_shift=SHIFT, vocab_size=tok.vocab_size))
               for _ in range(2)]
    engines[0].rng = torch.Generator().manual_seed(11)
    first, second = (run(engine, [req])[0]["rows"] for engine in engines)
    g, idx = torch.Generator().manual_seed(11), torch.tensor([prompt] * 2)
    with torch.no_grad():
        for _ in range(20):
            idx = torch.cat([idx, draw_by_sum(torch.softmax(model(idx)[0][:, -1], dim=-1), g)], dim=1)
    assert first == idx[:, len(prompt):].tolist() and first[0] != first[1]
    assert second != first and len({t for row in first for t in row}) > 5

def test_a_request_on_slots_apart_gets_what_generate_gives_it_alone():
    """Two short requests on slots 0 and 2 end together, around a long one on slot 1: the waiting request
    of n=2 then takes slots 0 and 2, not side by side in the cache."""
    model = sharp_model()
    reqs = [([1, 2], 1, 5, 1.0, 1), ([3], 1, 40, 1.0, 2), ([4, 5], 1, 5, 1.0, 3), ([6, 7, 8], 2, 20, 1.0, 4)]
    engine = BatchEngine(model, EngineSettings(max_batch=3, window_shift=SHIFT, vocab_size=50))
    got = run(engine, [request(model, *r) for r in reqs])
    for r, g in zip(reqs, got):
        assert g["rows"] == alone(model, *r), r
    assert got[3]["rows"][0] != got[3]["rows"][1]

def test_trained_model_text_and_eot_equal_generate(trained):
    model, tok = trained
    prompts = [tok.encode(p) for p in ("ROMEO:", "JULIET:", "O Romeo, Romeo", "What light", "But soft")]
    eot = alone(model, prompts[0], 1, 50, 0, 0)[0][10]  # rows stop at a character the model writes (whichever its
    # kernels' rounding makes it), as at <|endoftext|>: padded with it until all stop
    reqs = [(p, n, 50, t, seed) for p, n, t, seed in zip(prompts, [1, 3, 1, 2, 1], [0, 1.0, 0.8, 1.0, 0], range(5))]
    engine = BatchEngine(model, EngineSettings(max_batch=16, window_shift=SHIFT, vocab_size=tok.vocab_size))
    got = run(engine, [request(model, *r, eot=eot) for r in reqs])
    for r, g in zip(reqs, got):
        assert g["rows"] == alone(model, *r, eot=eot), r
    text = "".join(tok.decode(row) for g in got for row in g["rows"])
    assert len(set(text)) > 10, text  # real text
    assert len(got[0]["rows"][0]) <= 11  # greedy, the first stopped there


def stepped(engine: BatchEngine, reqs: list[EngineRequest]) -> list[dict]:
    """run(), but every request is in the queue before the first step, and the steps are taken here, not by the
    engine's thread: which rows share a forward is then fixed."""
    loop = asyncio.new_event_loop()
    handles = [engine.submit(r, loop) for r in reqs]
    with one_thread():
        engine._admit(block=False)
        for _ in range(1000):  # a row that never becomes cached would step forever: fail instead
            if not engine.active:
                break
            engine.step()
            engine._admit(block=False)  # as the engine's thread does between steps
            engine._flush()
        assert not engine.active, "the requests did not end in 1000 steps"

    async def rows(handle):
        got = {"rows": [[] for _ in range(handle.req.n)]}
        async for event in handle.events():
            if isinstance(event, PromptScores):
                got["cached"], got["prompt"] = event.cached, event.scores
                continue
            for r, step in enumerate(event):
                got["rows"][r].append(step.token)
        return got

    async def every():
        return await asyncio.gather(*(rows(h) for h in handles))

    try:
        return loop.run_until_complete(every())
    finally:
        loop.close()


def test_one_forward_per_step_for_every_row(trained, monkeypatch):
    """16 requests decode together: each step is one forward over all 16 rows, not 16 forwards; their 16
    prompts are prefilled in one forward, and so are their 16 windows when they slide past the context at the
    same step; and no step leaves a graph behind (the cache is written in place at every step)."""
    model, tok = trained
    calls = forwards(model, monkeypatch)
    prompt = tok.encode("ROMEO:")
    reqs = [request(model, prompt, 1, 40, 1.0, seed) for seed in range(16)]  # 6 + 40 tokens pass block 32
    engine = BatchEngine(model, EngineSettings(max_batch=16, window_shift=SHIFT, vocab_size=tok.vocab_size))
    got = stepped(engine, reqs)
    monkeypatch.undo()
    window = 32 - SHIFT + 1  # the window after it slides, as generate's slide_window leaves it
    assert [c for c in calls if c[0][1] > 1] == [[(1, len(prompt))] * 16, [(1, window)] * 16]
    assert calls.count([(16, 1)]) == len(calls) - 2 == 39 - 1  # every other step: the 16 rows' next tokens
    assert engine.cache.k.grad_fn is None and not engine.cache.k.requires_grad
    for seed, g in enumerate(got):
        assert g["rows"] == alone(model, prompt, 1, 40, 1.0, seed)


def forwards(model, monkeypatch) -> list[list[tuple[int, int]]]:
    """For every forward the model is given from now on, the (rows, tokens) of each part fed side by side
    (cache.Segments), or of its whole batch."""
    calls, real = [], model.forward

    def spy(idx, *args, kv_cache=None, **kwargs):
        parts = getattr(kv_cache, "parts", None)
        calls.append([(view.batch_size, T) for view, T in parts] if parts else [tuple(idx.shape)])
        return real(idx, *args, kv_cache=kv_cache, **kwargs)

    monkeypatch.setattr(model, "forward", spy)
    return calls


def test_a_prompt_sent_again_is_prefilled_from_the_prefix_cache(trained, monkeypatch):
    """A prompt sent again takes its leading block's keys from the prefix cache and feeds only the rest; its
    tokens are a cold start's, greedy and sampled, and so are its prompt scores (prompt_logprobs)."""
    model, tok = trained
    engine = BatchEngine(model, EngineSettings(max_batch=4, window_shift=SHIFT, vocab_size=tok.vocab_size))
    prompt = tok.encode("ROMEO: But soft, what light thr")  # 31 tokens: a block of 16 and 15 more
    reqs = [(prompt, 1, 12, 0.0, 0), (prompt, 2, 40, 1.0, 3)]  # the second slides its window past block 32
    cold = stepped(engine, [request(model, *r) for r in reqs[:1]])[0]
    calls = forwards(model, monkeypatch)
    warm = stepped(engine, [request(model, *r) for r in reqs])
    assert cold["cached"] == 0 and [g["cached"] for g in warm] == [16, 16]
    assert calls[0] == [(1, 15), (1, 15)]  # both prompts' last 15 tokens in one forward
    for r, g in zip([reqs[0]] + reqs, [cold] + warm):
        assert g["rows"] == alone(model, *r), r
    scored = [request(model, prompt, 1, 1, 0.0, 0, logprobs=2, prompt_logprobs=2) for _ in range(2)]
    first, again = stepped(engine, scored[:1])[0], stepped(engine, scored[1:])[0]
    # blocks without scores serve no request that wants them; with them, all but the last cached token's keys
    # (its logits score the next token)
    assert first["cached"] == 0 and again["cached"] == 15
    assert again["rows"] == first["rows"] and len(again["prompt"]) == len(prompt)
    assert [s.logprob for s in again["prompt"][1:]] == pytest.approx([s.logprob for s in first["prompt"][1:]], abs=1e-5)
    assert [[i for i, _ in s.top] for s in again["prompt"][1:]] == [[i for i, _ in s.top] for s in first["prompt"][1:]]


def test_a_chats_next_turn_reuses_the_last_turns_prompt_and_reply():
    """Each turn's prompt is the last turn's prompt and reply and 4 new tokens: every whole block of the last
    turn (all but its last token drawn, never fed) comes from the prefix cache, and each turn's tokens are what a
    cold start gives."""
    model = sharp_model(block_size=128)
    engine = BatchEngine(model, EngineSettings(max_batch=2, window_shift=SHIFT, vocab_size=50))
    prompt, cached = [1, 2, 3, 4, 5], []
    for turn in range(5):
        got = stepped(engine, [request(model, prompt, 1, 12, 0.0, turn)])[0]
        assert got["rows"] == alone(model, prompt, 1, 12, 0.0, turn), turn
        cached.append(got["cached"])
        prompt = prompt + got["rows"][0] + [turn + 6, 7, 8, 9]
    assert cached == [0, 16, 32, 48, 64]  # (len(last prompt) + 12 - 1) // 16 blocks


def test_prompts_that_share_a_prefix_at_once_compute_it_once(trained, monkeypatch):
    """lm-eval's endings after one context, sent together: the first computes the context's blocks, the others
    wait a step for them, then feed only their own tokens; each gets a cold start's tokens."""
    model, tok = trained
    engine = BatchEngine(model, EngineSettings(max_batch=4, window_shift=SHIFT, vocab_size=tok.vocab_size))
    context = tok.encode("ROMEO: But soft, what ")
    reqs = [(context + tok.encode(end), 1, 5, 0.0, 0) for end in ("light", "dark", "sun", "moon")]
    calls = forwards(model, monkeypatch)
    got = stepped(engine, [request(model, *r) for r in reqs])
    assert [g["cached"] for g in got] == [0, 16, 16, 16]
    fed = sum(B * T for call in calls for B, T in call if T > 1)  # prompt tokens computed
    assert fed == len(reqs[0][0]) + sum(len(r[0]) - 16 for r in reqs[1:])
    for r, g in zip(reqs, got):
        assert g["rows"] == alone(model, *r), r


def test_sample_replies_prefills_each_prompt_once_for_its_group(trained, monkeypatch):
    """The same sharing outside the server (rl.py's groups, eval.py's pass@k): replies.sample_replies prefills
    each prompt in one row and copies its keys to its other n rows; each row is what generate draws for it from
    the prompt's generator, up to the token that ends it (here a newline, as a chat's <|end|>)."""
    from core.decoding.replies import sample_replies
    model, tok = trained
    template = SimpleNamespace(tok=tok, stop_tokens={tok.encode("\n")[0]})  # what sample_replies reads of one
    prompts = [tok.encode("ROMEO: But soft, what"), tok.encode("JULIET:")]
    calls = forwards(model, monkeypatch)
    together = sample_replies(model, template, prompts, 4, 20, generators=[torch.Generator().manual_seed(s) for s in (0, 1)])
    assert calls[0] == [(1, len(p)) for p in prompts]  # two prompts, not eight rows
    for seed, (prompt, group) in enumerate(zip(prompts, together)):
        s = Sampling(generator=torch.Generator().manual_seed(seed), vocab_size=tok.vocab_size)
        budget = min(20, model.config.block_size - len(prompt))  # the context's room
        rows = generate(model, torch.tensor([prompt] * 4), budget, s)[:, len(prompt):].tolist()
        assert group == [row[:next((i + 1 for i, t in enumerate(row) if t in template.stop_tokens), budget)]
                         for row in rows]
    assert len({tuple(r) for group in together for r in group}) > 4  # the rows of a prompt differ


def test_the_prefix_cache_drops_the_least_recently_used_tail_first():
    """Two blocks of room: a 35-token prompt's two blocks, then another prompt's one, drop the first prompt's
    second block, not its first (useless without it); no room, nothing is kept."""
    model = sharp_model(block_size=64)
    a, b = [1 + i % 7 for i in range(35)], [2 + i % 5 for i in range(20)]
    engine = BatchEngine(model, EngineSettings(max_batch=2, window_shift=SHIFT, vocab_size=50,
                                               prefix_cache_tokens=32))
    cached = [stepped(engine, [request(model, p, 1, 1, 0.0, 0)])[0]["cached"] for p in (a, b, a)]
    assert cached == [0, 0, 16]
    engine = BatchEngine(model, EngineSettings(max_batch=2, window_shift=SHIFT, vocab_size=50, prefix_cache_tokens=0))
    assert [stepped(engine, [request(model, a, 1, 1, 0.0, 0)])[0]["cached"] for _ in range(2)] == [0, 0]


def test_logprobs_are_the_models_log_softmax_and_echo_scores_the_prompt(trained):
    model, tok = trained
    text = "ROMEO: But soft, what light"
    ids = tok.encode(text)
    engine = BatchEngine(model, EngineSettings(max_batch=4, window_shift=SHIFT, vocab_size=tok.vocab_size,
                                               step_tokens=5))
    got = run(engine, [request(model, ids, 1, 6, 0.0, 0, logprobs=3, prompt_logprobs=3),
                       request(model, ids, 1, 0, 0.0, 0, logprobs=0, prompt_logprobs=0)])
    whole = ids + got[0]["rows"][0]
    with torch.no_grad():
        logits, _ = model(torch.tensor([whole[:-1]]))
        want = F.log_softmax(logits[0].float(), dim=-1)  # (T, V)
        losses = token_losses(model, torch.tensor([ids[:-1]]), torch.tensor([ids[1:]]))  # eval.py's loss
    prompt = got[0]["prompt"]
    assert prompt[0] is None and len(prompt) == len(ids)
    for i in range(1, len(ids)):
        assert abs(prompt[i].logprob - want[i - 1, ids[i]].item()) < 1e-5
    for t, (step,) in enumerate(got[0]["steps"]):
        p = len(ids) - 1 + t
        assert abs(step.score.logprob - want[p, step.token].item()) < 1e-5
        top_id, top_lp = step.score.top[0]
        assert top_id == step.token and top_lp == step.score.logprob  # greedy: the argmax, the same float
        assert [i for i, _ in step.score.top] == want[p].topk(3).indices.tolist()
    total = sum(s.logprob for s in prompt[1:])
    assert abs(total - -(losses.mean().item() * len(ids[1:]))) < 1e-4
    assert got[1]["steps"] == []  # max_tokens 0: the prompt's scores only (chunked apart: equal to rounding)
    assert [s.logprob for s in got[1]["prompt"][1:]] == pytest.approx([s.logprob for s in prompt[1:]], abs=1e-5)


def test_logit_bias_and_penalties(trained):
    model, tok = trained
    prompt = tok.encode("ROMEO:")
    z = tok.encode("z")[0] if "z" in ROMEO_JULIET else 0
    engine = BatchEngine(model, EngineSettings(max_batch=8, window_shift=SHIFT, vocab_size=tok.vocab_size))
    greedy = run(BatchEngine(model, EngineSettings(max_batch=8, window_shift=SHIFT, vocab_size=tok.vocab_size)),
                 [request(model, prompt, 1, 30, 0.0, 0)])[0]["rows"][0]
    common = set(sorted(set(greedy), key=greedy.count)[-2:])  # the greedy text's two most common tokens
    plain, forced, banned, fpen, ppen = run(engine, [
        request(model, prompt, 1, 30, 0.0, 0), request(model, prompt, 1, 30, 0.0, 0, logit_bias={z: 100}),
        request(model, prompt, 1, 30, 0.0, 0, logit_bias={t: -100 for t in common}),
        request(model, prompt, 1, 30, 0.0, 0, frequency_penalty=2.0),
        request(model, prompt, 1, 30, 0.0, 0, presence_penalty=2.0)])
    assert forced["rows"][0] == [z] * 30  # +100 forces the token
    assert not common & set(banned["rows"][0]) and common <= set(plain["rows"][0])
    for pen in (fpen, ppen):  # penalised: fewer repeats than the greedy text
        assert pen["rows"][0] != plain["rows"][0]
        assert len(set(pen["rows"][0])) > len(set(plain["rows"][0]))
    # bad_words match the generated ids only: a word that starts at the prompt's last id bans nothing at first
    word = run(BatchEngine(model, EngineSettings(max_batch=8, window_shift=SHIFT, vocab_size=tok.vocab_size)),
               [request(model, prompt, 1, 1, 0.0, 0, bad_words=((prompt[-1], greedy[0]),))])[0]
    assert word["rows"][0] == greedy[:1]


def test_adjust_logits_is_vllms_formula_in_vllms_order():
    """logit_bias, then min_tokens' ban, then repetition_penalty on prompt and generated tokens (a positive logit
    divided, a negative one multiplied), then OpenAI's frequency and presence penalties on generated ones."""
    logits = torch.tensor([[2., -2, 1, 0, 3], [1, 1, 1, 1, 1]])
    counts = torch.tensor([[0., 1, 3, 0, 0], [2, 0, 0, 0, 0]])  # each row's generated tokens
    seen = torch.tensor([True, False, False, False, False])  # the prompt's
    bias = torch.tensor([0., 0, 0, 5, 0])
    req = EngineRequest([0], 2, 10, None, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0,
                        min_tokens=3, stop_tokens=(4,))
    inf = float("inf")
    assert adjust_logits(logits, req, 2, counts, seen, bias).tolist() == [[1, -4.75, -0.75, 5, -inf],
                                                                          [-0.5, 1, 1, 6, -inf]]
    assert adjust_logits(logits, req, 3, counts, seen, bias)[:, 4].tolist() == [3, 1]  # min_tokens reached


@pytest.mark.parametrize("kind", ENGINES)
def test_max_batch_queues_and_cancel_frees_the_slot(trained, kind):
    """One slot: a second request waits; cancelling the first (its client left) lets the second run at once."""
    model, tok = trained
    engine = ENGINES[kind](model, EngineSettings(max_batch=1, window_shift=SHIFT, vocab_size=tok.vocab_size))
    prompt = tok.encode("ROMEO:")
    with pytest.raises(ValueError, match="max_batch"):
        engine.submit(request(model, prompt, 2, 5, 0.0, 0), None)

    async def both():
        loop = asyncio.get_running_loop()
        first = engine.submit(request(model, prompt, 1, 100000, 1.0, 0), loop)
        second = engine.submit(request(model, prompt, 1, 5, 0.0, 0), loop)
        events = first.events()
        for _ in range(3):
            await events.__anext__()
        assert engine.waiting_count() == 1 and engine.running == 1
        await events.aclose()  # the client leaves
        return [[s.token for s in e] async for e in second.events() if not isinstance(e, PromptScores)]

    engine.start()
    try:
        with one_thread():  # bounded: a lost cancel fails here instead of generating 100,000 tokens
            got = asyncio.run(asyncio.wait_for(both(), timeout=120))
    finally:
        stop_and_join(engine)
    assert [t for (t,) in got] == alone(model, prompt, 1, 5, 0.0, 0)[0]
    assert engine.tokens_generated < 1000


# --- the engine in a process of its own (serve.py's --engine=process) ------------------------------------


class Recorder:
    """core/serving/metrics.py's Metrics' two calls, recorded."""

    def __init__(self):
        self.batches, self.tokens = [], []

    def batch(self, rows):
        self.batches.append(rows)

    def token(self, handle, rows):
        self.tokens.append((handle, rows))


def test_the_engine_process_reports_each_step_to_the_servers_metrics(trained):
    """The metrics the engine process gathers reach the server's side: every decoding forward's rows, every
    request's tokens, each tied to the server's own handle (its submission time gives time to first token)."""
    model, tok = trained
    metrics = Recorder()
    engine = EngineProcess(model, EngineSettings(max_batch=4, window_shift=SHIFT, vocab_size=tok.vocab_size),
                           metrics=metrics)
    prompt = tok.encode("ROMEO:")
    reqs = [request(model, prompt, n, 12, 1.0, seed) for n, seed in ((1, 0), (2, 1), (1, 2))]
    got = run(engine, reqs)
    for req, g, seed in zip(reqs, got, range(3)):
        assert g["rows"] == alone(model, prompt, req.n, 12, 1.0, seed)
    assert 4 in metrics.batches and sum(metrics.batches) == 4 * 11  # every row's 11 decoding forwards
    assert sorted(rows for _, rows in metrics.tokens) == [1] * 24 + [2] * 12
    assert {type(h).__name__ for h, _ in metrics.tokens} == {"ProcessHandle"}
    assert engine.tokens_generated == 36 and not engine.process.is_alive()


async def streaming(engine, model, prompt):
    """A request that would run for ever, its first event taken: its events go on from there."""
    events = engine.submit(request(model, prompt, 1, 100000, 1.0, 0), asyncio.get_running_loop()).events()
    await events.__anext__()
    return events


def test_the_engine_process_ending_fails_its_requests_in_one_line(trained):
    """The engine process killed mid-generation: the open request ends with EngineDied naming the exit code (the
    server's 503, engine_dead), and the next submission is refused the same way, rather than waiting for ever."""
    model, tok = trained
    engine = EngineProcess(model, EngineSettings(max_batch=2, window_shift=SHIFT, vocab_size=tok.vocab_size))
    prompt = tok.encode("ROMEO:")

    async def killed():
        events = await streaming(engine, model, prompt)
        engine.process.kill()
        with pytest.raises(EngineDied, match=r"^the engine process has ended \(exit code -9\)$"):
            async for _ in events:
                pass

    engine.start()
    try:
        asyncio.run(asyncio.wait_for(killed(), 60))  # a request left waiting for ever fails here
        with pytest.raises(EngineDied, match=r"^the engine process has ended \(exit code -9\)$"):
            engine.submit(request(model, prompt, 1, 5, 0.0, 0), None)
    finally:
        stop_and_join(engine)


def test_stopping_the_engine_process_ends_open_requests_and_the_process(trained):
    model, tok = trained
    engine = EngineProcess(model, EngineSettings(max_batch=2, window_shift=SHIFT, vocab_size=tok.vocab_size))
    prompt = tok.encode("ROMEO:")

    async def stopped():
        events = await streaming(engine, model, prompt)
        engine.stop()
        with pytest.raises(ServerStopping):
            async for _ in events:
                pass
        with pytest.raises(ServerStopping):
            engine.submit(request(model, prompt, 1, 5, 0.0, 0), None)

    engine.start()
    asyncio.run(asyncio.wait_for(stopped(), 60))
    engine.join(30)
    assert engine.process.exitcode == 0
