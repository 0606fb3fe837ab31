"""Compile `record.c` into a temporary folder with the system's C compiler, load it, and read back the
records it writes (`decode`). No build step of the project's: only the experiment needs it."""

from __future__ import annotations

import importlib.util
import os
import shutil
import struct
import subprocess
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from connector.miss_reasons import MISS_REASONS

SOURCE = Path(__file__).with_name("record.c")
MODULE_NAME = "kvscope_c_recorder"
REASON_CODES = {reason: code for code, reason in enumerate(MISS_REASONS)}
HEADER = struct.Struct("=16q")  # ids (4), lookup (6), load (4), groups, request id length
SCAN = struct.Struct("=8q")  # span id, start, end, group index, blocks total, null skipped, pending, start index


class NoCompiler(RuntimeError):
    pass


def compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def build(out_dir: str | None = None) -> ModuleType:
    """The compiled recorder, a new module object, compiled into ``out_dir`` (a new temporary folder when
    None). Its state, one batch, is the loaded library's: per process and per build."""
    cc = compiler()
    if cc is None:
        raise NoCompiler("no C compiler (cc, gcc or $CC) on PATH: the C recorder experiment cannot run")
    out = Path(out_dir or tempfile.mkdtemp(prefix="kvscope-c-recorder-"))
    target = out / f"{MODULE_NAME}{sysconfig.get_config_var('EXT_SUFFIX')}"
    subprocess.run([cc, "-O2", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}", str(SOURCE),
                    "-o", str(target)], check=True, capture_output=True)
    spec = importlib.util.spec_from_file_location(MODULE_NAME, target)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class LoadRecord:
    """One record as the C recorder packed it."""

    trace_id: int
    lookup_span_id: int
    load_span_id: int
    lookup: tuple[int, ...]  # start ns, end ns, tokens queried, tokens hit, miss reason code, tokens local
    load: tuple[int, ...]  # start ns, end ns, tokens local, tokens external
    scans: list[tuple[int, ...]]  # per group: SCAN's fields
    request_id: str


def decode(data: bytes) -> list[LoadRecord]:
    records, pos = [], 0
    while pos < len(data):
        fields = HEADER.unpack_from(data, pos)
        pos += HEADER.size
        hi, lo, lookup_span, load_span = (f & (1 << 64) - 1 for f in fields[:4])
        groups, id_len = fields[14], fields[15]
        scans = []
        for _ in range(groups):
            scan = SCAN.unpack_from(data, pos)
            scans.append((scan[0] & (1 << 64) - 1, *scan[1:]))
            pos += SCAN.size
        request_id = data[pos:pos + id_len].decode()
        pos += id_len
        records.append(LoadRecord(hi << 64 | lo, lookup_span, load_span, fields[4:10], fields[10:14], scans,
                                  request_id))
    return records
