"""files/zip_records.py: a stored member's bytes are where stored_members says, and set_crc32
puts a CRC-32 everywhere the archive keeps one, so that zipfile (which checks every member it
reads against its central directory and, with a data descriptor, against that) reads it."""

from __future__ import annotations

import zipfile
import zlib

import pytest

from transformer_rosetta.files.zip_records import ZipLayoutError, set_crc32, stored_members

DATA = {"a/first": b"0123456789" * 7, "a/second": b"", "a/third": bytes(range(256)) * 3}


def archive(path, *, descriptor: bool):
    """DATA as stored members: written at once (the CRC in the local header), or streamed
    (zipfile's open("w") on an unseekable stream writes a data descriptor after the bytes)."""
    if descriptor:

        class Unseekable:
            def __init__(self, f):
                self.f = f

            def write(self, b):
                return self.f.write(b)

            def flush(self):
                self.f.flush()

            def tell(self):
                return self.f.tell()

        with open(path, "wb") as raw, zipfile.ZipFile(Unseekable(raw), "w") as z:
            for name, data in DATA.items():
                with z.open(name, "w") as member:
                    member.write(data)
    else:
        with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
            for name, data in DATA.items():
                z.writestr(name, data)


@pytest.mark.parametrize("descriptor", [False, True])
def test_the_members_bytes_are_where_it_says(tmp_path, descriptor):
    path = tmp_path / "a.zip"
    archive(path, descriptor=descriptor)
    members = stored_members(path)
    assert list(members) == list(DATA)
    raw = path.read_bytes()
    for name, data in DATA.items():
        m = members[name]
        assert (m.size, raw[m.offset : m.offset + m.size]) == (len(data), data)
        assert m.has_descriptor == descriptor


@pytest.mark.parametrize("descriptor", [False, True])
def test_bytes_filled_in_place_read_back_once_their_crcs_are_set(tmp_path, descriptor):
    path = tmp_path / "a.zip"
    archive(path, descriptor=descriptor)
    members = stored_members(path)
    new = {name: bytes(255 - b for b in data) for name, data in DATA.items()}
    with open(path, "r+b") as f:  # the same length, other bytes: every stored CRC is now stale
        for name, data in new.items():
            f.seek(members[name].offset)
            f.write(data)
    with zipfile.ZipFile(path) as z, pytest.raises(zipfile.BadZipFile, match="CRC"):
        z.read("a/first")
    set_crc32(path, {name: zlib.crc32(data) for name, data in new.items()})
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None
        assert {name: z.read(name) for name in DATA} == new
        assert [i.CRC for i in z.infolist()] == [zlib.crc32(d) for d in new.values()]
    raw = path.read_bytes()
    for name, data in new.items():  # and the other place: a descriptor, or the local header
        m = members[name]
        at = m.offset + m.size + 4 if descriptor else m.header_offset + 14
        assert int.from_bytes(raw[at : at + 4], "little") == zlib.crc32(data), name


def test_what_it_cannot_fill_is_refused_before_any_write(tmp_path):
    path = tmp_path / "a.zip"
    archive(path, descriptor=False)
    before = path.read_bytes()
    with pytest.raises(ZipLayoutError, match="no member a/fourth"):
        set_crc32(path, {"a/first": 1, "a/fourth": 2})
    assert path.read_bytes() == before
    compressed = tmp_path / "c.zip"
    with zipfile.ZipFile(compressed, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("x", b"x" * 100)
    with pytest.raises(ZipLayoutError, match="x is compressed"):
        stored_members(compressed)
