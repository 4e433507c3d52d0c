"""Name validation: nothing unsafe may reach a file path, an S3 key or a URL."""

from __future__ import annotations

import pytest

from loraplex.registry.errors import InvalidName
from loraplex.registry.names import (
    MAX_NAME_LENGTH,
    format_model_ref,
    parse_model_ref,
    parse_version,
    validate_adapter_name,
    validate_tenant_name,
)


@pytest.mark.parametrize(
    "name",
    ["a", "acme", "sql-lora", "team_7", "0day", "a" * MAX_NAME_LENGTH, "x-y_z-1"],
)
def test_valid_names_are_accepted_unchanged(name):
    assert validate_tenant_name(name) == name
    assert validate_adapter_name(name) == name


@pytest.mark.parametrize(
    ("name", "rule"),
    [
        ("../etc", "path separator"),
        ("..", "'..'"),
        (".", "'..'"),
        ("...", "'..'"),
        ("a/b", "path separator"),
        ("/abs", "path separator"),
        ("a\\b", "path separator"),
        ("nul\x00byte", "NUL or control"),
        ("tab\there", "NUL or control"),
        ("line\nfeed", "NUL or control"),
        ("bell\x07", "NUL or control"),
        ("x" * 300, "limit is 63"),
        ("a" * (MAX_NAME_LENGTH + 1), "limit is 63"),
        ("\u0430cme", "ASCII"),  # Cyrillic 'а' looks like Latin 'a'
        ("acm\u0435", "ASCII"),  # Cyrillic 'е'
        ("caf\u00e9", "ASCII"),
        ("zero\u200bwidth", "control"),  # zero-width space (format character)
        ("ｆｕｌｌ", "ASCII"),  # full-width letters
        ("", "empty"),
        ("Acme", "lower case"),
        ("a.b", "'.'"),
        (".hidden", "'.'"),
        ("-lead", "starting with a letter or digit"),
        ("_lead", "starting with a letter or digit"),
        ("sp ace", "use lower-case letters"),
        ("a@1", "use lower-case letters"),
        ("semi;colon", "use lower-case letters"),
    ],
)
def test_unsafe_names_are_rejected_with_the_rule(name, rule):
    with pytest.raises(InvalidName) as excinfo:
        validate_adapter_name(name)
    assert rule in str(excinfo.value)
    with pytest.raises(InvalidName):
        validate_tenant_name(name)


def test_error_message_says_which_kind_of_name():
    with pytest.raises(InvalidName, match="tenant name"):
        validate_tenant_name("a/b")
    with pytest.raises(InvalidName, match="adapter name"):
        validate_adapter_name("a/b")


@pytest.mark.parametrize("bad", [None, 3, b"acme", ["acme"]])
def test_non_strings_are_rejected(bad):
    with pytest.raises(InvalidName):
        validate_adapter_name(bad)


def test_model_refs_parse_and_round_trip():
    assert parse_model_ref("sql") == ("sql", None)
    assert parse_model_ref("sql@3") == ("sql", 3)
    assert parse_model_ref("sql@12") == ("sql", 12)
    for name, version in [("sql", None), ("sql", 7)]:
        assert parse_model_ref(format_model_ref(name, version)) == (name, version)


@pytest.mark.parametrize("ref", ["sql@", "sql@0", "sql@-1", "sql@+2", "sql@ 2", "sql@x", "sql@1@2", "sql@1.0",
                                 "sql@\u0663", "@3", "../x@1", "sql@99999999999"])
def test_bad_model_refs_are_rejected(ref):
    with pytest.raises(InvalidName):
        parse_model_ref(ref)


def test_parse_version_accepts_ints_and_digit_strings_only():
    assert parse_version(4) == 4
    assert parse_version("4") == 4
    for bad in (0, -1, True, 1.0, "04x", "", None):
        with pytest.raises(InvalidName):
            parse_version(bad)
    with pytest.raises(InvalidName, match="positive integer of at most 2147483647"):  # the column's bound, said
        parse_version(2**31)
