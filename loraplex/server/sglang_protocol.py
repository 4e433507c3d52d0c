"""SGLang's native ``/generate`` request (``GenerateReqInput`` of sgl-project/sglang
``srt/managers/io_struct.py``, its ``sampling_params`` as ``srt/sampling/sampling_params.py``
reads them), read into loraplex ``GenerationRequest``s.

- ``text`` (a string, or a list of them: a batch) or ``input_ids`` (a list of token ids, or a
  list of such lists), not both (SGLang lets ``text`` win silently; loraplex says so instead).
- ``sampling_params``: an object, or a list with one object per prompt. SGLang's defaults:
  ``max_new_tokens`` 128, ``temperature`` 1.0 (0 is greedy), ``top_p`` 1, ``top_k`` -1 (all),
  ``min_p`` 0, penalties off, ``n`` 1 (the same in every object, as SGLang requires).
  ``max_new_tokens`` 0 scores the prompt and generates nothing (SGLang's prefill-only request,
  what its ``sgl.function`` frontend sends to cache a prefix and to rank ``select`` choices by
  their logprobs): the engine runs its one step and the token is not shown. Stop
  strings are cut from the text unless ``no_stop_trim``. ``json_schema`` (a JSON string),
  ``regex`` and ``ebnf``: at most one. A key SGLang does not know is refused (SGLang's
  ``SamplingParams`` refuses unknown keywords); keys SGLang knows that would change the output
  and loraplex does not implement (``stop_regex``, ``structural_tag``, ``custom_params``,
  ``spaces_between_special_tokens: false``) are refused by name, never ignored.
- ``lora_path``: an adapter of the caller's tenant (``name`` or ``name@N``), or a list with one
  per prompt (null: the base model).
- ``return_logprob``, ``logprob_start_len`` (-1: output tokens only), ``top_logprobs_num``,
  ``return_text_in_logprobs``; ``rid`` (a string, or one per prompt); ``stream``.

Prompts that share an adapter and sampling parameters run as one loraplex request (a
``Group``); each group is admitted as any request is (tenant limits, rate limits).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from loraplex.sampling_params import InvalidRequestError, SamplingParams
from loraplex.server.body_fields import as_float, is_int, is_number
from loraplex.server.errors import bad_request
from loraplex.server.protocol import GenerationRequest
from loraplex.server.structured_fields import checked_constraint

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's SamplingParams default
# top-level fields that would change the answer and are not served
REFUSED_FIELDS = ("input_embeds", "image_data", "video_data", "audio_data", "custom_logit_processor",
                  "session_params", "token_ids_logprob", "return_hidden_states")
# sampling_params keys SGLang knows and loraplex does not implement
REFUSED_SAMPLING = {
    "stop_regex": "stop regexes are not supported; use `stop` strings",
    "structural_tag": "structural tags are not supported; use `json_schema`, `regex` or `ebnf`",
    "custom_params": "custom logit processors are not supported",
}
SAMPLING_KEYS = frozenset({
    "max_new_tokens", "min_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "n", "json_schema", "regex", "ebnf",
    "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "logit_bias",
    "sampling_seed", "stream_interval", *REFUSED_SAMPLING,
})


@dataclass
class Group:
    """Prompts that run as one loraplex request: same adapter, same sampling parameters."""

    gen: GenerationRequest
    indices: list[int]  # each prompt's place in the request's batch


@dataclass
class SGLangRequest:
    """A validated ``/generate`` request."""

    groups: list[Group]
    batch_size: int
    is_single: bool  # one prompt given as a string / a flat id list, and n == 1: one object back
    n: int
    rids: list[str]  # one per output, in SGLang's order (prompt by prompt, n each)
    stream: bool
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    return_text_in_logprobs: bool
    no_stop_trim: list[bool] = field(default_factory=list)  # per prompt
    max_new_tokens: list[int] = field(default_factory=list)  # per prompt, as asked (0: prompt scoring)


def _error(message: str, param: str | None = None):
    return bad_request(message, param=param)


def _prompts(body: dict) -> tuple[list, bool]:
    text, ids = body.get("text"), body.get("input_ids")
    if text is not None and ids is not None:
        raise _error("Give either `text` or `input_ids`, not both.", "text")
    if text is None and ids is None:
        raise _error("Either `text` or `input_ids` should be provided.", "text")
    if text is not None:
        if isinstance(text, str):
            return [text], True
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return list(text), False
        raise _error("`text` must be a string or a non-empty list of strings.", "text")
    if isinstance(ids, list) and ids and all(is_int(t) for t in ids):
        return [list(ids)], True
    if isinstance(ids, list) and ids and all(isinstance(p, list) and p and all(is_int(t) for t in p) for p in ids):
        return [list(p) for p in ids], False
    raise _error("`input_ids` must be a non-empty list of token ids or a list of such lists.", "input_ids")


def _per_prompt(body: dict, name: str, size: int, check) -> list:
    """``name``'s value for each prompt: one value for all, or a list of ``size``."""
    value = body.get(name)
    if isinstance(value, list):
        if len(value) != size:
            raise _error(f"`{name}` must have one entry per prompt ({size}).", name)
        return [check(v) for v in value]
    return [check(value)] * size


def _lora(value):
    if value is not None and not isinstance(value, str):
        raise _error("`lora_path` must be an adapter name, null, or a list of them.", "lora_path")
    return value or None


def _sampling_dict(value):
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _error("`sampling_params` must be an object or a list of objects.", "sampling_params")
    return value


def _number(sp: dict, name: str, default, *, integer: bool = False):
    v = sp.get(name)
    if v is None:  # SGLang: null is the default
        return default
    if not (is_int(v) if integer else is_number(v)):
        raise _error(f"`sampling_params.{name}` must be {'an integer' if integer else 'a number'}.", name)
    return v if integer else as_float(v)


def _flag(sp: dict, name: str, default: bool) -> bool:
    v = sp.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _error(f"`sampling_params.{name}` must be a boolean.", name)
    return v


def _constraint(sp: dict):
    given = [k for k in ("json_schema", "regex", "ebnf") if sp.get(k) is not None]
    if len(given) > 1:
        raise _error("Only one of regex, json_schema, or ebnf can be set.", given[1])
    if not given:
        return None
    name = given[0]
    value = sp[name]
    if not isinstance(value, str) or not value:
        raise _error(f"`sampling_params.{name}` must be a non-empty string.", name)
    if name == "json_schema":
        try:
            schema = json.loads(value)
        except (ValueError, RecursionError):  # nested past the parser's recursion: no ValueError
            raise _error("`sampling_params.json_schema` must be a JSON schema in a string.", name) from None
        return checked_constraint(name, json=schema)
    return checked_constraint(name, **({"regex": value} if name == "regex" else {"grammar": value}))


def sampling_params(sp: dict, *, logprobs: int | None, prompt_logprobs: int | None) -> tuple[SamplingParams, bool]:
    """``(params, no_stop_trim)`` for one ``sampling_params`` object. ``max_new_tokens`` 0
    (prompt scoring) runs one token, which the caller does not show."""
    for key in sp:
        if key not in SAMPLING_KEYS:
            raise _error(f"Unexpected keyword argument `{key}` in `sampling_params`.", key)
        if key in REFUSED_SAMPLING and sp[key] is not None:
            raise _error(f"`sampling_params.{key}`: {REFUSED_SAMPLING[key]}.", key)
    if not _flag(sp, "spaces_between_special_tokens", True):
        raise _error("`sampling_params.spaces_between_special_tokens`: false is not supported.",
                     "spaces_between_special_tokens")
    max_new = _number(sp, "max_new_tokens", DEFAULT_MAX_NEW_TOKENS, integer=True)
    if max_new < 0:
        raise _error(f"max_new_tokens must be at least 0, got {max_new}.", "max_new_tokens")
    min_new = _number(sp, "min_new_tokens", 0, integer=True)
    if not 0 <= min_new <= max_new:  # SGLang's SamplingParams.verify
        raise _error(f"min_new_tokens must be in [0, max_new_tokens({max_new})], got {min_new}.", "min_new_tokens")
    seed = _number(sp, "sampling_seed", None, integer=True)
    if seed is not None and not -(2**63) <= seed < 2**63:  # the sampler keeps 64 bits
        raise _error("`sampling_params.sampling_seed` must be a 64-bit signed integer.", "sampling_seed")
    temperature = float(_number(sp, "temperature", 1.0))
    top_k = _number(sp, "top_k", -1, integer=True)
    if top_k == 0 or top_k < -1:
        raise _error(f"top_k must be -1 (disable) or at least 1, got {top_k}.", "top_k")
    stop = sp.get("stop")
    if stop is not None and not isinstance(stop, (str, list)):
        raise _error("`sampling_params.stop` must be a string or a list of strings.", "stop")
    bias = sp.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict) or not all(isinstance(k, str) and k.lstrip("-").isdigit() for k in bias):
            raise _error("`sampling_params.logit_bias` must map token ids to biases.", "logit_bias")
        bias = {int(k): v for k, v in bias.items()}
    no_stop_trim = _flag(sp, "no_stop_trim", False)
    try:
        params = SamplingParams(
            n=_number(sp, "n", 1, integer=True),
            max_tokens=max_new or 1,  # 0: the one step a prompt's logprobs take
            min_tokens=min_new,
            # SGLang: temperature below 1e-6 is greedy
            temperature=0.0 if 0 <= temperature < 1e-6 else temperature,
            top_p=float(_number(sp, "top_p", 1.0)),
            top_k=0 if top_k == -1 else top_k,
            min_p=float(_number(sp, "min_p", 0.0)),
            frequency_penalty=float(_number(sp, "frequency_penalty", 0.0)),
            presence_penalty=float(_number(sp, "presence_penalty", 0.0)),
            repetition_penalty=float(_number(sp, "repetition_penalty", 1.0)),
            seed=seed,
            stop=stop or [],
            stop_token_ids=list(sp.get("stop_token_ids") or []),
            ignore_eos=_flag(sp, "ignore_eos", False),
            skip_special_tokens=_flag(sp, "skip_special_tokens", True),
            include_stop_str_in_output=no_stop_trim,
            logit_bias=bias,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            structured_outputs=_constraint(sp),
        )
    except InvalidRequestError as exc:
        raise _error(exc.message, exc.param) from None
    except (TypeError, ValueError) as exc:  # a stop list of non-strings, ids of the wrong type
        raise _error(f"`sampling_params`: {exc}", None) from None
    return params, no_stop_trim


def _rids(body: dict, size: int, n: int, is_single: bool) -> list[str]:
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, (str, list)):
        raise _error("The rid should be a string or a list of strings.", "rid")
    if n > 1:  # SGLang gives each parallel sample an id of its own
        return [uuid.uuid4().hex for _ in range(size * n)]
    if is_single:
        if isinstance(rid, list):
            raise _error("The rid should be a string for a single request.", "rid")
        return [rid or uuid.uuid4().hex]
    if isinstance(rid, list):
        if len(rid) != size or not all(isinstance(r, str) for r in rid):
            raise _error("The specified rids length mismatch with the batch_size for batch processing.", "rid")
        if len(set(rid)) != len(rid):
            raise _error(f"Duplicate request IDs detected within the request: {rid}", "rid")
        return list(rid)
    return [f"{rid}_{i}" for i in range(size)] if rid else [uuid.uuid4().hex for _ in range(size)]


def _logprob_options(body: dict, max_logprobs: int) -> tuple[bool, int, int, bool]:
    want = body.get("return_logprob")
    if want is not None and not isinstance(want, bool):
        raise _error("`return_logprob` must be a boolean (one for every prompt).", "return_logprob")
    start = body.get("logprob_start_len", -1)
    start = -1 if start is None else start
    if not is_int(start) or start < -1:
        raise _error("`logprob_start_len` must be an integer >= -1.", "logprob_start_len")
    top = body.get("top_logprobs_num", 0) or 0
    if not is_int(top) or top < 0 or (max_logprobs != -1 and top > max_logprobs):
        bound = "" if max_logprobs == -1 else f", at most {max_logprobs} (--max-logprobs)"
        raise _error(f"`top_logprobs_num` must be an integer >= 0{bound}.", "top_logprobs_num")
    text = body.get("return_text_in_logprobs", False)
    if not isinstance(text, bool):
        raise _error("`return_text_in_logprobs` must be a boolean.", "return_text_in_logprobs")
    return bool(want), start, top, text


def parse_sglang_request(body, served_model: str, max_logprobs: int = 20, max_n: int = 16) -> SGLangRequest:
    """The request, grouped; a 400 naming the field at fault otherwise. ``n`` is held to
    ``max_n`` (``--max-n``) here, before anything is made per sample (each sample's id)."""
    if not isinstance(body, dict):
        raise _error("request body must be a JSON object")
    for name in REFUSED_FIELDS:
        if body.get(name) not in (None, False, [], {}):
            raise _error(f"`{name}` is not supported by this server.", name)
    prompts, is_single = _prompts(body)
    size = len(prompts)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _error("`stream` must be a boolean.", "stream")
    loras = _per_prompt(body, "lora_path", size, _lora)
    sps = _per_prompt(body, "sampling_params", size, _sampling_dict)
    ns = {_number(sp, "n", 1, integer=True) for sp in sps}
    if len(ns) > 1:
        raise _error("The parallel_sample_num should be the same for all samples in sample params.", "n")
    n = ns.pop()
    if n > max_n:  # admission checks it too, but only after the per-sample ids exist
        raise _error(f"`n` must be <= {max_n}, got {n}", "n")
    want, start, top, text = _logprob_options(body, max_logprobs)
    logprobs = top if want else None
    prompt_logprobs = top if want and start >= 0 else None
    groups: dict[tuple, Group] = {}
    no_stop_trim, max_new_tokens = [], []
    for i, (prompt, lora, sp) in enumerate(zip(prompts, loras, sps)):
        params, trim = sampling_params(sp, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        no_stop_trim.append(trim)
        max_new_tokens.append(_number(sp, "max_new_tokens", DEFAULT_MAX_NEW_TOKENS, integer=True))
        key = (lora, json.dumps(sp, sort_keys=True))
        if key not in groups:
            gen = GenerationRequest(kind="sglang_generate", model=lora or served_model, params=params, stream=stream,
                                    max_tokens_given=True)
            groups[key] = Group(gen=gen, indices=[])
        groups[key].gen.prompts.append(prompt)
        groups[key].indices.append(i)
    single = is_single and n == 1
    return SGLangRequest(groups=list(groups.values()), batch_size=size, is_single=single, n=n,
                         rids=_rids(body, size, n, single), stream=stream, return_logprob=want,
                         logprob_start_len=start, top_logprobs_num=top, return_text_in_logprobs=text,
                         no_stop_trim=no_stop_trim, max_new_tokens=max_new_tokens)
