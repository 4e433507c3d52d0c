"""Beam search's cost, offline: ``LLM.beam_search`` (4 beams, 32 tokens, EOS ignored) on one long
prompt, with prefix caching on (the default) and off, against 32 greedy tokens of the same
prompt. Each step of the search re-submits every beam's whole sequence as a one-token request
(vLLM's design); the prefix cache is what keeps that from recomputing the prompt every step.

    .venv/bin/python benchmarks/bench_beam_search.py [--model smollm2] [--prompt-tokens 256] [--repeats 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


def _run(model: str, home: str, cache: bool, prompt_tokens: int, repeats: int) -> dict:
    from loraplex import LLM, BeamSearchParams, SamplingParams

    llm = LLM(model=model, dtype="float32", home=home, enable_prefix_caching=cache, max_num_batched_tokens=2048)
    vocab = llm.engine.vocab_size
    prompt = [4 + (i * 37) % (vocab - 4) for i in range(prompt_tokens)]
    params = BeamSearchParams(beam_width=4, max_tokens=32, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=4, max_tokens=2, ignore_eos=True))
    beam_s, greedy_s = [], []
    for _ in range(repeats):
        llm.reset_prefix_cache()  # each round starts cold
        before = llm.engine.stats()["prefix_cache_hits"]
        t = time.perf_counter()
        llm.beam_search([{"prompt_token_ids": prompt}], params)
        beam_s.append(time.perf_counter() - t)
        hits = llm.engine.stats()["prefix_cache_hits"] - before
        llm.reset_prefix_cache()
        t = time.perf_counter()
        llm.generate([prompt], greedy)
        greedy_s.append(time.perf_counter() - t)
    return {"beam": statistics.median(beam_s), "greedy": statistics.median(greedy_s), "hits": hits}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--home", default="~/.loraplex", help="LORAPLEX_HOME (GGUF conversion cache)")
    args = ap.parse_args()
    home = str(Path(args.home).expanduser())
    for cache in (True, False):
        r = _run(args.model, home, cache, args.prompt_tokens, args.repeats)
        print(f"prefix caching {'on ' if cache else 'off'}: beam search {r['beam']:.2f} s, greedy {r['greedy']:.2f} s "
              f"({r['beam'] / r['greedy']:.1f}x), prefix-cache hit tokens in the search {r['hits']}")


if __name__ == "__main__":
    main()
