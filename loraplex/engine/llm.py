"""Offline batch API: ``LLM(model=..., **engine options).generate(prompts, params)``, and
``chat(conversations, params)`` through the model's chat template (vLLM's ``LLM.chat``)."""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC

from loraplex.beam_search import BeamSearchOutput, BeamSearchParams
from loraplex.chat_content import check_messages, shape_messages
from loraplex.engine.beam_search_offline import run_offline_beam_search
from loraplex.config import EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.outputs import RequestOutput
from loraplex.sampling_params import InvalidRequestError, SamplingParams
from loraplex.template_content_format import CONTENT_FORMAT_OPTIONS, ContentFormatResolver, template_text


# offline, nothing changes between empty steps except the starvation counter: give up after this
_MAX_IDLE_STEPS = 1000


def _normalize_prompts(prompts) -> list[tuple[str | list[int], str | None]]:
    """str | list[int] | a prompt dict, or a list of those -> [(prompt, cache_salt)]. A prompt dict
    is vLLM's: ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}``, with an optional
    ``"cache_salt"``."""
    if isinstance(prompts, (str, dict)):
        return [_one_prompt(prompts)]
    if isinstance(prompts, SequenceABC) and prompts and all(isinstance(t, int) for t in prompts):
        return [(list(prompts), None)]
    if isinstance(prompts, SequenceABC):
        return [_one_prompt(p) for p in prompts]
    raise TypeError("prompts must be a string, token ids, a prompt dict, or a list of those")


def _one_prompt(p) -> tuple[str | list[int], str | None]:
    if isinstance(p, str):
        return p, None
    if isinstance(p, dict):
        unknown = set(p) - {"prompt", "prompt_token_ids", "cache_salt"}
        if unknown or ("prompt" in p) == ("prompt_token_ids" in p):
            raise TypeError('a prompt dict has "prompt" or "prompt_token_ids", and may have "cache_salt"')
        text = p.get("prompt")
        return (text if text is not None else list(p["prompt_token_ids"])), p.get("cache_salt")
    return list(p), None


def _vllm_params(params, sampling_params):
    """``params``, or vLLM's keyword for it (``generate(prompts, sampling_params=...)``)."""
    if sampling_params is None:
        return params
    if params is not None:
        raise InvalidRequestError("give params or sampling_params, not both", param="sampling_params")
    return sampling_params


def _adapters_of(lora_request, count: int) -> list:
    """vLLM's ``lora_request`` (one for every prompt, or a list with None for the base model) ->
    ``adapters``."""
    requests = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * count
    return [None if r is None else r.adapter for r in requests]


class LLM:
    """Generate for a batch of prompts with one engine (vLLM's ``LLM`` interface).

    Engine options are ``EngineConfig`` fields under vLLM's names (``max_num_seqs``,
    ``max_num_batched_tokens``, ``block_size``, ``max_model_len``, ``max_loras``,
    ``generation_config``, ``override_generation_config``, ...); an unknown option is a
    ``TypeError`` that names it.
    """

    def __init__(self, model: str | None = None, dtype: str | None = None, **options):
        unknown = sorted(set(options) - EngineConfig.option_names())
        if unknown:
            raise TypeError(f"LLM got unknown engine option(s): {', '.join(unknown)}")
        if model is not None:
            options["model"] = model
        if dtype is not None:
            options["dtype"] = dtype
        self.engine = LLMEngine(EngineConfig(**options))
        # chat's content format under "auto", detected once per chat template
        self._detected_content_format = ContentFormatResolver("auto")

    @property
    def config(self) -> EngineConfig:
        """The config the engine runs with (``LLMEngine.config``: its step budget is final)."""
        return self.engine.config

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: a new ``SamplingParams`` holding the defaults ``generation_config`` gives
        (the model's ``generation_config.json`` under ``"auto"``, see loraplex/generation_defaults.py);
        ``generate`` and ``chat`` use it when given no params."""
        return self.engine.sampling_defaults.sampling_params()

    def add_adapter(self, name: str, path: str) -> str:
        """Register a PEFT directory under ``name``; returns its content hash."""
        return self.engine.register_adapter(name, str(path))

    def remove_adapter(self, name: str) -> None:
        self.engine.unregister_adapter(name)

    def reset_prefix_cache(self) -> None:
        """Drop every unused prefix-cache block, so the next ``generate`` starts cold."""
        self.engine.reset_prefix_cache()

    def chat(self, messages, params: SamplingParams | list[SamplingParams] | None = None, adapters=None, *,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, lora_request=None, sampling_params=None,
             use_tqdm: bool = False, chat_template_content_format: str = "auto") -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: one conversation (a list of ``{"role", "content"}`` messages) or a
        list of them, rendered with the chat template (``chat_template`` replaces the tokenizer's)
        and generated as ``generate`` does; ``adapters`` one entry per conversation. The
        template writes the special tokens, so none are added on top (as the server's chat).
        ``content`` is a string or a list of text parts, handed to the template as
        ``chat_template_content_format`` says (vLLM's: ``"auto"`` detects it from the template,
        ``"string"`` joins the texts with a newline, ``"openai"`` passes the parts; see
        loraplex/chat_content.py). ``sampling_params`` and ``use_tqdm`` are vLLM's keywords (see
        ``generate``)."""
        params = _vllm_params(params, sampling_params)
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError("continue_final_message needs add_generation_prompt=False",
                                      param="continue_final_message")
        if chat_template_content_format not in CONTENT_FORMAT_OPTIONS:
            raise InvalidRequestError("chat_template_content_format must be one of "
                                      f"{', '.join(CONTENT_FORMAT_OPTIONS)}", param="chat_template_content_format")
        one = bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if one else list(messages)
        for i, conversation in enumerate(conversations):
            check_messages(conversation, "messages" if one else f"messages[{i}]")
        tok = self.engine.tokenizer
        if chat_template is None and not getattr(tok, "chat_template", None):
            raise InvalidRequestError("this model has no chat template: pass chat_template, or use generate",
                                      param="chat_template")
        resolver = (self._detected_content_format if chat_template_content_format == "auto"
                    else ContentFormatResolver(chat_template_content_format))
        fmt = resolver.format_for(template_text(tok, chat_template, tools))
        kwargs = dict(chat_template_kwargs or {})
        if tools:
            kwargs["tools"] = tools
        prompts = []
        for conversation in conversations:
            text = tok.apply_chat_template(shape_messages(conversation, fmt), chat_template=chat_template,
                                           tokenize=False, add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message, **kwargs)
            prompts.append(list(tok(text, add_special_tokens=False)["input_ids"]))
        return self.generate(prompts, params, adapters, lora_request=lora_request)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None, adapters=None,
                 lora_request=None, sampling_params=None, use_tqdm: bool = False,
                 priority: list[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order.

        ``params``: one ``SamplingParams`` for all, or one per prompt; None:
        ``get_default_sampling_params()``. ``adapters``: None, or one
        entry per prompt (None = base model, a registered name, or a PEFT directory path).
        ``lora_request``: vLLM's form of the same, one ``LoRARequest`` for all or one per prompt.
        ``sampling_params`` is vLLM's name for ``params``; ``use_tqdm`` (vLLM's progress bar) is
        accepted and shows nothing. ``priority``: vLLM's, one int per prompt, lower first (not
        with ``scheduling_policy="fcfs"``). A bad prompt raises before anything runs.
        """
        params = _vllm_params(params, sampling_params)
        if lora_request is not None:
            if adapters is not None:
                raise InvalidRequestError("give adapters or lora_request, not both", param="lora_request")
            adapters = _adapters_of(lora_request, len(_normalize_prompts(prompts)))
        items = _normalize_prompts(prompts)
        if params is None:
            params_list = [self.get_default_sampling_params()] * len(items)
        elif isinstance(params, SamplingParams):
            params_list = [params] * len(items)
        else:
            params_list = list(params)
            if len(params_list) != len(items):
                raise InvalidRequestError("params must be one SamplingParams or one per prompt", param="params")
        adapter_list = [None] * len(items) if adapters is None else list(adapters)
        if len(adapter_list) != len(items):
            raise InvalidRequestError("adapters must have one entry per prompt", param="adapters")
        priorities = [0] * len(items) if priority is None else list(priority)
        if len(priorities) != len(items):
            raise InvalidRequestError("priority must have one entry per prompt", param="priority")
        engine = self._idle_engine()
        prepared = []
        for (prompt, salt), p, adapter, prio in zip(items, params_list, adapter_list, priorities):
            req = engine.prepare_request(None, prompt, p, cache_salt=salt, priority=prio)
            req.adapter_id = engine.resolve_adapter(adapter)
            req.final_only = True  # only finished outputs are read below
            prepared.append(req)
        finals = self._run_prepared(prepared)
        return [finals[req.request_id] for req in prepared]

    def _idle_engine(self):
        """The engine, for a call that steps it itself: refused while a running AsyncLLMEngine
        steps it (the engine has no locks)."""
        if getattr(self.engine.driver, "is_running", False):
            raise RuntimeError("this LLM's engine is driven by a running AsyncLLMEngine: shut that one down first")
        return self.engine

    def _run_prepared(self, prepared: list) -> dict[str, RequestOutput]:
        """Add the prepared requests and step the engine until they are all done; request id ->
        final output. On any error (an adapter that fails to load refuses the whole call) every
        one of them is aborted, so nothing stays queued or holds KV blocks."""
        engine = self.engine
        finals: dict[str, RequestOutput] = {}
        idle_steps = 0
        try:
            for req in prepared:
                engine.add_prepared(req)
            while engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        finals[out.request_id] = out
                idle_steps = idle_steps + 1 if engine.last_step_was_empty else 0
                if idle_steps > _MAX_IDLE_STEPS:
                    raise RuntimeError(
                        f"no request could be scheduled for {_MAX_IDLE_STEPS} steps "
                        f"(engine stats: {engine.stats()})"
                    )
        except BaseException:
            for req in prepared:
                engine.abort(req.request_id)
            raise
        return finals

    def beam_search(self, prompts, params: BeamSearchParams, lora_request=None, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: for each prompt (a string, token ids or a prompt dict),
        its best ``params.beam_width`` beams, best first (loraplex/beam_search.py has the
        semantics). ``lora_request``: one for all prompts or one per prompt (None: the base
        model). ``concurrency_limit``: at most this many prompts searched at once (None: all);
        ``use_tqdm`` is accepted and shows nothing."""
        return run_offline_beam_search(self, prompts, params, lora_request, concurrency_limit)
