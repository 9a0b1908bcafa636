"""Training data: JSON lines of {"text": ...} or {"messages": [...]} -> packed, masked batches.

Text examples count every token; chat examples are rendered with the model's chat template
and count only the assistant turns (their content and the closing <|im_end|>). Examples are
joined into one token stream (each followed by <|endoftext|> when the vocabulary has it) and
cut into windows of T+1 tokens overlapping by one, so every token is predicted once per epoch.

Batches are a pure function of (seed, index): batch i of epoch e takes rows of a permutation
drawn from (seed, e), cut at an offset drawn from (seed, e). So the data position of a run is one integer, the number of batches
consumed, and a resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import numpy as np

EOT = "<|endoftext|>"


class DataError(ValueError):
    """Unreadable or malformed training data; the message names the file and line."""


def read_jsonl(path: str | Path) -> list[dict]:
    """Examples from a JSON-lines file, each {"text": str} or {"messages": [{role, content}, ...]}."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            ex = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{i}: invalid JSON ({e})") from None
        check_example(ex, f"{path}:{i}")
        out.append(ex)
    if not out:
        raise DataError(f"{path}: no examples")
    return out


def check_example(ex, where: str) -> None:
    if isinstance(ex, dict) and isinstance(ex.get("text"), str):
        return
    if isinstance(ex, dict) and isinstance(ex.get("messages"), list) and ex["messages"]:
        for m in ex["messages"]:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise DataError(f"{where}: each message needs a string 'role' and 'content'")
        return
    raise DataError(f'{where}: expected {{"text": str}} or {{"messages": [...]}}')


def encode_example(tok, ex: dict) -> tuple[list[int], list[int]]:
    """(token ids, per-token loss flags): all 1 for text; 1 on assistant turns for chats."""
    if "text" in ex:
        ids = tok.encode(ex["text"])
        return ids, [1] * len(ids)
    msgs = ex["messages"]
    text = tok.render_chat(msgs, add_generation_prompt=False)
    spans = []  # character spans of the assistant turns, from prefix renders of the same template
    for i, m in enumerate(msgs):
        if m["role"] == "assistant":
            before = tok.render_chat(msgs[:i], add_generation_prompt=True) if i else ""
            through = tok.render_chat(msgs[: i + 1], add_generation_prompt=False)
            if not (text.startswith(through) and through.startswith(before)):
                raise DataError("the chat template does not render a conversation's prefixes as prefixes")
            spans.append((len(before), len(through)))
    enc = tok.backend.encode(text, add_special_tokens=False)
    flags = [int(any(s <= a < e for s, e in spans)) for a, _ in enc.offsets]
    return list(enc.ids), flags


def token_stream(tok, examples: Iterable[dict]) -> tuple[np.ndarray, np.ndarray]:
    """All examples joined: (ids int32 [N], loss flags float32 [N])."""
    eot = tok.token_id(EOT)
    ids, flags = [], []
    for ex in examples:
        i, f = encode_example(tok, ex)
        ids += i
        flags += f
        if eot is not None:
            ids.append(eot)
            flags.append(1 if "text" in ex else 0)
    return np.asarray(ids, np.int32), np.asarray(flags, np.float32)


class Batches:
    """Windows of T+1 tokens from a stream, served as batches by index (see the module doc).

    With `shift` (the default), epoch e > 0 cuts its windows from a random offset in [0, T), so
    a text is not always seen at the same position of a window (a model trained on fixed
    windows of a short text learns "the text at window position p" and cannot continue it
    past T tokens). Epoch 0 starts at offset 0. `tokens` / `mask` hold the offset-0 windows.
    """

    def __init__(self, ids: np.ndarray, flags: np.ndarray, batch_size: int, seq_len: int, seed: int = 0,
                 shift: bool = True):
        if batch_size < 1 or seq_len < 2:
            raise DataError(f"batch size must be >= 1 and sequence length >= 2, got {batch_size}, {seq_len}")
        self.ids, self.flags = ids, flags
        self.batch_size, self.seq_len, self.seed, self.shift = batch_size, seq_len, seed, shift
        # Rows every epoch can cut, whatever its offset.
        self.n_rows = (len(ids) - 1 - (seq_len - 1 if shift else 0)) // seq_len
        if self.n_rows < batch_size:
            raise DataError(
                f"the data holds {len(ids)} tokens: fewer than one batch of {batch_size} x {seq_len + 1}; "
                "lower --batch-size or --seq-len, or add data"
            )
        self.tokens, self.mask = self._windows(np.arange(self.n_rows), 0)
        self.per_epoch = self.n_rows // batch_size

    def _windows(self, rows: np.ndarray, offset: int) -> tuple[np.ndarray, np.ndarray]:
        idx = offset + rows[:, None] * self.seq_len + np.arange(self.seq_len + 1)  # [rows, T+1]
        # mask[t] weighs the prediction of token t+1: the flag of that token.
        return self.ids[idx], self.flags[idx[:, 1:]]

    @property
    def n_tokens(self) -> int:
        return int(self.n_rows * self.seq_len)

    def offset(self, epoch: int) -> int:
        if not self.shift or epoch == 0:
            return 0
        return int(np.random.default_rng([self.seed, epoch, 1]).integers(self.seq_len))

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        epoch, j = divmod(int(i), self.per_epoch)
        perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_rows)
        tokens, mask = self._windows(perm[j * self.batch_size : (j + 1) * self.batch_size], self.offset(epoch))
        return {"tokens": tokens, "mask": mask}
