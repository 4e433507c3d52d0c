"""vLLM's beam search fields on /v1/completions and /v1/chat/completions.

``"use_beam_search": true`` runs beam search (loraplex/beam_search.py) with vLLM's mapping of the
body (its ``to_beam_search_params``): ``n`` beams kept and returned (``n`` choices, best first),
``max_tokens`` / ``max_completion_tokens``, ``ignore_eos``, ``include_stop_str_in_output``
(the finishing EOS in ``token_ids``) and ``length_penalty`` (default 1.0). ``temperature`` is
accepted and changes nothing (the candidates are the model's raw top 2n logprobs). Streaming
works as vLLM's does: the search ends before anything is known, so the stream carries each
choice's whole text in one chunk, then the finish and the usage. Usage counts the prompt once
and, as completion tokens, the returned beams' ``token_ids`` (vLLM's figure; the search computes
more than that).

Fields that would change a sampled answer and that the search does not apply are a 400 naming
the field rather than silently ignored (vLLM ignores most of them): logprobs, echo and prompt
logprobs, stop strings and stop token ids, structured output and tools, and the sampling
controls (top_p, top_k, min_p, penalties, logit_bias, allowed_token_ids, bad_words, min_tokens,
seed) when set to anything but their neutral value; ``early_stopping`` other than false (vLLM's
search always runs max_tokens steps). ``n`` is bound by the server's ``--max-logprobs``: each
step asks for 2n logprobs per beam.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.server.errors import bad_request

# field -> its neutral values: a body may send these with beam search (clients send defaults)
_NEUTRAL: dict[str, tuple] = {
    "top_p": (1, 1.0),
    "top_k": (0, -1),
    "min_p": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "min_tokens": (0,),
    "seed": (),
    "logit_bias": ({},),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "stop": ("", []),
    "stop_token_ids": ([],),
    "early_stopping": (False,),
    "echo": (False,),
    "prompt_logprobs": (),
    "tools": ([],),
    "response_format": ({"type": "text"},),
    "structured_outputs": (),
    "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (),
}
# completions: logprobs is a count (null: none); chat: a boolean, with top_logprobs
_LOGPROBS_NEUTRAL = {"completion": {"logprobs": ()}, "chat": {"logprobs": (False,), "top_logprobs": ()}}


@dataclass
class BeamOptions:
    """The beam-only fields of a request that asked for beam search."""

    length_penalty: float = 1.0


def parse_beam_search(body: dict, kind: str) -> BeamOptions | None:
    """None unless ``use_beam_search`` is true; then the beam options, or a 400 naming the first
    field that beam search does not apply."""
    use = body.get("use_beam_search")
    if use is None or use is False:
        return None
    if use is not True:
        raise bad_request("`use_beam_search` must be a boolean", param="use_beam_search")
    for name, neutral in {**_NEUTRAL, **_LOGPROBS_NEUTRAL[kind]}.items():
        value = body.get(name)
        if value is None or any(value == v and type(value) is type(v) for v in neutral):
            continue
        raise bad_request(f"`{name}` is not supported with beam search (`use_beam_search`); leave it out",
                          param=name, code="unsupported_parameter")
    penalty = body.get("length_penalty", 1.0)
    if penalty is None:
        penalty = 1.0
    if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or penalty != penalty \
            or abs(penalty) == float("inf"):
        raise bad_request("`length_penalty` must be a finite number", param="length_penalty")
    return BeamOptions(length_penalty=float(penalty))
