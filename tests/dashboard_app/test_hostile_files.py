"""Trace files that are wrong in ways a reader should survive: nesting deep enough to overflow a parser's stack,
byte-order marks, file and folder names the system cannot show or read, keys and numbers of the wrong kind.
Each is a problem named by file and line (or a note), never a crash, and the good lines beside it are read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dashboard import sources
from dashboard.traces import otlp_arrow
from dashboard.traces import TraceSource, read_trace_files

from .conftest import REPO, TWO_ROUNDS

GOOD_LINES = TWO_ROUNDS.read_bytes().splitlines()
GOOD_SPANS = len(read_trace_files([TWO_ROUNDS]).spans)


def _with_nested_attribute(levels: int, hidden: bool = False) -> bytes:
    """The fixture's first line with an attribute ``levels`` arrays deep added to its first span (written as text:
    no JSON encoder recurses that deep); ``hidden``: ``levels`` objects deep, each holding a string "}" on its way in
    and "{" on its way out, so that a count of every bracket sees a line 1 deep."""
    export = json.loads(GOOD_LINES[0])
    export["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["attributes"].append({"key": "deep", "value": "VALUE"})
    if hidden:
        value = '{"s":"}","c":' * levels + "1" + ',"t":"{"}' * levels
    else:
        value = '{"arrayValue":{"values":[' * levels + '{"intValue":"1"}' + "]}}" * levels
    return json.dumps(export).replace('"VALUE"', value, 1).encode()


def _summary(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`kvscope summary` in a process of its own: a parser that overflows its stack kills the process."""
    return subprocess.run([sys.executable, "-m", "connector.cli", "summary", *argv], cwd=REPO, capture_output=True,
                          timeout=300, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("deep_line", [
    pytest.param(lambda: _with_nested_attribute(1000), id="an attribute 1000 arrays deep"),
    pytest.param(lambda: _with_nested_attribute(30_000, hidden=True), id="30000 deep, strings hiding its brackets"),
    pytest.param(lambda: b'{"a":' * 20000 + b"1" + b"}" * 20000, id="20000 nested objects"),
])
def test_a_line_nested_past_a_parsers_stack_is_a_problem_not_a_crash(tmp_path, deep_line):
    """Arrow's JSON parser and kernels recurse per level: such a line killed the process (a segfault) where
    it read the whole file. The line decoder takes the file instead; that line alone is lost, named."""
    path = tmp_path / "deep.jsonl"
    path.write_bytes(b"\n".join([deep_line()] + GOOD_LINES[1:]) + b"\n")
    done = _summary("--json", str(path))
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    document = json.loads(done.stdout)
    assert [(p["line"], "nested too deeply" in p["reason"]) for p in document["problems"]] == [(1, True)]
    assert document["numbers"]["requests"] > 0


def test_an_attribute_nested_a_few_hundred_deep_loses_its_span_alone():
    """Deep enough for Python's own recursion limit (it raised out of the reader: every line lost)."""
    lines = [_with_nested_attribute(300)] + GOOD_LINES[1:]
    read = read_trace_files([_source(lines)])
    assert len(read.spans) == GOOD_SPANS - 1
    (problem,) = read.problems
    assert problem.line == 1 and "nested too deeply" in problem.reason and problem.spans == 1


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(alphabet='ab[]{}"\\\n\t'),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(alphabet='k[{"\\'), inner,
                                                                                  max_size=3), max_leaves=20),
       st.integers(0, 3))
def test_the_nesting_scan_is_exact_for_json_lines_whatever_their_strings_hold(value, copies):
    """Brackets, quotes and backslashes inside strings do not count; each line counts from 0, also after a line
    cut short (which the whole-file count must not carry into the next)."""
    line = json.dumps(value).encode()
    depth = _depth(value)
    assert otlp_arrow.nesting_depth(b"\n".join([line] * (copies + 1)) + b"\n") == depth
    cut = b'{"a":[[["x' + b"\n"  # unbalanced, and inside a string
    assert otlp_arrow.nesting_depth(cut + line + b"\n") == max(depth, 4)


def _depth(value) -> int:
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    return 0


def test_a_byte_order_mark_before_a_pretty_printed_export_reads_as_without_it(tmp_path):
    """Windows editors write one; it hid the document's "{" from the check for one JSON document per file."""
    pretty = json.dumps(json.loads(GOOD_LINES[0]), indent=2).encode()
    plain, marked = tmp_path / "plain.json", tmp_path / "marked.json"
    plain.write_bytes(pretty)
    marked.write_bytes(b"\xef\xbb\xbf" + pretty)
    without, with_mark = read_trace_files([plain]), read_trace_files([marked])
    assert len(with_mark.spans) == len(without.spans) > 0 and with_mark.problems == without.problems == []


def test_a_folder_that_cannot_be_read_is_a_note_beside_the_files_that_can(tmp_path, monkeypatch):
    """(Faked: as root, which CI is, no folder is unreadable.) It raised out of `trace_paths`, in the app outside
    its guard: the files given beside it were not shown either."""
    locked = tmp_path / "locked"
    locked.mkdir()
    real_iterdir = Path.iterdir

    def iterdir(self):
        if self == locked:
            raise PermissionError(13, "Permission denied", str(self))
        return real_iterdir(self)

    monkeypatch.setattr(Path, "iterdir", iterdir)
    given = sources.trace_paths([str(locked), str(TWO_ROUNDS)], {})
    assert given.paths == [str(TWO_ROUNDS)]
    assert given.empty_folders == [f"The folder {locked} cannot be read (Permission denied)."]


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every folder")
def test_a_folder_without_read_permission_is_a_note(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0)
    try:
        given = sources.trace_paths([str(locked), str(TWO_ROUNDS)], {})
    finally:
        locked.chmod(0o755)
    assert given.paths == [str(TWO_ROUNDS)] and "cannot be read" in given.empty_folders[0]


def test_a_file_name_that_is_not_utf8_is_read_and_shown_escaped(tmp_path):
    """A name in another encoding (Latin-1's "ÿ"): its problems are printed with the name escaped, where a
    UTF-8 terminal could not print it (the command failed), and the file is read."""
    folder = tmp_path / "traces"
    folder.mkdir()
    name = os.fsencode(folder) + b"/caf\xff.jsonl"
    with open(name, "wb") as out:
        out.write(b"\n".join(GOOD_LINES + [b"not json"]) + b"\n")
    done = _summary(str(folder), env={"PYTHONIOENCODING": "utf-8"})
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    text = done.stdout.decode()
    assert "caf\\xff.jsonl" in text and "traced requests" in text


def test_an_attribute_key_that_is_not_a_string_is_named(tmp_path):
    export = json.loads(GOOD_LINES[0])
    export["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["attributes"].append({"key": ["k"], "value": {}})
    read = read_trace_files([_source([json.dumps(export).encode()] + GOOD_LINES[1:])])
    (problem,) = read.problems
    assert problem.line == 1 and "an attribute key is a list, expected a string" in problem.reason
    assert len(read.spans) == GOOD_SPANS - 1


def test_a_number_too_long_to_read_is_not_called_a_text_encoding_problem():
    line = b'{"resourceSpans": [], "n": ' + b"7" * 5000 + b"}"
    read = read_trace_files([_source([line, b"not json"] + GOOD_LINES)])
    reasons = {problem.line: problem.reason for problem in read.problems}
    assert reasons[1].startswith("not JSON that can be read: ") and "UTF-8" not in reasons[1]
    assert reasons[2].startswith("not JSON: ")
    assert len(read.spans) == GOOD_SPANS


def _source(lines: list[bytes]) -> TraceSource:
    return TraceSource("hostile.jsonl", b"\n".join(lines) + b"\n")


def test_the_app_reads_a_folder_holding_a_file_name_that_is_not_utf8(tmp_path, monkeypatch, expected):
    """Streamlit could not hash such a path for its cache, nor the sidebar print it: the pages showed nothing."""
    from .test_pages import app, assert_ok, metrics, number

    folder = tmp_path / "traces"
    folder.mkdir()
    with open(os.fsencode(folder) + b"/caf\xff.jsonl", "wb") as out:
        out.write(TWO_ROUNDS.read_bytes())
    at = app(monkeypatch, folder)
    assert_ok(at)
    assert number(metrics(at)["Requests"]) == len(expected.lookups)
    assert any("caf\\xff.jsonl" in caption.value for caption in at.sidebar.caption)


@pytest.mark.parametrize("encoding, bom", [("utf-16-le", b"\xff\xfe"), ("utf-16-be", b"\xfe\xff"),
                                           ("utf-32-le", b"\xff\xfe\x00\x00"), ("utf-32-be", b"\x00\x00\xfe\xff")])
def test_a_utf16_or_utf32_file_is_read_and_said_to_be_so(tmp_path, encoding, bom):
    """What Windows PowerShell 5's `>` writes (UTF-16 with its byte-order mark): every line was "not JSON".
    UTF-32's little-endian mark begins with UTF-16's: it was decoded as UTF-16, into nothing readable."""
    path = tmp_path / "t.jsonl"
    path.write_bytes(bom + TWO_ROUNDS.read_text().encode(encoding))
    read = read_trace_files([path])
    assert len(read.spans) == GOOD_SPANS
    name = encoding[:6].upper()
    assert [(p.line, p.reason, p.spans) for p in read.problems] == [
        (0, f"{name} text, read as such (kvscope writes UTF-8)", 0)]


def test_a_utf16_file_cut_mid_character_is_named(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(TWO_ROUNDS.read_text().encode("utf-16")[:-1])
    (problem,) = read_trace_files([path]).problems
    assert problem.line == 0 and problem.reason.startswith("UTF-16 text that does not decode (truncated data")


def test_the_summary_names_a_folder_without_trace_files_given_beside_files(tmp_path):
    (tmp_path / "empty").mkdir()
    text, document = _summary(str(tmp_path / "empty"), str(TWO_ROUNDS)), _summary("--json", str(tmp_path / "empty"),
                                                                                  str(TWO_ROUNDS))
    assert text.returncode == document.returncode == 0
    note = f"The folder {tmp_path / 'empty'} holds no trace files (it is empty)"
    assert f"note: {note}" in text.stdout.decode()
    assert [folder.startswith(note) for folder in json.loads(document.stdout)["empty_folders"]] == [True]


@pytest.mark.parametrize("where", ["resource", "scope"])
def test_a_resource_or_scope_not_in_otlps_shape_loses_its_own_spans_not_its_neighbours(where):
    """A bad entry of `spans` lost only itself, but a bad resource or scope lost every span of its line."""
    export = json.loads(GOOD_LINES[0])
    kept = sum(len(scope["spans"]) for resource in export["resourceSpans"] for scope in resource["scopeSpans"])
    if where == "resource":
        export["resourceSpans"].append({"scopeSpans": "x"})
        expected = "not an OTLP trace export: resourceSpans[1].scopeSpans is a string, expected a list"
    else:
        export["resourceSpans"][0]["scopeSpans"].append({"scope": {"name": "kvscope"}, "spans": 7})
        expected = "not an OTLP trace export: resourceSpans[0].scopeSpans[1].spans is a number, expected a list"
    read = read_trace_files([_source([json.dumps(export).encode()] + GOOD_LINES[1:])])
    assert [(p.line, p.reason, p.spans) for p in read.problems] == [(1, expected, None)]
    assert len(read.spans) == GOOD_SPANS and kept > 0


def test_span_times_before_2000_are_read_and_said_to_be_suspect():
    """Times in µs (or a clock at 1970) read as nanoseconds: "20 requests over 2.7 ms", or over 19,675 days
    beside good ones, with nothing said. They are kept (a wrong clock loses no data), and named."""
    export = json.loads(GOOD_LINES[0])
    spans = export["resourceSpans"][0]["scopeSpans"][0]["spans"]
    for span in spans:
        span["startTimeUnixNano"] = str(int(span["startTimeUnixNano"]) // 1000)
        span["endTimeUnixNano"] = str(int(span["endTimeUnixNano"]) // 1000)
    read = read_trace_files([_source([json.dumps(export).encode()] + GOOD_LINES[1:])])
    assert len(read.spans) == GOOD_SPANS
    early = sum(span["name"].startswith("kvscope.") for span in spans)
    # (and its spans' children on other lines, 1,000 times later, are named as on another clock)
    assert (read.problems[0].line, read.problems[0].spans) == (0, 0)
    assert read.problems[0].reason.startswith(f"{early} span(s) start before 2000-01-01: a clock set wrong")
