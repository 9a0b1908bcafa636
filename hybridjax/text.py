"""Text in, text out: a loaded model with its tokenizer, beside the functional API.

    model = hybridjax.load_model("path/to/model")        # or load_model() for the embedded default
    print(model.generate("def fib(n):", max_new_tokens=32))
    print(model.generate([{"role": "user", "content": "What does json.dumps do?"}]))
    for piece in model.stream("Once upon a time"):
        print(piece, end="", flush=True)

A string is continued as is; a list of messages is rendered with the model's chat template
(generation prompt added). Generation stops at the model's end-of-turn tokens or after
`max_new_tokens`; the returned text leaves special tokens out. Everything here is a thin layer
over `hybridjax.generate` (whose functions take token ids and caches).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterator, Sequence, Union

from hybridjax.config import Config
from hybridjax.params import Params

Prompt = Union[str, Sequence[dict]]


@dataclasses.dataclass
class Model:
    cfg: Config
    params: Params
    tokenizer: object  # hybridjax.tokenizer.Tokenizer
    name: str = "model"

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """End-of-turn tokens: the tokenizer's EOS ids and the config's."""
        return tuple(dict.fromkeys(tuple(self.tokenizer.eos_token_ids) + tuple(self.cfg.eos_token_id)))

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return self.tokenizer.encode_chat(list(prompt), add_generation_prompt=True)

    def generate(self, prompt: Prompt, max_new_tokens: int = 128, *, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int = 0) -> str:
        """The model's continuation of `prompt` (a string, or chat messages), as text."""
        from hybridjax.generate import generate
        from hybridjax.sampling import sampling_params

        sp = sampling_params(1, temperature=temperature, top_p=top_p, top_k=top_k)
        ids = generate(self.params, self.cfg, [self.encode(prompt)], max_new_tokens=max_new_tokens,
                       stop_ids=self.stop_ids, seeds=[seed], sampling=sp).token_lists()[0]
        return self.tokenizer.decode([t for t in ids if t not in self.stop_ids], skip_special_tokens=True)

    def stream(self, prompt: Prompt, max_new_tokens: int = 128, *, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, seed: int = 0) -> Iterator[str]:
        """Like `generate`, as pieces of text while they are produced."""
        from hybridjax.generate import stream
        from hybridjax.sampling import sampling_params
        from hybridjax.tokenizer import StreamDecoder

        sp = sampling_params(1, temperature=temperature, top_p=top_p, top_k=top_k)
        decoder = StreamDecoder(self.tokenizer)
        for t in stream(self.params, self.cfg, self.encode(prompt), max_new_tokens=max_new_tokens,
                        stop_ids=self.stop_ids, seed=seed, sampling=sp):
            piece = decoder.push(t) if t not in self.stop_ids else ""
            if piece:
                yield piece
        rest = decoder.flush()
        if rest:
            yield rest


def load_model(path: str | Path | None = None, dtype: str | None = None) -> Model:
    """A Model from an HF model directory, a converted checkpoint or a Hugging Face Hub id
    ORG/NAME[@REVISION] (it needs a tokenizer.json), or the embedded default model when `path`
    is None. Its compiled programs are kept in the same cache as the CLI's
    (`hybridjax.compile_cache`; HYBRIDJAX_COMPILE_CACHE=0: off), so only a first run compiles."""
    from hybridjax.compile_cache import library_compile_cache

    library_compile_cache()
    if path is None:
        from hybridjax.default_model import DEFAULT_NAME, default_model

        cfg, params, tok = default_model(dtype or "float32")
        return Model(cfg, params, tok, DEFAULT_NAME)
    import hybridjax
    from hybridjax.tokenizer import Tokenizer

    if not hybridjax.is_hub_id(path) and not Path(path).is_dir():
        raise FileNotFoundError(f"model directory not found: {path}")
    d = hybridjax.resolve_model(path)  # a directory, or a hub id ORG/NAME[@REVISION]
    tok = Tokenizer.from_dir(d)  # first: a missing tokenizer.json fails before loading weights
    cfg, params = hybridjax.load(d, dtype=dtype or "float32")  # float32: faster decode on CPU
    tok = Tokenizer.from_dir(d, cfg.eos_token_id)
    return Model(cfg, params, tok, str(path) if hybridjax.is_hub_id(path) else d.name)
