"""Errors raised by the LoRA code. All are ``InvalidRequestError`` so the server maps them to a
400 in OpenAI's envelope; ``param`` is ``"adapter"`` (or the offending field)."""

from __future__ import annotations

from loraplex.sampling_params import InvalidRequestError


class InvalidAdapterError(InvalidRequestError):
    """An adapter loraplex refuses to load: bad format, unsafe files, or not fitting the base
    model. The message names the problem. Nothing is loaded when this is raised."""

    def __init__(self, message: str, param: str | None = "adapter", code: str | None = "invalid_adapter"):
        super().__init__(message, param=param, code=code)


class AdapterBusyError(InvalidAdapterError):
    """A valid adapter that cannot be placed now: every device slot (or the host budget) is held
    by running requests or pins. Transient: the server answers 409 with ``Retry-After`` (its
    ``http_status``), not a 400, so an operator's script retries instead of giving up. Nothing is
    loaded when this is raised."""

    http_status = 409
    retry_after_seconds = 1

    def __init__(self, message: str, param: str | None = "tier", code: str | None = "adapter_busy"):
        super().__init__(message, param=param, code=code)


class AdapterNotFoundError(InvalidRequestError):
    """A request names an adapter that is neither registered nor a readable PEFT directory."""

    def __init__(self, message: str, param: str | None = "model", code: str | None = "model_not_found"):
        super().__init__(message, param=param, code=code)


class AdapterHashMismatchError(InvalidAdapterError):
    """The weights on disk do not hash to the content hash the caller (the registry) expected."""


class AdapterLoadFailedError(RuntimeError):
    """A step's adapter could not be put in a device slot (its weights were neither in host
    memory nor readable from disk any more). Raised by ``LoRAManager.place`` before anything of
    the step ran; the engine aborts that adapter's requests and goes on with the others."""

    def __init__(self, adapter_id: str, reason: str):
        super().__init__(f"adapter {adapter_id[:12]} could not be loaded: {reason}")
        self.adapter_id = adapter_id

