"""vLLM's own scheduler and KV-connector lifecycle around a fake forward pass: no model, no platform.

What runs is vLLM's code: its `Scheduler` (prefix cache, hybrid KV groups, sliding-window null
blocks, chunked prefill, asynchronous connector loads) creates the scheduler side of
`KVScopeConnector` from the `KVTransferConfig`, and vLLM's own model-runner glue drives the worker side
(bind metadata, start loads, save, transfer results, worker metadata) as a model runner does: the V1
runner's `KVConnectorModelRunnerMixin`, or the V2 runner's `ActiveKVConnector` (vLLM's default on
GPUs since 0.32, which calls the hooks in another order: loads start and stores run after the
forward and the sampling; with speculative decoding in 0.33 stores run after the step's worker
metadata is built), on one or several workers (tensor-parallel ranks, each with its own KV cache) whose outputs
vLLM's `KVOutputAggregator` merges as its executors do. Only the forward pass is ours: it writes, into every KV block a step computes, bytes that are
a function of the layer and of the tokens up to the block's computed end, as real KV depends on the
whole prefix. Before each forward it checks every block the new tokens attend to (all of the prefix
for full attention, the last `window - 1` positions for a sliding window) holds exactly those
bytes. A load that put wrong or misplaced KV into a block a request reads fails that check, whichever
vLLM version runs it: the test suite's vLLM 0.32, or 0.33's own sources (`scripts/dev compat`).
"""

from __future__ import annotations

import hashlib
from collections import defaultdict, deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from unittest import mock

import torch

from connector import KVScopeConnector

BLOCK = 16  # device block size (tokens)
# How the worker side is driven: vLLM's V1 model runner, its V2 runner (the default on GPUs), and the V2
# runner with speculative decoding (vLLM 0.33+: stores after the step's results)
RUNNERS = ("v1", "v2", "v2-spec")
PAGE = 2 * BLOCK * 1 * 64 * 2  # bytes of one block of one layer: K and V, 1 head of 64, bf16
SLIDING = "sliding_window"
FULL = "full_attention"


@dataclass
class Violation:
    step: int
    rank: int
    req_id: str
    group: int
    block_index: int
    block_id: int
    reason: str


@dataclass
class LoopStats:
    steps: int = 0
    loads: dict[str, list] = field(default_factory=dict)  # req id -> its load jobs' GroupTransfers
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    external_hit_tokens: int = 0  # vLLM's own counter (connector prefix-cache stats)
    external_queried_tokens: int = 0
    checked_blocks: int = 0
    resumed: set[str] = field(default_factory=set)  # requests vLLM preempted and scheduled again
    scheduled_ahead: int = 0  # steps scheduled while the previous one was still in flight
    # kvscope's stats as vLLM hands them to its stat loggers (`SchedulerStats.kv_connector_stats`),
    # rebuilt and summed the way the front end does
    connector: object | None = None
    violations: list[Violation] = field(default_factory=list)


def _pattern(rank: int, layer: str, tokens: list[int]) -> int:
    """The 8 bytes every word of a block holds once `tokens` (the prefix up to the block's
    computed end) are computed: a function of the worker (its shard of heads), the layer and
    the whole prefix."""
    digest = hashlib.blake2b(repr((rank, layer, tokens)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class ModelFreeEngine:
    """One vLLM scheduler with KVScopeConnector, layers alternating sliding window and full attention,
    and `workers` worker-side connectors (tensor parallel ranks), each with its own KV cache, whose
    outputs vLLM's `KVOutputAggregator` merges as its executors do."""

    def __init__(self, model_path: str, extra_config: dict, *, window: int, num_blocks: int = 1200,
                 max_num_batched_tokens: int = 2048, max_model_len: int = 2048, workers: int = 1,
                 async_scheduling: bool = False, runner: str = "v1"):
        from vllm.config import KVTransferConfig
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.engine.arg_utils import EngineArgs
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        args = EngineArgs(
            model=model_path, skip_tokenizer_init=True, enable_prefix_caching=True, block_size=BLOCK,
            max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=True, max_num_seqs=16, tensor_parallel_size=workers,
            kv_transfer_config=KVTransferConfig(kv_connector="KVScopeConnector", kv_connector_module_path="connector",
                                                kv_role="kv_both", kv_connector_extra_config=extra_config),
        )
        self.vllm_config = args.create_engine_config()
        # vLLM's default on GPUs (the CPU platform turns it off): the engine schedules step N+1
        # before it has step N's output, through `AsyncScheduler`, two batches in flight.
        self.async_scheduling = async_scheduling
        self.vllm_config.scheduler_config.async_scheduling = async_scheduling
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        self.window = window
        self.kv_cache_config = _kv_cache_config(num_blocks, window)
        self.group_kinds = [SLIDING, FULL]
        self.group_layers = [g.layer_names for g in self.kv_cache_config.kv_cache_groups]
        if runner not in RUNNERS:
            raise ValueError(f"runner={runner!r}: accepted are {', '.join(RUNNERS)}")
        self.runner = runner
        self.workers, self.words = [], []  # per rank: its connector, and its caches as int64 words
        self.v2_glue = []  # per rank, for the V2 runners: vLLM's ActiveKVConnector around the connector
        for rank in range(workers):
            caches = {name: torch.zeros(num_blocks, PAGE, dtype=torch.int8)
                      for names in self.group_layers for name in names}
            # vLLM's tensor-parallel state is not set up here: each worker is told its rank
            with mock.patch("connector.connector._worker_rank", return_value=rank):
                connector = KVScopeConnector(self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config)
            if runner == "v1":
                connector.register_kv_caches(caches)
            else:  # the V2 runner's glue registers the caches itself
                from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

                with _as_transfer_group(connector):
                    self.v2_glue.append(ActiveKVConnector(self.vllm_config, caches))
            self.workers.append(connector)
            self.words.append({name: t.view(torch.int64) for name, t in caches.items()})
        self.aggregator = KVOutputAggregator.from_connector(self.workers[0], workers)
        scheduler_class = AsyncScheduler if async_scheduling else Scheduler
        self.scheduler = scheduler_class(vllm_config=self.vllm_config, kv_cache_config=self.kv_cache_config,
                                         structured_output_manager=StructuredOutputManager(self.vllm_config),
                                         block_size=BLOCK, log_stats=True)
        hash_fn = get_hash_fn_by_name(self.vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._block_hasher = get_request_block_hasher(BLOCK, hash_fn)
        self.after_step: list = []  # callables run after each step's workers (`LateReadingStores.tick`)
        self.tokens: dict[str, list[int]] = {}  # prompt + sampled, as the model runner knows them
        self.tables: dict[str, list[list[int]]] = {}  # per request, per group: block ids (worker's view)
        self.stats = LoopStats()

    # ------------------------------------------------------------------ driving
    def add(self, req_id: str, prompt: list[int], max_tokens: int = 2, trace_headers: dict | None = None,
            cache_salt: str | None = None) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.tokens[req_id] = list(prompt)
        self.scheduler.add_request(Request(req_id, list(prompt), params, None, block_hasher=self._block_hasher,
                                           trace_headers=trace_headers, cache_salt=cache_salt))

    def run(self, max_steps: int = 2000, on_scheduled=None) -> None:
        """Step while vLLM's engine core would (`Scheduler.has_requests`: unfinished or just finished
        requests, or connector work pending): schedule, execute, update, one step at a time, or
        with async scheduling as vLLM's engine core does it (`step_with_batch_queue`): schedule the
        next step before executing and processing the one in flight. `on_scheduled(output)` runs
        after each schedule, before the workers see it (where a client's abort can land)."""
        in_flight: deque = deque()
        for _ in range(max_steps):
            if not (self.scheduler.has_requests() or in_flight):
                return
            if self.scheduler.has_requests():
                out = self.scheduler.schedule()
                self.stats.steps += 1
                self.stats.scheduled_ahead += bool(in_flight) and out.total_num_scheduled_tokens > 0
                if on_scheduled is not None:
                    on_scheduled(out)
                in_flight.appendleft(out)
                if self.async_scheduling and len(in_flight) < 2 and (
                        out.total_num_scheduled_tokens > 0 or self.scheduler.has_requests()):
                    continue
            if in_flight:
                out = in_flight.pop()
                self._process(out, self._execute(out))
        raise AssertionError(f"requests still unfinished (or connector work pending) after {max_steps} steps")

    def _execute(self, out):
        """What the workers do with one scheduler output, in scheduling order: their block tables,
        the connector's hooks around the fake forward, the sampled tokens; merged as vLLM merges them."""
        from vllm.forward_context import set_forward_context
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

        computed = self._update_tables(out)
        meta = out.kv_connector_metadata
        for job in getattr(meta, "loads", ()):
            self.stats.loads.setdefault(job.req_id, []).append(job)
        kv_outputs = []
        for rank, worker in enumerate(self.workers):
            if self.runner != "v1":
                kv_outputs.append(self._execute_v2(rank, out, computed))
                continue
            worker.handle_preemptions(out.kv_connector_metadata)  # first in the V1 runner's execute_model
            with _as_transfer_group(worker), set_forward_context(None, self.vllm_config), \
                    KVConnectorModelRunnerMixin._get_kv_connector_output(out) as kv_output:
                self._forward_all(rank, out, computed)
            kv_outputs.append(kv_output)
        for callback in self.after_step:
            callback()
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            tokens = self.tokens[req_id]
            if computed[req_id] + out.num_scheduled_tokens[req_id] >= len(tokens):
                token = (len(tokens) * 31) % 500 + 1
                tokens.append(token)
                sampled.append([token])
            else:
                sampled.append([])  # a prefill chunk: nothing sampled
        index = {r: i for i, r in enumerate(req_ids)}
        runner_output = self.aggregator.aggregate(
            [ModelRunnerOutput(req_ids=req_ids, req_id_to_index=index, sampled_token_ids=sampled,
                               kv_connector_output=kv_output) for kv_output in kv_outputs])
        merged = runner_output.kv_connector_output
        self.stats.finished_recving |= (merged.finished_recving or set()) if merged else set()
        self.stats.failed_recving |= (merged.failed_recving or set()) if merged else set()
        return runner_output

    def _forward_all(self, rank: int, out, computed: dict[str, int]) -> None:
        for req_id, n in out.num_scheduled_tokens.items():
            self._check_reads(rank, req_id, computed[req_id])
            self._forward(rank, req_id, computed[req_id], n)

    def _execute_v2(self, rank: int, out, computed: dict[str, int]):
        """One worker's step as vLLM's V2 model runner runs it (`execute_model`, then `sample_tokens`):
        `no_forward` when nothing is scheduled; else `pre_forward` (preemptions, metadata, synchronous
        loads) and the forward, then after the sampling `post_forward` (asynchronous loads, stores,
        results); with speculative decoding (0.33) the stores wait for the draft model
        (`finalize_step`), after the results and the worker metadata."""
        from vllm.forward_context import set_forward_context

        glue = self.v2_glue[rank]
        with _as_transfer_group(self.workers[rank]):
            if out.total_num_scheduled_tokens == 0:
                return glue.no_forward(out).kv_connector_output
            with set_forward_context(None, self.vllm_config):
                glue.pre_forward(out)
                self._forward_all(rank, out, computed)
            glue.finish_forward()
            if self.runner == "v2":
                return glue.post_forward(out.finished_req_ids)
            kv_output = glue.post_forward(out.finished_req_ids, defer_finalize=True)
            glue.finalize_step()  # the draft model has run
            return kv_output

    def _process(self, out, runner_output) -> None:
        for engine_outputs in self.scheduler.update_from_output(out, runner_output).values():
            stats = engine_outputs.scheduler_stats
            connector_stats = stats.connector_prefix_cache_stats if stats is not None else None
            if connector_stats is not None:
                self.stats.external_hit_tokens += connector_stats.hits
                self.stats.external_queried_tokens += connector_stats.queries
            payload = stats.kv_connector_stats if stats is not None else None
            if payload:
                interval = KVScopeConnector.build_kv_connector_stats(data=payload)
                self.stats.connector = interval if self.stats.connector is None else \
                    self.stats.connector.aggregate(interval)

    def abort(self, req_ids) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(list(req_ids), RequestStatus.FINISHED_ABORTED)

    def host_tier_leaks(self) -> list[str]:
        """What the connector still holds once every request is done: pinned or never completed
        host entries, transfer jobs without their reports. Empty when nothing leaked."""
        sched = self.scheduler.get_kv_connector()._scheduler
        leaks = [f"{key}: pins={e.pins} ready={e.ready}" for key, e in sched.index._entries.items()
                 if e.pins or not e.ready]
        return leaks + [f"job {job_id}: {job.direction} of {job.req_id}" for job_id, job in sched._jobs.items()]

    def reset_device_prefix_cache(self) -> None:
        assert self.scheduler.reset_prefix_cache(), "vLLM refused to reset its prefix cache"

    def shutdown(self) -> None:
        connector = self.scheduler.get_kv_connector()
        if connector is not None:
            connector.shutdown()
        for worker in self.workers:
            worker.shutdown()

    # ------------------------------------------------------------------ the fake model runner
    def _update_tables(self, out) -> dict[str, int]:
        """Block tables as the model runner keeps them, and each scheduled request's computed tokens."""
        computed = {}
        for new in out.scheduled_new_reqs:
            self.tables[new.req_id] = [list(ids) for ids in new.block_ids]
            computed[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set()) or set()
        self.stats.resumed |= resumed
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in resumed:
                    self.tables[req_id] = [list(ids) for ids in new_ids]
                else:
                    for table, ids in zip(self.tables[req_id], new_ids):
                        table.extend(ids)
            computed[req_id] = cached.num_computed_tokens[i]
        return computed

    def _first_read(self, group: int, computed: int) -> int:
        """First prefix position the step's first new token (at `computed`) attends to."""
        if self.group_kinds[group] == SLIDING:
            return max(0, computed - self.window + 1)
        return 0

    def _check_reads(self, rank: int, req_id: str, computed: int) -> None:
        tokens, words = self.tokens[req_id], self.words[rank]
        for group, layers in enumerate(self.group_layers):
            table = self.tables[req_id][group]
            for i in range(self._first_read(group, computed) // BLOCK, -(-computed // BLOCK)):
                block_id = table[i] if i < len(table) else None
                if not block_id:
                    self.stats.violations.append(Violation(self.stats.steps, rank, req_id, group, i, block_id or 0,
                                                           "no block where the forward reads"))
                    continue
                end = min((i + 1) * BLOCK, computed)
                for layer in layers:
                    self.stats.checked_blocks += 1
                    row = words[layer][block_id]
                    want = _pattern(rank, layer, tokens[:end])
                    if not bool((row == want).all()):
                        self.stats.violations.append(Violation(
                            self.stats.steps, rank, req_id, group, i, block_id,
                            f"layer {layer}: KV of tokens [{i * BLOCK}, {end}) is not what the forward wrote"))

    def _forward(self, rank: int, req_id: str, computed: int, n: int) -> None:
        tokens, words = self.tokens[req_id], self.words[rank]
        for group, layers in enumerate(self.group_layers):
            table = self.tables[req_id][group]
            for i in range(computed // BLOCK, -(-(computed + n) // BLOCK)):
                end = min((i + 1) * BLOCK, computed + n)
                for layer in layers:
                    words[layer][table[i]].fill_(_pattern(rank, layer, tokens[:end]))


def _kv_cache_config(num_blocks: int, window: int):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    common = dict(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    groups = [
        KVCacheGroupSpec(["layers.0", "layers.2"], SlidingWindowSpec(**common, sliding_window=window)),
        KVCacheGroupSpec(["layers.1", "layers.3"], FullAttentionSpec(**common)),
    ]
    assert all(g.kv_cache_spec.page_size_bytes == PAGE for g in groups)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


@contextmanager
def _as_transfer_group(connector):
    """Make `connector` vLLM's worker-side KV transfer group for the step (what the model runner reads)."""
    from vllm.distributed.kv_transfer import kv_transfer_state

    saved = kv_transfer_state._KV_CONNECTOR_AGENT
    kv_transfer_state._KV_CONNECTOR_AGENT = connector
    try:
        yield
    finally:
        kv_transfer_state._KV_CONNECTOR_AGENT = saved


def loaded_blocks_by_group(stats: LoopStats, req_ids) -> dict[int, int]:
    """Device blocks loaded per group for the given requests."""
    totals: dict[int, int] = defaultdict(int)
    for req_id in req_ids:
        for job in stats.loads.get(req_id, ()):
            for part in job.groups:
                totals[part.group_index] += len(part.block_ids)
    return dict(totals)


class LateReadingStores:
    """A worker's copy engine whose stores read the device as a DMA does on CUDA: late.

    On the CPU a store copies at once, inside `wait_for_save`, so no later write can reach its
    source blocks first. Here a store's bytes are read only when it completes: `steps` engine steps
    later (`tick`, after each step), when a fence orders later compute after it
    (`fence_compute_stream`), or when a load comes (a load waits for the stores before it, as
    on CUDA). A fence placed too late, or missing, lets a later forward overwrite a block a store
    has yet to read, and the host tier then holds what a later load gives the checks as wrong KV."""

    def __init__(self, engine, steps: int = 3):
        self.engine, self.steps = engine, steps
        self._pending: dict[int, list] = {}  # id(result) -> [result, store args, steps left]
        self._copy, self._poll = engine._copy, engine.poll
        engine.store, engine.poll = self._store, self._poll_late
        engine.load, engine.fence_compute_stream = self._load, self._read_all

    def _store(self, group, slots, subs, block_ids):
        from connector.copy_engine import CopyResult

        result = CopyResult(len(block_ids) * self.engine.group_block_bytes(group), len(block_ids), 0, 0,
                            done_event="pending")
        self._pending[id(result)] = [result, (group, slots, subs, block_ids), self.steps]
        return result

    def _poll_late(self, result) -> bool:
        return id(result) not in self._pending and self._poll(result)

    def tick(self) -> None:
        """An engine step is over: stores issued `steps` steps ago have read their blocks by now."""
        for entry in list(self._pending.values()):
            entry[2] -= 1
            if entry[2] <= 0:
                self._read(entry)

    def _read(self, entry) -> None:
        result, args, _ = entry
        done = self._copy(*args, to_device=False)
        result.start_ns, result.end_ns, result.done_event = done.start_ns, done.end_ns, None
        del self._pending[id(result)]

    def _read_all(self) -> None:
        for entry in list(self._pending.values()):
            self._read(entry)

    def _load(self, group, slots, subs, block_ids):
        self._read_all()  # the load stream waits for the store stream
        return self._copy(group, slots, subs, block_ids, to_device=True)
