"""gzip trace files that are corrupt, cut short or altered (`gzip_files`): what is kept, and what is said."""

from __future__ import annotations

import gzip
import json
import zlib

from dashboard import traces
from dashboard.traces import gzip_files

from .test_reader import line, lookup

TEXT = "".join(line(lookup(f"r{i}", span_id=f"{i + 1:016x}")) + "\n" for i in range(200)).encode()


def _inflate_until_error(data: bytes) -> tuple[bytes, int]:
    """What zlib gives of `data` fed byte by byte, and the index of the byte it fails at (independent of the code)."""
    inflater, out = zlib.decompressobj(wbits=31), []
    for i in range(len(data)):
        try:
            out.append(inflater.decompress(data[i:i + 1]))
        except zlib.error:
            return b"".join(out), i
    raise AssertionError("no error")


def _read(data: bytes, name: str = "t.jsonl.gz") -> traces.Traces:
    return traces.read_trace_files([traces.TraceSource(name, data)])


def test_corruption_mid_file_keeps_every_line_decompressed_before_it():
    half = TEXT.index(b"\n", len(TEXT) // 2) + 1
    packer = zlib.compressobj(wbits=31)
    head = packer.compress(TEXT[:half]) + packer.flush(zlib.Z_FULL_FLUSH)  # the next block starts at a byte
    rest = packer.compress(TEXT[half:]) + packer.flush()
    corrupt = head + b"\x07" + rest[1:]  # a block header of the type deflate does not have (BTYPE 11)
    assert len(corrupt) < gzip_files._CHUNK  # one step: a failing step used to keep nothing

    read = _read(corrupt)
    assert read.spans["request_id"].tolist() == [f"r{i}" for i in range(TEXT[:half].count(b"\n"))]
    assert [(p.line, p.spans) for p in read.problems] == [(0, None)]
    assert read.problems[0].reason.startswith(f"gzip data is corrupt: cannot decompress past byte {len(head):,} of "
                                              "the file (Error -3 while decompressing data: invalid block type)")


def test_corrupt_data_that_deflate_still_decodes_is_a_checksum_problem():
    packed = bytearray(gzip.compress(TEXT))
    middle = len(packed) // 2
    for k in range(middle, middle + 50):
        packed[k] ^= 0x55
    before, _ = _inflate_until_error(bytes(packed))
    intact = 0
    while before.split(b"\n")[intact] == TEXT.split(b"\n")[intact]:
        intact += 1
    read = _read(bytes(packed))
    assert read.spans["request_id"].tolist()[:intact] == [f"r{i}" for i in range(intact)] and intact > 50
    assert read.problems[0].line == 0 and read.problems[0].reason.startswith("gzip checksum does not match")


def test_a_member_whose_checksum_does_not_match_is_read_and_reported():
    for trailer_byte, words in ((-8, "incorrect data check"), (-1, "incorrect length check")):
        altered = bytearray(gzip.compress(TEXT))
        altered[trailer_byte] ^= 0x01  # the CRC-32 or the length: deflate decodes all the data
        with_next = bytes(altered) + gzip.compress(line(lookup("next", span_id="ff" * 8)).encode() + b"\n")
        read = _read(with_next)
        assert read.spans["request_id"].tolist() == [f"r{i}" for i in range(200)] + ["next"], words
        assert [(p.line, p.spans) for p in read.problems] == [(0, 0)]
        assert read.problems[0].reason == gzip_files.CHECKSUM_MISMATCH.format(end=len(altered))
        assert "checksum does not match" in read.problems[0].reason and "may be altered" in read.problems[0].reason


def test_a_gzip_file_cut_before_its_first_newline_is_one_problem():
    one_line = gzip.compress(TEXT[:TEXT.index(b"\n") + 1])
    pretty = gzip.compress(json.dumps(json.loads(TEXT[:TEXT.index(b"\n")]), indent=2).encode())
    for data in (one_line, pretty):
        read = _read(data[: len(data) // 2])
        assert [(p.line, p.reason, p.spans) for p in read.problems] == [(0, gzip_files.CUT_SHORT, None)]
        assert read.empty


def test_a_gzip_bomb_stops_at_the_cap_keeping_the_complete_lines_before_it(monkeypatch):
    """As for zstd (`collector_files.MAX_INFLATED_BYTES`): an upload inflating past the cap stops there."""
    monkeypatch.setattr(gzip_files, "MAX_INFLATED_BYTES", 10_000)
    bomb = gzip.compress(b"\n" * 50_000_000, 1)  # 50 MB of newlines in some 200 kB
    assert len(gzip_files.gunzip(bomb).data) == 10_000
    half = TEXT.index(b"\n", 5_000) + 1  # the cap falls in the second member
    read = _read(gzip.compress(TEXT[:half]) + gzip.compress(TEXT[half:]))
    assert read.spans["request_id"].tolist() == [f"r{i}" for i in range(TEXT[:10_000].count(b"\n"))]
    assert [(p.line, p.reason, p.spans) for p in read.problems] == [(0, gzip_files.TOO_LARGE, None)]


def test_zero_bytes_between_and_after_members_are_padding_not_corruption():
    """Tape and block-device writers pad gzip members with zero bytes (gzip itself skips them): every line is read,
    and nothing is said."""
    half = TEXT.index(b"\n", len(TEXT) // 2) + 1
    read = _read(gzip.compress(TEXT[:half]) + bytes(512) + gzip.compress(TEXT[half:]) + bytes(100))
    assert read.problems == [] and len(read.spans) == 200
