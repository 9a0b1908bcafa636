"""The next chat turn's stable prefix, as the model's own template will render it.

A chat template need not render a turn's history as the previous prompt + the response: Qwen3.5
opens every generation with `<think>` and drops thinking from earlier turns; a response ending
on `<|endoftext|>` comes back closed by `<|im_end|>`; a response cut by max_tokens gets an
end-of-turn it never generated. Then the snapshot of the response is not a prefix of the next
prompt, and the next turn would prefill the whole answer again.

So when a response ends, the server renders the conversation with that answer in it, followed
by two different placeholder user messages; the tokens the two renderings share are what every
next turn starts with. If they are not already what the cache holds, the engine prefills them in
idle time (from the longest snapshot it has) and keeps the snapshot: the next turn then prefills
only its new message and the generation prompt.
"""

from __future__ import annotations

from typing import Sequence

from hybridjax.scheduler import common_prefix

# Two user messages that differ from their first character on.
_PLACEHOLDERS = ("A", "Z")


def next_turn_prefix(tokenizer, messages: list[dict], answer: dict, **template_kwargs) -> list[int] | None:
    """Token ids every next turn after `messages` + `answer` (the assistant's message as the client
    will send it back) starts with, or None if the template rejects the conversation."""
    history = list(messages) + [answer]
    try:
        a, b = (tokenizer.encode_chat(history + [{"role": "user", "content": p}], add_generation_prompt=True,
                                      **template_kwargs) for p in _PLACEHOLDERS)
    except ValueError:
        return None
    n = common_prefix(a, b)
    return a[:n] if n else None


def needs_prefill(prefix: Sequence[int], cached: Sequence[int]) -> bool:
    """True unless the cache's tokens (prompt + response) already start with the whole prefix."""
    return len(prefix) > len(cached) or list(cached[: len(prefix)]) != list(prefix)
