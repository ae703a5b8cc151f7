"""Stored (uncompressed) members of a zip archive, filled in place after the archive was laid out.

torch.save's checkpoint is a zip of stored members, and torch can lay one out without the
tensors' bytes (torch.serialization.skip_data): the members' headers and room for each. A writer
then puts each tensor's bytes into its room straight from wherever they are (a mapped file, a
transposed view a block at a time) and sets each member's CRC-32, which the zip keeps in the
member's data descriptor (or its local header) and in the central directory. This module finds
the rooms (`stored_members`) and sets the CRCs (`set_crc32`); it reads the layout with Python's
zipfile and checks every field it writes next to.
"""

from __future__ import annotations

import struct
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

_LOCAL_HEADER = b"PK\x03\x04"
_CENTRAL_HEADER = b"PK\x01\x02"
_DESCRIPTOR = b"PK\x07\x08"
_HAS_DESCRIPTOR = 0x08  # general purpose flag bit 3: the CRC and sizes follow the data


class ZipLayoutError(ValueError):
    """An archive whose layout is not what these functions fill in place."""


@dataclass(frozen=True)
class Member:
    """A stored member: its bytes are `size` bytes at `offset` in the archive."""

    name: str
    offset: int
    size: int
    header_offset: int
    has_descriptor: bool


def stored_members(path: str | Path) -> dict[str, Member]:
    """Every member of the archive at `path`, by name, in the archive's order; a compressed
    member is refused (its bytes are not the data)."""
    members = {}
    with zipfile.ZipFile(path) as archive, open(path, "rb") as f:
        for info in archive.infolist():
            if info.compress_type != zipfile.ZIP_STORED:
                raise ZipLayoutError(f"{info.filename} is compressed")
            f.seek(info.header_offset)
            head = f.read(30)
            if head[:4] != _LOCAL_HEADER:
                raise ZipLayoutError(f"{info.filename}: no local header at its offset")
            name_length, extra_length = struct.unpack_from("<HH", head, 26)
            members[info.filename] = Member(
                info.filename,
                info.header_offset + 30 + name_length + extra_length,
                info.file_size,
                info.header_offset,
                bool(info.flag_bits & _HAS_DESCRIPTOR),
            )
    return members


def set_crc32(path: str | Path, crcs: Mapping[str, int]) -> None:
    """Set the CRC-32 of the named stored members, wherever the archive keeps it: the data
    descriptor after the member's bytes (or its local header, where it has no descriptor) and
    its entry in the central directory. Every place is checked before any is written."""
    members = stored_members(path)
    unknown = sorted(set(crcs) - set(members))
    if unknown:
        raise ZipLayoutError(f"no member {unknown[0]}")
    places: list[tuple[int, int]] = []
    with zipfile.ZipFile(path) as archive:
        start, names = archive.start_dir, [info.filename for info in archive.infolist()]
    with open(path, "r+b") as f:
        for name, crc in crcs.items():
            member = members[name]
            if member.has_descriptor:
                f.seek(member.offset + member.size)
                signature = f.read(4)
                if signature != _DESCRIPTOR:  # the signature is optional, but torch writes it
                    raise ZipLayoutError(f"{name}: no data descriptor after its bytes")
                places.append((member.offset + member.size + 4, crc))
            else:
                places.append((member.header_offset + 14, crc))
        position = start
        for name in names:
            f.seek(position)
            entry = f.read(46)
            if entry[:4] != _CENTRAL_HEADER:
                raise ZipLayoutError(f"{name}: no central directory entry where expected")
            name_length, extra_length, comment_length = struct.unpack_from("<HHH", entry, 28)
            if f.read(name_length).decode("utf-8", "replace") != name:
                raise ZipLayoutError(f"{name}: the central directory names another member")
            if name in crcs:
                places.append((position + 16, crcs[name]))
            position += 46 + name_length + extra_length + comment_length
        for offset, crc in places:
            f.seek(offset)
            f.write(struct.pack("<I", crc))
