"""What a trace file holds, told from its first bytes, and its content as JSON lines.

gzip (`gzip_files`) and zstd are decompressed, the Collector's length-prefixed messages (protobuf, zstd frames:
`collector_files`) become JSON lines, Prometheus' text format is recognized and reported, and one
JSON document over many lines (a pretty-printed export, or a list of exports) becomes one line; the
reader then decodes JSON lines only.
"""

from __future__ import annotations

import json
import re

from dashboard.traces import gzip_files
from dashboard.traces.collector_files import ZSTD_MAGIC, is_length_prefixed, messages_as_json_lines, unzstd
from dashboard.traces.problems import Problem

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
    stopped_early = False  # a compressed stream cut short or corrupt: its problem says why the rest is missing
    if data[:2] == gzip_files.MAGIC:
        gunzipped = gzip_files.gunzip(data)
        data, stopped_early = gunzipped.data, gunzipped.stopped is not None
        problems += [Problem(label, 0, reason) for reason in gunzipped.altered]  # read all the same
        if gunzipped.stopped:
            problems.append(Problem(label, 0, gunzipped.stopped, spans=None))
    elif data[:4] == ZSTD_MAGIC:
        data, found = unzstd(label, data)
        problems += found
        if data is None:
            return None, problems
        if found:  # cut short: complete lines (or messages) only
            data = data if is_length_prefixed(data) else data[: data.rfind(b"\n") + 1]
            stopped_early = True
    if data.startswith(b"\xef\xbb\xbf"):  # a UTF-8 BOM (Windows editors): before a document's "{" too
        data = data[3:]
    elif (encoding := _bom_encoding(data)) and not is_length_prefixed(data):  # PowerShell 5's `>` writes UTF-16
        try:
            data = data.decode(encoding).encode("utf-8")
        except UnicodeDecodeError as exc:
            return None, problems + [Problem(label, 0, f"{encoding.upper()} text that does not decode ({exc.reason} "
                                                       f"at byte {exc.start}); expected UTF-8", spans=None)]
        problems.append(Problem(label, 0, f"{encoding.upper()} text, read as such (kvscope writes UTF-8)"))
    if is_length_prefixed(data):
        lines, found = messages_as_json_lines(label, data)
        return lines, problems + found
    first = _FIRST_LINE.match(data).group(1).strip()
    if _PROMETHEUS_LINE.match(first):
        return None, problems + [Problem(label, 0, PROMETHEUS_TEXT, spans=None)]
    # A JSON line ends in "}" (or "]": a list of exports); a pretty-printed document's first line in "{", "[" or
    # ",". Only then is the whole file parsed as one document: a long first line parsed twice would cost seconds.
    # One line alone is no pretty-printed document: a line cut short, which the line decoder names as such.
    if first[:1] in (b"{", b"[") and not first.endswith((b"}", b"]")) and b"\n" in data.strip():
        try:
            document = json.loads(data)
        except (ValueError, RecursionError):
            if not any(map(_is_json_line, data.split(b"\n"))):  # not one line of JSON lines either
                if stopped_early:  # a document cut short does not parse: the decompression problem says why
                    return None, problems
                return None, problems + [Problem(label, 0, f"{EXPECTED_JSON_LINES}; as one JSON document it does "
                                                           "not parse either", spans=None)]
            # JSON lines after all, with a bad first line (a stray "{"?): read line by line, each bad one reported
        else:  # one JSON document over many lines: read it as one line
            return json.dumps(document).encode(), problems
    return data, problems


def _bom_encoding(data: bytes) -> str | None:
    """The UTF-16 or UTF-32 encoding a byte-order mark names; UTF-32's first (its little-endian mark
    begins with UTF-16's). A Collector message 65,279 bytes long begins as UTF-32's big-endian mark."""
    if data.startswith((b"\xff\xfe\x00\x00", b"\x00\x00\xfe\xff")):
        return "utf-32"
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        return "utf-16"
    return None


def _is_json_line(line: bytes) -> bool:
    """Whether a line is an export or a list of exports (`jq -c '[.]'`), as the reader takes them."""
    if line.lstrip()[:1] not in (b"{", b"["):  # cheap first: most lines of a pretty-printed document are neither
        return False
    try:
        doc = json.loads(line)
    except (ValueError, RecursionError):
        return False
    return isinstance(doc, dict) or (isinstance(doc, list) and bool(doc) and all(isinstance(d, dict) for d in doc))
