"""The real OpenAI-compatible server as a subprocess, for the server tests: started with kvscope's
transfer config on a tiny model, waited for until healthy, stopped with SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_api_server(model: str, transfer: dict, log_path: str, extra_args: Sequence[str] = (),
                       env: dict | None = None, start_timeout_s: float = 300) -> Iterator[tuple[str, subprocess.Popen]]:
    """(base URL, process) of a server on a free port; its output goes to `log_path`. Its own process
    group (`start_new_session`), so a test may signal the group as Ctrl-C does."""
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=str(ROOT),
               **(env or {}))
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    log = open(log_path, "w")

    def start() -> tuple[str, subprocess.Popen]:
        port = free_port()
        return f"http://127.0.0.1:{port}", subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
             "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", "--dtype", "bfloat16",
             "--max-model-len", "4096", "--enforce-eager", "--max-num-seqs", "8",
             "--kv-transfer-config", json.dumps(transfer), *extra_args],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    base, proc = start()
    restarts = 2  # the port was free when picked, but another bind(0) may take it before vLLM binds it
    try:
        deadline = time.time() + start_timeout_s
        while True:
            if proc.poll() is not None:
                if restarts and "Address already in use" in open(log_path).read():
                    restarts -= 1
                    base, proc = start()
                    continue
                raise AssertionError("server exited:\n" + open(log_path).read()[-5000:])
            try:
                if requests.get(base + "/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.time() > deadline:
                raise AssertionError("server did not start:\n" + open(log_path).read()[-5000:])
            time.sleep(2)
        yield base, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        # The engines and export helpers outlive the API process a little, draining their spans into
        # the trace file: a test reading it before they are gone could read a line still being written.
        deadline = time.time() + 60
        while processes_in_group(proc.pid) and time.time() < deadline:
            time.sleep(0.2)
        if processes_in_group(proc.pid):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, process group) of a process, from /proc; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state, ppid, pgrp = f.read().rsplit(")", 1)[1].split()[:3]
        return state, int(ppid), int(pgrp)
    except (OSError, ValueError):
        return None


def live_processes() -> dict[int, tuple[str, int, int]]:
    """`proc_stat` of every process."""
    stats = {int(entry): proc_stat(int(entry)) for entry in os.listdir("/proc") if entry.isdigit()}
    return {pid: stat for pid, stat in stats.items() if stat is not None}


def processes_in_group(pgid: int) -> list[int]:
    """The live (not zombie) processes of a process group."""
    return [pid for pid, (state, _, pgrp) in live_processes().items() if state != "Z" and pgrp == pgid]
