"""Tokenizer and chat template from a Hugging Face model directory.

Reads `tokenizer.json` (the `tokenizers` library does the encoding), the chat template from
`chat_template.jinja` or `tokenizer_config.json`, special tokens from `tokenizer_config.json`,
and EOS ids from `generation_config.json` / `config.json`. Templates render in a sandboxed
Jinja environment set up as transformers sets it up (trim_blocks, lstrip_blocks, loop
controls, a non-escaping `tojson`, `raise_exception`, `strftime_now`), so the same messages
give the same string.
"""

from __future__ import annotations

import datetime
import functools
import json
import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Iterable, Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from hybridjax.config import read_json

SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


class TokenizerError(ValueError):
    """A missing or unreadable tokenizer file, or a chat the template rejects."""


def _token_str(v) -> str | None:
    if isinstance(v, dict):  # AddedToken serialisation
        return v.get("content")
    return v


def _environment() -> ImmutableSandboxedEnvironment:
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


class Tokenizer:
    """Encode / decode text and render chats; `eos_token_ids` end a generation."""

    def __init__(self, backend: _HFTokenizer, chat_template: str | None, special_tokens: dict, eos_token_ids: Sequence[int]):
        self.backend = backend
        self.chat_template = chat_template
        self.special_tokens = {k: v for k, v in special_tokens.items() if v is not None}
        self.eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        self._template = _environment().from_string(chat_template) if chat_template else None
        self._segments = SegmentCache()

    @classmethod
    def from_dir(cls, model_dir: str | Path, eos_token_ids: Iterable[int] = ()) -> "Tokenizer":
        d = Path(model_dir)
        if not (d / "tokenizer.json").is_file():
            raise TokenizerError(f"{d}: no tokenizer.json (a fast tokenizer file is required)")
        backend = _HFTokenizer.from_file(str(d / "tokenizer.json"))
        tcfg = _read_json(d / "tokenizer_config.json")
        template = tcfg.get("chat_template")
        if (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text()
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        special = {k: _token_str(tcfg.get(k)) for k in SPECIAL_KEYS}
        eos = list(eos_token_ids)
        for source in (_read_json(d / "generation_config.json"), _read_json(d / "config.json")):
            e = source.get("eos_token_id")
            eos += e if isinstance(e, list) else ([e] if e is not None else [])
        if special.get("eos_token") and backend.token_to_id(special["eos_token"]) is not None:
            eos.append(backend.token_to_id(special["eos_token"]))
        return cls(backend, template, special, eos)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Characters of the longest token's text, an upper bound on what one token decodes to
        (byte-level vocabularies spell each byte as one character): a text of n characters has
        at least n / max_token_chars tokens, known without tokenizing it."""
        return max(1, max(map(len, self.backend.get_vocab(with_added_tokens=True)), default=1))

    def encode(self, text: str, add_special_tokens: bool = False, *, scope: str = "") -> list[int]:
        """The backend's ids for `text`. Without special-token additions, through the segment cache:
        a chat transcript resent each turn tokenizes only the segments it has not seen. `scope`: whose
        segments (the server: the request's cache namespace, so that the time of one client's
        request cannot tell whether another sent the same text, as its prefix cache cannot)."""
        if add_special_tokens:
            return self.backend.encode(text, add_special_tokens=True).ids
        return self._segments.encode(self.backend, text, scope)

    def scoped(self, scope: str) -> "ScopedTokenizer":
        """This tokenizer, encoding in `scope`'s segments (see `encode`)."""
        return ScopedTokenizer(self, scope)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt string for `messages`, as transformers' apply_chat_template(tokenize=False)."""
        if self._template is None:
            raise TokenizerError("this model has no chat template; send a plain prompt instead")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m:
                raise TokenizerError(f"messages[{i}] must be an object with a 'role'")
        try:
            return self._template.render(
                messages=messages, tools=kwargs.pop("tools", None), documents=kwargs.pop("documents", None),
                add_generation_prompt=add_generation_prompt, **self.special_tokens, **kwargs,
            )
        except jinja2.exceptions.TemplateError as e:
            raise TokenizerError(f"chat template rejected the messages: {e}") from None

    @functools.cached_property
    def renders_tools(self) -> bool:
        """Whether the chat template shows `tools` to the model: some templates drop them, and a
        request with tools would then be answered as if it had none."""
        probe = [{"type": "function", "function": {"name": "hybridjax_probe_tool", "parameters": {"type": "object"}}}]
        try:
            return "hybridjax_probe_tool" in self.render_chat([{"role": "user", "content": "?"}], tools=probe)
        except TokenizerError:
            return False

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt, **kwargs))


class ScopedTokenizer:
    """A Tokenizer whose encodes use one scope of its segment cache: what history_boundary and
    chat_reuse.next_turn_prefix are given (the scope is not a template argument a client could set)."""

    def __init__(self, tokenizer: Tokenizer, scope: str):
        self.tokenizer, self.scope = tokenizer, scope

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        return self.tokenizer.render_chat(messages, add_generation_prompt, **kwargs)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens, scope=self.scope)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt, **kwargs))


class SegmentCache:
    """Encodes a text as the concatenation of its segments' ids, each segment's ids kept (LRU,
    bounded in tokens, per scope) for the next text of that scope that contains it.

    Exact because the `tokenizers` library itself cuts a text at its added tokens (leftmost, longest
    first) before normalizing and pre-tokenizing, and encodes each piece between them on its own.
    Where that does not hold plainly (an added token that strips its neighbours' whitespace or
    matches single words only, or one matched after a normalizer) the whole text is encoded as is.
    """

    def __init__(self, max_tokens: int = 1 << 20, max_piece_tokens: int = 1 << 16):
        self.max_tokens, self.max_piece_tokens = max_tokens, max_piece_tokens
        self._ids: OrderedDict[tuple[str, str], tuple[int, ...]] = OrderedDict()  # (scope, piece) -> ids
        self._tokens = 0
        self._lock = threading.Lock()  # the server encodes in worker threads
        self._key, self._split = None, None

    def encode(self, backend: _HFTokenizer, text: str, scope: str = "") -> list[int]:
        split = self._splitter(backend)
        if split is None:
            return backend.encode(text, add_special_tokens=False).ids
        out: list[int] = []
        for piece, special_id in split(text):
            if special_id is not None:
                out.append(special_id)
                continue
            key = (scope, piece)
            with self._lock:
                ids = self._ids.get(key)
                if ids is not None:
                    self._ids.move_to_end(key)
            if ids is None:
                ids = tuple(backend.encode(piece, add_special_tokens=False).ids)
                self._keep(key, ids)
            out.extend(ids)
        return out

    def _keep(self, key: tuple[str, str], ids: tuple[int, ...]) -> None:
        if len(ids) > self.max_piece_tokens:
            return
        with self._lock:
            if key in self._ids:
                return
            self._ids[key] = ids
            self._tokens += len(ids)
            while self._tokens > self.max_tokens:
                self._tokens -= len(self._ids.popitem(last=False)[1])

    def _splitter(self, backend: _HFTokenizer):
        """The text -> [(piece, added token id or None)] function for the backend's added tokens
        now (a token added later makes a new one, and forgets the pieces)."""
        key = backend.get_vocab_size(with_added_tokens=True)
        if key != self._key:
            split = added_token_splitter(backend)
            with self._lock:
                self._key, self._split = key, split
                self._ids.clear()
                self._tokens = 0
        return self._split


def added_token_splitter(backend: _HFTokenizer):
    """A function cutting a text where `backend` cuts it at added tokens, or None where that is not
    a plain string match (see SegmentCache)."""
    added = list(backend.get_added_tokens_decoder().items())
    if any(t.lstrip or t.rstrip or t.single_word for _, t in added):
        return None
    if backend.normalizer is not None and any(t.normalized for _, t in added):
        return None
    ids = {t.content: i for i, t in added}
    # tokenizers matches the tokens that skip the normalizer first, then the others in what is left.
    passes = [_alternation([t.content for _, t in added if t.normalized is n]) for n in (False, True)]

    def split(text: str) -> list[tuple[str, int | None]]:
        pieces = [text]
        for rx in passes:
            if rx is not None:
                pieces = [q for p in pieces for q in (rx.split(p) if p not in ids else (p,))]
        return [(p, ids.get(p)) for p in pieces if p]

    return split


def _alternation(tokens: list[str]):
    """A regex whose split keeps the tokens, the longest first at each position (leftmost-longest)."""
    if not tokens:
        return None
    return re.compile("(" + "|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)) + ")")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    return read_json(path, TokenizerError)


class StreamDecoder:
    """Turns a growing list of token ids into text deltas that never split a UTF-8 character.

    Decodes the ids since the last emitted boundary; while the tail decodes to U+FFFD (an
    incomplete byte sequence) it waits for more tokens.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # ids before this are context for the decoder only
        self.read_offset = 0  # ids before this have been emitted as text

    def push(self, token: int) -> str:
        self.ids.append(token)
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip)  # noqa: E731
        before = decode(self.ids[self.prefix_offset : self.read_offset])
        after = decode(self.ids[self.prefix_offset :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever is left (an incomplete character at the very end comes out as U+FFFD)."""
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip)  # noqa: E731
        before = decode(self.ids[self.prefix_offset : self.read_offset])
        after = decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return after[len(before) :]


# --- a small byte-level tokenizer: the embedded default model and the tests use it -------

def chatml_template(trim_content: bool = True) -> str:
    """ChatML, with tools as Qwen3 renders them: the signatures in a system block between
    <tools></tools>, an assistant's calls as `<tool_call>` JSON blocks, and `tool` turns verbatim.
    Without tools a conversation renders exactly as plain ChatML. `trim_content`: strip each
    message's content (the byte-level template), or keep it verbatim (the char-level one)."""
    content = "(message['content'] or '')" + (" | trim" if trim_content else "")
    return (
        "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
        "{%- set loop_messages = messages[1:] %}"
        "{%- else %}{%- set system = none %}{%- set loop_messages = messages %}{%- endif %}\n"
        "{%- if tools %}"
        "{{- '<|im_start|>system\\n' + (system + '\\n\\n' if system else '') }}"
        "{{- '# Tools\\n\\nYou can call these functions, given by their JSON signatures:\\n<tools>' }}"
        "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
        "{{- '\\n</tools>\\n\\nTo call one, answer with its name and arguments as JSON in a block:\\n"
        "<tool_call>\\n{\"name\": <function-name>, \"arguments\": <arguments-object>}\\n</tool_call><|im_end|>\\n' }}"
        "{%- elif system is not none %}{{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' }}{%- endif %}\n"
        "{%- for message in loop_messages %}\n"
        "{%- if message['role'] not in ['user', 'assistant', 'tool'] %}"
        "{{- raise_exception('Unknown role: ' + message['role']) }}{%- endif %}\n"
        "{%- set text = " + content + " %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' + text }}"
        "{%- for call in (message['tool_calls'] if message['tool_calls'] is defined and message['tool_calls'] else []) %}"
        "{%- set f = call['function'] if call['function'] is defined else call %}"
        "{%- set args = f['arguments'] if f['arguments'] is string else (f['arguments'] | tojson) %}"
        "{{- ('\\n' if text or not loop.first else '') + '<tool_call>\\n{\"name\": ' + (f['name'] | tojson)"
        " + ', \"arguments\": ' + args + '}\\n</tool_call>' }}"
        "{%- endfor %}"
        "{{- '<|im_end|>\\n' }}\n"
        "{%- endfor %}\n"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n"
    )


CHATML_TEMPLATE = chatml_template()
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def byte_level_backend() -> _HFTokenizer:
    """256 byte tokens (GPT-2 byte-to-unicode alphabet, no merges) + ChatML specials."""
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # The GPT-2 order: printable bytes keep their code point; sort by the byte they stand for.
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=_byte_of))}
    tok = _HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    return tok


def _byte_of(ch: str) -> int:
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    c = ord(ch)
    if c in printable:
        return c
    return sorted(set(range(256)) - set(printable))[c - 256]


def byte_level_tokenizer(chat_template: str = CHATML_TEMPLATE) -> Tokenizer:
    backend = byte_level_backend()
    special = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None, "unk_token": None}
    eos = [backend.token_to_id("<|im_end|>"), backend.token_to_id("<|endoftext|>")]
    return Tokenizer(backend, chat_template, special, eos)


def save_tokenizer(tokenizer: Tokenizer, model_dir: str | Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja (HF layout)."""
    d = Path(model_dir)
    d.mkdir(parents=True, exist_ok=True)
    tokenizer.backend.save(str(d / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 131072, **tokenizer.special_tokens}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    if tokenizer.chat_template:
        (d / "chat_template.jinja").write_text(tokenizer.chat_template)


# The embedded default model's tokenizer: one token per character, so that decoding then
# re-encoding any generated ids gives the same ids (a chat's history re-sent by a client
# hits the snapshot of the response exactly). Its template keeps content verbatim (no trim).
CHAR_ALPHABET = "".join(chr(c) for c in range(0x20, 0x7F)) + "\n" + "".join(chr(c) for c in range(0xC0, 0xDD))
DEFAULT_TEMPLATE = chatml_template(trim_content=False)


def char_level_tokenizer() -> Tokenizer:
    """128 tokens: printable ASCII, newline, 29 Latin-1 letters, ChatML specials; other
    characters encode as '?'."""
    from tokenizers import Regex, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(CHAR_ALPHABET)}
    backend = _HFTokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(SPECIALS))
    special = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None, "unk_token": None}
    eos = [backend.token_to_id("<|im_end|>"), backend.token_to_id("<|endoftext|>")]
    return Tokenizer(backend, DEFAULT_TEMPLATE, special, eos)
