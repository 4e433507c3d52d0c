"""Structured output with ``schedule_ahead``: a step launched ahead whose rows include a
grammar's computes its logits at launch and draws once the step before is applied
(``pending_run.DeferredDraw``). On the tiny model, a batch mixing JSON-schema (seeded), regex,
choice (greedy) and unconstrained rows gives the same tokens, texts and finish reasons as the
engine that waits, every constrained text still validates, and deferred draws did happen."""

from __future__ import annotations

import json
import re

import jsonschema

from loraplex.engine import model_runner as runner_module
from loraplex.engine.llm import LLM
from loraplex.sampling_params import SamplingParams
from loraplex.structured_output import StructuredOutputs
from tests.engine.test_structured_output import SCHEMA

PATTERN = r"[a-c]{3}-[0-9]{2}"


def _requests() -> tuple[list[str], list[SamplingParams]]:
    prompts = ["person:", "code:", "pick:", "free text", "another person", "more"]
    params = [
        SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=200,
                       structured_outputs=StructuredOutputs(json=SCHEMA, disable_any_whitespace=True)),
        SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=StructuredOutputs(regex=PATTERN)),
        SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=StructuredOutputs(choice=["yes", "no", "maybe"])),
        SamplingParams(temperature=0.0, max_tokens=15, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=9, max_tokens=60, repetition_penalty=1.2,
                       structured_outputs=StructuredOutputs(json_object=True, disable_any_whitespace=True)),
        SamplingParams(temperature=0.7, seed=4, max_tokens=15, ignore_eos=True, frequency_penalty=0.5),
    ]
    return prompts, params


def test_constrained_rows_give_the_same_outputs_ahead(tiny_llama_dir, tmp_path, monkeypatch):
    draws = {"made": 0, "launched": 0}

    class CountedDraw(runner_module.DeferredDraw):
        __slots__ = ()

        def __init__(self, *args):
            draws["made"] += 1
            super().__init__(*args)

        def launched(self):
            if self._tokens is None:
                draws["launched"] += 1
            return super().launched()

    monkeypatch.setattr(runner_module, "DeferredDraw", CountedDraw)
    results = []
    for ahead in (False, True):
        llm = LLM(model=str(tiny_llama_dir), dtype="float32", device="cpu", home=tmp_path / f"home{ahead}",
                  schedule_ahead=ahead)
        prompts, params = _requests()
        outs = llm.generate(prompts, params)
        results.append([[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs])
        engine = llm.engine
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        if not ahead:
            assert draws["made"] == 0
    sync, ahead = results
    assert ahead == sync
    # every one drawn but a last step ahead whose sequences had all ended (dropped unread)
    assert draws["made"] > 10 and draws["launched"] >= draws["made"] - 1, draws
    for text, finish in [(c[1], c[2]) for c in sync[0]]:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert re.fullmatch(PATTERN, sync[1][0][1]) and sync[2][0][1] in ("yes", "no", "maybe")
    text, finish = sync[4][0][1:]
    assert finish == "length" or isinstance(json.loads(text), dict), text


class _RecordingGrammar:
    """A matcher that allows every token and records what it is asked."""

    def __init__(self, vocab: int):
        self.vocab = vocab
        self.masks = 0
        self.consumed: list[int] = []

    def compute_bitmask(self) -> bytes:
        self.masks += 1
        return b"\xff" * ((self.vocab + 7) // 8)

    def consume_token(self, token: int) -> bool:
        self.consumed.append(token)
        return True


def test_a_deferred_draw_leaves_the_grammar_of_a_sequence_ended_since_alone():
    """Drawn after the step before is applied: the row of a sequence that step ended is drawn
    greedily without any option (no mask asked, no token consumed, no prompt kept for its
    repetition penalty); the others as usual, once."""
    import torch

    from loraplex.engine.pending_run import DeferredDraw
    from loraplex.engine.sampler import Sampler
    from loraplex.engine.sequence import Sequence, SequenceStatus

    vocab = 16
    seqs = [Sequence(i, f"r{i}", [1, 2], SamplingParams(temperature=0.0, repetition_penalty=1.3)) for i in range(2)]
    for seq in seqs:
        seq.grammar = _RecordingGrammar(vocab)
        seq.status = SequenceStatus.RUNNING
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0)).abs()  # penalized: divided
    sampler = Sampler()
    draw = DeferredDraw(sampler, logits, seqs, {1})
    assert seqs[0].grammar.masks == 0  # nothing drawn at launch
    seqs[1].status = SequenceStatus.FINISHED_STOPPED  # ended by the step before
    tokens = [t.token_id for t in draw.result()]
    penalized = logits.clone()
    penalized[0, [1, 2]] /= 1.3  # the prompt's tokens, in the live row only
    assert tokens == penalized.argmax(dim=-1).tolist()
    assert len(sampler.prompts) == 1  # the ended sequence's prompt not kept (it may be released already)
    assert (seqs[0].grammar.masks, seqs[0].grammar.consumed) == (1, [tokens[0]])
    assert (seqs[1].grammar.masks, seqs[1].grammar.consumed) == (0, [])
    assert draw.token_ids.tolist() == tokens  # drawn once
    assert seqs[0].grammar.masks == 1
