"""The sampling fields of a completions or chat request (OpenAI's and vLLM's names) ->
``SamplingParams``; ``stop`` is read the same way by the TGI parser (tgi_protocol.py)."""

from __future__ import annotations

import re

from loraplex.generation_defaults import SamplingDefaults
from loraplex.sampling_params import InvalidRequestError, SamplingParams
from loraplex.server.body_fields import is_int, read_bool, read_int, read_int_list, read_number
from loraplex.server.errors import bad_request


def parse_stop(body) -> list[str]:
    """``stop``: one string or a list of them, none empty."""
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad_request("`stop` must be a non-empty string or a list of them", param="stop")
    return stop


def _bad_words(body) -> list[str] | None:
    words = body.get("bad_words")  # checked by SamplingParams
    return None if words is None or words == [] else words


_TOKEN_KEY = re.compile(r"[0-9]+")


def _logit_bias(body) -> dict[int, float] | None:
    """OpenAI's ``logit_bias``: an object of token ids (JSON keys are strings; ints are taken
    too) to a bias; the values' range is SamplingParams's check. Ids past the vocabulary are
    refused once the model is known."""
    raw = body.get("logit_bias")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise bad_request("`logit_bias` must be an object mapping token ids to biases", param="logit_bias")
    out: dict[int, float] = {}
    for key, value in raw.items():
        if is_int(key) and key >= 0:
            token = key
        elif isinstance(key, str) and _TOKEN_KEY.fullmatch(key):
            token = int(key)
        else:
            raise bad_request(
                f"`logit_bias` keys must be token ids (non-negative integers), got {key!r}", param="logit_bias"
            )
        out[token] = value
    return out


def logprobs_cap(max_logprobs: int) -> int | None:
    """The parse-time bound of a logprobs count: the server's ``max_logprobs`` (-1: none here;
    the engine holds it to the vocabulary)."""
    return None if max_logprobs == -1 else max_logprobs


def parse_sampling(body: dict, max_tokens: int | None, logprobs: int | None,
                   defaults: SamplingDefaults) -> SamplingParams:
    """The sampling fields common to both endpoints, checked for type here and for range by
    SamplingParams (its InvalidRequestError already names the field). A field left out or null
    takes the server's default (``defaults``: the model's generation config, as vLLM), else the
    library's."""
    kwargs = dict(
        n=read_int(body, "n", 1, lo=1),
        max_tokens=max_tokens,
        min_tokens=read_int(body, "min_tokens", 0, lo=0),
        temperature=read_number(body, "temperature", defaults.get("temperature", 1.0), lo=0.0, hi=2.0),
        top_p=read_number(body, "top_p", defaults.get("top_p", 1.0), lo=0.0, hi=1.0),
        top_k=read_int(body, "top_k", defaults.get("top_k", 0), lo=-1),
        min_p=read_number(body, "min_p", defaults.get("min_p", 0.0), lo=0.0, hi=1.0),
        repetition_penalty=read_number(body, "repetition_penalty", defaults.get("repetition_penalty", 1.0)),
        presence_penalty=read_number(body, "presence_penalty", 0.0, lo=-2.0, hi=2.0),
        frequency_penalty=read_number(body, "frequency_penalty", 0.0, lo=-2.0, hi=2.0),
        seed=read_int(body, "seed", None, lo=-(2**63), hi=2**63 - 1),  # vLLM: a 64-bit signed integer
        stop=parse_stop(body),
        stop_token_ids=read_int_list(body, "stop_token_ids"),
        ignore_eos=read_bool(body, "ignore_eos", False),
        logprobs=logprobs,
        skip_special_tokens=read_bool(body, "skip_special_tokens", True),
        include_stop_str_in_output=read_bool(body, "include_stop_str_in_output", False),
        logit_bias=_logit_bias(body),
        allowed_token_ids=read_int_list(body, "allowed_token_ids") if body.get("allowed_token_ids") is not None else None,
        bad_words=_bad_words(body),
    )
    if kwargs["top_p"] == 0.0:
        raise bad_request("`top_p` must be > 0", param="top_p")
    try:
        return SamplingParams(**kwargs)
    except InvalidRequestError as exc:
        raise bad_request(exc.message, param=exc.param, code=exc.code) from None
