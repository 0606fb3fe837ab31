"""What the benchmarks give the scheduler side for vLLM's KV cache manager."""

from __future__ import annotations

from types import SimpleNamespace

# A device KV cache no load ever waits for room in (`connector/load_admission.py`): the benchmarks time the
# planner, not a cache's pressure
ROOMY_BLOCK_POOL = SimpleNamespace(num_gpu_blocks=1 << 40)
ROOMY_KV_CACHE_MANAGER = SimpleNamespace(block_pool=ROOMY_BLOCK_POOL)
