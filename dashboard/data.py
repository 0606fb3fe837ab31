"""The traces the pages show: read once per set of files (cached), shared with the page of this run.

`app.py` resolves the sources (command line, ``KVSCOPE_TRACE_FILES``, uploads) and calls `load`;
pages call `current()` or `require_requests()`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd
import streamlit as st

from dashboard import sources, traces

_SESSION_KEY = "kvscope.loaded"
_EMPTY_FOLDERS_KEY = "kvscope.empty_folders"

HOW_TO_ADD_TRACES = (
    "Start the dashboard with trace files: `kvscope dashboard PATH...` or "
    "`streamlit run dashboard/app.py -- PATH...`, set `KVSCOPE_TRACE_FILES` (comma-separated), "
    "or add files with the uploader in the sidebar."
)


@dataclass(frozen=True)
class Loaded:
    traces: traces.Traces
    requests: pd.DataFrame

    @property
    def spans(self) -> pd.DataFrame:
        return self.traces.spans

    @property
    def vllm(self) -> pd.DataFrame:
        """vLLM's own request spans (`traces.VLLM_COLUMNS`); requests point to theirs by `vllm_key`."""
        return self.traces.vllm_requests


@st.cache_data(max_entries=4, show_spinner="Reading trace files…")
def _read(path_keys: tuple[tuple[bytes, int, int], ...], upload_keys: tuple[str, ...],
          _paths: tuple[str, ...], _uploads: tuple[traces.TraceSource, ...]) -> Loaded:
    # path_keys and upload_keys are the cache key (path as bytes: a file name need not be UTF-8, mtime, size /
    # upload id); _paths and _uploads are not hashed.
    read = traces.read_trace_files(list(_paths) + list(_uploads))
    return Loaded(traces=read, requests=traces.requests_table(read.spans, read.vllm_requests))


def load(paths: Sequence[str], uploads: Sequence, empty_folders: Sequence[str] = ()) -> Loaded:
    """Read `paths` and the uploaded files (Streamlit `UploadedFile`s), cached; `empty_folders`: what the folders
    given that held no trace file held (`sources.TracePaths`), for the pages to say."""
    upload_sources = tuple(traces.TraceSource(f"upload: {u.name}", u.getvalue()) for u in uploads)
    keys = tuple((os.fsencode(p), mtime, size) for p, mtime, size in map(sources.file_key, paths))
    loaded = _read(keys, tuple(u.file_id for u in uploads), tuple(paths), upload_sources)
    st.session_state[_SESSION_KEY] = loaded
    st.session_state[_EMPTY_FOLDERS_KEY] = list(empty_folders)
    return loaded


def current() -> Loaded:
    """What `app.py` loaded in this run."""
    return st.session_state[_SESSION_KEY]


def require_requests() -> Loaded:
    """The loaded traces; when they hold no request, say how to add some and stop the page."""
    loaded = current()
    if loaded.requests.empty:
        if loaded.traces.files:
            skipped = any(p.reason != traces.DUPLICATE_SPAN for p in loaded.traces.problems)
            st.info("The trace files hold no kvscope lookup or load spans"
                    + (" that could be read (the warning above says what was skipped). " if skipped else ". ")
                    + HOW_TO_ADD_TRACES)
        elif empty_folders():  # paths were given: say why nothing came of them, not "no trace files yet"
            for note in empty_folders():
                st.warning(note, icon=":material/folder_off:")
            st.info(HOW_TO_ADD_TRACES)
        else:
            st.info("No trace files yet. " + HOW_TO_ADD_TRACES)
        st.stop()
    return loaded


def empty_folders() -> list[str]:
    """What each folder given that held no trace file held (`sources.TracePaths.empty_folders`)."""
    return st.session_state.get(_EMPTY_FOLDERS_KEY, [])
