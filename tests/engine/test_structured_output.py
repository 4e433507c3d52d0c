"""Structured output through the engine: outputs checked by independent validators (json +
jsonschema, re.fullmatch), and greedy choice decoding against a reference that applies the same
constraint by hand to the transformers model's logits.

The tiny model's tokenizer has one token per byte (id = 4 + byte, EOS = 1), so the allowed next
tokens of a choice constraint are easy to list here without llguidance."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from transformers import AutoModelForCausalLM

from loraplex.engine.llm import LLM
from loraplex.sampling_params import InvalidRequestError, SamplingParams
from loraplex.structured_output import StructuredOutputs, escape_regex
from tests.engine.test_engine_exact import hf_greedy_all
from tests.fixtures.tiny_models import EOS_ID

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir, tmp_path_factory):
    return LLM(model=str(tiny_llama_dir), dtype="float32", device="cpu", home=tmp_path_factory.mktemp("home"))


def _texts(outs) -> list[tuple[str, str]]:
    return [(c.text, c.finish_reason) for o in outs for c in o.outputs]


def test_json_schema_outputs_validate(llm):
    params = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=200,
                            structured_outputs=StructuredOutputs(json=SCHEMA))
    outs = llm.generate(["person:", "another"], params)
    for text, finish in _texts(outs):
        assert finish == "stop", text  # the grammar completed, then EOS was the only choice
        jsonschema.validate(json.loads(text), SCHEMA)


def test_regex_and_json_object(llm):
    pattern = r"[a-c]{3}-[0-9]{2}"
    outs = llm.generate(["code:"] * 3, SamplingParams(temperature=1.0, seed=5, max_tokens=20,
                                                       structured_outputs=StructuredOutputs(regex=pattern)))
    assert all(re.fullmatch(pattern, t) and f == "stop" for t, f in _texts(outs))
    # a random model writes long strings: a bias towards closing quotes and braces ends them
    # (the grammar decides where they may go)
    closing = {4 + ord('"'): 6.0, 4 + ord("}"): 6.0}
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=120, logit_bias=closing,
                            structured_outputs=StructuredOutputs(json_object=True))
    for text, finish in _texts(llm.generate(["{", "obj"], params)):
        assert finish == "stop" and isinstance(json.loads(text), dict)


def _reference_choice(model, prompt: list[int], choices: list[str]) -> str:
    """Greedy over the transformers logits, each step restricted to the bytes that keep the
    text a prefix of some choice (EOS once it is one)."""
    text, ids = "", list(prompt)
    with torch.no_grad():
        while True:
            logits = model(torch.tensor([ids])).logits[0, -1]
            allowed = {4 + ord(c[len(text)]) for c in choices if c.startswith(text) and len(c) > len(text)}
            if text in choices:
                allowed.add(EOS_ID)
            best = max(allowed, key=lambda t: float(logits[t]))
            if best == EOS_ID:
                return text
            text += chr(best - 4)
            ids.append(best)


def test_greedy_choice_matches_a_hand_constrained_reference(llm, tiny_llama_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    choices = ["alpha", "alps", "beta", "be", "gamma ray", "a+b (c)"]  # shared prefixes, metacharacters
    prompts = [[4 + b for b in p.encode()] for p in ("pick:", "x", "the answer is")]
    spec = StructuredOutputs(choice=choices)
    constrained = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=spec))
    for prompt, out in zip(prompts, constrained):
        assert out.text == _reference_choice(model, prompt, choices) and out.finish_reason == "stop"
    # unconstrained requests in the same batch are untouched
    mixed = llm.generate(prompts[:2], [SamplingParams(temperature=0.0, max_tokens=6, structured_outputs=spec),
                                       SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)])
    assert mixed[1].token_ids == hf_greedy_all(tiny_llama_dir, [prompts[1]], 6)[0]


def test_bad_constraints_are_refused(llm):
    with pytest.raises(InvalidRequestError) as info:
        StructuredOutputs(regex="a", choice=["b"])
    assert info.value.param == "structured_outputs"
    with pytest.raises(InvalidRequestError):
        StructuredOutputs(json="[1, 2]")
    with pytest.raises(InvalidRequestError) as info:
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputs(regex="(unclosed")))
    assert info.value.param == "structured_outputs" and "regex" in info.value.message
    assert not llm.engine.has_unfinished()
    with pytest.raises(InvalidRequestError):
        StructuredOutputs(grammar="start: undefined_rule").check()
    StructuredOutputs(grammar="start: \"yes\" | \"no\"").check()  # a valid one passes


# SGLang's ebnf example (docs.sglang.io "Structured Outputs"), GBNF as xgrammar and llama.cpp write it
GBNF_CITIES = ('root ::= city | description\n'
               'city ::= "London" | "Paris" | "Berlin" | "Rome"\n'
               'description ::= city " is " status\n'
               'status ::= "the capital of " country\n'
               'country ::= "England" | "France" | "Germany" | "Italy"')
CITIES_LANGUAGE = r"(London|Paris|Berlin|Rome)( is the capital of (England|France|Germany|Italy))?"


def test_gbnf_grammars_are_taken_as_vllms_guidance_backend_takes_them(llm):
    """A grammar in GBNF (``root ::= ...``: vLLM's docs, SGLang's ebnf) is enforced, not
    refused as bad Lark; Lark grammars are taken as they were, and a bad GBNF one is still a 400."""
    params = SamplingParams(temperature=1.0, seed=7, n=4, max_tokens=40,
                            structured_outputs=StructuredOutputs(grammar=GBNF_CITIES))
    for text, finish in _texts(llm.generate(["capital:"], params)):
        assert finish == "stop" and re.fullmatch(CITIES_LANGUAGE, text), text
    with pytest.raises(InvalidRequestError):
        StructuredOutputs(grammar="root ::= undefined_rule").check()
    with pytest.raises(InvalidRequestError):
        StructuredOutputs(grammar='root ::= "unclosed').check()
    StructuredOutputs(grammar='start: "a ::= b"').check()  # Lark that quotes ::= stays Lark


def test_escape_regex_keeps_every_choice_literal():
    for text in ["a+b", "(x)", "1.5", "[y]", "q?", "a|b", "c*", "$^", "{2}", "back\\slash", "a-b ~ #&"]:
        assert re.fullmatch(escape_regex(text), text)


def test_warm_builds_the_tokenizer_once(tiny_llama_dir, tmp_path):
    import threading

    engine = LLM(model=str(tiny_llama_dir), dtype="float32", device="cpu", home=tmp_path).engine
    factory = engine.grammars
    threads = [threading.Thread(target=factory.warm) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    built = factory._lltokenizer
    assert built is not None
    factory.matcher(StructuredOutputs(choice=["x"]))
    assert factory._lltokenizer is built


def test_parallel_masks_equal_serial_ones(llm):
    """GrammarFactory.allowed_tokens (llguidance's threads, into one buffer) gives every matcher
    the same allowed set as asking each one alone, at several points of their grammars."""
    from loraplex.engine.sampler import serial_allowed_tokens

    factory = llm.engine.grammars
    specs = [StructuredOutputs(json=SCHEMA), StructuredOutputs(regex=r"[a-c]{3}-[0-9]{2}"),
             StructuredOutputs(choice=["yes", "no"]), StructuredOutputs(json_object=True)]
    matchers = [factory.matcher(spec) for spec in specs]
    for prefix in ('{"name": "ab', "abc-1", "y", '{"k"'):
        parallel = factory.allowed_tokens(matchers)
        assert parallel.shape == (len(matchers), factory.vocab_size)
        assert (parallel == serial_allowed_tokens(matchers, factory.vocab_size)).all()
        assert parallel.any(axis=1).all()
        for m in matchers:  # advance each along what it allows, where the prefix fits
            for ch in prefix:
                token = 4 + ord(ch)
                if serial_allowed_tokens([m], factory.vocab_size)[0, token]:
                    m.consume_token(token)


def test_disable_any_whitespace_gives_compact_json(llm):
    """vLLM's disable_any_whitespace: no whitespace between JSON tokens; without it the random
    model puts some in (so the option is what removes it)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
              "required": ["a", "b"], "additionalProperties": False}

    def texts(compact: bool) -> list[str]:
        spec = StructuredOutputs(json=schema, disable_any_whitespace=compact)
        params = SamplingParams(temperature=1.0, seed=9, n=4, max_tokens=80, structured_outputs=spec)
        return [t for t, f in _texts(llm.generate(["j"], params)) if f == "stop"]

    compact, loose = texts(True), texts(False)
    assert compact and all(not any(ch in t for ch in " \t\n\r") for t in compact)
    assert all(t == json.dumps(json.loads(t), separators=(",", ":"), ensure_ascii=False) for t in compact)
    assert any(any(ch in t for ch in " \t\n\r") for t in loose)


# --- check()'s verdicts, kept -----------------------------------------------------------------


class _CountingMatcher:
    """llguidance's LLMatcher, counting the grammar checks made through it."""

    def __init__(self):
        import llguidance

        self.real, self.checks = llguidance.LLMatcher, 0

    def validate_grammar_with_warnings(self, grammar):
        self.checks += 1
        return self.real.validate_grammar_with_warnings(grammar)

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.fixture
def matcher(monkeypatch):
    import llguidance

    from loraplex import structured_output

    counting = _CountingMatcher()
    monkeypatch.setattr(llguidance, "LLMatcher", counting)
    monkeypatch.setattr(structured_output, "VERDICTS", structured_output.VerdictCache(3))
    return counting


def test_a_repeated_constraint_is_checked_once(matcher):
    for _ in range(3):  # a new but equal schema each time, as each request parses its own body
        StructuredOutputs(json=json.loads(json.dumps(SCHEMA))).check(param="tools")
    assert matcher.checks == 1
    StructuredOutputs(json=SCHEMA, disable_any_whitespace=True).check()  # another grammar
    StructuredOutputs(json=json.dumps(SCHEMA)).check()  # the schema as text is another input
    assert matcher.checks == 3


def test_a_bad_constraint_is_refused_every_time(matcher):
    from llguidance import LLMatcher

    grammar = "start: undefined_rule"
    is_error, messages = matcher.real.validate_grammar_with_warnings(LLMatcher.grammar_from_lark(grammar))
    assert is_error
    for param in ("structured_outputs", "tools", "structured_outputs"):  # the param is the caller's
        with pytest.raises(InvalidRequestError) as info:
            StructuredOutputs(grammar=grammar).check(param=param)
        assert (info.value.message, info.value.param) == (f"invalid structured output: {messages[0].strip()}", param)
    assert matcher.checks == 1


def test_verdicts_are_bounded_least_recently_used_first(matcher):
    a, b, c, d = (StructuredOutputs(choice=[x]) for x in "abcd")
    for constraint in (a, b, c, a, d):  # a used again, so d evicts b (size 3)
        constraint.check()
    assert matcher.checks == 4
    a.check(), c.check(), d.check()
    assert matcher.checks == 4
    b.check()
    assert matcher.checks == 5
