"""OpenAI's error envelope, and the mapping from loraplex's exceptions onto HTTP statuses.

Every error the server returns, tenant or admin route, has the shape::

    {"error": {"message": str, "type": str, "param": str | None, "code": str | None}}
"""

from __future__ import annotations

import logging

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

from loraplex.sampling_params import InvalidRequestError
from loraplex.server.request_ids import request_ids

log = logging.getLogger("loraplex.server")
CLIENT_CLOSED = 499  # nginx's status for "client closed the request": logs and metrics only

# HTTP status -> OpenAI error "type"
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error to answer with the OpenAI envelope."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# a caller's value echoed in a message or an access line is cut to this many characters: a
# 20 MB `model` was written whole into the log line of its refusal
MAX_ECHOED_CHARS = 256


def clipped(value: str) -> str:
    """``value`` as a message or log line shows it: whole up to ``MAX_ECHOED_CHARS``, else its
    start and its length."""
    if len(value) <= MAX_ECHOED_CHARS:
        return value
    return f"{value[:MAX_ECHOED_CHARS]}... ({len(value)} characters)"


def model_not_found(model: str) -> APIError:
    # One message for "does not exist" and "belongs to another tenant": the answer must not tell
    # the two apart.
    return APIError(
        404,
        f"The model `{clipped(model)}` does not exist or you do not have access to it.",
        param="model",
        code="model_not_found",
    )


def unauthorized(message: str = "Invalid or missing API key.") -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def from_exception(exc: Exception, *, log_unknown: bool = True, request_id: str | None = None) -> APIError:
    """Map an exception raised below the server onto an APIError (unknown ones: 500, logged with
    ``request_id``, the request's ``x-request-id``, where given)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):  # a transient refusal says so (AdapterBusyError: 409)
        status = getattr(exc, "http_status", 400)
        retry = getattr(exc, "retry_after_seconds", None)
        headers = {"Retry-After": str(retry)} if retry is not None else None
        return APIError(status, exc.message, param=exc.param, code=exc.code, headers=headers)
    if isinstance(exc, ClientDisconnect):  # gone while its body was read: nobody reads an answer
        return APIError(CLIENT_CLOSED, "Client closed the request.", code="client_closed")
    # registry/storage errors carry their HTTP status; matched by attribute so this module does
    # not import the registry
    status = getattr(exc, "http_status", None)
    if isinstance(status, int) and 400 <= status < 600:
        codes = {"NotFound": "not_found", "AlreadyExists": "already_exists", "InvalidName": "invalid_name",
                 "InvalidSetting": "invalid_value", "TenantDeleted": "tenant_deleted"}
        name = type(exc).__name__
        param = "name" if name == "InvalidName" else getattr(exc, "param", None)
        return APIError(status, str(exc), param=param, code=codes.get(name, "conflict" if status == 409 else None))
    if type(exc).__name__ == "BlobStoreUnavailable":
        return APIError(503, str(exc), code="blob_store_unavailable")
    if type(exc).__name__.startswith("Blob"):
        return APIError(502, str(exc), type="server_error", code="blob_store_error")
    if log_unknown:
        log.error("internal error%s", f" (request {request_id})" if request_id else "", exc_info=exc)
    return APIError(500, "Internal server error.", type="server_error", code="internal_error")


async def api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    return from_exception(exc, request_id=request_ids(request).server).response()


async def http_exception_handler(request: Request, exc: HTTPException) -> JSONResponse:
    err = APIError(exc.status_code, exc.detail or "error", headers=dict(exc.headers or {}))
    if exc.status_code == 404:
        err.code = "not_found"
    return err.response()


def exception_handlers() -> dict:
    """Handlers by class. Errors with a known status get their own entry: the catch-all
    ``Exception`` entry is Starlette's 500 path, which logs and re-raises."""
    from loraplex.registry.errors import RegistryError
    from loraplex.storage.base import BlobStoreError

    return {**EXCEPTION_HANDLERS, RegistryError: api_error_handler, BlobStoreError: api_error_handler}


EXCEPTION_HANDLERS = {
    APIError: api_error_handler,
    InvalidRequestError: api_error_handler,
    ClientDisconnect: api_error_handler,  # its own entry: the Exception entry logs a 500
    HTTPException: http_exception_handler,
    Exception: api_error_handler,
}
