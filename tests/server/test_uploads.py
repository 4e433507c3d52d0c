"""Archive uploads: unpacked member by member into the staging dir, nothing may leave it."""

from __future__ import annotations

import io
import stat
import struct
import tarfile
import zipfile

import pytest

from loraplex.server.errors import APIError
from loraplex.server.uploads import unpack_archive

CONFIG = b'{"r": 4}'
WEIGHTS = b"\x00" * 64


def _tar(members: list[tuple[str, bytes | None, str]], gz: bool = True) -> io.BytesIO:
    """members: (name, data, kind) with kind file|dir|sym|lnk|fifo."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gz else "w") as tar:
        for name, data, kind in members:
            info = tarfile.TarInfo(name)
            if kind == "file":
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
                continue
            info.type = {"dir": tarfile.DIRTYPE, "sym": tarfile.SYMTYPE, "lnk": tarfile.LNKTYPE, "fifo": tarfile.FIFOTYPE}[kind]
            if kind in ("sym", "lnk"):
                info.linkname = data.decode()
            tar.addfile(info)
    buf.seek(0)
    return buf


def _zip(members: list[tuple[str, bytes, int | None]]) -> io.BytesIO:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data, mode in members:
            info = zipfile.ZipInfo(name)
            if mode is not None:
                info.external_attr = mode << 16
            z.writestr(info, data)
    buf.seek(0)
    return buf


def test_good_archives_unpack(tmp_path):
    (tmp_path / "t").mkdir()
    peft = unpack_archive(
        _tar([("adapter/", None, "dir"), ("adapter/adapter_config.json", CONFIG, "file"),
              ("adapter/adapter_model.safetensors", WEIGHTS, "file")]),
        "a.tar.gz", tmp_path / "t", 1 << 20,
    )
    assert (peft / "adapter_config.json").read_bytes() == CONFIG
    assert (peft / "adapter_model.safetensors").read_bytes() == WEIGHTS
    (tmp_path / "z").mkdir()
    peft = unpack_archive(
        _zip([("adapter_config.json", CONFIG, None), ("adapter_model.safetensors", WEIGHTS, None)]),
        "a.zip", tmp_path / "z", 1 << 20,
    )
    assert peft == tmp_path / "z" and (peft / "adapter_config.json").read_bytes() == CONFIG


@pytest.mark.parametrize(
    "members,what",
    [
        ([("/etc/evil", b"x", "file")], "absolute"),
        ([("../evil", b"x", "file")], ".."),
        ([("a/../../evil", b"x", "file")], ".."),
        ([("link", b"/etc/passwd", "sym")], "link"),
        ([("adapter_config.json", CONFIG, "file"), ("hard", b"adapter_config.json", "lnk")], "link"),
        ([("fifo", None, "fifo")], "regular"),
    ],
)
def test_bad_tar_members_rejected(tmp_path, members, what):
    with pytest.raises(APIError) as err:
        unpack_archive(_tar(members), "a.tar.gz", tmp_path, 1 << 20)
    assert err.value.status == 400 and what in err.value.message
    assert not (tmp_path.parent / "evil").exists()


def test_oversized_member_rejected(tmp_path):
    with pytest.raises(APIError) as err:
        unpack_archive(_tar([("adapter_model.safetensors", b"x" * 2000, "file")]), "a.tgz", tmp_path, 1000)
    assert err.value.status == 413
    with pytest.raises(APIError) as err:
        unpack_archive(_zip([("adapter_model.safetensors", b"x" * 2000, None)]), "a.zip", tmp_path, 1000)
    assert err.value.status == 413


@pytest.mark.parametrize(
    "members,what",
    [
        ([("../evil", b"x", None)], ".."),
        ([("/abs", b"x", None)], "absolute"),
        ([("link", b"/etc/passwd", stat.S_IFLNK | 0o777)], "link"),
    ],
)
def test_bad_zip_members_rejected(tmp_path, members, what):
    with pytest.raises(APIError) as err:
        unpack_archive(_zip(members), "a.zip", tmp_path, 1 << 20)
    assert err.value.status == 400 and what in err.value.message


def test_archive_without_config_rejected(tmp_path):
    with pytest.raises(APIError) as err:
        unpack_archive(_tar([("readme.txt", b"x", "file")]), "a.tar.gz", tmp_path, 1 << 20)
    assert err.value.param == "archive"


def test_not_an_archive(tmp_path):
    with pytest.raises(APIError) as err:
        unpack_archive(io.BytesIO(b"garbage" * 10), "a.tar.gz", tmp_path, 1 << 20)
    assert err.value.status == 400


def _bytes_under(root) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize("kind", ["tar", "zip"])
def test_archive_total_is_capped(tmp_path, kind):
    """A bomb of members each under the per-member cap: the total written stops at twice the cap
    (room for the weights and everything else a PEFT directory holds)."""
    members = [("adapter_config.json", CONFIG)] + [(f"junk{i}.bin", b"\x00" * 900) for i in range(5)]
    archive = _tar([(n, d, "file") for n, d in members]) if kind == "tar" else _zip([(n, d, None) for n, d in members])
    with pytest.raises(APIError) as err:
        unpack_archive(archive, f"a.{kind}", tmp_path, 1000)
    assert err.value.status == 413 and err.value.param == "archive"
    assert _bytes_under(tmp_path) <= 2000


@pytest.mark.parametrize("kind", ["tar", "zip"])
def test_archive_member_count_is_capped(tmp_path, kind):
    from loraplex.server.uploads import MAX_ARCHIVE_MEMBERS

    members = [(f"d/f{i}", b"") for i in range(MAX_ARCHIVE_MEMBERS + 1)]
    archive = _tar([(n, d, "file") for n, d in members]) if kind == "tar" else _zip([(n, d, None) for n, d in members])
    with pytest.raises(APIError) as err:
        unpack_archive(archive, f"a.{kind}", tmp_path, 1 << 20)
    assert err.value.status == 400 and err.value.param == "archive" and "members" in err.value.message
    assert sum(1 for p in tmp_path.rglob("*") if p.is_file()) <= MAX_ARCHIVE_MEMBERS


@pytest.mark.parametrize("kind, filename", [("tar", "adapter.zip"), ("zip", "adapter.tar.gz"), ("tar", "adapter")])
def test_archive_kind_comes_from_its_bytes_not_its_name(tmp_path, kind, filename):
    members = [("adapter_config.json", CONFIG), ("adapter_model.safetensors", WEIGHTS)]
    archive = _tar([(n, d, "file") for n, d in members]) if kind == "tar" else _zip([(n, d, None) for n, d in members])
    peft = unpack_archive(archive, filename, tmp_path, 1 << 20)
    assert (peft / "adapter_config.json").read_bytes() == CONFIG
    assert (peft / "adapter_model.safetensors").read_bytes() == WEIGHTS


@pytest.mark.parametrize("filename", ["a.zip", "a.tar.gz"])
def test_neither_zip_nor_tar(tmp_path, filename):
    with pytest.raises(APIError) as err:
        unpack_archive(io.BytesIO(b"garbage" * 10), filename, tmp_path, 1 << 20)
    assert err.value.status == 400 and err.value.param == "archive"
    assert list(tmp_path.iterdir()) == []


def _truncated_tar(mode: str) -> io.BytesIO:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode) as tar:
        data = bytes(range(256)) * 400  # not too compressible: the cut lands inside the member
        info = tarfile.TarInfo("adapter_model.safetensors")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return io.BytesIO(buf.getvalue()[: len(buf.getvalue()) // 2])


def _encrypted_zip() -> io.BytesIO:
    raw = bytearray(_zip([("adapter_config.json", CONFIG, None)]).getvalue())
    raw[raw.find(b"PK\x03\x04") + 6] |= 1  # "encrypted" flag, local header and central directory
    raw[raw.find(b"PK\x01\x02") + 8] |= 1
    return io.BytesIO(bytes(raw))


def _corrupt_deflate_zip() -> io.BytesIO:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("adapter_config.json", b"{}" * 5000)
    raw = bytearray(buf.getvalue())
    start = raw.find(b"PK\x03\x04") + 30 + len("adapter_config.json")
    raw[start + 2 : start + 6] = b"\xff\xff\xff\xff"
    return io.BytesIO(bytes(raw))


def _zip_central_directory_past_its_place() -> io.BytesIO:
    """The end record claims the central directory starts 5000 bytes later than it does, so the
    member offsets zipfile derives from it are negative."""
    raw = bytearray(_zip([("adapter_config.json", CONFIG * 50, None)]).getvalue())
    end = raw.rfind(b"PK\x05\x06")
    (offset,) = struct.unpack("<I", raw[end + 16 : end + 20])
    raw[end + 16 : end + 20] = struct.pack("<I", offset + 5000)
    return io.BytesIO(bytes(raw))


def _zip_from_the_future() -> io.BytesIO:
    """The central directory says a zip version newer than zipfile knows ("version needed")."""
    raw = bytearray(_zip([("adapter_config.json", CONFIG, None)]).getvalue())
    cd = raw.find(b"PK\x01\x02")
    raw[cd + 6 : cd + 8] = struct.pack("<H", 245)
    return io.BytesIO(bytes(raw))


@pytest.mark.parametrize(
    "make",
    [lambda: _truncated_tar("w:gz"), lambda: _truncated_tar("w:bz2"), lambda: _truncated_tar("w:xz"),
     lambda: _truncated_tar("w"), _encrypted_zip, _corrupt_deflate_zip, _zip_central_directory_past_its_place,
     _zip_from_the_future],
    ids=["tgz", "tbz2", "txz", "tar", "zip_encrypted", "zip_corrupt_deflate", "zip_bad_offsets", "zip_version"],
)
def test_truncated_or_corrupt_archive_is_a_400(tmp_path, make):
    with pytest.raises(APIError) as err:
        unpack_archive(make(), "adapter", tmp_path, 1 << 20)
    assert err.value.status == 400 and err.value.param == "archive"


@pytest.mark.parametrize("kind", ["tar", "zip"])
@pytest.mark.parametrize(
    "members,what",
    [
        ([("x", b"1", "file"), ("x", None, "dir")], "both a file and a folder"),
        ([("x", b"1", "file"), ("x/y", b"2", "file")], "both a file and a folder"),
        ([("a" * 300, b"1", "file")], "too long"),
    ],
)
def test_member_paths_the_file_system_refuses_are_a_400_naming_the_member(tmp_path, kind, members, what):
    """An archive's own member names that cannot coexist on disk were a 500 (an OSError taken for
    a disk failure); the archive is bad, so a 400 naming the member."""
    ok = [("adapter_config.json", CONFIG, "file"), ("adapter_model.safetensors", WEIGHTS, "file")]
    if kind == "tar":
        archive = _tar(members + ok)
    else:
        archive = _zip([(name + "/" if k == "dir" else name, data or b"", None) for name, data, k in members + ok])
    with pytest.raises(APIError) as err:
        unpack_archive(archive, f"a.{kind}", tmp_path, 1 << 20)
    assert err.value.status == 400 and err.value.param == "archive"
    assert what in err.value.message and f"archive member {members[-1][0][:40]}" in err.value.message.replace("'", "")


def test_a_full_disk_while_unpacking_stays_a_server_error(tmp_path, monkeypatch):
    import errno

    from loraplex.server import uploads

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(uploads, "_copy_capped", no_space)
    archive = _tar([("adapter_config.json", CONFIG, "file")])
    with pytest.raises(OSError) as err:
        unpack_archive(archive, "a.tar", tmp_path, 1 << 20)
    assert err.value.errno == errno.ENOSPC


@pytest.mark.parametrize("kind", ["tar", "zip"])
def test_macos_metadata_members_are_skipped(tmp_path, kind):
    """Finder's "Compress" adds __MACOSX/ (and macOS tar ._ files): they were a second top
    folder, so the adapter inside the archive's one folder was not found."""
    members = [("sql/adapter_config.json", CONFIG), ("sql/adapter_model.safetensors", WEIGHTS),
               ("__MACOSX/sql/._adapter_config.json", b"\x00\x05\x16\x07"), ("sql/._adapter_model.safetensors", b"x")]
    archive = _tar([(n, d, "file") for n, d in members]) if kind == "tar" else _zip([(n, d, None) for n, d in members])
    peft = unpack_archive(archive, f"sql.{kind}", tmp_path, 1 << 20)
    assert peft == tmp_path / "sql"
    assert sorted(p.name for p in peft.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert not (tmp_path / "__MACOSX").exists()
