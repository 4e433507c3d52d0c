"""References for beam search tests, written here over a transformers model, independent of
loraplex/beam_search.py: a naive vLLM-semantics beam search (a full forward pass per beam and
step, no KV cache) and transformers' own ``generate(num_beams=...)``; plus a tiny model whose
end-of-sequence token is likely enough to finish beams."""

from __future__ import annotations

from pathlib import Path

import torch

EOS_ID = 1  # tests/fixtures/tiny_models.py
PAD_ID = 2


def naive_vllm_beam_search(model, prompt: list[int], width: int, max_tokens: int, *, length_penalty: float = 1.0,
                           ignore_eos: bool = False, eos_ids=(EOS_ID,)) -> list[tuple[list[int], float, bool]]:
    """vLLM's algorithm as its docs and ``get_beam_search_score`` state it: every live beam is
    expanded by its top ``2 * width`` tokens; EOS children are finished (all of them), the best
    ``width`` others by summed logprob live on; after ``max_tokens`` steps finished and live beams
    are ranked by ``sum / (prompt + generated - final EOS) ** length_penalty``. Returns
    ``(generated tokens, summed logprob, finished on EOS)``, best first."""
    live = [([], 0.0)]
    finished = []
    for _ in range(max_tokens):
        pool = []
        for gen, total in live:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + gen])).logits[0, -1].double()
            logprobs = torch.log_softmax(logits, dim=-1)
            top = logprobs.topk(min(2 * width, logprobs.numel()))
            for value, token in zip(top.values.tolist(), top.indices.tolist()):
                if token in eos_ids and not ignore_eos:
                    finished.append((gen + [token], total + value, True))
                else:
                    pool.append((gen + [token], total + value))
        pool.sort(key=lambda c: -c[1])
        live = pool[:width]
        if not live:
            break
    beams = finished + [(g, t, False) for g, t in live]

    def score(beam):
        gen, total, eos = beam
        return total / ((len(prompt) + len(gen) - (1 if eos else 0)) ** length_penalty)

    return sorted(beams, key=score, reverse=True)[:width]


def hf_beam_search(model, prompt: list[int], width: int, max_tokens: int) -> list[tuple[list[int], float]]:
    """transformers' ``generate(num_beams=width, num_return_sequences=width)``, canonical form
    (``early_stopping="never"``, ``length_penalty=0``: the score is the summed logprob) with no
    end-of-sequence token, so every beam runs ``max_tokens`` tokens. Returns ``(generated
    tokens, summed logprob)`` best first."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            num_beams=width, num_return_sequences=width, do_sample=False, max_new_tokens=max_tokens,
            length_penalty=0.0, early_stopping="never", eos_token_id=None, pad_token_id=PAD_ID,
            output_scores=True, return_dict_in_generate=True,
        )
    seqs = out.sequences[:, len(prompt):].tolist()
    return list(zip(seqs, out.sequences_scores.tolist()))


def make_eos_prone_model_dir(path: Path, boost: float = 0.7) -> Path:
    """The tiny Llama with its EOS row of ``lm_head`` moved towards the mean final hidden state,
    so EOS is among a beam's top candidates at a good share of steps (not at all otherwise)."""
    from transformers import AutoModelForCausalLM

    from tests.fixtures.tiny_models import make_tiny_model_dir

    make_tiny_model_dir(path, "llama")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        states = torch.cat([
            model(torch.randint(4, 260, (1, n), generator=g), output_hidden_states=True).hidden_states[-1][0]
            for n in (3, 7, 12, 20)
        ])
        mean = states.mean(0)
        model.lm_head.weight[EOS_ID] += boost * mean / mean.norm() ** 2
    model.save_pretrained(path)
    return path
