"""Host CPU per token of one long streamed output: detokenizing each token and building its
delta output, as ``LLMEngine.step`` does for a running request, by 1,000-token window.

    .venv/bin/python benchmarks/bench_long_output.py [--tokens 8000] [--stop ZZZQ]

Tokens are drawn from SmolLM2's word tokens (4-6 characters; ``~/.loraplex/models/smollm2`` from
``loraplex pull smollm2``, else the tests' byte-level tokenizer, about one character per token).
A cost per token that grows from window to window is work that grows with the text so far.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8000)
    p.add_argument("--stop", nargs="*", default=[], help="stop strings (that never occur): the hold-back path")
    p.add_argument("--home", default="~/.loraplex")
    args = p.parse_args()
    from loraplex.engine.detokenizer import backend_decoder, single_token_texts
    from loraplex.engine.request_state import PreparedRequest, RequestState
    from loraplex.engine.sequence import Sequence, SequenceStatus
    from loraplex.model.loader import load_tokenizer
    from loraplex.sampling_params import SamplingParams
    from tests.fixtures.tiny_models import make_tiny_model_dir

    smollm2 = Path(args.home).expanduser() / "models" / "smollm2"
    if (smollm2 / "tokenizer.json").exists():
        tok = load_tokenizer(smollm2)
        words = [t for t in range(1000, 6000) if tok.decode([t]).strip().isalpha()]
    else:
        tok = load_tokenizer(make_tiny_model_dir(Path(tempfile.mkdtemp()) / "m", "llama"))
        words = list(range(4, 250))
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.tokens, stop=args.stop or None)
    prompt = [5, 6, 7]
    seq = Sequence(0, "r", prompt, params)
    seq.status = SequenceStatus.RUNNING
    state = RequestState(PreparedRequest("r", None, prompt, params, None, stream_deltas=True), [seq], tok,
                         backend_decoder(tok), single_token_texts())
    detok = state.tracks[0].detok
    gc.collect()
    gc.freeze()
    windows, start = [], time.thread_time()
    for i in range(args.tokens):
        token = rng.choice(words)
        seq.output_token_ids.append(token)
        detok.add_token(token)
        state.make_output()
        if (i + 1) % 1000 == 0:
            now = time.thread_time()
            windows.append(now - start)
            start = now
    print(f"{args.tokens} tokens, {len(detok.text)} characters, stop strings {args.stop}: us per token, "
          f"by 1000-token window: {' '.join(f'{w * 1e3:.1f}' for w in windows)}; total {sum(windows) * 1e3:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
