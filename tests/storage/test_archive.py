"""The blob archive: deterministic packing and a strict unpacker."""

from __future__ import annotations

import io
import os
import tarfile

import pytest

from loraplex.storage.archive import ArchiveError, pack_files, unpack_files

NAMES = ("adapter_config.json", "adapter_model.safetensors")


def make_src(path, config=b'{"r": 4}', weights=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / NAMES[0]).write_bytes(config)
    (path / NAMES[1]).write_bytes(weights if weights is not None else os.urandom(5000))
    return path


def test_pack_is_deterministic_and_roundtrips(tmp_path):
    src = make_src(tmp_path / "src")
    (src / "README.md").write_text("not packed")
    first, second = io.BytesIO(), io.BytesIO()
    size = pack_files(src, NAMES, first)
    os.utime(src / NAMES[1], (12345, 12345))  # metadata changes do not change the bytes
    pack_files(src, list(reversed(NAMES)), second)
    assert first.getvalue() == second.getvalue() and size == len(first.getvalue())
    dest = tmp_path / "dest"
    dest.mkdir()
    data = first.getvalue()
    unpack_files((data[i : i + 777] for i in range(0, len(data), 777)), dest, NAMES, 1 << 20)
    assert sorted(p.name for p in dest.iterdir()) == sorted(NAMES)
    for name in NAMES:
        assert (dest / name).read_bytes() == (src / name).read_bytes()


def _tar(members) -> bytes:
    """members: list of (TarInfo-modifier, name, payload)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, payload, kind in members:
            info = tarfile.TarInfo(name)
            if kind == "file":
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
            elif kind == "symlink":
                info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
                tar.addfile(info)
            elif kind == "dir":
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
    return buf.getvalue()


GOOD = [(NAMES[0], b"{}", "file"), (NAMES[1], b"w", "file")]


@pytest.mark.parametrize(
    "members,message",
    [
        ([("../adapter_config.json", b"{}", "file")] + GOOD[1:], "unexpected"),
        ([("/tmp/adapter_config.json", b"{}", "file")] + GOOD[1:], "unexpected"),
        ([(NAMES[0], b"", "symlink")] + GOOD[1:], "not a regular file"),
        ([(NAMES[0], b"", "dir")] + GOOD[1:], "not a regular file"),
        (GOOD + [("extra.bin", b"x", "file")], "unexpected"),
        (GOOD + [GOOD[0]], "twice"),
        (GOOD[:1], "lacks adapter_model.safetensors"),
        ([GOOD[0], (NAMES[1], b"x" * 2000, "file")], "above 1000"),
    ],
)
def test_unpack_rejects(tmp_path, members, message):
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(ArchiveError, match=message):
        unpack_files([_tar(members)], dest, NAMES, 1000)
    assert not (tmp_path / "adapter_config.json").exists()


def test_unpack_rejects_garbage(tmp_path):
    with pytest.raises(ArchiveError, match="not a valid archive"):
        unpack_files([os.urandom(4096)], tmp_path, NAMES, 1000)
