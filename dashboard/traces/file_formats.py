"""What a trace file holds, told from its first bytes, and its content as JSON lines.

gzip and zstd are decompressed, the Collector's length-prefixed messages (protobuf, zstd frames:
`collector_files`) become JSON lines, Prometheus' text format is recognized and reported, and one
JSON document over many lines (a pretty-printed export, or a list of exports) becomes one line; the
reader then decodes JSON lines only.
"""

from __future__ import annotations

import json
import re
import zlib

from dashboard.traces.collector_files import ZSTD_MAGIC, is_length_prefixed, messages_as_json_lines, unzstd
from dashboard.traces.problems import Problem

_GZIP_MAGIC = b"\x1f\x8b"
GZIP_CUT_SHORT = ("gzip stream ends early (is the file still being written?): the lines before the cut are read, "
                  "the rest is unknown")
EXPECTED_JSON_LINES = ("expected JSON Lines: one ExportTraceServiceRequest per line (a pretty-printed export can be "
                       "converted with `jq -c . FILE`)")
PROMETHEUS_TEXT = ("looks like Prometheus metrics (text exposition format), not a trace file: the Live page "
                   "shows kvscope's metrics from a Prometheus server")
_FIRST_LINE = re.compile(rb"\s*([^\n]*)")  # the first line that is not blank
# The first line of Prometheus' text format: a HELP/TYPE comment, or a sample such as `name{label="x"} 1.5`.
_PROMETHEUS_LINE = re.compile(
    rb"# (HELP|TYPE|EOF)\b|[a-zA-Z_:][a-zA-Z0-9_:]*(\{[^}]*\})? +[-+0-9.eEINFinfNa]+( +\d+)?$")


def as_json_lines(label: str, data: bytes) -> tuple[bytes | None, list[Problem]]:
    """A file's bytes as JSON lines, and what was wrong with the file as a whole; None: nothing to read.

    Decompresses gzip and zstd (corruption or a stream cut short keeps the lines before it), reads the
    Collector's length-prefixed messages, recognizes Prometheus text, and turns one JSON document over
    several lines (a pretty-printed export, or a list of exports) into one line.
    """
    problems = []
    if data[:2] == _GZIP_MAGIC:
        data, stopped = _gunzip(data)
        if stopped:
            problems.append(Problem(label, 0, stopped, spans=None))
    elif data[:4] == ZSTD_MAGIC:
        data, found = unzstd(label, data)
        problems += found
        if data is None:
            return None, problems
        if found:  # cut short: complete lines (or messages) only
            data = data if is_length_prefixed(data) else data[: data.rfind(b"\n") + 1]
    if is_length_prefixed(data):
        lines, found = messages_as_json_lines(label, data)
        return lines, problems + found
    first = _FIRST_LINE.match(data).group(1).strip()
    if _PROMETHEUS_LINE.match(first):
        return None, problems + [Problem(label, 0, PROMETHEUS_TEXT, spans=None)]
    # A JSON line ends in "}"; a pretty-printed document's first line in "{", "[" or ",". Only then is
    # the whole file parsed as one document: a long first line parsed twice would cost seconds.
    if first[:1] in (b"{", b"[") and not first.endswith(b"}"):
        try:
            document = json.loads(data)
        except (ValueError, RecursionError):
            if not any(map(_is_json_object, data.split(b"\n"))):  # not one line of JSON lines either
                return None, problems + [Problem(label, 0, f"{EXPECTED_JSON_LINES}; as one JSON document it does "
                                                           "not parse either", spans=None)]
            # JSON lines after all, with a bad first line (a stray "{"?): read line by line, each bad one reported
        else:  # one JSON document over many lines: read it as one line
            return json.dumps(document).encode(), problems
    return data, problems


def _is_json_object(line: bytes) -> bool:
    if line.lstrip()[:1] != b"{":  # cheap first: most lines of a pretty-printed document are not objects
        return False
    try:
        return isinstance(json.loads(line), dict)
    except (ValueError, RecursionError):
        return False


_GZIP_CHUNK = 1 << 16  # compressed bytes per step: an error loses at most the output of one step


def _gunzip(data: bytes) -> tuple[bytes, str | None]:
    """The bytes of every gzip member, and why decompression stopped early (None: it did not).

    A stream cut short keeps all it holds (its last line is reported as incomplete); corruption or
    bytes that are no gzip member keep the complete lines before it, as the step that fails yields nothing.
    """
    parts: list[bytes] = []
    view, at = memoryview(data), 0
    while at < len(data):
        member = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)  # 16: a gzip header and trailer
        try:
            while at < len(data) and not member.eof:
                chunk = view[at:at + _GZIP_CHUNK]
                parts.append(member.decompress(chunk))
                at += len(chunk) - len(member.unused_data)
        except zlib.error as exc:
            out = b"".join(parts)
            out = out[: out.rfind(b"\n") + 1]
            return out, (f"cannot decompress past byte {len(out):,} of its content ({exc}): the complete lines "
                         "before it are read, the rest is unknown")
        if not member.eof:
            return b"".join(parts), GZIP_CUT_SHORT
        while at < len(data) and data[at] == 0:  # members can follow; padding with zeros can too
            at += 1
    return b"".join(parts), None
