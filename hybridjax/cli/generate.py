"""`hybridjax generate`: text from a prompt, a chat file or token ids (whole call or streamed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hybridjax.cli.common import (DTYPE_HELP, PACK_HELP, QUANTIZE_HELP, QUANTIZE_MODES, CLIError, add_compile_cache, add_mesh_args, init_distributed,
                                 int_at_least, load_model, token_ids, use_compile_cache)


def _prompt_ids(args, tok) -> list[int]:
    if args.token_ids is not None:
        return args.token_ids
    if tok is None:
        raise CLIError("this model directory has no tokenizer.json: pass --token-ids")
    if args.messages is not None:
        try:
            messages = json.loads(Path(args.messages).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CLIError(f"--messages: cannot read {args.messages}: {e}") from None
        if not isinstance(messages, list):
            raise CLIError("--messages: the file must hold a JSON list of {role, content} objects")
        return tok.encode_chat(messages, add_generation_prompt=True)
    return tok.encode(args.prompt)


def cmd_generate(args) -> int:
    from hybridjax.generate import generate, stream
    from hybridjax.sampling import sampling_params
    from hybridjax.tokenizer import StreamDecoder

    init_distributed(args)
    use_compile_cache(args.compile_cache_dir, not args.no_compile_cache)
    cfg, params, tok, _ = load_model(args.model, args.dtype, args.mesh, args.pack_for_decode, args.quantize)
    prompt = _prompt_ids(args, tok)
    bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
    if bad:
        raise CLIError(f"token id {bad[0]} is outside the vocabulary (0..{cfg.vocab_size - 1})")
    sp = sampling_params(1, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                         repetition_penalty=args.repetition_penalty)
    stops = tuple(tok.eos_token_ids) if tok is not None else cfg.eos_token_id
    max_len = len(prompt) + args.max_new_tokens
    spec = {}
    if args.speculative_tokens:
        if args.stream:
            raise CLIError("--speculative-tokens runs the whole-call generate: drop --stream")
        from hybridjax.speculative import check_speculative

        check_speculative(params, args.speculative_tokens)
        spec = dict(speculative_tokens=args.speculative_tokens)
    if args.stream:
        decoder = StreamDecoder(tok) if tok is not None else None
        out = []
        for t in stream(params, cfg, prompt, max_new_tokens=args.max_new_tokens, stop_ids=stops, seed=args.seed,
                        sampling=sp, max_len=max_len):
            out.append(t)
            if not args.json:
                print(decoder.push(t) if decoder else f"{t} ", end="", flush=True)
        if not args.json:
            print(decoder.flush() if decoder else "", flush=True)
    else:
        g = generate(params, cfg, [prompt], max_new_tokens=args.max_new_tokens, stop_ids=stops, seeds=[args.seed],
                     sampling=sp, max_len=max_len, **spec)
        out = g.token_lists()[0]
        if spec:
            spec = {"speculative": {"drafted": int(g.drafted[0]), "accepted": int(g.accepted[0])}}
    _say_what_compiled(args)
    text = tok.decode(out, skip_special_tokens=True) if tok is not None else None
    if args.json:
        print(json.dumps({"prompt_token_ids": prompt, "token_ids": out, "text": text, **spec}))
    elif not args.stream:
        print(text if text is not None else " ".join(map(str, out)))
    return 0


def _say_what_compiled(args) -> None:
    """After a first run's compiles, one line: how many programs, how long, and that the next
    run skips them (the compile cache keeps them)."""
    from hybridjax.compile_cache import compiled_so_far

    n, seconds = compiled_so_far()
    if n and not args.no_compile_cache:
        print(f"hybridjax: compiled {n} programs in {seconds:.1f} s; the next run loads them instead", file=sys.stderr,
              flush=True)


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt")
    p.add_argument("--model", help="HF model directory or converted checkpoint (default: the embedded default model)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--messages", help="JSON file with a list of chat messages (rendered with the chat template)")
    src.add_argument("--token-ids", type=token_ids, help="comma-separated prompt token ids")
    p.add_argument("--max-new-tokens", type=int_at_least(0), default=64, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely (0 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top probability")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None, help=DTYPE_HELP)
    p.add_argument("--pack-for-decode", action="store_true", help=PACK_HELP)
    p.add_argument("--quantize", choices=list(QUANTIZE_MODES), default=None, help=QUANTIZE_HELP)
    p.add_argument("--stream", action="store_true", help="print tokens as they are produced")
    p.add_argument("--speculative-tokens", type=int, default=0, metavar="K",
                   help="draft K (1-4) tokens per step with the model's MTP head and verify them in one forward "
                        "(same greedy output, same sampling distribution; default 0: off)")
    p.add_argument("--json", action="store_true",
                   help='print {"prompt_token_ids", "token_ids", "text"} (+ "speculative": drafted / accepted counts)')
    add_mesh_args(p)
    add_compile_cache(p)
    p.set_defaults(func=cmd_generate)
