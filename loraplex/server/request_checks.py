"""The checks a generation request passes after tokenizing and before the engine sees it, so
that a stream never starts with a request the engine would refuse: token ids inside the
vocabulary, no image placeholder on a text-only deployment, the ``--max-logprobs`` cap, the
priority the policy takes, and each prompt's room in the context (which also fills an open
``max_tokens``)."""

from __future__ import annotations

from loraplex.beam_search import check_beam_width_cap
from loraplex.engine.admission_order import check_priority
from loraplex.sampling_params import InvalidRequestError, check_logprobs_cap, check_token_ids_in_vocab
from loraplex.server.context import AppContext
from loraplex.server.errors import bad_request
from loraplex.server.generation import vocab_size
from loraplex.server.limits import check_generation_limits
from loraplex.server.protocol import GenerationRequest


# the request field a sampling count comes from, where the route names it otherwise
_LOGPROBS_FIELD = {"chat": "top_logprobs", "generate": "return_k_alternatives", "sglang_generate": "top_logprobs_num"}


def _check_logprobs_cap(ctx: AppContext, req: GenerationRequest) -> None:
    """The engine's ``--max-logprobs`` check, made here so that a stream never starts with a
    count the engine refuses (under ``-1`` the parsers leave the bound, the vocabulary, to it);
    the error names the field the client sent."""
    try:
        check_logprobs_cap(req.params, ctx.settings.max_logprobs, vocab_size(ctx))
    except InvalidRequestError as exc:
        field = _LOGPROBS_FIELD.get(req.kind, exc.param) if exc.param == "logprobs" else exc.param
        raise bad_request(exc.message, param=field) from None


def prepare(ctx: AppContext, req: GenerationRequest, prompt_ids: list[list[int]]) -> None:
    """Check limits for every prompt; sets max_tokens where the request left it open (to the
    server's default when it has one, never more than the context leaves). Token ids
    in the sampling options are checked here too, so a stream never starts with a request the
    engine would refuse."""
    check_token_ids_in_vocab(req.params, vocab_size(ctx))  # an InvalidRequestError is a 400 naming the field
    image_token = getattr(getattr(ctx.engine, "engine", None), "image_token_id", None)
    if image_token is not None and any(image_token in ids for ids in prompt_ids):
        raise bad_request(f"the prompt holds the image placeholder token (id {image_token}); this server runs "
                          "the model's text part only and serves no images",
                          param="messages" if req.kind == "chat" else "prompt")
    _check_logprobs_cap(ctx, req)
    if req.beam is not None:  # each step asks for 2n logprobs per beam
        check_beam_width_cap(req.params.n, ctx.settings.max_logprobs, vocab_size(ctx), param="n")
    s = ctx.settings
    check_priority(req.priority, s.scheduling_policy)
    effective = []
    for ids in prompt_ids:
        effective.append(
            check_generation_limits(
                prompt_len=len(ids), max_tokens=req.params.max_tokens if req.max_tokens_given else None,
                n=req.params.n, max_model_len=ctx.max_model_len, max_prompt_tokens=s.max_prompt_tokens, max_n=s.max_n,
            )
        )
    if not req.max_tokens_given:  # the server's default (generation config), if any, capped by the context
        room = min(effective)
        default = req.params.max_tokens
        req.params.max_tokens = room if default is None else min(default, room)
        if req.params.min_tokens > req.params.max_tokens:
            raise bad_request("`min_tokens` exceeds what the context leaves", param="min_tokens")
