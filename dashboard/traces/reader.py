"""Trace files (OTLP/JSON lines) -> one row per kvscope span, and a problem for all it skipped;
vLLM's request spans beside them (`vllm_spans`).

Takes the lines the connector and the OpenTelemetry Collector's file exporter write (one
``ExportTraceServiceRequest`` per line). Never raises on bad input: each skipped line or span is a
`Problem` naming the file, the line and the reason.

Each file is decoded by the Arrow decoder (`otlp_arrow`) when it is clean, else line by line
(`line_decoder`); converting, validating and joining are done here, column-wise.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from dashboard.formatting import printable_path
from dashboard.traces.file_formats import as_json_lines
from dashboard.traces import otlp_arrow
from dashboard.traces.line_decoder import DecodedSpans, decode_lines, integral_mask
from dashboard.traces.owners import CLOCK_TOLERANCE_NS, owner_keys, starts_before_owner
from dashboard.traces.problems import DUPLICATE_SPAN, Problem
from dashboard.traces.schema import (
    ALLOWED_VALUES,
    ATTRIBUTE_COLUMNS,
    LOOKUP,
    REQUIRED_ATTRIBUTES,
    SCAN,
    SPAN_COLUMNS,
    base64_id,
)
from dashboard.traces.vllm_spans import combine_vllm_requests, empty_vllm_requests, read_vllm_requests


@dataclass(frozen=True)
class Traces:
    """Result of reading trace files: one row per kvscope span, and what was skipped."""

    spans: pd.DataFrame
    problems: list[Problem] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    lines: int = 0  # non-empty lines read
    other_spans: int = 0  # spans outside kvscope, vLLM's request spans among them
    vllm_requests: pd.DataFrame = field(default_factory=empty_vllm_requests)  # vLLM's request spans (`vllm_spans`)
    vllm_spans_read: int = 0  # vLLM request spans in all files, a span given twice counted twice (as `other_spans`)

    @property
    def empty(self) -> bool:
        return self.spans.empty

    @property
    def spans_left_out(self) -> int:
        """Spans neither kvscope's nor vLLM's request spans (at least 0: a line the kvscope decoder could not
        take apart may still have given a vLLM span)."""
        return max(self.other_spans - self.vllm_spans_read, 0)


@dataclass(frozen=True)
class TraceSource:
    """In-memory trace file (e.g. an upload): a label for messages and its bytes."""

    name: str
    data: bytes


def read_trace_files(sources: Iterable[str | os.PathLike[str] | TraceSource]) -> Traces:
    """Read trace files (paths, ``.gz`` allowed, or in-memory sources) into one span frame.

    Never raises on bad input: unreadable, empty or compressed-beyond-reach files, files of another
    kind, lines that are not OTLP/JSON, spans without the attributes their name requires, duplicate
    spans and unknown kvscope scope versions become `Problem`s, and everything else loads. A path
    given twice (a folder and a file in it) is read once. vLLM's request spans of every file are
    read too (`vllm_spans`), never as problems.
    """
    frames: list[pd.DataFrame] = []
    vllm_frames: list[pd.DataFrame] = []
    problems: list[Problem] = []
    files: list[str] = []
    first_label: dict[Path, tuple[str, bool]] = {}  # a path -> the label it was first given as, and if it was read
    lines = other = 0
    for source in sources:
        if isinstance(source, TraceSource):
            label, data = source.name, source.data
        else:
            path = os.fspath(source)
            label = printable_path(path)  # a file name need not be UTF-8: messages and pages show it escaped
            resolved = Path(path).resolve()
            if resolved in first_label:
                first, was_read = first_label[resolved]
                problems.append(Problem(label, 0, f"the same file as {first}: "
                                        + ("read once" if was_read else "it could not be read")))
                continue
            first_label[resolved] = (label, False)
            try:
                data = Path(path).read_bytes()
            except OSError as exc:
                files.append(label)
                problems.append(Problem(label, 0, f"cannot read file: {exc.strerror or exc}", spans=None))
                continue
            first_label[resolved] = (label, True)
        files.append(label)
        data, found = as_json_lines(label, data)
        problems += found
        if data is None:
            continue
        decoded = decode_spans(label, data)
        vllm_frames.append(read_vllm_requests(label, data))
        if not decoded.lines and not found:
            problems.append(Problem(label, 0, "empty file: it holds no lines"))
        frame, rejected = _validated_frame(decoded, label)
        frames.append(frame)
        problems += decoded.problems + rejected + _early_times(frame, label)
        lines += decoded.lines
        other += decoded.other_spans
    spans, duplicates = _combine(frames)
    order = {name: i for i, name in enumerate(files)}
    problems = sorted(problems + duplicates, key=lambda p: (order.get(p.file, len(order)), p.line))
    return Traces(spans=spans, problems=problems, files=files, lines=lines, other_spans=other,
                  vllm_requests=combine_vllm_requests(vllm_frames), vllm_spans_read=sum(map(len, vllm_frames)))


# 2000-01-01 in ns since the epoch: span times before it are no clock's now, but a clock set wrong or times in
# another unit (µs, s)
PLAUSIBLE_SINCE_NS = 946_684_800 * 10**9


def _early_times(frame: pd.DataFrame, label: str) -> list[Problem]:
    """A note where spans start before 2000: read all the same, but they stretch every time axis."""
    early = int((frame["start_ns"] < PLAUSIBLE_SINCE_NS).sum()) if len(frame) else 0
    if not early:
        return []
    return [Problem(label, 0, f"{early} span(s) start before 2000-01-01: a clock set wrong, or times not in "
                              "nanoseconds since the epoch (microseconds? seconds?); read all the same")]


def decode_spans(label: str, data: bytes) -> DecodedSpans:
    """Decode one file's bytes: the Arrow decoder when the file is clean, else line by line.

    The Arrow decoder parses the whole file in C++ and unnests it column-wise; it declines
    (returns None) on anything unusual, such as a line that does not parse or a value of an
    unexpected type, and the line-by-line decoder then reports each problem with its line.
    """
    lines = data.split(b"\n")
    fast = otlp_arrow.decode(data, label, lines)
    return fast if fast is not None else decode_lines(label, lines)


def _empty_spans() -> pd.DataFrame:
    frame = pd.DataFrame({col: pd.Series(dtype=object) for col in SPAN_COLUMNS})
    for col in ("start_ns", "end_ns", "source_line", "status_code"):
        frame[col] = frame[col].astype("int64")
    frame["duration_ms"] = frame["duration_ms"].astype(float)
    frame["span_key"] = frame["span_key"].astype("int64")
    frame["owner_key"] = frame["owner_key"].astype("Int64")
    frame["clock_ok"] = frame["clock_ok"].astype(bool)
    for col, is_int in ATTRIBUTE_COLUMNS.values():
        if is_int:
            frame[col] = frame[col].astype("Int64")
    for col in ("name", "group_kind", "copy_direction", "source_file"):
        frame[col] = frame[col].astype("category")
    return frame


def _validated_frame(d: DecodedSpans, label: str) -> tuple[pd.DataFrame, list[Problem]]:
    """The spans of one file that satisfy the contract, and a problem for each kind of violation."""
    n = len(d.start_ns)
    frame = pd.DataFrame({
        "trace_id": pd.Series(d.trace_id, dtype=object),
        "span_id": pd.Series(d.span_id, dtype=object),
        "parent_span_id": pd.Series(d.parent_span_id, dtype=object),
        "name": pd.Series(d.name, dtype=object),
        "start_ns": d.start_ns,
        "end_ns": d.end_ns,
    })
    reasons: list[tuple[np.ndarray, str]] = []

    # Ids: OTLP/JSON writes lowercase hex; protobuf-JSON tools write base64. Accept both.
    # An id that is no string (null, a number, a list) is invalid: `astype(str)` would keep null as NaN
    # (which base64 decoding rejects with TypeError) and could turn a 16-digit number into a valid id.
    for col, width in (("trace_id", 32), ("span_id", 16), ("parent_span_id", 16)):
        is_text = frame[col].map(lambda v: isinstance(v, str)).to_numpy(dtype=bool)
        original = frame[col].where(is_text, "").astype(str)
        ids = original.str.lower()
        ok = ids.str.fullmatch(f"[0-9a-f]{{{width}}}").to_numpy(dtype=bool, copy=True) & is_text
        if col == "parent_span_id":
            ok |= (ids == "").to_numpy(dtype=bool) & is_text
        if not ok.all():
            fixed = original[~ok].map(lambda v, w=width: base64_id(v, w))
            ids.loc[~ok] = fixed.fillna(ids[~ok])
            still = np.zeros(n, dtype=bool)
            still[~ok] = fixed.isna().to_numpy()
            reasons.append((still, f"span with an invalid {col.replace('_', ' ')} (expected a string of {width} hex "
                                   f"digits, or {width // 2} bytes in base64)"))
        frame[col] = ids

    for key, (col, is_int) in ATTRIBUTE_COLUMNS.items():
        values = d.values[key]
        if d.invalid[key].any():
            reasons.append((d.invalid[key], f"{key} is not an integer (or beyond ±2^53)"))
        if is_int:
            lowest, accepted = _LOWEST_VALUES.get(key, (0, "a count >= 0"))
            with np.errstate(invalid="ignore"):
                negative = values < lowest  # every integer attribute counts or indexes something
            if negative.any():
                reasons.append((negative, _each_value(values, negative, f"{key} is {{}}, expected {accepted}")))
            frame[col] = pd.array(np.where(integral_mask(values), values, np.nan), dtype="Int64")
            continue
        allowed = ALLOWED_VALUES.get(key)
        if allowed is not None:
            bad = np.not_equal(values, None) & ~np.isin(values, allowed)
            if bad.any():
                reasons.append((bad, f"{key} is not one of {', '.join(allowed)}"))
        frame[col] = values

    names = frame["name"].to_numpy()
    for span_name, required in REQUIRED_ATTRIBUTES.items():
        is_name = names == span_name
        if not is_name.any():
            continue
        for key in required:
            missing = is_name & frame[ATTRIBUTE_COLUMNS[key][0]].isna().to_numpy()
            if missing.any():
                reasons.append((missing, f"{span_name} span lacks {key}"))

    queried, hit = d.values["kvscope.tokens.queried"], d.values["kvscope.tokens.hit"]
    with np.errstate(invalid="ignore"):
        hit_too_many = (names == LOOKUP) & (hit > queried)
    if hit_too_many.any():
        reasons.append((hit_too_many, _each_value(
            np.stack([hit, queried], axis=1), hit_too_many,
            "kvscope.tokens.hit {} is more than kvscope.tokens.queried {}, expected hit <= queried")))
    # a scan's blocks are null (skipped) or pending (loaded): more of them than it scanned made a null-skip share
    # over 100%
    total = d.values["kvscope.group.blocks.total"]
    split = d.values["kvscope.group.blocks.null_skipped"] + d.values["kvscope.group.blocks.pending"]
    with np.errstate(invalid="ignore"):
        split_too_many = (names == SCAN) & (split > total)
    if split_too_many.any():
        reasons.append((split_too_many, _each_value(
            np.stack([d.values["kvscope.group.blocks.null_skipped"], d.values["kvscope.group.blocks.pending"], total],
                     axis=1), split_too_many,
            "kvscope.group.blocks.null_skipped {} + kvscope.group.blocks.pending {} is more than "
            "kvscope.group.blocks.total {}, expected null skipped + pending <= total")))

    frame["status_code"] = d.status_code
    frame["attributes"] = pd.Series(d.extra_attributes, dtype=object)
    frame["source_file"] = label
    frame["source_line"] = d.source_line

    problems: list[Problem] = []
    bad = np.zeros(n, dtype=bool)
    for mask, reason in reasons:
        mask = mask & ~bad  # report each span once, under its first problem
        if mask.any():
            problems += _problems_at(frame, mask, reason)
            bad |= mask
    return frame[~bad], problems


# Integer attributes that may go below 0, and how far: a scan with no pending block starts at -1.
_LOWEST_VALUES = {"kvscope.group.blocks.start": (-1, "a block index >= 0, or -1 when no block is pending")}


def _each_value(values: np.ndarray, mask: np.ndarray, template: str) -> np.ndarray:
    """A reason per masked span naming its value(s) (`template` holds one {} per column of `values`)."""
    reasons = np.full(len(mask), None, dtype=object)
    picked = values[mask].reshape(int(mask.sum()), -1)
    reasons[mask] = [template.format(*(f"{v:.0f}" if float(v).is_integer() else f"{v:g}" for v in row))
                     for row in picked]
    return reasons


def _combine(frames: list[pd.DataFrame]) -> tuple[pd.DataFrame, list[Problem]]:
    frames = [f for f in frames if len(f)]
    if not frames:
        return _empty_spans(), []
    frame = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0].reset_index(drop=True)
    problems: list[Problem] = []
    ids = ["trace_id", "span_id"]
    dup = frame.duplicated([*ids, "name", "start_ns", "end_ns"], keep="first").to_numpy()
    if dup.any():  # the same span twice: a file read twice, or a Collector copy beside the connector's
        problems = _problems_at(frame, dup, DUPLICATE_SPAN)
        frame = frame[~dup].reset_index(drop=True)
    too_large, reasons = _counts_past_sum_limit(frame)
    if too_large.any():
        problems += _problems_at(frame, too_large, reasons)
        frame = frame[~too_large].reset_index(drop=True)
    # Kept: different spans. Owners are looked for in the child's own file first (`owners`), and in
    # another file only when one span of all the others has the id, so a span id reused in another
    # file does no harm; within one file, the child's request id tells the spans apart.
    reused_in_file = frame.duplicated(["source_file", *ids], keep=False).to_numpy()
    reused_elsewhere = frame.duplicated(ids, keep=False).to_numpy() & ~reused_in_file
    if reused_in_file.any():
        problems += _problems_at(frame, reused_in_file, "traceId and spanId also used by a different span of this "
                                 "file; a copy or scan under that id joins the one of its request id, or none",
                                 skipped=False)
    if reused_elsewhere.any():
        problems += _problems_at(frame, reused_elsewhere, "traceId and spanId also used by a different span in another "
                                 "file (runs whose id generator was seeded alike?); a copy or scan under that id joins "
                                 "the one of its own file, or none", skipped=False)
    frame["duration_ms"] = (frame["end_ns"] - frame["start_ns"]) / 1e6
    for col in ("name", "group_kind", "copy_direction", "source_file"):
        frame[col] = frame[col].astype("category")
    frame["span_key"] = np.arange(len(frame), dtype=np.int64)
    frame["owner_key"] = owner_keys(frame)
    problems += _clock_problems(frame)
    return frame[list(SPAN_COLUMNS)], problems


# Every sum the pages make adds one integer column's values (all >= 0) over some spans, at most two such sums
# together: with each column's total below 2^62, no int64 sum wraps around.
_SUM_LIMIT = 1 << 62
# float64 sums of values >= 0 are off by far less than this share of the total: only a column whose float total
# comes this close to the limit is summed exactly.
_FLOAT_SUM_MARGIN = 1 - 2.0 ** -30


def _counts_past_sum_limit(frame: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """The spans to leave out so that no column's total reaches `_SUM_LIMIT`, and a reason per span.

    Only when a column's total does (absurd counts: 2^53 tokens in each of a thousand lookups): then the values
    above the largest bound whose values (those at or below it) still total less than the limit go, so the
    fewest and largest counts go, and equal counts go or stay together.
    """
    mask = np.zeros(len(frame), dtype=bool)
    reasons = np.full(len(frame), None, dtype=object)
    for key, (col, is_int) in ATTRIBUTE_COLUMNS.items():
        if not is_int:
            continue
        values = frame[col].to_numpy(dtype=float, na_value=np.nan)
        kept = ~np.isnan(values) & ~mask
        if not np.sum(values[kept]) >= _SUM_LIMIT * _FLOAT_SUM_MARGIN:
            continue
        bound = _largest_bound_below_limit(values[kept])
        if bound is None:
            continue
        over = kept & (values > bound)
        mask |= over
        having = np.count_nonzero(kept)
        reasons[over] = [f"{key} is {v:.0f}: summed over the {having:,} spans that have it, counts this large would "
                         f"pass 2^62, expected at most {bound:.0f}" for v in values[over]]
    return mask, reasons


def _largest_bound_below_limit(values: np.ndarray) -> float | None:
    """The largest bound such that ``values`` (whole numbers >= 0, up to 2^53) at or below it total less than
    `_SUM_LIMIT`, summed exactly: the largest value that can stay, or one below the smallest when the smallest
    alone reach the limit; None when all of them total less."""
    distinct, counts = np.unique(values, return_counts=True)
    total, bound = 0, float(distinct[0]) - 1
    for value, count in zip(distinct.tolist(), counts.tolist()):
        total += int(value) * count  # Python ints: exact, where float64 or int64 sums are not
        if total >= _SUM_LIMIT:
            return bound
        bound = value
    return None


ENDS_BEFORE_START = ("span ends before it starts (endTimeUnixNano < startTimeUnixNano); a copy that does is left "
                     "out of copy durations and throughput, and a load that does or whose copy does gets no load "
                     "time")
STARTS_BEFORE_OWNER = (f"copy or scan starts more than {CLOCK_TOLERANCE_NS / 1e6:g} ms before the load or store it "
                       "belongs to (placed on another clock?); a load copy's load gets no load time, and the span's "
                       "own duration still counts")


def _clock_problems(frame: pd.DataFrame) -> list[Problem]:
    """Set `clock_ok` and report the spans whose times cannot be trusted (kept: their ids and bytes still count).

    Only a span ending before it starts has a wrong duration (`schema.duration_ok`); one starting
    before its owner was measured on its own clock, whose offset to the scheduler's is off: that
    spoils its load's load time only.
    """
    ends_early = (frame["end_ns"] < frame["start_ns"]).to_numpy()
    early = starts_before_owner(frame) & ~ends_early
    frame["clock_ok"] = ~(ends_early | early)
    return (_problems_at(frame, ends_early, ENDS_BEFORE_START, skipped=False)
            + _problems_at(frame, early, STARTS_BEFORE_OWNER, skipped=False))


def _problems_at(frame: pd.DataFrame, mask: np.ndarray, reason: str | np.ndarray,
                 skipped: bool = True) -> list[Problem]:
    """One problem per (file, line) and reason of the masked spans; `reason`: one for all, or one per span (an
    array as long as the frame); `skipped` False: the spans stay, counted in the text."""
    hits = frame.loc[mask, ["source_file", "source_line"]].assign(
        reason=reason if isinstance(reason, str) else reason[mask])
    counts = hits.groupby(["source_file", "source_line", "reason"], observed=True, sort=True).size()
    if skipped:
        return [Problem(str(f), int(line), why, int(n)) for (f, line, why), n in counts.items()]
    return [Problem(str(f), int(line), f"{why} ({n} span(s), kept)") for (f, line, why), n in counts.items()]
