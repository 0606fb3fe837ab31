"""kvscope dashboard: replays the connector's traced requests (hit rates, load latency).

    streamlit run dashboard/app.py -- PATH...     or     kvscope dashboard PATH...

Without paths it reads the comma-separated KVSCOPE_TRACE_FILES; files can also be uploaded.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import streamlit as st

_HERE = Path(__file__).resolve().parent
if str(_HERE.parent) not in sys.path:  # `streamlit run` puts dashboard/ on the path, not the repo root
    sys.path.insert(0, str(_HERE.parent))

from dashboard import data, formatting, sources  # noqa: E402


def command_line_paths() -> list[str]:
    """Arguments after `--`: `streamlit run` sets sys.argv to [this script, *args]; other hosts don't."""
    if sys.argv and Path(sys.argv[0]).resolve() == Path(__file__).resolve():
        return sys.argv[1:]
    return []


st.set_page_config(page_title="kvscope", page_icon=":material/memory:", layout="wide")

navigation = st.navigation([
    st.Page(_HERE / "views" / "overview.py", title="Overview", icon=":material/dashboard:", default=True),
    st.Page(_HERE / "views" / "request_explorer.py", title="Requests", icon=":material/table_rows:",
            url_path="requests"),
    st.Page(_HERE / "views" / "replay.py", title="Replay", icon=":material/replay:", url_path="replay"),
    st.Page(_HERE / "views" / "live.py", title="Live", icon=":material/monitoring:", url_path="live"),
])

given = sources.trace_paths(command_line_paths(), os.environ)
paths = given.paths
with st.sidebar:
    st.subheader("Trace files")
    uploads = st.file_uploader(
        "Add trace files",
        type=["jsonl", "json", "gz", "zst", "zstd", "pb", "binpb"],
        accept_multiple_files=True,
        key="uploads",
        help="OTLP/JSON lines, as the connector's trace_file or the OpenTelemetry Collector's file exporter write "
             "(also the Collector's `format: proto` and `compression: zstd` files).",
    )
try:
    loaded = data.load(paths, uploads or [], given.empty_folders)
except Exception as exc:  # the reader reports bad input as problems (file, line): this is a bug's last guard
    st.error(f"kvscope could not read these trace files ({type(exc).__name__}: {exc}). Nothing is shown; "
             "please report this with the file.")
    st.stop()
with st.sidebar:
    for path in paths:
        shown = formatting.printable_path(path)  # a file name need not be UTF-8
        st.caption(f":material/description: {Path(shown).name}", help=shown)
    for note in given.empty_folders:
        st.caption(f":material/folder_off: {note}")
    read = loaded.traces
    st.caption(
        f"{formatting.count(len(loaded.requests))} requests · {formatting.count(len(read.spans))} kvscope spans"
        + (f" · {formatting.count(len(read.vllm_requests))} vLLM request spans" if len(read.vllm_requests) else "")
        + (f" · {formatting.count(read.spans_left_out)} other spans left out" if read.spans_left_out else "")
    )

navigation.run()
