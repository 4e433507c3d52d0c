"""Host time of a CUDA-graph decode step, base model against adapters, on any machine.

    .venv/bin/python benchmarks/bench_graph_host.py [--batch 256] [--adapters 0 64] [--rounds 3]

The LoRA step overhead target (issue 4: at most 15% at batch 256, 64 adapters) is measured on a
GPU whose 4-layer decode step is host-bound (kernels/RESULTS.md: 5 ms of host against 1.3 ms of
graph device time), so the host time that adapters add counts there in full. This measures that
part without a GPU: the engine's graph decode path (``DecodeGraphs``: bucket, static buffers,
LoRA metadata, replay) runs on CPU with a stand-in capture whose replay launches nothing, so a
step is all host. A tiny random Llama (one layer, hidden 64) keeps the LM head and the eager
prefill cheap. Each round runs every adapter count once (all streams decode together after one
prefill), with the step's phases timed as the GPU check times them (``kernels/step_phases.py``).
Prints the median per phase over the graph steps of all rounds, and the difference adapters make.
On the GPU the copies and the replay launch cost more (the copies were 45 us each before they
became asynchronous), and the device work is missing here by design.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without install
sys.path.insert(0, str(ROOT / "kernels"))  # step_phases.py, the GPU check's phase timer


def _parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256, help="streams decoding together")
    p.add_argument("--adapters", type=int, nargs="+", default=[0, 64], help="distinct adapters (round-robin)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per stream")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--churn", action="store_true",
                   help="streams end at every step (batch / max-tokens of them), so no two steps have the same batch")
    return p.parse_args()


class _NoReplay:
    """A captured graph that launches nothing: its output is a fixed hidden state."""

    def __init__(self, hidden):
        self.hidden = hidden

    def replay(self) -> None:
        pass


def _host_only_graphs(runner, max_num_seqs: int, hidden_size: int):
    import torch

    from loraplex.engine.cuda_graphs import DecodeGraphs, _Graph

    class HostOnlyGraphs(DecodeGraphs):
        def _capture(self, batch, seg_class, pool):
            hidden = torch.randn(batch, hidden_size, generator=torch.Generator().manual_seed(batch))
            return _Graph(_NoReplay(hidden), hidden)

    return HostOnlyGraphs(runner.model, runner.kv_caches, runner.block_size, runner.max_model_len, max_num_seqs,
                          capture=None, layout=runner.kv_layout)


HIDDEN_SIZE, PROMPT_LEN = 64, 16


def tiny_graph_llm(prefix: str, batch: int, num_adapters: int, max_tokens: int):
    """A one-layer Llama (hidden 64) served through the graph decode path with a replay that
    launches nothing, ``num_adapters`` rank-16 adapters registered; (llm, adapter names, vocab size)."""
    import torch
    from transformers import AutoModelForCausalLM

    from loraplex import LLM
    from tests.fixtures.peft_adapters import make_peft_adapter
    from tests.fixtures.tiny_models import make_tiny_model_dir

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix=prefix))
    model_dir = make_tiny_model_dir(root / "model", "llama", num_hidden_layers=1, hidden_size=HIDDEN_SIZE,
                                    intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    llm = LLM(model=str(model_dir), dtype="float32", device="cpu", home=root / "home",
              max_loras=max(1, num_adapters), max_lora_rank=16, max_num_seqs=batch,
              max_num_batched_tokens=batch * PROMPT_LEN, max_model_len=PROMPT_LEN + max_tokens + 16,
              enable_prefix_caching=False)
    names = [f"a{i:03d}" for i in range(num_adapters)]
    for i, name in enumerate(names):
        llm.add_adapter(name, str(make_peft_adapter(base, root / name, seed=i, r=16, target_modules="all-linear")))
    runner = llm.engine.runner
    runner.decode_graphs = _host_only_graphs(runner, batch, HIDDEN_SIZE)
    return llm, names, base.config.vocab_size


def main() -> int:
    args = _parse_args()
    import torch

    from loraplex import SamplingParams
    from step_phases import NESTED, PHASES, REST, StepPhases

    llm, names, vocab_size = tiny_graph_llm("loraplex-bench-graph-host-", args.batch, max(args.adapters),
                                            args.max_tokens)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, vocab_size, (args.batch, PROMPT_LEN), generator=gen).tolist()
    if args.churn:  # stream i ends after 1 + i % max_tokens tokens: some end at every step
        params = [SamplingParams(max_tokens=1 + i % args.max_tokens, temperature=0.0, ignore_eos=True)
                  for i in range(args.batch)]
    else:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    gc.collect()
    gc.freeze()  # as `loraplex serve` does once its model is loaded: start-up objects leave the collections

    labels = ["step"] + [label for label, _, _ in PHASES] + [REST]
    steps: dict[int, list[dict[str, float]]] = {n: [] for n in args.adapters}
    for _ in range(args.rounds):
        for n in args.adapters:
            adapters = [names[i % n] if n else None for i in range(args.batch)]
            llm.generate(prompts, params, adapters=adapters)  # warm: graphs "captured", slots filled
            with StepPhases(llm) as phases:
                llm.generate(prompts, params, adapters=adapters)
            for s in phases.steps:
                # every graph step with --churn (the batch shrinks through the buckets), else the full ones
                if "graph" in s and s.get("decode_seqs") and (args.churn or s["decode_seqs"] == args.batch):
                    s[REST] = s["step"] - sum(s.get(label, 0.0) for label, _, _ in PHASES if label not in NESTED)
                    steps[n].append(s)

    def median_ms(n: int, label: str) -> float:
        return statistics.median(s.get(label, 0.0) for s in steps[n]) * 1e3

    base_n = args.adapters[0]
    head = ["phase"] + [f"{n} adapters ms" for n in args.adapters] + [f"{n} - {base_n} ms" for n in args.adapters[1:]]
    batch = f"batch {args.batch} shrinking as streams end" if args.churn else f"batch {args.batch}"
    print(f"Host ms per graph decode step (median over {len(steps[base_n])} steps in {args.rounds} rounds), "
          f"{batch}, no device work:\n")
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    for label in labels:
        cells = [f"{median_ms(n, label):.3f}" for n in args.adapters]
        cells += [f"{median_ms(n, label) - median_ms(base_n, label):+.3f}" for n in args.adapters[1:]]
        print(f"| {label} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
