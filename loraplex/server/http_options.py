"""vLLM's HTTP front-end flags on ``loraplex serve``: CORS, TLS, the root path behind a proxy,
uvicorn's logging, and the answer options (role, token ids, logprobs cap, cached-token usage).

The flags are grouped in ``loraplex serve --help`` under "vLLM HTTP server flags", under vLLM's
names and forms: ``--allowed-origins '["https://app.example"]'`` (a JSON list, as vLLM parses it),
``--ssl-cert-reqs 2`` (the ``ssl`` module's number). Most are ``Settings`` fields
(``LORAPLEX_ALLOWED_ORIGINS`` and so on, see ``FIELDS``); the ones that only steer the process's
logging are flags alone (``PROCESS_FLAGS``), as ``--log-level`` is.

One default differs from vLLM's: no origin is allowed unless ``--allowed-origins`` names some
(vLLM allows ``*``). ``/metrics`` answers without a key and names tenants; a wildcard would let any
web page that someone on the network opens read it. The admin UI keeps its key in sessionStorage
and sends it as a bearer header (never a cookie), so ``--allow-credentials`` is not needed for it.

CORS runs outside Starlette's error handling (``ServerApp``), so every answer a browser gets
carries the headers: a 401, a 413, a stream, and a 500 too (a browser shows the script none of
these without them).
"""

from __future__ import annotations

import argparse
import json
import re
import ssl
from collections.abc import Sequence

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware

from loraplex.config import Settings
from loraplex.server.request_ids import CLIENT_REQUEST_ID_HEADER, REQUEST_ID_HEADER

# Settings fields whose flags this module adds (in its help group), not cli.add_settings_flags
FIELDS = ("allowed_origins", "allowed_methods", "allowed_headers", "allow_credentials", "ssl_keyfile",
          "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs", "root_path", "response_role",
          "return_tokens_as_token_ids", "max_logprobs", "enable_prompt_tokens_details")
# ... of which these mean nothing without an HTTP server (run-batch leaves them out)
SERVER_ONLY_FIELDS = frozenset(FIELDS[:9])
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # vLLM's choices
ROOT_PATH = re.compile(r"(/[^/\s]+)*")


class HttpOptionsError(ValueError):
    """HTTP options that cannot work together; the message says what to change."""


def json_string_list(text: str) -> list[str]:
    """vLLM's form of the CORS flags: one JSON list of strings (``'["GET", "POST"]'``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings such as '[\"*\"]', got {text!r} "
                                         f"({exc.msg})") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings such as '[\"*\"]', got {text!r}")
    return value


def add_http_flags(parser: argparse.ArgumentParser) -> None:
    """The group of flags; ``FIELDS`` land under their Settings names (``settings_from_args``
    reads them), the process flags under theirs (``uvicorn_options`` reads them)."""
    g = parser.add_argument_group(
        "vLLM HTTP server flags", "vLLM's front-end flags under vLLM's names and forms; the first thirteen are "
        "settings too (LORAPLEX_ALLOWED_ORIGINS='[\"https://app.example\"]', LORAPLEX_SSL_CERTFILE=...)")
    cors = {"type": json_string_list, "default": None, "metavar": "JSON_LIST"}
    g.add_argument("--allowed-origins", **cors,
                   help='CORS origins, e.g. \'["https://app.example"]\' or \'["*"]\' (default: none, unlike vLLM\'s "*")')
    g.add_argument("--allowed-methods", **cors, help='CORS methods (default ["*"])')
    g.add_argument("--allowed-headers", **cors, help='CORS request headers (default ["*"])')
    g.add_argument("--allow-credentials", action=argparse.BooleanOptionalAction, default=None,
                   help="CORS: let browsers send cookies / HTTP auth / client certificates (default off)")
    g.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="TLS private key (PEM)")
    g.add_argument("--ssl-certfile", default=None, metavar="FILE", help="TLS certificate chain (PEM); serves HTTPS")
    g.add_argument("--ssl-ca-certs", default=None, metavar="FILE", help="CA certificates to verify client certificates")
    g.add_argument("--ssl-cert-reqs", type=int, choices=[0, 1, 2], default=None,
                   help="client certificates: 0 not asked (default), 1 optional, 2 required (ssl.CERT_*)")
    g.add_argument("--root-path", default=None, metavar="PATH",
                   help="path prefix a path-stripping proxy serves this server under, e.g. /llm")
    g.add_argument("--response-role", default=None, metavar="ROLE",
                   help='role of chat answers (default "assistant")')
    g.add_argument("--return-tokens-as-token-ids", action=argparse.BooleanOptionalAction, default=None,
                   help='logprob tokens as "token_id:N" unless a request says otherwise')
    g.add_argument("--max-logprobs", type=int, default=None, metavar="N",
                   help="most logprobs / top_logprobs / prompt_logprobs a request may ask (default 20; -1: no cap)")
    g.add_argument("--enable-prompt-tokens-details", action=argparse.BooleanOptionalAction, default=None,
                   help="OpenAI usage carries prompt_tokens_details.cached_tokens, the prompt tokens served from "
                        "the prefix cache (default off, as vLLM)")
    g.add_argument("--uvicorn-log-level", choices=UVICORN_LOG_LEVELS, default=None,
                   help="uvicorn's own log level (default: --log-level)")
    g.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="no per-request access line (loraplex writes one JSON line per request; uvicorn's is off)")
    g.add_argument("--disable-fastapi-docs", action="store_true",
                   help="accepted: loraplex serves no /docs, /redoc or /openapi.json")
    g.add_argument("--max-log-len", type=int, default=None, metavar="N",
                   help="accepted: loraplex logs no prompts, so there is nothing to shorten")


def check(settings: Settings) -> None:
    """Raise ``HttpOptionsError`` for options that cannot work together, and load the TLS files
    once, so a wrong path or a key that does not match its certificate is said before the
    model loads."""
    if settings.root_path and not ROOT_PATH.fullmatch(settings.root_path):
        raise HttpOptionsError(f"--root-path {settings.root_path!r}: a path such as /llm or /team/llm "
                               "(a leading /, no trailing / or spaces)")
    if settings.ssl_certfile is None:
        given = [flag for flag, value in (("--ssl-keyfile", settings.ssl_keyfile), ("--ssl-ca-certs", settings.ssl_ca_certs),
                                           ("--ssl-cert-reqs", settings.ssl_cert_reqs or None)) if value is not None]
        if given:
            raise HttpOptionsError(f"{', '.join(given)} without --ssl-certfile: TLS needs the server's certificate")
        return
    if settings.ssl_cert_reqs != ssl.CERT_NONE and settings.ssl_ca_certs is None:
        raise HttpOptionsError(f"--ssl-cert-reqs {settings.ssl_cert_reqs} asks for client certificates: give "
                               "--ssl-ca-certs, the CA certificates to verify them against")
    try:
        _refuse_encrypted_key(settings)
        tls_context(settings)
    except _KeyNeedsPassphrase:
        raise HttpOptionsError(
            f"TLS: the key in {settings.ssl_keyfile or settings.ssl_certfile} is encrypted, and there is no "
            "passphrase option (vLLM has none either; OpenSSL would wait for one on the terminal): give the "
            "key unencrypted (openssl pkey -in KEY -out PLAIN_KEY), readable by the server's user only") from None
    except (OSError, ssl.SSLError) as exc:
        raise HttpOptionsError(f"TLS: cannot load --ssl-certfile {settings.ssl_certfile}"
                               f"{f' / --ssl-keyfile {settings.ssl_keyfile}' if settings.ssl_keyfile else ''}"
                               f"{f' / --ssl-ca-certs {settings.ssl_ca_certs}' if settings.ssl_ca_certs else ''}: {exc}") from None


class _KeyNeedsPassphrase(Exception):
    pass


def _refuse_encrypted_key(settings: Settings) -> None:
    """Load the certificate and key as uvicorn will, but with a passphrase callback that raises:
    OpenSSL calls it only for an encrypted key, which uvicorn (given no password, as vLLM gives
    none) would make OpenSSL ask for on the terminal, a start that waits for ever under a
    terminal and fails as "Invalid argument" without one."""
    def no_passphrase():
        raise _KeyNeedsPassphrase

    ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(settings.ssl_certfile, settings.ssl_keyfile, no_passphrase)


def tls_context(settings: Settings) -> ssl.SSLContext:
    """The server's TLS context as uvicorn makes it from these options."""
    from uvicorn.config import SSL_PROTOCOL_VERSION, create_ssl_context

    return create_ssl_context(certfile=settings.ssl_certfile, keyfile=settings.ssl_keyfile, password=None,
                              ssl_version=SSL_PROTOCOL_VERSION, cert_reqs=settings.ssl_cert_reqs,
                              ca_certs=settings.ssl_ca_certs, ciphers=None)


def uvicorn_options(settings: Settings, log_level: str, uvicorn_log_level: str | None = None) -> dict:
    """``uvicorn.Config`` keywords for the TLS and root path options and uvicorn's log level."""
    options: dict = {"log_level": uvicorn_log_level or log_level, "root_path": settings.root_path}
    if settings.ssl_certfile is not None:
        options.update(ssl_certfile=str(settings.ssl_certfile), ssl_cert_reqs=settings.ssl_cert_reqs,
                       ssl_keyfile=None if settings.ssl_keyfile is None else str(settings.ssl_keyfile),
                       ssl_ca_certs=None if settings.ssl_ca_certs is None else str(settings.ssl_ca_certs))
    return options


def scheme(settings: Settings) -> str:
    return "https" if settings.ssl_certfile is not None else "http"


# response headers a browser script may read (CORS hides all but a few by default): the request
# ids a support ticket quotes, and the rate-limit state a client backs off by
EXPOSED_HEADERS = [
    REQUEST_ID_HEADER, CLIENT_REQUEST_ID_HEADER, "retry-after",
    *(f"x-ratelimit-{what}-{kind}" for what in ("limit", "remaining", "reset") for kind in ("requests", "tokens")),
]


def cors_middleware(settings: Settings) -> list[Middleware]:
    """Starlette's CORS middleware on the options, or none when no origin is allowed (browsers
    then keep to the same origin). Preflights are answered by the middleware itself; an origin
    not allowed gets no ``Access-Control-Allow-Origin``."""
    if not settings.allowed_origins:
        return []
    return [Middleware(CORSMiddleware, allow_origins=settings.allowed_origins, allow_methods=settings.allowed_methods,
                       allow_headers=settings.allowed_headers, allow_credentials=settings.allow_credentials,
                       expose_headers=EXPOSED_HEADERS)]


class ServerApp(Starlette):
    """Starlette with ``outer_middleware`` wrapped around its whole stack, error handling
    included: Starlette answers an unhandled exception (500) in its outermost layer, which the
    ordinary ``add_middleware`` layers sit inside of."""

    def __init__(self, *args, outer_middleware: Sequence[Middleware] = (), **kwargs):
        self.outer_middleware = list(outer_middleware)
        super().__init__(*args, **kwargs)

    def build_middleware_stack(self):
        app = super().build_middleware_stack()
        for cls, args, kwargs in reversed(self.outer_middleware):
            app = cls(app, *args, **kwargs)
        return app
