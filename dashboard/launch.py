"""Start the dashboard: `kvscope dashboard PATH...` calls `main(paths)`."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path

APP = Path(__file__).resolve().with_name("app.py")


DEFAULT_STREAMLIT_ARGS = ("--browser.gatherUsageStats", "false", "--client.toolbarMode", "minimal")


def streamlit_command(paths: Sequence[str], streamlit_args: Sequence[str] = ()) -> list[str]:
    """`python -m streamlit run app.py [streamlit options] -- PATH...` with absolute paths."""
    return [sys.executable, "-m", "streamlit", "run", str(APP), *DEFAULT_STREAMLIT_ARGS, *streamlit_args, "--",
            *(os.path.abspath(p) for p in paths)]


def main(paths: list[str], streamlit_args: Sequence[str] = ()) -> int:
    """Run the dashboard on `paths`: this process becomes streamlit's; returns an exit status only
    when it cannot start.

    `streamlit_args` go to `streamlit run` (e.g. ["--server.port", "8502", "--server.headless", "true"]).
    """
    if importlib.util.find_spec("streamlit") is None:
        print("kvscope dashboard: streamlit is not installed; install the dashboard extra: "
              "pip install -e '.[dashboard]'", file=sys.stderr)
        return 1
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        print(f"kvscope dashboard: no such trace file or directory: {', '.join(missing)}", file=sys.stderr)
        return 2
    command = streamlit_command(paths, streamlit_args)
    # Become streamlit instead of waiting for it: a signal to this process (a supervisor's SIGTERM,
    # SIGKILL) then stops the server itself; a waiting parent left it running, orphaned.
    os.execv(command[0], command)
    return 1  # not reached: execv replaces this process or raises


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
