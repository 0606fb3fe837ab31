"""Device-KV pressure under vLLM's own scheduler (`model_free`, a Gemma-3-like model of `WINDOW`-token
sliding windows): the two scenarios in which vLLM (0.32 to 0.34) alone stalls for good (README, "Device KV
headroom") and kvscope's load admission defers loads instead, and the storing round they start with."""

from __future__ import annotations

import os

from tests.compat.model_free import ModelFreeEngine, true_token

WINDOW = 64  # tokens: prompts of 450-750 tokens reach far past it


def store_round(engine: ModelFreeEngine, prompts, max_tokens: int = 2) -> int:
    """Round 0: the prompts are computed and stored; then vLLM's device prefix cache is reset, so the
    next round can only hit the host tier. Returns round 0's host hit tokens.

    A prompt can load in round 0 only a prefix it shares with an earlier prompt: with vLLM's default
    window retention its device cache keeps no sliding-window block at such a junction (the first
    prompt's end is not one), so the host tier serves what the earlier prompt stored."""
    for j, prompt in enumerate(prompts):
        engine.add(f"r0-{j}", prompt, max_tokens)
    engine.run()
    hits = engine.stats.external_hit_tokens
    assert hits <= sum(_longest_shared_prefix(prompt, prompts[:j]) for j, prompt in enumerate(prompts)), hits
    engine.reset_device_prefix_cache()
    return hits


def _longest_shared_prefix(prompt, earlier) -> int:
    return max((len(os.path.commonprefix([prompt, other])) for other in earlier), default=0)


def three_loads_past_their_reserve(model_path, engine_args: dict | None = None,
                                   trace_file=None) -> ModelFreeEngine:
    """Round 0 stored, then three requests that load 512, 1024 and 512 tokens into a 200-block cache."""
    engine = ModelFreeEngine(model_path, _traced({"cpu_bytes": 64 << 20, "block_size": 256}, trace_file),
                             window=WINDOW, num_blocks=200, max_num_batched_tokens=512, engine_args=engine_args)
    shared = [(31 * i + 3) % 509 + 1 for i in range(700)]
    suffix = [[(17 * i + 11 * j + 5) % 509 + 1 for i in range(n)] for j, n in enumerate((525, 307, 54, 63))]
    first = shared + suffix[0]
    store_round(engine, [first])  # 1225 tokens, and the 2 it samples
    engine.add("r1-0", shared + suffix[1], 2)  # loads 512 tokens
    engine.add("r1-1", first + [true_token(p) for p in range(len(first), len(first) + 2)] + suffix[2], 2)  # 1024
    engine.add("r1-2", shared + suffix[3], 1)  # 512
    return engine


def two_failing_loads(model_path, engine_args: dict | None = None, trace_file=None) -> ModelFreeEngine:
    """Round 0 stored, then two requests whose loads fail (a copy error), admitted in one step."""
    engine = ModelFreeEngine(model_path, _traced({"cpu_bytes": 64 << 20, "block_size": 64}, trace_file),
                             window=WINDOW, num_blocks=150, max_num_batched_tokens=2048, engine_args=engine_args)
    shared = [(31 * i + 3) % 509 + 1 for i in range(700)]
    suffix = [[(17 * i + 11 * j + 5) % 509 + 1 for i in range(n)] for j, n in enumerate((308, 294, 40))]
    store_round(engine, [shared + suffix[0]])
    engine.workers[0]._worker.fail_all_loads = True
    engine.add("r1-0", shared + suffix[1], 2)
    engine.add("r1-1", shared + suffix[2], 2)
    return engine


def _traced(extra_config: dict, trace_file) -> dict:
    return extra_config if trace_file is None else {**extra_config, "trace_file": str(trace_file)}
