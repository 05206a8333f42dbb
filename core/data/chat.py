"""The chat template: how a conversation becomes token ids, and which of them the model learns (docs/chat.md).

    <|system|>You are terse.<|end|><|user|>reverse: abc<|end|><|assistant|>cba<|end|>
                                                                           ^^^^^^^^^^ loss mask 1

Four special tokens, no newlines between turns, content through the ordinary encode: the same ids as transformers'
apply_chat_template, a prompt's ids a prefix of the conversation's, no forged turns. Where the ids go: docs/chat.md.
"""
from __future__ import annotations

from core.data.tokenizer import GPT2_VOCAB, Tokenizer, reserved_tokens
from core.errors import UserError

TEMPLATE_NAME = "role-tokens-v1"
SYSTEM, USER, ASSISTANT, END = "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"
CHAT_TOKENS = (SYSTEM, USER, ASSISTANT, END)
ROLES = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT}
NEXT_ROLES = {None: ("system", "user"), "system": ("user",), "user": ("assistant",), "assistant": ("user",)}

# For transformers' tokenizer_config.json: apply_chat_template renders the same text, and the
# tokenizer (with these four as added special tokens) splits on them before BPE, giving our ids.
JINJA_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def with_chat_tokens(tokenizer_meta: dict) -> dict:
    """Tokenizer metadata with the chat tokens added after the ordinary ids (kept where already there), which stay
    untouched: a base model's tokens mean the same in the chat vocabulary."""
    special = dict(tokenizer_meta.get("special_tokens") or {})
    kind = tokenizer_meta.get("tokenizer")
    if kind == "bpe" and isinstance(tokenizer_meta.get("tokenizer_json"), str):  # trained with them reserved
        reserved = reserved_tokens(tokenizer_meta["tokenizer_json"])
        missing = [name for name in CHAT_TOKENS if name not in reserved]
        if missing:
            raise UserError(f"this BPE reserves no ids for the chat tokens {missing}; train it again with prepare.py")
        return tokenizer_meta | {"special_tokens": special | {name: reserved[name] for name in CHAT_TOKENS}}
    if kind == "gpt2":
        first = GPT2_VOCAB
    elif kind == "char" and isinstance(tokenizer_meta.get("itos"), list):
        first = len(tokenizer_meta["itos"])
    else:
        raise UserError(f"cannot add chat tokens to tokenizer {kind!r}; expected 'char', 'gpt2' or 'bpe' metadata")
    next_id = max([first - 1, *special.values()]) + 1
    for name in CHAT_TOKENS:
        if name not in special:
            special[name], next_id = next_id, next_id + 1
    return tokenizer_meta | {"special_tokens": special, "vocab_size": max(tokenizer_meta["vocab_size"], next_id)}


class ChatTemplate:
    """render(messages) -> (ids, loss mask) for training; render_prompt(messages) -> ids for a reply."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.role_id = {role: tok.special_tokens[name] for role, name in ROLES.items()}
        self.end_of_turn = tok.special_tokens[END]
        # A role token (a turn the model should not write) and a base vocabulary's <|endoftext|> also end a reply.
        self.stop_tokens = {self.end_of_turn, *self.role_id.values()} | ({tok.eot_token} - {None})

    @classmethod
    def for_tokenizer(cls, tok: Tokenizer) -> "ChatTemplate | None":
        """The template for `tok`, or None when it lacks the chat tokens (a base model's tokenizer)."""
        special = getattr(tok, "special_tokens", None) or {}
        return cls(tok) if all(name in special for name in CHAT_TOKENS) else None

    def meta(self) -> dict:  # for meta.json
        return {"template": TEMPLATE_NAME, "special_tokens": {name: self.tok.special_tokens[name] for name in CHAT_TOKENS},
                "end_of_turn": self.end_of_turn}

    def check(self, messages) -> None:
        """A UserError (one line) unless `messages` is an OpenAI messages list in a valid order."""
        if not isinstance(messages, list) or not messages:
            raise UserError(f"messages must be a non-empty list of {{\"role\", \"content\"}} objects, "
                            f"got {_short(messages)}")
        previous = None
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise UserError(f"message {i} must be an object with \"role\" and \"content\", got {_short(m)}")
            role, content = m["role"], m["content"]
            if role not in ROLES:
                raise UserError(f"message {i} has unknown role {_short(role)}; use system, user or assistant")
            if not isinstance(content, str):
                raise UserError(f"message {i} ({role}) has content {_short(content)}; it must be a string")
            if role not in NEXT_ROLES[previous]:
                raise UserError(f"roles out of order: message {i} is {role} after {previous or 'the start'}; "
                                f"expected {' or '.join(NEXT_ROLES[previous])} (an optional system message, "
                                f"then user and assistant alternating)")
            if role == "assistant" and not content:
                raise UserError(f"message {i} is an empty assistant turn; give it content or drop it")
            previous = role

    def render(self, messages) -> tuple[list[int], list[int]]:
        """A whole conversation, ending in an assistant turn -> (ids, mask): mask 1 on each assistant
        turn's content and its <|end|>, 0 on role tokens and on system and user turns."""
        self.check(messages)
        if messages[-1]["role"] != "assistant":
            raise UserError(f"a training conversation must end with an assistant turn, this one ends with "
                            f"{messages[-1]['role']}")
        return self._turns(messages)

    def render_prompt(self, messages) -> list[int]:
        """The conversation so far, ending in a user turn, then <|assistant|>: what the model continues."""
        self.check(messages)
        if messages[-1]["role"] != "user":
            raise UserError(f"a prompt must end with a user message, this one ends with {messages[-1]['role']}")
        return self._turns(messages)[0] + [self.role_id["assistant"]]

    def _turns(self, messages) -> tuple[list[int], list[int]]:
        ids, mask = [], []
        for i, m in enumerate(messages):
            try:
                body = self.tok.encode(m["content"]) + [self.end_of_turn]  # ordinary tokens only: never a special id
            except UserError as e:  # a character vocabulary names what it lacks
                raise UserError(f"message {i}: {e}") from None
            ids += [self.role_id[m["role"]]] + body
            mask += [0] + [int(m["role"] == "assistant")] * len(body)
        return ids, mask

    def fit_prompt(self, messages, max_len: int) -> tuple[list[int], int]:
        """render_prompt's ids in at most max_len tokens, the oldest exchanges (not a system message) left out until
        it fits -> (ids, how many messages were left out)."""
        system = messages[:1] if messages and isinstance(messages[0], dict) and messages[0].get("role") == "system" else []
        turns = messages[len(system):]
        for dropped in range(0, len(turns), 2):
            ids = self.render_prompt(system + turns[dropped:])
            if len(ids) <= max_len:
                return ids, dropped
        raise UserError(f"the last message alone is {len(ids)} tokens with the template, longer than the {max_len} "
                        f"the model can take with room for a reply; shorten it")


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
