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
