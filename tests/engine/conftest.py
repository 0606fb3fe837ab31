"""Real vLLM CPU engine scenarios, each in its own process, results shared per session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 128  # device block size of the CPU backend


def cpu_backend_runs_fp8_kv() -> bool:
    """vLLM's CPU attention backend runs an fp8 KV cache only on x86 with AVX-512 or AMX (it asks
    torch, as here); elsewhere the engine refuses to start, whatever the connector does."""
    import torch

    return torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()


requires_cpu_fp8_kv = pytest.mark.skipif(
    not cpu_backend_runs_fp8_kv(), reason="vLLM's CPU backend needs AVX-512 or AMX for an fp8 KV cache")


def prompts_sharing_prefixes() -> list[list[int]]:
    """Lengths that are not multiples of the block size, a shared prefix with distinct suffixes,
    one exact multiple of the block size, and one prompt shorter than a block."""
    shared = [(31 * i + 3) % 509 + 1 for i in range(300)]
    prompts = [shared + [(17 * i + 11 * j + 5) % 509 + 1 for i in range(150 + 97 * j)] for j in range(4)]
    prompts.append([(13 * i + 7) % 509 + 1 for i in range(4 * BLOCK)])
    prompts.append([(7 * i + 1) % 509 + 1 for i in range(90)])
    return prompts


def run_scenario_process(spec: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    env = dict(os.environ, PYTHONPATH=str(ROOT), **spec.get("env", {}))
    try:
        return subprocess.run([sys.executable, "-m", "tests.engine.scenario", f.name], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=timeout)
    finally:
        os.unlink(f.name)


def run_scenario(spec: dict, timeout: int = 600) -> dict:
    proc = run_scenario_process(spec, timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("SCENARIO_JSON "):
            return json.loads(line[len("SCENARIO_JSON "):])
    raise AssertionError(f"scenario failed (rc={proc.returncode}):\n{proc.stderr[-6000:]}")


class ScenarioCache:
    """Runs each scenario spec once per session, whichever test names it first. Results are kept by the
    spec itself, not by ``name``, so that tests naming the same scenario alike with other specs (another
    model, say) never share a result; ``name`` labels its failure."""

    def __init__(self):
        self._results: dict[str, dict] = {}

    def get(self, name: str, spec: dict) -> dict:
        key = json.dumps(spec, sort_keys=True)
        if key not in self._results:
            try:
                self._results[key] = run_scenario(spec)
            except AssertionError as failed:
                raise AssertionError(f"scenario {name}: {failed}") from None
        return self._results[key]


@pytest.fixture(scope="session")
def scenarios() -> ScenarioCache:
    return ScenarioCache()
