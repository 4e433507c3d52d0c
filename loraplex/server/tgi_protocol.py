"""LoRAX's (and TGI's) native generate request, read into loraplex's ``GenerationRequest``.

The body is ``{"inputs": str, "parameters": {...}}`` (plus ``"stream"`` on ``POST /``), with
LoRAX's field names and meanings (predibase/lorax ``router/src/lib.rs`` ``GenerateParameters``,
``router/src/validation.rs``, ``server/lorax_server/utils/tokens.py``):

- ``adapter_id``: an adapter of the caller's tenant (its active version) or ``name@N``; absent,
  empty or the base model's name: the base model.
- ``merged_adapters``: several of the tenant's adapters merged into one for the request
  (merged_adapters.py); not with a non-empty ``adapter_id``.
- Greedy unless sampling is asked for: ``do_sample``, or any warper (``temperature`` other than
  1 and 0, ``top_k``, ``top_p`` < 1); ``temperature: 0`` is greedy even with ``do_sample``.
  A sampled request without ``seed`` gets a random one, reported in ``details.seed`` (null when
  greedy), so passing it back gives the same text.
- These defaults are LoRAX's own: ``--generation-config`` (the model's sampling defaults, an
  OpenAI-route notion from vLLM) does not apply here, as neither LoRAX nor TGI reads sampling
  defaults from ``generation_config.json`` and an unset field here means greedy, not "the
  library's default". An operator's ``max_new_tokens`` ceiling (a folder's file, or the
  override) does hold here (``tgi_routes``): it is vLLM's limit on every request.
- ``max_new_tokens`` defaults to what the context leaves; stop sequences stay in the text
  (TGI's rule), so the text ends with the stop sequence that ended it.
- ``details`` (default false) asks for per-token ids, texts and logprobs;
  ``decoder_input_details`` for the prompt's (``prefill``, through prompt logprobs; not with
  streams, as LoRAX); ``return_k_alternatives`` for the top k of each step.
- ``response_format`` ``{"type": "json_object", "schema": {...}}`` (LoRAX; no schema: any JSON
  object) and TGI's ``grammar`` ``{"type": "json" | "regex", "value": ...}``: structured output.

Fields that would change the output but are not implemented are refused (422, LoRAX's
``validation`` error naming the field), never ignored: ``adapter_source`` other than ``"local"``
(adapters come from loraplex's registry, not the Hub, S3 or Predibase),
``watermark: true``, ``typical_p`` < 1, ``best_of`` > 1, ``apply_chat_template: true``, TGI's
``top_n_tokens``. Other unknown fields are ignored, as LoRAX's parser ignores them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from loraplex.sampling_params import InvalidRequestError, SamplingParams
from loraplex.server.body_fields import read_bool, read_int, read_number
from loraplex.server.errors import bad_request
from loraplex.server.merged_adapters import parse_merged_adapters
from loraplex.server.protocol import MAX_TOP_LOGPROBS, GenerationRequest
from loraplex.server.sampling_fields import parse_stop
from loraplex.server.structured_fields import checked_constraint
from loraplex.structured_output import StructuredOutputs

ADAPTER_SOURCES_SERVED = (None, "local")
SEED_BITS = 53  # a random seed survives a round trip through any JSON client (doubles)


@dataclass
class TGIRequest:
    """A validated generate request: the engine request plus what shapes the answer."""

    gen: GenerationRequest
    inputs: str
    adapter_id: str | None  # as the client sent it (None: the base model)
    details: bool
    decoder_input_details: bool
    return_full_text: bool
    alternatives: int  # return_k_alternatives (0: none)
    truncate: int | None  # keep only the prompt's last N tokens
    seed: int | None  # reported in details: the sampling seed, None when greedy
    merged: tuple | None = None  # (ids, MergeParams) of ``merged_adapters``; None: none asked


def unsupported(param: str, why: str):
    return bad_request(f"`{param}`: {why}", param=param, code="unsupported_parameter")


def _refuse_unsupported(p: dict, stream: bool) -> None:
    source = p.get("adapter_source")
    if source not in ADAPTER_SOURCES_SERVED:
        raise unsupported("adapter_source", f"{source!r} is not served: adapters come from loraplex's registry "
                          "(upload them through the admin API); leave it out or send \"local\"")
    if read_bool(p, "watermark", False):
        raise unsupported("watermark", "watermarking is not supported")
    typical_p = read_number(p, "typical_p", None)
    if typical_p is not None and not 0.0 < typical_p <= 1.0:
        raise bad_request("`typical_p` must be > 0.0 and < 1.0", param="typical_p")
    if typical_p is not None and typical_p < 1.0:
        raise unsupported("typical_p", "typical sampling is not supported")
    best_of = read_int(p, "best_of", None)
    if best_of is not None and best_of < 1:
        raise bad_request("`best_of` must be strictly positive", param="best_of")
    if best_of is not None and best_of > 1:
        raise unsupported("best_of", "`best_of` > 1 is not supported")
    if read_bool(p, "apply_chat_template", False):
        raise unsupported("apply_chat_template", "use /v1/chat/completions for chat messages")
    if read_int(p, "top_n_tokens", None):
        raise unsupported("top_n_tokens", "not supported; `return_k_alternatives` gives the top k of each step")
    if stream and read_bool(p, "decoder_input_details", False):
        raise bad_request("`decoder_input_details` == true is not supported when streaming tokens",
                          param="decoder_input_details")


def _structured(p: dict) -> StructuredOutputs | None:
    found = []
    fmt = p.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_object":
            raise bad_request('`response_format` must be {"type": "json_object", "schema": {...}}',
                              param="response_format")
        schema = fmt.get("schema")
        if schema is not None and not isinstance(schema, dict):
            raise bad_request("`response_format.schema` must be a JSON schema (an object)", param="response_format")
        found.append(("response_format", {"json": schema} if schema else {"json_object": True}))
    grammar = p.get("grammar")
    if grammar is not None:  # TGI's field
        kind = grammar.get("type") if isinstance(grammar, dict) else None
        value = grammar.get("value") if isinstance(grammar, dict) else None
        if kind == "json" and isinstance(value, (dict, str)) and value:
            found.append(("grammar", {"json": value}))
        elif kind == "regex" and isinstance(value, str) and value:
            found.append(("grammar", {"regex": value}))
        else:
            raise bad_request(
                '`grammar` must be {"type": "json", "value": <schema>} or {"type": "regex", "value": str}', param="grammar"
            )
    if len(found) > 1:
        raise bad_request("`grammar`: one structured output constraint per request (`response_format` gives one)",
                          param="grammar")
    if not found:
        return None
    field, spec = found[0]
    return checked_constraint(field, **spec)


def parameters(body: dict) -> dict:
    """The request's ``parameters`` object ({} when absent)."""
    p = body.get("parameters")
    if p is None:
        return {}
    if not isinstance(p, dict):
        raise bad_request("`parameters` must be an object", param="parameters")
    return p


def _positive(p: dict, name: str, message: str):
    v = read_number(p, name, None)
    if v is not None and v <= 0:
        raise bad_request(message, param=name)
    return v


def parse_generate_request(body, served_model: str, *, stream: bool | None,
                           max_logprobs: int = MAX_TOP_LOGPROBS) -> tuple[TGIRequest, bool]:
    """``(request, stream)``. ``stream=None``: the body's ``stream`` decides (``POST /``).
    ``max_logprobs``: the server's ``--max-logprobs``, the bound of ``return_k_alternatives``
    (-1: the vocabulary, checked by ``request_checks.prepare``)."""
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    inputs = body.get("inputs")
    if not isinstance(inputs, str):
        raise bad_request("`inputs` is required and must be a string", param="inputs")
    if not inputs:
        raise bad_request("`inputs` cannot be empty", param="inputs")
    if stream is None:
        stream = read_bool(body, "stream", False)
    p = parameters(body)
    _refuse_unsupported(p, stream)

    adapter_id = p.get("adapter_id")
    if adapter_id is not None and not isinstance(adapter_id, str):
        raise bad_request("`adapter_id` must be a string", param="adapter_id")
    merged = None
    if p.get("merged_adapters") is not None:
        if adapter_id:  # lorax-client's own rule (types.py Parameters.valid_adapter_id)
            raise bad_request("`merged_adapters`: you must specify at most one of `adapter_id` or `merged_adapters`",
                              param="merged_adapters")
        merged = parse_merged_adapters(p["merged_adapters"])
    temperature = read_number(p, "temperature", None, lo=0.0)
    top_k = read_int(p, "top_k", None)
    if top_k is not None and top_k <= 0:
        raise bad_request("`top_k` must be strictly positive", param="top_k")
    top_p = _positive(p, "top_p", "`top_p` must be > 0.0 and < 1.0")
    if top_p is not None and top_p > 1.0:
        raise bad_request("`top_p` must be > 0.0 and < 1.0", param="top_p")
    repetition_penalty = _positive(p, "repetition_penalty", "`repetition_penalty` must be strictly positive")
    max_new_tokens = read_int(p, "max_new_tokens", None)
    if max_new_tokens is not None and max_new_tokens < 1:
        raise bad_request("`max_new_tokens` must be strictly positive", param="max_new_tokens")
    seed = read_int(p, "seed", None, lo=0, hi=2**64 - 1)  # LoRAX: a u64; the sampler keeps 64 bits
    truncate = read_int(p, "truncate", None)
    if truncate is not None and truncate < 1:
        raise bad_request("`truncate` must be strictly positive", param="truncate")
    alternatives = read_int(p, "return_k_alternatives", None)
    if alternatives is not None and (alternatives < 1 or -1 < max_logprobs < alternatives):
        bound = "" if max_logprobs == -1 else f", at most {max_logprobs} (--max-logprobs)"
        raise bad_request(f"`return_k_alternatives` must be >= 1{bound}", param="return_k_alternatives")
    decoder_input_details = read_bool(p, "decoder_input_details", False)
    details = read_bool(p, "details", False) or decoder_input_details

    # LoRAX's NextTokenChooser: a warper turns sampling on; temperature 0 turns it off
    warped = (temperature not in (None, 0.0, 1.0)) or top_k is not None or (top_p is not None and top_p < 1.0)
    sampling = (read_bool(p, "do_sample", False) or warped) and temperature != 0.0
    if sampling and seed is None:
        seed = random.getrandbits(SEED_BITS)
    try:
        params = SamplingParams(
            max_tokens=max_new_tokens,
            temperature=(1.0 if temperature is None else temperature) if sampling else 0.0,
            top_k=top_k or 0,
            top_p=top_p or 1.0,
            repetition_penalty=1.0 if repetition_penalty is None else repetition_penalty,
            frequency_penalty=read_number(p, "frequency_penalty", 0.0, lo=-2.0, hi=2.0),
            presence_penalty=read_number(p, "presence_penalty", 0.0, lo=-2.0, hi=2.0),
            seed=seed if sampling else None,
            stop=parse_stop(p),
            ignore_eos=read_bool(p, "ignore_eos_token", False),
            # every streamed token carries its logprob, as does every token of `details`
            logprobs=alternatives or (0 if details or stream else None),
            prompt_logprobs=0 if decoder_input_details else None,
            include_stop_str_in_output=True,  # TGI keeps the stop sequence in the text
            structured_outputs=_structured(p),
        )
    except InvalidRequestError as exc:
        raise bad_request(exc.message, param=exc.param) from None
    model = adapter_id or served_model
    gen = GenerationRequest(kind="generate", model=model, params=params, prompts=[inputs], stream=stream,
                            max_tokens_given=max_new_tokens is not None)
    full_text = p.get("return_full_text")
    if full_text is not None and not isinstance(full_text, bool):
        raise bad_request("`return_full_text` must be a boolean", param="return_full_text")
    req = TGIRequest(gen=gen, inputs=inputs, adapter_id=adapter_id or None, details=details,
                     decoder_input_details=decoder_input_details, return_full_text=bool(full_text),
                     alternatives=alternatives or 0, truncate=truncate, seed=seed if sampling else None,
                     merged=merged)
    return req, stream
