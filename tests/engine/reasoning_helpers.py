"""A tiny thinking model and a hand-written reference for structured output after reasoning.

The model is the tiny random Llama with a tokenizer that knows ``<think>`` and ``</think>`` as
single (non-special) tokens, as Qwen3's and DeepSeek-R1's tokenizers do: ids 318 and 319 of the
model's 320. Its bytes are tokens 4..259 (one per byte), so a choice constraint can be applied by
hand over transformers' logits, without llguidance: ``gated_greedy`` is that reference, reasoning
included."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.fixtures.tiny_models import EOS_ID, VOCAB_SIZE, make_tiny_model_dir, make_tiny_tokenizer

THINK, END_THINK = "<think>", "</think>"
# a Qwen3-style template: enable_thinking=false writes an empty thinking block into the prompt
THINKING_CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def thinking_tokenizer():
    tok = make_tiny_tokenizer(VOCAB_SIZE - 2)
    tok.add_tokens([THINK, END_THINK])  # ids VOCAB_SIZE - 2 and VOCAB_SIZE - 1
    tok.chat_template = THINKING_CHAT_TEMPLATE
    return tok


def make_thinking_model_dir(path: Path) -> Path:
    make_tiny_model_dir(path, "llama")
    thinking_tokenizer().save_pretrained(path)
    return path


def byte_ids(text: str) -> list[int]:
    return [4 + b for b in text.encode()]


class Stepper:
    """Greedy steps over transformers' logits with its KV cache: ``logits()`` of the next token,
    ``push(token)`` appends one."""

    def __init__(self, model, prompt: list[int]):
        self.model, self._past, self._pending = model, None, list(prompt)

    def logits(self) -> torch.Tensor:  # [vocab]
        with torch.no_grad():
            out = self.model(torch.tensor([self._pending]), cache=self._past, use_cache=True)
        self._past, self._pending = out.cache, []
        self._last = out.logits[0, -1].clone()
        return self._last

    def push(self, token: int) -> None:
        self._pending.append(token)


def end_bias(model, prompt: list[int], end_id: int, base_bias: dict[int, float], earliest: int = 2,
             horizon: int = 12, path: list[int] | None = None) -> float | None:
    """A bias on ``end_id`` under which greedy decoding (with ``base_bias``) first writes it at a
    step >= ``earliest``: below every earlier step's margin of the best token over it and above
    that step's, with room on both sides; None when the first ``horizon`` steps have no such step.
    ``path``, when given, receives the greedy tokens before ``end_id``."""
    stepper, margins = Stepper(model, prompt), []
    path = [] if path is None else path
    for _ in range(horizon):
        logits = stepper.logits()
        for token, value in base_bias.items():
            logits[token] += value
        best = int(logits.argmax())
        if best == end_id:
            return None
        margin = float(logits[best] - logits[end_id])
        if len(margins) >= earliest and margin < min(margins) - 0.1:
            return (margin + min(margins)) / 2
        margins.append(margin)
        path.append(best)
        stepper.push(best)
    return None


def gated_greedy(model, prompt: list[int], choices: list[str], bias: dict[int, float], starts_in: str,
                 think_id: int, end_id: int, max_tokens: int) -> tuple[list[int], str, float]:
    """Greedy decoding over ``model``'s logits plus ``bias``, with the choice constraint applied
    by hand only in the answer: free while reasoning (up to and including ``end_id``); in
    "either", the first token may be ``think_id`` besides the answer's. Returns the tokens, the
    finish reason and the smallest gap between the best and second-best allowed logit seen (a
    caller skips cases too close to call between two implementations)."""
    stepper, out, state, text, gap = Stepper(model, prompt), [], starts_in, "", float("inf")
    while len(out) < max_tokens:
        logits = stepper.logits()
        for token, value in bias.items():
            logits[token] += value
        if state == "reasoning":
            allowed = range(logits.shape[0])
        else:
            allowed = {4 + c.encode()[len(text)] for c in choices if c.startswith(text) and len(c) > len(text)}
            if text in choices:
                allowed.add(EOS_ID)
            if state == "either":
                allowed.add(think_id)
        ranked = sorted(allowed, key=lambda t: float(logits[t]), reverse=True)
        if len(ranked) > 1:
            gap = min(gap, float(logits[ranked[0]] - logits[ranked[1]]))
        best = ranked[0]
        out.append(best)
        stepper.push(best)
        if best == EOS_ID:
            return out, "stop", gap
        if state == "either":
            state = "reasoning" if best == think_id else "content"
            if state == "reasoning":
                continue
        elif state == "reasoning":
            if best == end_id:
                state = "content"
            continue
        text += chr(best - 4)
    return out, "length", gap
