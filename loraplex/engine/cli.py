"""``loraplex generate``: an offline demo generation (no server, no registry).

Example::

    loraplex generate --model smollm2 --chat --prompt "What is the capital of France?"
"""

from __future__ import annotations

import argparse
import logging
import sys
import time


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate text offline with the engine (demo)")
    p.add_argument("--model", default=None, help="HF directory, GGUF file, or 'smollm2' (default: settings)")
    p.add_argument("--dtype", default=None, help="auto | float32 | bfloat16 | float16")
    p.add_argument("--device", default=None, help="auto | cpu | cuda | cuda:N")
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--adapter", default=None, help="PEFT LoRA directory applied to every prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from loraplex.config import Settings
    from loraplex.engine.llm import LLM
    from loraplex.sampling_params import InvalidRequestError, SamplingParams

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    config = Settings().engine_config()
    overrides = {k: v for k, v in (("model", args.model), ("dtype", args.dtype), ("device", args.device)) if v}
    config = config.replace(**overrides)
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=args.stop,
        )
    except InvalidRequestError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    from loraplex.model.gguf import ModelNotFoundError

    try:
        llm = LLM(**vars_of(config))
    except ModelNotFoundError as exc:  # the one line serve and run-batch say, not a traceback
        print(f"error: --model: {exc}", file=sys.stderr)
        return 2
    prompts = list(args.prompt)
    if args.chat:
        tok = llm.get_tokenizer()
        texts = [
            tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
            for p in prompts
        ]
        # the template already holds any BOS token (same as the server's chat route)
        prompts = [list(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    adapters = [args.adapter] * len(prompts) if args.adapter else None
    start = time.perf_counter()
    try:
        outputs = llm.generate(prompts, params, adapters=adapters)
    except InvalidRequestError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - start
    num_tokens = 0
    for prompt, out in zip(args.prompt, outputs):
        num_tokens += len(out.token_ids)
        print(f"### {prompt}\n{out.text}\n[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]")
    print(f"{num_tokens} tokens in {elapsed:.2f}s ({num_tokens / max(elapsed, 1e-9):.1f} tokens/s)", file=sys.stderr)
    return 0


def vars_of(config) -> dict:
    import dataclasses

    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
