"""Throughput of the loraplex engine against transformers' batched ``generate``, same prompts,
same run, same process.

    .venv/bin/python benchmarks/bench_engine.py                      # base section, fp32 + bf16
    .venv/bin/python benchmarks/bench_engine.py --dtypes float32 --only engine
    .venv/bin/python benchmarks/bench_engine.py --section lora       # multi-LoRA (added by its owner)

Base section: ``--num-requests`` prompts (default 64) x ``--output-tokens`` greedy tokens
(default 32, EOS ignored so every request produces them all) on SmolLM2-135M-Instruct. The
engine gets all requests at once (continuous batching, paged KV); transformers gets them as one
left-padded batch. Output tokens per second, wall clock, after one warm-up call each.
Sections live in ``SECTIONS``; a new one is ``def section_x(args) -> list[Row]`` plus an entry.

Seen 2026-12-02 on the 2-core AVX2 dev VM (shared with other jobs, so ``--threads 1``),
SmolLM2-135M, 64 x 32 tokens: float32 76.6 vs 65.8 tok/s (1.16x); bfloat16 78.1 vs 13.1 tok/s
(5.9x: this CPU has no native bf16, see ``loraplex.model.cpu_linear``).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
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
    engine_tps: float | None
    transformers_tps: float | None
    note: str = ""

    @property
    def ratio(self) -> float | None:
        if self.engine_tps and self.transformers_tps:
            return self.engine_tps / self.transformers_tps
        return None


def make_prompts(n: int) -> list[str]:
    return [STYLES[i % len(STYLES)].format(t=TOPICS[(i * 7) % len(TOPICS)]) for i in range(n)]


def chat_token_ids(tokenizer, prompts: list[str]) -> list[list[int]]:
    out = []
    for prompt in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        out.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
    return out


def bench_engine(args, dtype: str, prompt_ids: list[list[int]]) -> tuple[float, int]:
    from loraplex import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=dtype, home=Path(args.home).expanduser(),
              max_model_len=args.max_model_len, max_num_seqs=max(256, len(prompt_ids)))
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    llm.generate(prompt_ids[:2], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompt_ids, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    del llm
    gc.collect()
    return tokens / elapsed, tokens


def bench_transformers(model_dir: Path, dtype: str, prompt_ids: list[list[int]], output_tokens: int) -> tuple[float, int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    pad = model.generation_config.pad_token_id
    pad = pad if pad is not None else 0
    width = max(len(p) for p in prompt_ids)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids])  # left padding
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
    kwargs = dict(do_sample=False, pad_token_id=pad, max_new_tokens=output_tokens, min_new_tokens=output_tokens)
    with torch.inference_mode():
        model.generate(input_ids[:2], attention_mask=attention_mask[:2], **{**kwargs, "max_new_tokens": 2,
                                                                             "min_new_tokens": 2})
        start = time.perf_counter()
        out = model.generate(input_ids, attention_mask=attention_mask, **kwargs)
        elapsed = time.perf_counter() - start
    tokens = (out.shape[1] - width) * out.shape[0]
    del model
    gc.collect()
    return tokens / elapsed, tokens


def section_base(args) -> list[Row]:
    from loraplex.model.loader import load_tokenizer, resolve_model_dir

    model_dir, _name = resolve_model_dir(args.model, Path(args.home).expanduser())  # converts GGUF once
    prompt_ids = chat_token_ids(load_tokenizer(model_dir), make_prompts(args.num_requests))
    print(f"# {len(prompt_ids)} requests, prompt lengths {min(map(len, prompt_ids))}-"
          f"{max(map(len, prompt_ids))} tokens, {args.output_tokens} output tokens each", flush=True)
    rows = []
    for dtype in args.dtypes.split(","):
        engine_tps = transformers_tps = None
        if args.only in (None, "engine"):
            engine_tps, _ = bench_engine(args, dtype, prompt_ids)
            print(f"  engine       {dtype:9s} {engine_tps:8.1f} tok/s", flush=True)
        if args.only in (None, "transformers"):
            transformers_tps, _ = bench_transformers(model_dir, dtype, prompt_ids, args.output_tokens)
            print(f"  transformers {dtype:9s} {transformers_tps:8.1f} tok/s", flush=True)
        rows.append(Row("base", dtype, engine_tps, transformers_tps))
    return rows


def section_lora(args) -> list[Row]:
    """Multi-LoRA throughput (32 adapters vs the same engine's base vs PEFT): benchmarks/bench_lora.py."""
    from bench_lora import section_lora as run  # this script's folder is on sys.path

    return run(args)


SECTIONS = {"base": section_base, "lora": section_lora}


def print_table(rows: list[Row]) -> None:
    def fmt(x, spec=".1f"):
        return "-" if x is None else format(x, spec)

    print("\n| section | dtype | loraplex tok/s | transformers tok/s | ratio | note |")
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
