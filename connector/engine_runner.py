"""Run a real vLLM engine with (or without) kvscope: shared by the demo, tests and benchmarks.

Token-id prompts only (no tokenizer), greedy sampling, in-process engine core where possible.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass


def engine_env() -> None:
    """Environment for a small CPU engine; must run before vLLM is imported."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def kv_transfer_config(extra: dict | None, module_path: bool = True) -> dict:
    config = {"kv_connector": "KVScopeConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": dict(extra or {})}
    if module_path:
        config["kv_connector_module_path"] = "connector"
    return config


MAX_MODEL_LEN = 4096  # tokens: the context of the engines make_llm starts


def make_llm(model: str, extra: dict | None = None, connector: bool = True, **kwargs):
    engine_env()
    from vllm import LLM

    args = dict(model=model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=MAX_MODEL_LEN,
                enforce_eager=True, max_num_seqs=8, disable_log_stats=False,
                enable_prefix_caching=True, seed=0)
    if connector:
        args["kv_transfer_config"] = kv_transfer_config(extra)
    args.update(kwargs)
    return LLM(**args)


@dataclass
class Completion:
    tokens: list[int]
    logprobs: list[float]  # of the chosen tokens
    num_cached_tokens: int


def generate(llm, prompts: list[list[int]], max_tokens: int = 8,
             trace_headers: list[dict | None] | None = None, request_ids: list[str] | None = None,
             ignore_eos: bool = False, n: int = 1) -> list[Completion]:
    """Greedy completions in prompt order; with ids or trace headers, requests go in one by one
    through the engine (vLLM's `LLM.generate` takes no trace headers). With ``n`` > 1, ``n`` samples
    a prompt (vLLM refuses greedy ones), seeded, so a run repeats: every sample in order."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sampling = dict(temperature=0.0) if n == 1 else dict(n=n, temperature=1.0, seed=0)
    params = SamplingParams(max_tokens=max_tokens, logprobs=1, detokenize=False, ignore_eos=ignore_eos,
                            **sampling)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    if trace_headers is None and request_ids is None:
        outs = llm.generate(inputs, params, use_tqdm=False)
    else:
        engine = llm.llm_engine
        ids = request_ids or [f"kvscope-{i}" for i in range(len(prompts))]
        headers = trace_headers or [None] * len(prompts)
        for rid, prompt, h in zip(ids, inputs, headers):
            engine.add_request(rid, prompt, params, trace_headers=h)
        finished = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
        outs = [finished[rid] for rid in ids]
    result = []
    for out in outs:
        for o in sorted(out.outputs, key=lambda o: o.index):
            lps = [step[tok].logprob for step, tok in zip(o.logprobs or [], o.token_ids)]
            result.append(Completion(list(o.token_ids), lps, out.num_cached_tokens or 0))
    return result


def metric_values(llm) -> dict[str, float]:
    """vLLM's own counters/gauges by name (summed over label sets)."""
    values: dict[str, float] = {}
    for m in llm.get_metrics():
        v = getattr(m, "value", None)
        if isinstance(v, (int, float)):
            values[m.name] = values.get(m.name, 0.0) + float(v)
    return values


def get_scheduler_connector(llm):
    """The scheduler-side connector of an in-process engine (tests and the demo's summary)."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def get_worker_connector():
    """The worker-side connector of an in-process engine."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()


def _baseline_main() -> None:
    """`python -m connector.engine_runner MODEL PROMPTS.json [LLM-KWARGS.json]`: outputs without kvscope."""
    model, prompts_path = sys.argv[1], sys.argv[2]
    extra_kwargs = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    spec = json.loads(open(prompts_path).read())
    llm = make_llm(model, connector=False, **extra_kwargs)
    outs = generate(llm, spec["prompts"], spec.get("max_tokens", 8))
    print("BASELINE_JSON " + json.dumps([{"tokens": o.tokens, "logprobs": o.logprobs} for o in outs]))


if __name__ == "__main__":
    _baseline_main()
