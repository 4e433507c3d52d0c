"""vLLM's offline ``LLM.chat``: conversations rendered by the chat template (the tokenizer called
directly is the reference for the prompt ids), generated as ``generate`` runs token ids, one or
many conversations, with adapters, a replacement template and a continued final message."""

from __future__ import annotations

import pytest

from loraplex import SamplingParams
from loraplex.sampling_params import InvalidRequestError
from tests.engine.test_engine_exact import hf_greedy_all, tight_llm

PARAMS = SamplingParams(temperature=0.0, max_tokens=5, min_tokens=5)
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is two and two"}]
OTHER = [{"role": "user", "content": "name a colour"}]
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<bot>{% endif %}"


def _ids(tok, conversation, **kwargs) -> list[int]:
    text = tok.apply_chat_template(conversation, tokenize=False, **kwargs)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def test_chat_is_generate_on_the_template_render(tiny_llama_dir, loraplex_home):
    llm = tight_llm(tiny_llama_dir, loraplex_home, num_blocks=64)
    tok = llm.get_tokenizer()
    if not getattr(tok, "chat_template", None):
        tok.chat_template = TEMPLATE
    one = llm.chat(CHAT, PARAMS)
    both = llm.chat([CHAT, OTHER], PARAMS)
    refs = [_ids(tok, c, add_generation_prompt=True) for c in (CHAT, OTHER)]
    assert one[0].prompt_token_ids == refs[0] and [o.prompt_token_ids for o in both] == refs
    assert [o.token_ids for o in both] == hf_greedy_all(tiny_llama_dir, refs, 5)
    assert one[0].token_ids == both[0].token_ids


def test_template_options_and_errors(tiny_llama_dir, loraplex_home):
    llm = tight_llm(tiny_llama_dir, loraplex_home, num_blocks=64)
    tok = llm.get_tokenizer()
    out = llm.chat(CHAT, PARAMS, chat_template=TEMPLATE)[0]
    assert out.prompt_token_ids == _ids(tok, CHAT, chat_template=TEMPLATE, add_generation_prompt=True)
    prefill = [*CHAT, {"role": "assistant", "content": "It is"}]
    out = llm.chat(prefill, PARAMS, chat_template=TEMPLATE, add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt_token_ids == _ids(tok, prefill, chat_template=TEMPLATE, continue_final_message=True)
    with pytest.raises(InvalidRequestError, match="continue_final_message"):
        llm.chat(prefill, PARAMS, chat_template=TEMPLATE, continue_final_message=True)
    tok.chat_template = None
    with pytest.raises(InvalidRequestError, match="no chat template"):
        llm.chat(CHAT, PARAMS)
    assert llm.engine.num_unfinished_requests == 0


def test_vllm_lora_request_names_the_adapter(tiny_llama_dir, loraplex_home, tmp_path):
    """``lora_request=LoRARequest(name, id, path)`` runs exactly what ``adapters=[path]`` runs."""
    from transformers import AutoModelForCausalLM

    from loraplex import LoRARequest
    from tests.fixtures.peft_adapters import make_peft_adapter

    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir))
    path = str(make_peft_adapter(base, tmp_path / "sql", seed=3, r=4, lora_alpha=8))
    llm = tight_llm(tiny_llama_dir, loraplex_home, num_blocks=64)
    prompts = [[5, 6, 7], [8, 9, 10]]
    expected = llm.generate(prompts, PARAMS, adapters=[path, None])
    got = llm.generate(prompts, PARAMS, lora_request=[LoRARequest("sql", 1, path), None])
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert expected[0].token_ids != expected[1].token_ids or expected[0].adapter_id != expected[1].adapter_id
    every = llm.generate(prompts, PARAMS, lora_request=LoRARequest("sql", 1, path))
    assert [o.adapter_id for o in every] == [expected[0].adapter_id] * 2
    llm.add_adapter("sql", path)
    assert llm.chat(CHAT, PARAMS, chat_template=TEMPLATE, lora_request=LoRARequest("sql", 1))[0].adapter_id == \
        expected[0].adapter_id
    with pytest.raises(InvalidRequestError, match="not both"):
        llm.generate(prompts, PARAMS, adapters=[None, None], lora_request=LoRARequest("sql", 1, path))


def test_vllm_keywords_sampling_params_and_use_tqdm(tiny_llama_dir, loraplex_home):
    llm = tight_llm(tiny_llama_dir, loraplex_home, num_blocks=64)
    expected = llm.generate([[5, 6, 7]], PARAMS)[0].token_ids
    assert llm.generate([[5, 6, 7]], sampling_params=PARAMS, use_tqdm=False)[0].token_ids == expected
    assert llm.chat(CHAT, sampling_params=PARAMS, chat_template=TEMPLATE, use_tqdm=True)[0].token_ids == \
        llm.chat(CHAT, PARAMS, chat_template=TEMPLATE)[0].token_ids
    with pytest.raises(InvalidRequestError, match="not both"):
        llm.generate([[5, 6, 7]], PARAMS, sampling_params=PARAMS)


def test_content_parts_reach_the_template_as_vllm_hands_them(tiny_llama_dir, loraplex_home):
    """vLLM's ``chat_template_content_format``: "auto" gives a template that loops over content
    the parts, and a string template the texts joined with "\\n"; "string" / "openai" override."""
    from tests.fixtures.chat_templates import GEMMA3_LIKE, LLAMA3_LIKE

    llm = tight_llm(tiny_llama_dir, loraplex_home, num_blocks=64)
    tok = llm.get_tokenizer()
    texts = [" what is ", " two and two "]
    sent = [{"role": "user", "content": [{"type": "text", "text": t} for t in texts]}]
    joined = [{"role": "user", "content": "\n".join(texts)}]  # vLLM's string format, written out
    short = SamplingParams(temperature=0.0, max_tokens=1)
    cases = [(GEMMA3_LIKE, "auto", sent), (LLAMA3_LIKE, "auto", joined), (GEMMA3_LIKE, "string", joined),
             (LLAMA3_LIKE, "openai", sent)]
    for template, option, reference in cases:
        out = llm.chat(sent, short, chat_template=template, chat_template_content_format=option)[0]
        assert out.prompt_token_ids == _ids(tok, reference, chat_template=template, add_generation_prompt=True), option
    assert llm._detected_content_format.cached_templates() == 2  # auto detected each template once
    with pytest.raises(InvalidRequestError) as info:
        llm.chat([OTHER, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]], short)
    assert info.value.param == "messages[1][0].content"
    with pytest.raises(InvalidRequestError) as info:
        llm.chat(sent, short, chat_template_content_format="list")
    assert info.value.param == "chat_template_content_format"
    assert llm.engine.num_unfinished_requests == 0
