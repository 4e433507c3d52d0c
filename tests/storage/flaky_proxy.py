"""A tiny HTTP forwarder on loopback that can break S3 downloads on purpose.

It forwards every request to ``upstream`` (the moto server). ``mode`` decides what happens to
GET requests for objects:

* ``"pass"``: forward unchanged;
* ``"cut"``: send the status line and headers (full Content-Length) but only half the body,
  then close the connection (a download that breaks mid-body);
* ``"stall"``: send headers and half the body, then go silent (for ``stall_seconds``) without
  closing: the client's read timeout has to notice;
* ``"error503"``: answer 503 Service Unavailable without asking upstream.

``cut_budget`` limits how many GETs are cut/failed (None: all of them) and ``gets`` counts the
object GETs seen.
"""

from __future__ import annotations

import http.client
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade"}


class FlakyProxy:
    """See the module docstring. Use as a context manager; ``url`` is its endpoint."""

    def __init__(self, upstream: str):
        parts = urlsplit(upstream)
        self.upstream_host = parts.hostname
        self.upstream_port = parts.port
        self.mode = "pass"
        self.cut_budget: int | None = None
        self.gets = 0
        self.stall_seconds = 5.0
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # keep test output quiet
                pass

            def _forward(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                is_object_get = self.command == "GET" and "/" in self.path.strip("/").split("?")[0]
                action = "pass"
                if is_object_get:
                    with proxy._lock:
                        proxy.gets += 1
                        if proxy.mode != "pass" and (proxy.cut_budget is None or proxy.cut_budget > 0):
                            action = proxy.mode
                            if proxy.cut_budget is not None:
                                proxy.cut_budget -= 1
                if action == "error503":
                    payload = b"<Error><Code>ServiceUnavailable</Code><Message>down</Message></Error>"
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                conn = http.client.HTTPConnection(proxy.upstream_host, proxy.upstream_port, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS}
                conn.request(self.command, self.path, body=body, headers=headers)
                response = conn.getresponse()
                data = response.read()
                conn.close()
                self.send_response(response.status)
                for name, value in response.getheaders():
                    if name.lower() not in _HOP_HEADERS and name.lower() != "content-length":
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                if action == "stall":
                    self.end_headers()
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    time.sleep(proxy.stall_seconds)
                    self.close_connection = True
                    return
                if action == "cut":
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> "FlakyProxy":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
