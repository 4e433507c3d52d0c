"""The HTTP protocol ``loraplex serve`` runs uvicorn with: httptools with a bound on a request's
head. uvicorn's h11 protocol refuses a head over ``h11_max_incomplete_event_size`` (16 KiB unless
set); its httptools protocol has no such bound, and httptools gathers a header value by joining
the pieces as they arrive, so one client sending a header of tens of MiB holds the event loop,
every stream's, for seconds (a 16 MiB header: about 0.6 s on a 2-core VM, 4 MiB: 0.05 s)."""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# vLLM's default for its h11 head limit (vllm/entrypoints/constants.py, GHSA-rxc4-3w6r-4v47)
MAX_HEAD_BYTES = 4 * 1024 * 1024


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol that answers 400 (as uvicorn's h11 protocol does for a head
    over its limit) and closes the connection once a request's head, the request line and headers,
    has taken more than ``MAX_HEAD_BYTES`` without ending. The count is of whole reads while a
    head is being received, so it may overshoot by one read: it bounds memory and parse time, not
    an exact size."""

    max_head_bytes = MAX_HEAD_BYTES

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._head_bytes: int | None = 0  # None while a body is being received

    def data_received(self, data: bytes) -> None:
        if self._head_bytes is not None:
            self._head_bytes += len(data)
            if self._head_bytes > self.max_head_bytes:
                msg = "Request head too large."
                self.logger.warning(msg)
                self.send_400_response(msg)
                return
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._head_bytes = None
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._head_bytes = 0
        super().on_message_complete()
