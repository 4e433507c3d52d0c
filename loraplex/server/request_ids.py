"""Request ids end to end: every HTTP response carries ``x-request-id``, and a client's own
``X-Request-Id`` is kept for the logs.

``x-request-id`` is the server's id, as OpenAI's API answers it (the openai client reads it as
``response._request_id`` and prints it in its exceptions): for a generation request the
response's own ``id`` (``cmpl-...``, ``chatcmpl-...``, ``resp_...``; LoRAX's ``gen-...``), so the
header and the body agree, otherwise a fresh ``req_...``. The access line of the request
(generation.py) logs the same id.

A client's (or gateway's) ``X-Request-Id`` is logged as ``client_request_id`` and echoed back in
``x-client-request-id``; it is never used as a key inside the server, so two requests sending the
same one stay apart. One that is not 1 to ``MAX_CLIENT_REQUEST_ID_LENGTH`` visible ASCII
characters is ignored (not logged, not echoed) rather than refused: it is a diagnostic header,
and vLLM, which takes the header as given, refuses nothing over it either.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID_HEADER = "x-request-id"
CLIENT_REQUEST_ID_HEADER = "x-client-request-id"
# long enough for a UUID or a W3C trace id with a prefix; short enough that a client cannot make
# every log line and response of its requests carry a kilobyte of its choosing
MAX_CLIENT_REQUEST_ID_LENGTH = 128
_STATE_KEY = "request_ids"  # on request.state (the ASGI scope's "state" dict)
_OWN_HEADERS = (REQUEST_ID_HEADER.encode(), CLIENT_REQUEST_ID_HEADER.encode())


@dataclass
class RequestIds:
    """One HTTP request's ids: ``server`` is answered in ``x-request-id`` (a generation request
    replaces the fresh one with its response id once admitted); ``client`` is the client's valid
    ``X-Request-Id``, or None."""

    server: str
    client: str | None = None

    def headers(self) -> dict[str, str]:
        out = {REQUEST_ID_HEADER: self.server}
        if self.client is not None:
            out[CLIENT_REQUEST_ID_HEADER] = self.client
        return out


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex}"


def valid_client_id(value: str | None) -> str | None:
    """``value`` if it is 1 to ``MAX_CLIENT_REQUEST_ID_LENGTH`` visible ASCII characters (no
    spaces, no control characters), else None."""
    if value is None or not 0 < len(value) <= MAX_CLIENT_REQUEST_ID_LENGTH:
        return None
    return value if all("!" <= ch <= "~" for ch in value) else None


def _ids_in(scope: Scope) -> RequestIds:
    state = scope.setdefault("state", {})
    ids = state.get(_STATE_KEY)
    if ids is None:
        client = None
        for name, value in scope.get("headers", []):
            if name.lower() == REQUEST_ID_HEADER.encode():
                client = valid_client_id(value.decode("latin-1"))
                break  # the first one, as Starlette's Headers.get reads it
        ids = state[_STATE_KEY] = RequestIds(new_request_id(), client)
    return ids


def request_ids(request: Request) -> RequestIds:
    """The ids of ``request``: those ``RequestIdMiddleware`` gave it (fresh ones, kept on the
    request, where it did not run)."""
    return _ids_in(request.scope)


class RequestIdMiddleware:
    """ASGI middleware giving each HTTP request its ``RequestIds`` and putting them on the
    response's headers as it starts (a stream's go out with its first bytes)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        ids = _ids_in(scope)

        async def send_with_ids(message: Message) -> None:
            if message["type"] == "http.response.start":
                # read now, not at the request's start: admission sets a generation's own id
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() not in _OWN_HEADERS]
                headers += [(k.encode(), v.encode()) for k, v in ids.headers().items()]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_ids)
