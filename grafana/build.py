"""Render the kvscope Grafana boards from code into grafana/dashboards/*.json.

    python grafana/build.py           # regenerate the committed JSON
    python grafana/build.py --check   # exit 1 if the committed JSON is not what the code renders

The JSON is deterministic (sorted keys, 2-space indent, panel ids numbered in order), so a
diff of the committed files shows exactly what a code change did to a board.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for folder in (HERE.parent, HERE):  # the board modules import each other as top-level modules, and `connector`
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import board_groups  # noqa: E402
import board_overview  # noqa: E402
import panels_common  # noqa: E402

DASHBOARDS_DIR = HERE / "dashboards"
BOARDS = {
    f"{board_overview.UID}.json": board_overview.build,
    f"{board_groups.UID}.json": board_groups.build,
}


def render_all() -> dict[str, str]:
    """File name -> rendered JSON text for every board."""
    return {name: panels_common.render(build()) for name, build in BOARDS.items()}


def stale_files(out_dir: Path = DASHBOARDS_DIR) -> list[str]:
    """Differences between the committed files and the rendered boards, as unified diffs."""
    problems = []
    rendered = render_all()
    for name, text in rendered.items():
        path = out_dir / name
        current = path.read_text() if path.exists() else ""
        if current != text:
            diff = difflib.unified_diff(
                current.splitlines(keepends=True), text.splitlines(keepends=True),
                fromfile=f"{path} (committed)", tofile=f"{path} (rendered)", n=1,
            )
            problems.append("".join(diff) or f"{path}: missing")
    for path in sorted(out_dir.glob("*.json")):
        if path.name not in rendered:
            problems.append(f"{path}: not produced by build.py (delete it or add its board)")
    return problems


def write_all(out_dir: Path = DASHBOARDS_DIR) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render_all().items():
        path = out_dir / name
        path.write_text(text)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 if the committed JSON is stale")
    args = parser.parse_args(argv)
    if args.check:
        problems = stale_files()
        if problems:
            for problem in problems:
                print(problem, file=sys.stderr)
            print("grafana/dashboards is stale: run `python grafana/build.py` and commit the result.", file=sys.stderr)
            return 1
        print(f"grafana/dashboards is current ({len(BOARDS)} boards).")
        return 0
    for path in write_all():
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
