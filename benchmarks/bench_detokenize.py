"""Host time of incremental detokenizing per token: this checkout against another commit's.

    .venv/bin/python benchmarks/bench_detokenize.py --baseline REV [--streams 256] [--steps 200]
        [--rounds 5]

Every running sequence's new token goes through its ``IncrementalDetokenizer`` each step, and a
streamed request with stop strings also asks how much of its text to hold back
(``held_back``): both are host time of every decode step at large batches. This loads
``loraplex/engine/detokenizer.py`` from this checkout and from ``git show REV:...`` into one
process and feeds both the same tokens: ``--streams`` detokenizers (SmolLM2-135M-Instruct's
tokenizer, this README's text from a different offset each), ``--steps`` tokens each, one token
per stream per step as an engine does, with ``held_back`` after each. Thread CPU time per token,
median of ``--rounds`` rounds, the two alternating; once without stop strings and once with two
(a chat's usual kind, which the text rarely contains).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without install

MODULE = "loraplex/engine/detokenizer.py"
STOPS = {"no stop strings": None, 'stop ["\\n\\nUser:", "</s>"]': ["\n\nUser:", "</s>"]}


def _parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", required=True, help="the commit whose detokenizer is the baseline")
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    return p.parse_args()


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _us_per_token(module, tok, prompt: list[int], token_lists: list[list[int]], stop) -> float:
    from loraplex.sampling_params import SamplingParams

    fast, texts = module.backend_decoder(tok), module.single_token_texts()
    detoks = [module.IncrementalDetokenizer(tok, prompt, SamplingParams(stop=stop), fast, texts)
              for _ in token_lists]
    steps = len(token_lists[0])
    start = time.thread_time()
    for step in range(steps):
        for detok, tokens in zip(detoks, token_lists):
            detok.add_token(tokens[step])
            detok.held_back(False)
    return (time.thread_time() - start) / (len(token_lists) * steps) * 1e6


def main() -> None:
    from loraplex.model.loader import load_tokenizer, resolve_model_dir

    args = _parse_args()
    baseline_src = subprocess.run(["git", "show", f"{args.baseline}:{MODULE}"], cwd=ROOT, check=True,
                                  capture_output=True, text=True).stdout
    baseline_file = Path(tempfile.mkdtemp(prefix="bench-detok-")) / "baseline_detokenizer.py"
    baseline_file.write_text(baseline_src)
    modules = {"baseline": _load(baseline_file, "baseline_detokenizer"), "this": _load(ROOT / MODULE, "this_detokenizer")}

    tok = load_tokenizer(resolve_model_dir("smollm2", Path("~/.loraplex").expanduser())[0])
    ids = tok.encode((ROOT / "README.md").read_text(), add_special_tokens=False)
    token_lists = [ids[i * 97: i * 97 + args.steps] for i in range(args.streams)]
    prompt = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)

    print(f"# {args.streams} streams x {args.steps} tokens, SmolLM2's tokenizer; thread CPU us per token "
          f"(add_token + held_back), median of {args.rounds} rounds")
    print(f"| stop strings | {args.baseline} us | this checkout us | ratio |")
    print("| --- | ---: | ---: | ---: |")
    for label, stop in STOPS.items():
        times: dict[str, list[float]] = {name: [] for name in modules}
        for _ in range(args.rounds):
            for name, module in modules.items():
                times[name].append(_us_per_token(module, tok, prompt, token_lists, stop))
        before, now = statistics.median(times["baseline"]), statistics.median(times["this"])
        print(f"| {label} | {before:.2f} | {now:.2f} | {now / before:.2f} |", flush=True)


if __name__ == "__main__":
    main()
