"""Throughput of the loraplex engine against transformers' batched ``generate``, same prompts,
same run, same process.

    .venv/bin/python benchmarks/bench_engine.py                      # base section, fp32 + bf16
    .venv/bin/python benchmarks/bench_engine.py --dtypes float32 --only engine
    .venv/bin/python benchmarks/bench_engine.py --section lora       # multi-LoRA (benchmarks/bench_lora.py)
    .venv/bin/python benchmarks/bench_engine.py --section sampling --dtypes float32   # top-k / top-p

Base section: ``--num-requests`` prompts (default 64) x ``--output-tokens`` greedy tokens
(default 32, EOS ignored so every request produces them all) on SmolLM2-135M-Instruct. The
engine gets all requests at once (continuous batching, paged KV); transformers gets them as one
left-padded batch. The prompts differ but begin alike (the chat template's system prompt, 24
tokens, one full KV block; four instruction openings), which the engine computes once when
prefix caching is on; rows with it on and off show what that buys, each round from a cold
cache. Output tokens per second, wall clock. Every side is warmed up once with the full
workload, then ``--repeats`` rounds run the sides in turn; the table gives each side's median
and the median of the per-round ratios (these shared VMs drift by +-20% within minutes).
Sections live in ``SECTIONS``; a new one is ``def section_x(args) -> list[Row]`` plus an entry.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

TOPICS = [
    "the history of the printing press", "how volcanoes form", "why the sky is blue", "the rules of chess",
    "photosynthesis", "the water cycle", "how a bicycle stays upright", "the life of honey bees",
    "black holes", "the causes of the first world war", "how vaccines work", "the Roman empire",
    "plate tectonics", "how compilers work", "the French revolution", "ocean tides",
]
STYLES = [
    "Explain {t} in simple words.",
    "Write a short paragraph about {t}.",
    "Give me three facts about {t}, then summarise them in one sentence for a ten year old child.",
    "I am studying for an exam tomorrow. Could you describe {t} and mention one common misconception?",
]


@dataclass
class Row:
    section: str
    dtype: str
    engine_tps: float | None  # median over rounds
    transformers_tps: float | None  # median over rounds (the baseline column)
    ratio: float | None = None  # median of the per-round ratios
    note: str = ""


def make_prompts(n: int) -> list[str]:
    """``n`` chat prompts, all different up to ``len(STYLES) * len(TOPICS)`` = 64. They share
    beginnings as real chat traffic does (system prompt, instruction openings), never a whole
    prompt, which a prefix cache would turn into an unrealistic win."""
    return [STYLES[(i // len(TOPICS)) % len(STYLES)].format(t=TOPICS[i % len(TOPICS)]) for i in range(n)]


def chat_token_ids(tokenizer, prompts: list[str]) -> list[list[int]]:
    out = []
    for prompt in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        out.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
    return out


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def alternate(runners: dict[str, Callable[[], float]], repeats: int) -> dict[str, list[float]]:
    """Warm every runner up once with the full workload, then ``repeats`` rounds that call each
    runner in turn, so slow phases of a noisy machine hit every side alike."""
    for run in runners.values():
        run()
    rates: dict[str, list[float]] = {name: [] for name in runners}
    for r in range(repeats):
        for name, run in runners.items():
            rates[name].append(run())
        print("  round", r + 1, "  ".join(f"{n} {v[-1]:.1f}" for n, v in rates.items()), "tok/s", flush=True)
    return rates


def ratio_median(num: list[float], den: list[float]) -> float:
    return median([a / b for a, b in zip(num, den)])


def engine_runner(llm, prompt_ids: list[list[int]], output_tokens: int, adapters=None, params=None
                  ) -> Callable[[], float]:
    """One timed ``LLM.generate`` of the whole workload -> output tokens per second (greedy
    unless ``params``)."""
    from loraplex import SamplingParams

    params = params or SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)

    def run() -> float:
        llm.reset_prefix_cache()  # each round starts cold: only sharing within the round counts
        start = time.perf_counter()
        outputs = llm.generate(prompt_ids, params, adapters=adapters)
        return sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start)

    return run


def hf_generate_runner(model, prompt_ids: list[list[int]], output_tokens: int, **extra) -> Callable[[], float]:
    """One timed batched ``generate`` (left-padded, as transformers expects for decoder-only
    models) -> output tokens per second. ``extra`` goes to ``generate`` (PEFT: adapter_names)."""
    import torch

    pad = model.generation_config.pad_token_id
    pad = pad if pad is not None else 0
    width = max(len(p) for p in prompt_ids)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
    kwargs = dict(do_sample=False, pad_token_id=pad, max_new_tokens=output_tokens, min_new_tokens=output_tokens)

    def run() -> float:
        with torch.inference_mode():
            start = time.perf_counter()
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs, **extra)
            elapsed = time.perf_counter() - start
        return (out.shape[1] - width) * out.shape[0] / elapsed

    return run


def section_base(args) -> list[Row]:
    import torch
    from transformers import AutoModelForCausalLM

    from loraplex import LLM
    from loraplex.model.loader import load_tokenizer, resolve_model_dir

    model_dir, _name = resolve_model_dir(args.model, Path(args.home).expanduser())  # converts GGUF once
    prompt_ids = chat_token_ids(load_tokenizer(model_dir), make_prompts(args.num_requests))
    print(f"# {len(prompt_ids)} requests, prompt lengths {min(map(len, prompt_ids))}-"
          f"{max(map(len, prompt_ids))} tokens, {args.output_tokens} output tokens each; "
          f"warm-up + {args.repeats} alternating rounds", flush=True)
    caching = {"on": [True], "off": [False], "both": [True, False]}[args.prefix_caching]
    rows = []
    for dtype in args.dtypes.split(","):
        runners = {}
        if args.only in (None, "engine"):
            for on in caching:
                llm = LLM(model=args.model, dtype=dtype, home=Path(args.home).expanduser(),
                          max_model_len=args.max_model_len, max_num_seqs=max(256, len(prompt_ids)),
                          enable_prefix_caching=on)
                runners[f"engine (prefix caching {'on' if on else 'off'})"] = engine_runner(
                    llm, prompt_ids, args.output_tokens)
        if args.only in (None, "transformers"):
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
            runners["transformers"] = hf_generate_runner(model, prompt_ids, args.output_tokens)
        print(f"## {dtype}", flush=True)
        rates = alternate(runners, args.repeats)
        hf = rates.pop("transformers", None)
        for name, eng in (rates or {"engine": None}).items():  # --only transformers: one row
            rows.append(Row("base", dtype, eng and median(eng), hf and median(hf),
                            ratio_median(eng, hf) if eng and hf else None, name.removeprefix("engine ")))
        runners.clear()
        gc.collect()
    return rows


def section_lora(args) -> list[Row]:
    """Multi-LoRA throughput (32 adapters vs the same engine's base vs PEFT): benchmarks/bench_lora.py."""
    from bench_lora import section_lora as run  # this script's folder is on sys.path

    return run(args)


# (note, SamplingParams fields): Qwen2.5-Instruct's generation config, and top_p alone
SAMPLING = [("top_k 20, top_p 0.8", dict(top_k=20, top_p=0.8)), ("top_p 0.9", dict(top_p=0.9))]


def section_sampling(args) -> list[Row]:
    """The engine sampling with top-k / top-p, ordering only the tokens that can survive
    (``top_k_top_p``) and drawing among a small top_k's candidates, against the same engine
    sorting the whole vocabulary and drawing over it each step (the way before,
    the engine's sampler with ``partial_top_k_max`` 0): temperature 0.8, seeded, prefix caching on, the first dtype."""
    from loraplex import LLM, SamplingParams
    from loraplex.model.loader import load_tokenizer, resolve_model_dir

    model_dir, _name = resolve_model_dir(args.model, Path(args.home).expanduser())
    prompt_ids = chat_token_ids(load_tokenizer(model_dir), make_prompts(args.num_requests))
    dtype = args.dtypes.split(",")[0]
    llm = LLM(model=args.model, dtype=dtype, home=Path(args.home).expanduser(), max_model_len=args.max_model_len,
              max_num_seqs=max(256, len(prompt_ids)))
    sampler = llm.engine.runner.sampler
    default_max = sampler.partial_top_k_max

    def with_limit(run: Callable[[], float], limit: int) -> Callable[[], float]:
        def limited() -> float:
            sampler.partial_top_k_max = limit
            try:
                return run()
            finally:
                sampler.partial_top_k_max = default_max
        return limited

    rows = []
    for note, fields in SAMPLING:
        params = SamplingParams(temperature=0.8, seed=1, max_tokens=args.output_tokens, ignore_eos=True, **fields)
        run = engine_runner(llm, prompt_ids, args.output_tokens, params=params)
        print(f"## {note}", flush=True)
        rates = alternate({"only candidates": with_limit(run, default_max), "full sort": with_limit(run, 0)},
                          args.repeats)
        new, old = rates["only candidates"], rates["full sort"]
        rows.append(Row("sampling", dtype, median(new), median(old), ratio_median(new, old),
                        f"{note}; baseline: the same engine sorting the whole vocabulary"))
    return rows


SECTIONS = {"base": section_base, "lora": section_lora, "sampling": section_sampling}


def print_table(rows: list[Row]) -> None:
    def fmt(x, spec=".1f"):
        return "-" if x is None else format(x, spec)

    print("\n| section | dtype | loraplex tok/s | baseline tok/s | ratio (median of rounds) | note |")
    print("| --- | --- | ---: | ---: | ---: | --- |")
    for r in rows:
        print(f"| {r.section} | {r.dtype} | {fmt(r.engine_tps)} | {fmt(r.transformers_tps)} | "
              f"{fmt(r.ratio, '.2f')}x | {r.note} |")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--section", default="base", help=f"comma list of {', '.join(SECTIONS)} or 'all'")
    parser.add_argument("--only", choices=["engine", "transformers"], default=None,
                        help="run one side only (default both)")
    parser.add_argument("--model", default="smollm2", help="model id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--home", default="~/.loraplex", help="LORAPLEX_HOME (GGUF conversion cache)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--prefix-caching", choices=["on", "off", "both"], default="both",
                        help="engine rows with prefix caching on, off or both (default both; the "
                        "prompts share only the chat template's system prompt)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds after the warm-up (medians reported)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    names = list(SECTIONS) if args.section == "all" else args.section.split(",")
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        print(f"unknown section(s) {unknown}; known: {list(SECTIONS)}", file=sys.stderr)
        return 2
    rows: list[Row] = []
    for name in names:
        rows += SECTIONS[name](args)
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
