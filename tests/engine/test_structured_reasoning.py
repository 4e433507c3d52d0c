"""Structured output after reasoning (``SamplingParams.reasoning_boundary``) on the real engine
with a tiny random thinking model: greedy outputs equal a reference that applies the choice
constraint by hand to transformers' logits only after ``</think>`` (reasoning_helpers.py), so
reasoning tokens the grammar would forbid come through; sampled JSON answers after reasoning
validate with jsonschema; a prompt that closed the reasoning constrains from the first token."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from transformers import AutoModelForCausalLM

from loraplex.engine.llm import LLM
from loraplex.engine.reasoning_gate import ReasoningGate
from loraplex.reasoning_boundary import ReasoningBoundary
from loraplex.sampling_params import InvalidRequestError, SamplingParams
from loraplex.structured_output import StructuredOutputs
from tests.engine.reasoning_helpers import (END_THINK, THINK, Stepper, byte_ids, end_bias, gated_greedy,
                                           make_thinking_model_dir, thinking_tokenizer)

CHOICES = ["alpha", "alps", "beta", "gamma ray"]
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                   "tag": {"enum": ["x", "y"]}},
    "required": ["ok", "n", "tag"],
    "additionalProperties": False,
}
PROMPTS = ["question:", "why", "Think first. "]


@pytest.fixture(scope="module")
def thinking_dir(tmp_path_factory):
    return make_thinking_model_dir(tmp_path_factory.mktemp("thinking"))


@pytest.fixture(scope="module")
def world(thinking_dir, tmp_path_factory):
    path = thinking_dir
    llm = LLM(model=str(path), dtype="float32", device="cpu", home=tmp_path_factory.mktemp("home"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = llm.get_tokenizer()
    think, end = tok.convert_tokens_to_ids(THINK), tok.convert_tokens_to_ids(END_THINK)
    assert tok.encode(END_THINK, add_special_tokens=False) == [end] and think != end
    return llm, model, tok, think, end


def _params(bias: dict[int, float], starts_in: str, think: int, end: int, max_tokens: int = 40) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logit_bias=bias or None,
                          structured_outputs=StructuredOutputs(choice=CHOICES),
                          reasoning_boundary=ReasoningBoundary((end,), (think,), starts_in))


def _find_case(model, starts_in, think, end, want):
    """The first prompt, with a bias on ``</think>`` (and, for "either", on ``<think>`` so that
    the output opens with it) chosen from transformers' logits, whose reference output has the
    wanted shape (``want(tokens, finish)``) and no near-tie between two tokens."""
    for text in PROMPTS:
        prompt = byte_ids(text)
        base = {}
        if starts_in == "either":  # just enough for <think> to beat the answer's first bytes
            first = Stepper(model, prompt).logits()
            base = {think: max(float(first[4 + ord(c[0])]) for c in CHOICES) - float(first[think]) + 0.3}
            b_end = end_bias(model, prompt + [think], end, base)
        else:
            b_end = end_bias(model, prompt, end, base)
        if b_end is None:
            continue
        bias = {**base, end: b_end}
        tokens, finish, gap = gated_greedy(model, prompt, CHOICES, bias, starts_in, think, end, 40)
        if gap > 0.02 and want(tokens, finish):
            return prompt, bias, tokens, finish
    pytest.fail(f"no case of the wanted shape for {starts_in!r} on this model")


def _not_a_choice_prefix(tok, ids: list[int]) -> bool:
    text = tok.decode(ids)
    return not any(c.startswith(text) for c in CHOICES)


@pytest.mark.parametrize("starts_in", ["reasoning", "either"])
def test_reasoning_is_free_and_the_answer_after_it_is_constrained(world, starts_in):
    llm, model, tok, think, end = world

    def want(tokens, finish):
        if end not in tokens or finish != "stop":
            return False
        at = tokens.index(end)
        opened = tokens[0] == think if starts_in == "either" else think not in tokens
        # some reasoning the grammar would refuse as the answer's start
        return opened and at >= 3 and _not_a_choice_prefix(tok, [t for t in tokens[:at] if t != think])

    prompt, bias, tokens, finish = _find_case(model, starts_in, think, end, want)
    out = llm.generate([prompt], _params(bias, starts_in, think, end))[0]
    assert out.outputs[0].token_ids == tokens and out.finish_reason == finish
    answer = out.text.split(END_THINK, 1)[1]
    assert answer in CHOICES


def test_prompt_closed_reasoning_constrains_from_the_first_token(world):
    """Qwen3 with thinking off: the prompt ends with the empty thinking block, so the output is
    the answer from its first token, however much the model favours opening a reasoning."""
    llm, model, tok, think, end = world
    prompt = tok("<s>user\nhi</s>\n<s>assistant\n<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"]
    bias = {think: 100.0, end: 100.0}
    tokens, finish, _ = gated_greedy(model, prompt, CHOICES, bias, "content", think, end, 40)
    out = llm.generate([prompt], _params(bias, "content", think, end))[0]
    assert out.outputs[0].token_ids == tokens and out.finish_reason == finish == "stop"
    assert out.text in CHOICES
    # "either" with the opening marker pushed away: also the answer from the first token
    out = llm.generate([prompt], _params({think: -100.0}, "either", think, end))[0]
    assert out.text == tok.decode(gated_greedy(model, prompt, CHOICES, {}, "content", think, end, 40)[0][:-1])


def test_reasoning_cut_by_max_tokens_has_no_answer(world):
    """max_tokens counts the reasoning: a model that never closes it ends with "length", its
    output all unconstrained reasoning (the greedy path of the bare model)."""
    llm, model, tok, think, end = world
    prompt = byte_ids("why")
    bias = {end: -100.0}
    tokens, finish, _ = gated_greedy(model, prompt, CHOICES, bias, "reasoning", think, end, 10)
    out = llm.generate([prompt], _params(bias, "reasoning", think, end, max_tokens=10))[0]
    assert finish == "length" and out.outputs[0].token_ids == tokens and out.finish_reason == "length"
    assert END_THINK not in out.text and _not_a_choice_prefix(tok, tokens)


def _sampled_json_params(think: int, end: int) -> SamplingParams:
    # the end marker favoured enough to close every reasoning within max_tokens, not so much
    # that it closes at once: with +9 about 3% of the sequences reasoned at all, so whether any
    # of these 6 did hung on the sampler's random stream (+5: about 80%, all stopping)
    bias = {end: 5.0, 4 + ord('"'): 3.0}
    spec = StructuredOutputs(json=SCHEMA, disable_any_whitespace=True)
    return SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=120, logit_bias=bias, structured_outputs=spec,
                          reasoning_boundary=ReasoningBoundary((end,), (think,), "reasoning"))


def test_sampled_json_after_reasoning_validates(world):
    """Several sampled sequences (n=3, each its own gate and matcher): reasoning of free bytes,
    then JSON that validates against the schema."""
    llm, model, tok, think, end = world
    outs = llm.generate([byte_ids("q:"), byte_ids("data")], _sampled_json_params(think, end))
    free = 0
    for comp in [c for o in outs for c in o.outputs]:
        assert comp.finish_reason == "stop" and comp.token_ids.count(end) == 1, comp.text
        reasoning, answer = comp.text.split(END_THINK)
        jsonschema.validate(json.loads(answer), SCHEMA)
        free += bool(reasoning) and not reasoning.startswith("{")
    assert free  # reasoning the grammar would have refused came through


def test_steps_ahead_give_the_same_reasoning_and_answers(world, thinking_dir, tmp_path):
    """With ``schedule_ahead`` the grammar rows' draws wait for the step before
    (``DeferredDraw``) and each gate opens the grammar at the same token: the same outputs."""
    llm, model, tok, think, end = world
    ahead = LLM(model=str(thinking_dir), dtype="float32", device="cpu", home=tmp_path / "home", schedule_ahead=True)
    prompts = [byte_ids("q:"), byte_ids("data")]
    params = _sampled_json_params(think, end)
    want = [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in llm.generate(prompts, params)]
    got = [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in ahead.generate(prompts, params)]
    assert got == want and any(end in tokens[1:] for out in want for tokens, _ in out)


def test_gate_with_multi_token_markers():
    """Markers of several tokens, against a real llguidance matcher: an opening marker whose
    first tokens the grammar also takes is rolled back once complete; a partial one the answer
    goes on from stays in the answer; the end marker is matched as a sequence."""
    import llguidance.hf
    from llguidance import LLMatcher

    tok = thinking_tokenizer()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok), eos_token=[1])
    grammar = LLMatcher.grammar_from_regex("(<tab|yes)")
    boundary = ReasoningBoundary(tuple(byte_ids("]]")), tuple(byte_ids("<th")), "either")

    matcher = LLMatcher(lltok, grammar, log_level=0)
    gate = ReasoningGate(boundary)
    for token in byte_ids("<th"):  # "<" and "t" fit the grammar, "h" does not
        assert gate.opening_token() == token
        gate.advance(token, matcher)
    assert gate.state == "reasoning" and matcher.validate_tokens(byte_ids("yes")) == 3  # back at the start
    for token in byte_ids("a]b]]"):
        gate.advance(token, matcher)
    assert gate.state == "content"
    for token in byte_ids("yes"):
        gate.advance(token, matcher)
    assert matcher.is_accepting() and not matcher.is_error()

    matcher = LLMatcher(lltok, grammar, log_level=0)
    gate = ReasoningGate(boundary)
    for token in byte_ids("<tab"):  # the marker's first two, then the answer goes on
        gate.advance(token, matcher)
    assert gate.state == "content" and matcher.is_accepting()


def test_bad_boundaries_are_refused(world):
    llm, model, tok, think, end = world
    with pytest.raises(InvalidRequestError) as info:
        ReasoningBoundary((), (think,), "reasoning")
    assert info.value.param == "reasoning_boundary"
    with pytest.raises(InvalidRequestError):
        ReasoningBoundary((end,), (), "either")
    with pytest.raises(InvalidRequestError):
        ReasoningBoundary((end,), (think,), "later")
    with pytest.raises(InvalidRequestError) as info:  # a boundary without a constraint to start
        SamplingParams(reasoning_boundary=ReasoningBoundary((end,)))
    assert info.value.param == "reasoning_boundary"
    with pytest.raises(InvalidRequestError) as info:
        llm.generate([byte_ids("x")], SamplingParams(structured_outputs=StructuredOutputs(choice=["a"]),
                                                     reasoning_boundary=ReasoningBoundary((10_000,))))
    assert info.value.param == "reasoning_boundary" and not llm.engine.has_unfinished()
