"""Which load or store span each copy and scan span belongs to: its owner.

Span ids do not name one span: two runs whose id generator was seeded alike reuse them, in files
read together. So an owner is looked for in the child's own file and trace first; in another file
of the trace only when none is found there, the parent's id names one load or store across all the
other files, and that span is of the child's request (one run split over files: a Collector's
rotated files, or the scheduler and worker writing apart). Shaping modules join `owner_key` to
`span_key` (unique per row of the span frame), never by span id.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from dashboard.traces.schema import COPY, LOAD, SCAN, STORE

# A copy's interval is measured on one clock (on a GPU, between two device events) and then placed on
# the scheduler's wall clock; that placement can be off by up to about 1 ms (the connector's CUDA
# tests accept ±1 ms). A copy starting within this much before its load or store is no other clock.
CLOCK_TOLERANCE_NS = 1_000_000

_SAME_PLACE = ["source_file", "trace_id"]  # an owner is looked for in its child's file and trace first
_OWNER_KIND = {"load": LOAD, "store": STORE}  # copy direction -> span that owns the copy


def owner_keys(spans: pd.DataFrame) -> pd.Series:
    """The `span_key` of the span each copy and scan belongs to; NA for other spans and when none is found.

    A scan or copy belongs to its parent when that is a load (scans, load copies) or a store (store
    copies) of its file and trace; when several such spans of the file share the parent's id, to the
    one of its request id. A child whose parent is not in its file belongs to the parent in another
    file of its trace when only one load (store) of all the other files has that id, and is of the
    child's request when the child carries one. A copy still without owner belongs to the only load
    (store) in its file and trace that can be its request's and started before it (within
    `CLOCK_TOLERANCE_NS`): the only one of its request id, or the only one at all when the copy
    carries no request id (copies of requests sharing one upstream trace must not join another's load).
    """
    owner = pd.Series(pd.NA, index=spans.index, dtype="Int64")
    name = spans["name"].astype(object)
    is_copy = (name == COPY).to_numpy()
    want = pd.Series(None, index=spans.index, dtype=object)
    want[(name == SCAN).to_numpy()] = LOAD
    want[is_copy] = spans.loc[is_copy, "copy_direction"].astype(object).map(_OWNER_KIND)
    is_child = want.notna().to_numpy()
    if not is_child.any():
        return owner
    children = spans.loc[is_child, [*_SAME_PLACE, "parent_span_id", "request_id", "start_ns"]].assign(
        want=want[is_child], child=spans.index[is_child], is_copy=is_copy[is_child])
    is_owner = name.isin([LOAD, STORE]).to_numpy()
    owners = spans.loc[is_owner, [*_SAME_PLACE, "span_id", "request_id", "span_key", "start_ns"]].assign(
        want=name[is_owner])

    parents = children.merge(owners, left_on=[*_SAME_PLACE, "want", "parent_span_id"],
                             right_on=[*_SAME_PLACE, "want", "span_id"], suffixes=("", "_owner"))
    found = _only_candidates(parents, prefer_same_request=True)
    found = pd.concat([found, _parent_elsewhere(children[~children["child"].isin(found.index)], owners)])
    orphans = children[children["is_copy"] & ~children["child"].isin(found.index)]
    with_request = orphans[orphans["request_id"].notna()]
    of_request = with_request.merge(owners, on=[*_SAME_PLACE, "want", "request_id"], suffixes=("", "_owner"))
    without_request = orphans[orphans["request_id"].isna()].drop(columns="request_id")
    alone = owners[~owners.duplicated([*_SAME_PLACE, "want"], keep=False)]  # merging all would be copies x loads
    in_trace = without_request.merge(alone.drop(columns="request_id"), on=[*_SAME_PLACE, "want"],
                                     suffixes=("", "_owner"))
    for pairs in (of_request, in_trace):
        # a copy never starts before its load or store: a lost first load's copies are not the second's
        pairs = pairs[pairs["start_ns"] >= pairs["start_ns_owner"] - CLOCK_TOLERANCE_NS]
        found = pd.concat([found, _only_candidates(pairs)])
    owner.loc[found.index] = found.to_numpy()
    return owner


def _parent_elsewhere(children: pd.DataFrame, owners: pd.DataFrame) -> pd.Series:
    """child -> owner `span_key` for the children whose parent id names one owner across the other files of the trace.

    Before the same-file guess by request id: a load's copies split from it by a file rotation must
    not join a later load of the request (resumed after preemption) that is in their file. Several
    candidates (runs reusing ids, each in its file, or an id reused in the child's own file) give
    none; so does another request's span.
    """
    children = children[children["parent_span_id"].notna()]  # NA keys would merge with each other
    pairs = children.merge(owners, left_on=["trace_id", "want", "parent_span_id"],
                           right_on=["trace_id", "want", "span_id"], suffixes=("", "_owner"))
    # No child here has one candidate in its own file (it would have joined it): the candidates are the
    # other files' spans, or also several of its own file, whose reused id then tells nothing either.
    pairs = pairs[~pairs["child"].duplicated(keep=False)]
    same_request = pairs["request_id"].isna() | (pairs["request_id"] == pairs["request_id_owner"])
    return pairs[same_request].set_index("child")["span_key"]


def _only_candidates(pairs: pd.DataFrame, prefer_same_request: bool = False) -> pd.Series:
    """child -> owner `span_key` for the children with one candidate owner in `pairs` (child, candidate rows).

    `prefer_same_request`: a child with several candidates (a reused span id) takes the only one of
    its request id, if there is one.
    """
    several = pairs["child"].duplicated(keep=False)
    if prefer_same_request and several.any():
        same_request = pairs["request_id"] == pairs["request_id_owner"]  # False where the child has none
        pairs = pairs[~several | same_request]
        several = pairs["child"].duplicated(keep=False)
    return pairs.loc[~several].set_index("child")["span_key"]


def starts_before_owner(spans: pd.DataFrame) -> np.ndarray:
    """Which spans start before the load or store they belong to (`owner_key`), by more than `CLOCK_TOLERANCE_NS`.

    A worker's copies run after the scheduler planned them: one that starts earlier was placed on
    another clock (another host's, or a GPU clock mapped wrongly), and its load time would be wrong.
    """
    has_owner = spans["owner_key"].notna().to_numpy()
    early = np.zeros(len(spans), dtype=bool)
    if has_owner.any():
        owner_at = pd.Index(spans["span_key"]).get_indexer(spans["owner_key"][has_owner].astype("int64"))
        start = spans["start_ns"].to_numpy()
        early[has_owner] = start[has_owner] < start[owner_at] - CLOCK_TOLERANCE_NS
    return early
