"""gzip trace files: the bytes of every member, and what stopped decompression, at which byte of the file."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

from dashboard.traces.collector_files import MAX_INFLATED_BYTES

MAGIC = b"\x1f\x8b"
CUT_SHORT = ("gzip stream ends early (is the file still being written?): the lines before the cut are read, "
             "the rest is unknown")
CHECKSUM_MISMATCH = ("gzip checksum does not match (the CRC-32 or length in the trailer of the member ending at byte "
                     "{end:,}): the file was altered after it was written, so its lines may be altered too; they are "
                     "read as they decompress")
_CHECK_ERRORS = ("incorrect data check", "incorrect length check")  # zlib's words for a trailer that disagrees
_TRAILER_AFTER_CRC = 4  # the member's length (ISIZE) follows its CRC-32
TOO_LARGE = (f"gzip stream decompresses past {MAX_INFLATED_BYTES >> 30} GiB: the complete lines before it are read; "
             "split the file")

_CHUNK = 1 << 16  # compressed bytes per step; a step that fails is replayed byte by byte


@dataclass(frozen=True)
class Gunzipped:
    data: bytes  # ends at a complete line when decompression stopped early
    altered: list[str] = field(default_factory=list)  # per member whose checksum does not match: its lines are kept
    stopped: str | None = None  # why decompression stopped early (cut short, corrupt): what follows is unknown


def gunzip(data: bytes) -> Gunzipped:
    """Decompress every gzip member (zero padding between them allowed).

    A stream cut short or corrupt keeps the complete lines decompressed before the failing byte, which
    the problem names; a member whose trailer disagrees with its data (deflate decoded it, but the data
    was altered) keeps all its lines, as they may still be right, and the problem says they may not be.
    Like zstd's, what decompresses past `MAX_INFLATED_BYTES` (a gzip bomb in an upload) is not read.
    """
    parts: list[bytes] = []
    altered: list[str] = []
    at = inflated = 0
    while at < len(data):
        out, at, error, ended = _member(data, at, MAX_INFLATED_BYTES - inflated)
        parts.append(out)
        inflated += len(out)
        if inflated > MAX_INFLATED_BYTES:
            return _stopped(parts, altered, TOO_LARGE)
        if error is None and not ended:
            return _stopped(parts, altered, CUT_SHORT)
        if error is not None:
            reason = str(error)
            if not any(words in reason for words in _CHECK_ERRORS):
                return _stopped(parts, altered, f"gzip data is corrupt: cannot decompress past byte {at:,} of the "
                                                f"file ({reason}): the complete lines before it are read, the rest is "
                                                "unknown")
            at += 1 + (_TRAILER_AFTER_CRC if _CHECK_ERRORS[0] in reason else 0)
            altered.append(CHECKSUM_MISMATCH.format(end=min(at, len(data))))
        while at < len(data) and data[at] == 0:
            at += 1
    return Gunzipped(b"".join(parts), altered)


def _member(data: bytes, at: int, room: int) -> tuple[bytes, int, zlib.error | None, bool]:
    """One member from byte `at`: its bytes, the byte after it (or the byte it fails at), the error, if it ended.

    Stops once more than `room` bytes came out: one more, as a chunk can inflate a thousandfold."""
    member = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)  # 16: a gzip header and trailer
    parts: list[bytes] = []
    view = memoryview(data)
    while at < len(data) and not member.eof and room >= 0:
        chunk = view[at:at + _CHUNK]
        before = member.copy()
        try:
            parts.append(member.decompress(chunk, room + 1))  # past `room`, the caller stops: what is left goes
            room -= len(parts[-1])
        except zlib.error:
            # One call that fails yields nothing: replay the chunk byte by byte to keep what precedes the error.
            out, failed, error = _replay(before, chunk)
            return b"".join(parts) + out, at + failed, error, False
        at += len(chunk) - len(member.unused_data)
    return b"".join(parts), at, None, member.eof


def _replay(member, chunk: memoryview) -> tuple[bytes, int, zlib.error]:
    """What `member` decompresses of `chunk` before the byte it fails at, that byte's index, and the error."""
    out: list[bytes] = []
    for i in range(len(chunk)):
        try:
            out.append(member.decompress(chunk[i:i + 1]))
        except zlib.error as exc:
            return b"".join(out), i, exc
    raise AssertionError("zlib failed on a chunk it decompresses byte by byte")  # inflate is deterministic


def _stopped(parts: list[bytes], altered: list[str], why: str) -> Gunzipped:
    out = b"".join(parts)[:MAX_INFLATED_BYTES]
    return Gunzipped(out[: out.rfind(b"\n") + 1], altered, why)
