"""``loraplex serve``'s vLLM HTTP flags: parsed in vLLM's forms into settings, and the start-up
check that refuses options that cannot work together before the model loads."""

from __future__ import annotations

import argparse
import ssl

import pytest

from loraplex.server import cli, http_options
from loraplex.server.cli import settings_from_args
from tests.fixtures.tls_certs import make_tls_files


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="loraplex")
    cli.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_vllm_command_line_forms_become_settings(tmp_path):
    args = parse("--allowed-origins", '["https://a.example", "https://b.example"]', "--allowed-methods", '["GET","POST"]',
                 "--allowed-headers", '["authorization"]', "--allow-credentials", "--root-path", "/llm",
                 "--ssl-certfile", "c.pem", "--ssl-keyfile", "k.pem", "--ssl-ca-certs", "ca.pem", "--ssl-cert-reqs", "2",
                 "--response-role", "bot", "--return-tokens-as-token-ids", "--max-logprobs", "-1",
                 "--uvicorn-log-level", "trace", "--disable-uvicorn-access-log", "--disable-fastapi-docs",
                 "--max-log-len", "100", "--enable-prompt-tokens-details")
    s = settings_from_args(args, home=tmp_path)
    assert s.enable_prompt_tokens_details
    assert s.allowed_origins == ["https://a.example", "https://b.example"]
    assert (s.allowed_methods, s.allowed_headers, s.allow_credentials) == (["GET", "POST"], ["authorization"], True)
    assert (s.root_path, s.response_role, s.return_tokens_as_token_ids, s.max_logprobs) == ("/llm", "bot", True, -1)
    assert (str(s.ssl_certfile), str(s.ssl_keyfile), str(s.ssl_ca_certs), s.ssl_cert_reqs) == \
        ("c.pem", "k.pem", "ca.pem", 2)
    assert s.engine_config().max_logprobs == -1  # the engine holds the cap too
    opts = http_options.uvicorn_options(s, args.log_level, args.uvicorn_log_level)
    assert opts == {"log_level": "trace", "root_path": "/llm", "ssl_certfile": "c.pem", "ssl_keyfile": "k.pem",
                    "ssl_ca_certs": "ca.pem", "ssl_cert_reqs": 2}


def test_defaults(tmp_path):
    args = parse()
    s = settings_from_args(args, home=tmp_path)
    assert s.allowed_origins == [] and http_options.cors_middleware(s) == []  # same-origin unless asked
    assert (s.allowed_methods, s.allowed_headers, s.allow_credentials) == (["*"], ["*"], False)  # vLLM's
    assert (s.response_role, s.return_tokens_as_token_ids, s.max_logprobs, s.root_path) == ("assistant", False, 20, "")
    assert not s.enable_prompt_tokens_details  # vLLM's default: usage without prompt_tokens_details
    assert http_options.uvicorn_options(s, "info") == {"log_level": "info", "root_path": ""}


@pytest.mark.parametrize("value", ['"*"', "*", '{"a": 1}', '[1]', "[not json"])
def test_cors_flags_take_a_json_list_of_strings(value, capsys):
    with pytest.raises(SystemExit) as info:
        parse("--allowed-origins", value)
    assert info.value.code == 2
    assert "--allowed-origins" in capsys.readouterr().err


def test_settings_refuse_what_no_tls_or_engine_takes(tmp_path):
    from pydantic import ValidationError

    for flags in (("--ssl-cert-reqs", "3"),):
        with pytest.raises(SystemExit):
            parse(*flags)
    with pytest.raises(ValidationError, match="max_logprobs"):
        settings_from_args(parse("--max-logprobs", "-2"), home=tmp_path)


def check_fails(tmp_path, match: str, **options) -> None:
    settings = settings_from_args(parse(), home=tmp_path, **options)
    with pytest.raises(http_options.HttpOptionsError, match=match):
        http_options.check(settings)


def test_startup_check_refuses_tls_options_that_cannot_work(tmp_path):
    tls = make_tls_files(tmp_path / "tls")
    check_fails(tmp_path, "--ssl-keyfile without --ssl-certfile", ssl_keyfile=tls.server_key)
    check_fails(tmp_path, "--ssl-ca-certs, --ssl-cert-reqs without --ssl-certfile", ssl_ca_certs=tls.ca_cert,
                ssl_cert_reqs=2)
    check_fails(tmp_path, "give --ssl-ca-certs", ssl_certfile=tls.server_cert, ssl_keyfile=tls.server_key,
                ssl_cert_reqs=ssl.CERT_REQUIRED)
    check_fails(tmp_path, "cannot load", ssl_certfile=tmp_path / "missing.pem")
    # a key that is not the certificate's
    check_fails(tmp_path, "cannot load", ssl_certfile=tls.server_cert, ssl_keyfile=tls.client_key)
    good = settings_from_args(parse(), home=tmp_path, ssl_certfile=tls.server_cert, ssl_keyfile=tls.server_key,
                              ssl_ca_certs=tls.ca_cert, ssl_cert_reqs=1)
    http_options.check(good)
    assert http_options.tls_context(good).verify_mode == ssl.CERT_OPTIONAL


@pytest.mark.parametrize("root_path", ["llm", "/llm/", "/a//b", "/with space"])
def test_startup_check_refuses_a_root_path_that_is_no_prefix(tmp_path, root_path):
    check_fails(tmp_path, "--root-path", root_path=root_path)


def test_serve_refuses_before_loading_anything(tmp_path, capsys):
    args = parse("--ssl-keyfile", str(tmp_path / "k.pem"), "--home", str(tmp_path / "home"))
    assert cli.run_serve(args) == 2
    assert "--ssl-keyfile without --ssl-certfile" in capsys.readouterr().err
    assert not (tmp_path / "home").exists()  # no registry made, no model loaded


def _encrypted_copy(key_path, out_path, passphrase: bytes) -> None:
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    out_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.BestAvailableEncryption(passphrase)))


def test_an_encrypted_key_is_refused_at_once_without_asking_on_the_terminal(tmp_path):
    """vLLM has no passphrase flag; OpenSSL, given none, asks on the controlling terminal (once
    for this check and again in uvicorn), and fails with "Invalid argument" where there is none.
    The start must stop at once saying why, terminal or not: run in a child whose controlling
    terminal is a pty that nobody types into."""
    import os
    import pty
    import select
    import time

    tls = make_tls_files(tmp_path / "tls")
    encrypted = tmp_path / "tls" / "encrypted.key"
    _encrypted_copy(tls.server_key, encrypted, b"secret")
    settings = settings_from_args(parse(), home=tmp_path, ssl_certfile=tls.server_cert, ssl_keyfile=encrypted)
    pid, fd = pty.fork()
    if pid == 0:  # the child: its controlling terminal is the pty
        try:
            http_options.check(settings)
            os.write(1, b"\nRESULT accepted\n")
        except http_options.HttpOptionsError as exc:
            os.write(1, f"\nRESULT refused: {exc}\n".encode())
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            os.write(1, f"\nRESULT {type(exc).__name__}: {exc}\n".encode())
        os._exit(0)
    out, deadline = b"", time.monotonic() + 15
    try:
        while b"RESULT" not in out or not out.endswith(b"\n"):
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            try:
                out += os.read(fd, 4096)
            except OSError:  # the child closed the pty
                break
    finally:
        if os.waitpid(pid, os.WNOHANG) == (0, 0):  # still waiting on the terminal
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        os.close(fd)
    text = out.decode(errors="replace")
    assert "RESULT refused" in text, text  # not waiting for a passphrase
    assert "pass phrase" not in text.lower()  # and never asked for one
    assert "encrypted" in text and str(encrypted) in text
