"""How long a long prompt's tokenizing holds the server's event loop (every open stream's next
chunk waits for the loop): the chat template and the tokenizer run on the loop (as before) against
on the app's tokenizer thread (``AppContext.run_tokenizer``, what the server does now).

    .venv/bin/python benchmarks/bench_tokenize_lag.py [--model smollm2] [--tokens 35000] [--prompts 5]

SmolLM2's tokenizer, ``--prompts`` chat prompts of about ``--tokens`` tokens rendered and tokenized
one after another, while a ticker task measures the loop's lag (the gap between 1 ms sleeps).
Prints the median and max lag and the time per prompt for each mode.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--home", default="~/.loraplex")
    p.add_argument("--tokens", type=int, default=35000)
    p.add_argument("--prompts", type=int, default=5)
    return p.parse_args()


async def _measure(tokenize, run_on_thread: bool, count: int) -> tuple[list[float], float]:
    from loraplex.server.context import AppContext

    lags: list[float] = []

    async def ticker() -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            lags.append(now - last)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.05)
    lags.clear()
    pool = AppContext.__dataclass_fields__["tokenizer_thread"].default_factory()
    started = time.perf_counter()
    for _ in range(count):
        if run_on_thread:
            await asyncio.get_running_loop().run_in_executor(pool, tokenize)
        else:
            tokenize()
            await asyncio.sleep(0)
    per_prompt = (time.perf_counter() - started) / count
    task.cancel()
    pool.shutdown()
    return lags, per_prompt


def main() -> int:
    args = _args()
    from loraplex.model.loader import load_tokenizer, resolve_model_dir

    model_dir, _ = resolve_model_dir(args.model, Path(args.home).expanduser())
    tok = load_tokenizer(model_dir)
    sentence = "The quick brown fox jumps over the lazy dog near the riverbank. "
    per_sentence = len(tok(sentence, add_special_tokens=False)["input_ids"])
    messages = [{"role": "user", "content": sentence * max(1, args.tokens // per_sentence)}]

    def tokenize() -> int:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return len(tok(text, add_special_tokens=False)["input_ids"])

    n_tokens = tokenize()
    print(f"# {args.prompts} chat prompts of {n_tokens} tokens ({model_dir.name} tokenizer), one after another; "
          "event-loop lag = gap between 1 ms sleeps of a ticker task")
    print("| tokenized on | lag median ms | lag max ms | ms per prompt |")
    print("| --- | --- | --- | --- |")
    for label, on_thread in (("event loop", False), ("tokenizer thread", True)):
        lags, per_prompt = asyncio.run(_measure(tokenize, on_thread, args.prompts))
        print(f"| {label} | {1e3 * statistics.median(lags):.1f} | {1e3 * max(lags):.1f} | {1e3 * per_prompt:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
