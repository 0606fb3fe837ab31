"""vLLM's own scheduler and KV-connector lifecycle around a fake forward pass: no model, no platform.

What runs is vLLM's code: its `Scheduler` (prefix cache, hybrid KV groups, sliding-window null
blocks, chunked prefill, asynchronous connector loads, speculative decoding) creates the scheduler
side of `KVScopeConnector` from the `KVTransferConfig`, and vLLM's own model-runner glue drives the
worker side (bind metadata, start loads, save, transfer results, worker metadata) as a model runner
does: the V1 runner's `KVConnectorModelRunnerMixin`, or the V2 runner's `ActiveKVConnector` (vLLM's
default on GPUs since 0.32, which calls the hooks in another order: loads start and stores run after
the forward and the sampling; with speculative decoding in 0.33 stores run after the step's worker
metadata is built), on one or several workers (tensor-parallel ranks, each with its own KV cache)
whose outputs vLLM's `KVOutputAggregator` merges as its executors do.

Only the forward pass is ours: it writes, into the slot of every position a step computes, bytes
that are a function of the worker, the layer and the tokens up to that position, as real KV depends
on the whole prefix. Before each forward it checks every position the new tokens attend to (all of
the prefix for full attention, the last `window - 1` positions for a sliding window) holds exactly
those bytes. With speculative decoding (`spec_tokens`) the forward also writes the KV of draft
tokens, some of them wrong, which vLLM rejects and the next step overwrites in place; under async
scheduling each step is scheduled as if all the previous step's drafts were accepted, and the runner
corrects that, as vLLM's model runners do; a Mamba group keeps a state block per draft and its
states move by the accepted tokens as vLLM's runners move them (`_plan_state_moves`). A load that
put wrong or misplaced KV into a block a request reads fails that check, whichever vLLM version
runs it: the test suite's vLLM 0.32, or 0.33's and 0.34's own sources (`scripts/dev compat`).
"""

from __future__ import annotations

import hashlib
import importlib.util
from collections import defaultdict, deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from unittest import mock

import torch

from connector import KVScopeConnector
from connector.load_admission import LoadAdmission
from tests.connector_leaks import connector_leaks


def create_engine_config(args):
    """``args.create_engine_config()``, past vLLM 0.34's refusal of the CPU platform on x86 without
    triton-cpu (0.32 and 0.33 only warn). No kernel runs here, the forward is ours; triton-cpu is not
    installed beside the CPU build's torch. The flag is patched for the config alone, so an engine
    started later in the same process still sees the truth."""
    import vllm.triton_utils

    with mock.patch.object(vllm.triton_utils, "HAS_TRITON", True):
        return args.create_engine_config()


def runner_output_index(req_ids: list[str]) -> dict:
    """The ``req_id_to_index`` argument of ``ModelRunnerOutput`` where it has one (vLLM up to 0.33)."""
    from vllm.v1.outputs import ModelRunnerOutput

    if "req_id_to_index" not in ModelRunnerOutput.__dataclass_fields__:
        return {}
    return {"req_id_to_index": {r: i for i, r in enumerate(req_ids)}}


BLOCK = 16  # device block size (tokens)
# How the worker side is driven: vLLM's V1 model runner, its V2 runner (the default on GPUs; from 0.34
# on the only one, on x86 CPUs too), the V2 runner with speculative decoding (vLLM 0.33+: stores after
# the step's results), and 0.34's standalone CPU runner (CPUs without Triton; its own copy of V2's glue,
# `vllm.v1.worker.cpu.kv_connector`), which "v1" drives where vLLM has no V1 runner
RUNNERS = ("v1", "v2", "v2-spec", "cpu")
HAS_V1_RUNNER = importlib.util.find_spec("vllm.v1.worker.kv_connector_model_runner_mixin") is not None
PAGE = 2 * BLOCK * 1 * 64 * 2  # bytes of one block of one layer: K and V, 1 head of 64, bf16
WORDS_PER_TOKEN = PAGE // 8 // BLOCK  # each position's slot in a block, as int64 words
_MASK = (1 << 63) - 1
SLIDING = "sliding_window"
FULL = "full_attention"
MAMBA = "mamba"


@dataclass(frozen=True)
class MambaAlign:
    """A Mamba state group in vLLM's align mode in place of the sliding window (Mamba2-like: the
    prompt's last chunk also saves a checkpoint state, `num_prefill_checkpoint_blocks`), with state
    blocks of `block` tokens and prefix-cache hashes of `hash_block` tokens: finer hashes turn on
    vLLM's partial hash hits, and the checkpoint then holds the state at the last hash boundary."""

    block: int = 64
    hash_block: int = BLOCK
    # vLLM's `prefix_cache_retention_interval`: 0 (its default) keys only the states a later
    # request is known to resume from (the prompt's, shared-prefix junctions); None keys every one
    retention: int | None = 0
    # vLLM's `enable_mamba_shared_prefix_checkpoint` (0.32, 0.33): a chunk also stops at, and vLLM
    # keys the state at, the junction where a sibling request sharing the prefix was seen to resume
    # (in effect only with EAGLE-style drafts and hash blocks finer than Mamba blocks)
    shared_prefix_checkpoint: bool = False


@dataclass
class Violation:
    step: int
    rank: int
    req_id: str
    group: int
    block_index: int
    block_id: int
    reason: str
    # A Mamba state the request got from vLLM's device prefix cache alone (its lookup found no host-tier
    # tokens past it) in a block whose state vLLM's own forward or state copy wrote last, not a kvscope
    # load: a wrong one is vLLM's (`_check_state`)
    from_vllm_cache: bool = False


@dataclass
class LoopStats:
    steps: int = 0
    loads: dict[str, list] = field(default_factory=dict)  # req id -> its load jobs' GroupTransfers
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    external_hit_tokens: int = 0  # vLLM's own counter (connector prefix-cache stats)
    external_queried_tokens: int = 0
    checked_blocks: int = 0
    checked_loaded_blocks: int = 0  # of those, blocks a load from the host tier filled
    resumed: set[str] = field(default_factory=set)  # requests vLLM preempted and scheduled again
    scheduled_ahead: int = 0  # steps scheduled while the previous one was still in flight
    drafts_rejected: int = 0  # draft tokens whose KV the forward wrote and the next step overwrote
    runner_corrections: int = 0  # forwards started before where vLLM counted (its drafts rejected)
    zeroed_blocks: int = 0  # new blocks vLLM had the runner zero (`new_block_ids_to_zero`)
    # Mamba with drafts: prefill chunks whose checkpoint (one vLLM's scheduler declined) the runner
    # exports into the running block itself, a speculative block the scheduler relocated there while
    # the worker's append-only table keeps it in the column before (`_write_states`)
    checkpoint_clobbers: int = 0
    # store jobs of kvscope reading a block so clobbered, before any forward wrote it again: on real vLLM
    # the host tier would keep that block's wrong conv state (vLLM's fault, carried further by the tier)
    clobbered_stored: int = 0
    # kvscope's stats as vLLM hands them to its stat loggers (`SchedulerStats.kv_connector_stats`),
    # rebuilt and summed the way the front end does
    connector: object | None = None
    violations: list[Violation] = field(default_factory=list)


def _extend_chain(chain: list[int], tokens) -> list[int]:
    """Append the identity of each position's KV: a function of the whole prefix through it."""
    h = chain[-1] if chain else 0
    for token in tokens:
        h = hash((h, token)) & _MASK
        chain.append(h)
    return chain


def _salt(rank: int, layer: str) -> int:
    """What makes a worker's (its shard of heads) and a layer's KV of the same prefix differ."""
    return int.from_bytes(hashlib.blake2b(repr((rank, layer)).encode(), digest_size=8).digest(), "little") & _MASK


def true_token(position: int) -> int:
    """The token the fake model samples at `position`, whatever was drafted."""
    return (position * 31) % 500 + 1


def propose_drafts(tokens: list[int], k: int) -> list[int]:
    """The fake drafter: `k` tokens after `tokens`, about a third of them wrong."""
    drafts = []
    for position in range(len(tokens), len(tokens) + k):
        right = true_token(position)
        drafts.append(right if (position * 2654435761 >> 7) % 3 else right % 500 + 2)
    return drafts


class ModelFreeEngine:
    """One vLLM scheduler with KVScopeConnector, layers alternating sliding window and full attention,
    and `workers` worker-side connectors (tensor parallel ranks), each with its own KV cache, whose
    outputs vLLM's `KVOutputAggregator` merges as its executors do."""

    def __init__(self, model_path: str, extra_config: dict, *, window: int, num_blocks: int = 1200,
                 max_num_batched_tokens: int = 2048, max_model_len: int = 2048, workers: int = 1,
                 async_scheduling: bool = False, runner: str = "v1", spec_tokens: int = 0,
                 spec_method: str = "ngram", mamba: MambaAlign | None = None,
                 parallel_overrides: dict | None = None, kv_events: bool = False, engine_args: dict | None = None,
                 window_retention: int | None | str = "engine"):
        from vllm.config import KVTransferConfig
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.engine.arg_utils import EngineArgs
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import MambaSpec
        from vllm.v1.structured_output import StructuredOutputManager

        args = EngineArgs(
            model=model_path, skip_tokenizer_init=True, enable_prefix_caching=True, block_size=BLOCK,
            max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=True, tensor_parallel_size=workers,
            kv_transfer_config=KVTransferConfig(kv_connector="KVScopeConnector", kv_connector_module_path="connector",
                                                kv_role="kv_both", kv_connector_extra_config=extra_config),
            # vLLM's KV cache events (its device blocks', kvscope's host tier's): `published_events`
            kv_events_config={"enable_kv_cache_events": True, "publisher": "null"} if kv_events else None,
            # vLLM schedules `spec_tokens` drafts per decode step; the drafter here is `propose_drafts`
            speculative_config={"method": "ngram", "num_speculative_tokens": spec_tokens,
                                "prompt_lookup_max": 2, "prompt_lookup_min": 1} if spec_tokens else None,
            # more of vLLM's engine arguments, as `vllm serve` flags give them
            **{"max_num_seqs": 16, **(engine_args or {})},
        )
        self.vllm_config = create_engine_config(args)
        for name, value in (parallel_overrides or {}).items():  # a launcher this machine cannot start
            setattr(self.vllm_config.parallel_config, name, value)
        if spec_tokens and spec_method != "ngram":
            # The drafter is the fake forward's either way; vLLM's scheduler and KV cache manager
            # (and the connector) follow the method's rules, e.g. EAGLE's dropped last block.
            self.vllm_config.speculative_config.method = spec_method
        # vLLM's default on GPUs (the CPU platform turns it off): the engine schedules step N+1
        # before it has step N's output, through `AsyncScheduler`, two batches in flight.
        self.async_scheduling = async_scheduling
        self.vllm_config.scheduler_config.async_scheduling = async_scheduling
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        self.window, self.mamba = window, mamba
        # with drafts vLLM gives a Mamba group a state block per draft (`num_speculative_blocks`)
        self.kv_cache_config = _kv_cache_config(num_blocks, window, mamba, spec_tokens)
        self.group_kinds = [MAMBA if mamba else SLIDING, FULL]
        scheduler_block, hash_block = (mamba.block, mamba.hash_block) if mamba else (BLOCK, BLOCK)
        if mamba:  # what vLLM resolves for a hybrid Mamba model in align mode (`engine/core.py`)
            cache = self.vllm_config.cache_config
            cache.block_size = cache.mamba_block_size = mamba.block
            cache.mamba_cache_mode = "align"
            cache.hash_block_size = cache.cache_hit_alignment_tokens = hash_block
            self.kv_cache_config.hash_block_size = hash_block
            self.kv_cache_config.cache_hit_alignment_tokens = hash_block
            cache.prefix_cache_retention_interval = mamba.retention
            self.kv_cache_config.prefix_cache_retention_interval = mamba.retention
            if mamba.shared_prefix_checkpoint:
                cache.enable_mamba_shared_prefix_checkpoint = True
        else:
            # `window_retention`: the sliding window's blocks vLLM's prefix cache keeps (its
            # `prefix_cache_retention_interval`): "engine", what the engine arguments give, which vLLM's
            # `get_kv_cache_configs` copies into the KV cache config (a hand-made one would keep the dataclass's
            # None); 0, the engine's default, only those a later request can resume at (prompt ends,
            # shared-prefix junctions); a multiple of the block size, those too; None, every one (the
            # model-free fuzz's profiles but sparse-windows and tight-sparse, drawn when that was the default here)
            if window_retention == "engine":
                window_retention = self.vllm_config.cache_config.prefix_cache_retention_interval
            self.vllm_config.cache_config.prefix_cache_retention_interval = window_retention
            self.kv_cache_config.prefix_cache_retention_interval = window_retention
        spec = self.vllm_config.speculative_config
        drops = getattr(spec, "use_eagle_block_drop", None)
        # the runner's prefill checkpoints follow EAGLE's dropped last block (`MambaPrefillCheckpointBuilder`)
        self._drop_eagle_block = spec is not None and bool(drops() if callable(drops) else spec.use_eagle())
        self.group_layers = [g.layer_names for g in self.kv_cache_config.kv_cache_groups]
        self._attention_layers = [name for g in self.kv_cache_config.kv_cache_groups
                                  if not isinstance(g.kv_cache_spec, MambaSpec) for name in g.layer_names]
        if runner not in RUNNERS:
            raise ValueError(f"runner={runner!r}: accepted are {', '.join(RUNNERS)}")
        if runner == "v1" and not HAS_V1_RUNNER:
            runner = "cpu"  # vLLM 0.34 on (`HAS_V1_RUNNER`): the one runner besides V2
        self.runner = runner
        self.workers, self.words = [], []  # per rank: its connector, and its caches as int64 words
        self.v2_glue = []  # per rank, for the V2 runners: vLLM's ActiveKVConnector around the connector
        for rank in range(workers):
            caches = {name: torch.zeros(num_blocks, PAGE, dtype=torch.int8)
                      for names in self.group_layers for name in names}
            # vLLM's tensor-parallel state is not set up here: each worker is told its rank
            with mock.patch("connector.sides.worker_rank", return_value=rank):
                connector = KVScopeConnector(self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config)
            if runner == "v1":
                connector.register_kv_caches(caches)
            else:  # the V2 runner's glue registers the caches itself (the CPU runner's alike)
                if runner == "cpu":
                    from vllm.v1.worker.cpu.kv_connector import ActiveKVConnector
                else:
                    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

                with _as_transfer_group(connector):
                    self.v2_glue.append(ActiveKVConnector(self.vllm_config, caches))
            self.workers.append(connector)
            self.words.append({name: t.view(torch.int64) for name, t in caches.items()})
        # per rank: Mamba block id -> who wrote its state last: "vllm" (the forward) or "kvscope" (a load's
        # copy, as it lands); a block copy's state (the runner's state moves, copy-on-write) is its source's
        self._state_writers: list[dict[int, str]] = [{} for _ in range(workers)]
        for rank, connector in enumerate(self.workers):
            self._note_loads_landing(rank, connector._worker.engine)
        self.aggregator = KVOutputAggregator.from_connector(self.workers[0], workers)
        scheduler_class = AsyncScheduler if async_scheduling else Scheduler
        self.scheduler = scheduler_class(vllm_config=self.vllm_config, kv_cache_config=self.kv_cache_config,
                                         structured_output_manager=StructuredOutputManager(self.vllm_config),
                                         block_size=scheduler_block, hash_block_size=hash_block, log_stats=True)
        self.published_events: list = []  # with `kv_events`: every event vLLM's scheduler published, in order
        if kv_events:
            self.scheduler.kv_event_publisher.publish = lambda batch: self.published_events.extend(batch.events)
        hash_fn = get_hash_fn_by_name(self.vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._block_hasher = get_request_block_hasher(hash_block, hash_fn)
        self.after_step: list = []  # callables run after each step's workers (`LateReadingStores.tick`)
        self.tokens: dict[str, list[int]] = {}  # prompt + sampled, as the model runner knows them
        self._chains: dict[str, list[int]] = {}  # per request: its positions' KV identities (`_extend_chain`)
        self._salts = {(rank, name): _salt(rank, name) for rank in range(workers)
                       for names in self.group_layers for name in names}
        self.spec_tokens = spec_tokens
        self._rejected: dict[str, int] = {}  # drafts each request of the last step had rejected
        # A Mamba group with drafts: the runner's state bookkeeping (`mamba_utils.preprocess_mamba`,
        # `postprocess_mamba_fused_kernel`), per request: the block its running state is kept in, and
        # the tokens its last step accepted (the state to resume from is that many blocks on, less one)
        self._mamba_drafts = bool(mamba and spec_tokens)
        self._clobbered: set[int] = set()  # rank 0's blocks holding a checkpoint's conv state (`checkpoint_clobbers`)
        self._state_idx: dict[str, int] = {}
        self._num_accepted: dict[str, int] = {}
        self._state_steps: dict[str, tuple[int, int, bool, bool]] = {}  # this step: (read, running, copy, drafted)
        self._state_copies: list[tuple[str, int, int]] = []  # this step's postprocess: (req, from, to)
        self.tables: dict[str, list[list[int]]] = {}  # per request, per group: block ids (worker's view)
        self._resumed_now: set[str] = set()  # requests this step schedules again after a preemption
        self.stats = LoopStats()
        self._loaded: dict[tuple[str, int], set[int]] = {}  # (req id, group) -> device blocks loads filled
        # per request, its last lookup: (device prefix-hit tokens, host-tier tokens kvscope offered)
        self._lookups: dict[str, tuple[int, int]] = {}
        connector = self.scheduler.connector
        lookup = connector.get_num_new_matched_tokens

        def noted_lookup(request, num_computed_tokens):
            found = lookup(request, num_computed_tokens)
            self._lookups[request.request_id] = (num_computed_tokens, found[0] or 0)
            return found

        connector.get_num_new_matched_tokens = noted_lookup

    def _note_loads_landing(self, rank: int, copy_engine) -> None:
        """Mark the Mamba blocks each load copy of `copy_engine` writes as kvscope's, when its bytes land
        (`LateReadingStores` wraps this copy, so late loads are marked late)."""
        if MAMBA not in self.group_kinds:
            return
        mamba, copy, writers = self.group_kinds.index(MAMBA), copy_engine._copy, self._state_writers[rank]

        def noted_copy(group, slots, subs, block_ids, to_device, **options):
            done = copy(group, slots, subs, block_ids, to_device=to_device, **options)
            if to_device and group == mamba:
                writers.update(dict.fromkeys(block_ids, "kvscope"))
            return done

        copy_engine._copy = noted_copy

    # ------------------------------------------------------------------ driving
    def add(self, req_id: str, prompt: list[int], max_tokens: int = 2, trace_headers: dict | None = None,
            cache_salt: str | None = None, prompt_logprobs: int | None = None) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        # (prompt logprobs: vLLM then reads no cached KV for the request, `skip_reading_prefix_cache`)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=prompt_logprobs)
        self.tokens[req_id] = list(prompt)
        self.scheduler.add_request(Request(req_id, list(prompt), params, None, block_hasher=self._block_hasher,
                                           trace_headers=trace_headers, cache_salt=cache_salt))

    def run(self, max_steps: int = 2000, on_scheduled=None, pause_after: int | None = None) -> None:
        """Step while vLLM's engine core would (`Scheduler.has_requests`: unfinished or just finished
        requests, or connector work pending): schedule, execute, update, one step at a time, or
        with async scheduling as vLLM's engine core does it (`step_with_batch_queue`): schedule the
        next step before executing and processing the one in flight. `on_scheduled(output)` runs
        after each schedule, before the workers see it (where a client's abort can land).
        `pause_after`: return after that many steps, none in flight (between two engine steps)."""
        in_flight: deque = deque()
        for step in range(max_steps):
            if not (self.scheduler.has_requests() or in_flight):
                return
            if pause_after is not None and step >= pause_after and not in_flight:
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

    def step_once(self) -> None:
        """One engine step with nothing to do, as the next request's first step: what waits to be
        published on an idle engine (KV cache events, stats) goes out with it."""
        out = self.scheduler.schedule()
        self.stats.steps += 1
        self._process(out, self._execute(out))

    def _execute(self, out):
        """What the workers do with one scheduler output, in scheduling order: their block tables,
        the connector's hooks around the fake forward, the sampled tokens; merged as vLLM merges them."""
        from vllm.forward_context import set_forward_context
        from vllm.v1.outputs import ModelRunnerOutput

        computed = self._update_tables(out)
        meta = out.kv_connector_metadata
        for job in getattr(meta, "loads", ()):
            self.stats.loads.setdefault(job.req_id, []).append(job)
            for part in job.groups:
                self._loaded.setdefault((job.req_id, part.group_index), set()).update(part.block_ids)
        forwards = {req_id: self._plan_forward(out, req_id, computed[req_id]) for req_id in out.num_scheduled_tokens}
        if self._mamba_drafts:
            self._plan_state_moves(out, forwards)
        kv_outputs = []
        for rank, worker in enumerate(self.workers):
            if self.runner != "v1":
                kv_outputs.append(self._execute_v2(rank, out, forwards))
                continue
            from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

            worker.handle_preemptions(out.kv_connector_metadata)  # first in the V1 runner's execute_model
            self._zero_and_copy_blocks(rank, out)  # `_update_states`, before the forward
            with _as_transfer_group(worker), set_forward_context(None, self.vllm_config), \
                    KVConnectorModelRunnerMixin._get_kv_connector_output(out) as kv_output:
                self._forward_all(rank, forwards)
            kv_outputs.append(kv_output)
            # the V1 runner's Mamba postprocess runs with the sampling, after execute_model's stores
            self._postprocess_states(rank)
        for callback in self.after_step:
            callback()
        if self._clobbered:
            self.stats.clobbered_stored += sum(bool(self._clobbered.intersection(part.block_ids))
                                               for job in getattr(meta, "stores", ()) for part in job.groups
                                               if self.group_kinds[part.group_index] == MAMBA)
        req_ids = list(out.num_scheduled_tokens)
        sampled = [self._sample(req_id, *forwards[req_id]) for req_id in req_ids]
        self._rejected = {req_id: len(forwards[req_id][1]) - (len(tokens) - 1)
                          for req_id, tokens in zip(req_ids, sampled) if tokens and forwards[req_id][1]}
        self.stats.drafts_rejected += sum(self._rejected.values())
        index = runner_output_index(req_ids)
        runner_output = self.aggregator.aggregate(
            [ModelRunnerOutput(req_ids=req_ids, **index, sampled_token_ids=sampled,
                               kv_connector_output=kv_output) for kv_output in kv_outputs])
        merged = runner_output.kv_connector_output
        self.stats.finished_recving |= (merged.finished_recving or set()) if merged else set()
        self.stats.failed_recving |= (merged.failed_recving or set()) if merged else set()
        return runner_output

    def _plan_forward(self, out, req_id: str, scheduled_computed: int) -> tuple[int, list[int], list[int]]:
        """Where one request's forward starts, its draft tokens, and the KV identities it writes.

        Under async scheduling with drafts, vLLM schedules a step before it knows which of the
        previous step's drafts were accepted, counting them all as computed; the model runner starts
        the forward after the last accepted one instead (V1 `_update_states`' deferred correction)."""
        tokens = self.tokens[req_id]
        start = min(scheduled_computed, len(tokens) - 1)
        correction = scheduled_computed - start
        self.stats.runner_corrections += correction > 0
        assert correction in (0, self._rejected.get(req_id, 0)) and (self.async_scheduling or not correction), \
            f"{req_id}: vLLM counts {scheduled_computed} tokens computed, the runner {start}"
        n = out.num_scheduled_tokens[req_id]
        drafts = list((out.scheduled_spec_decode_tokens or {}).get(req_id, ()))
        if drafts and drafts[0] < 0:  # async scheduling: the drafter's tokens stay on the worker
            drafts = propose_drafts(tokens, len(drafts))
        assert not drafts or (start == len(tokens) - 1 and n == 1 + len(drafts)), (req_id, start, n, drafts)
        chain = self._chain(req_id)
        if drafts:
            values = _extend_chain(chain[:start + 1], drafts)[start:]
        else:
            values = chain[start:start + n]
        return start, drafts, values

    def _sample(self, req_id: str, start: int, drafts: list[int], values: list[int]) -> list[int]:
        """The tokens one request's step samples: none for a prefill chunk; else its drafts up to the
        first wrong one, and the token after them (vLLM's rejection sampling, greedy)."""
        tokens = self.tokens[req_id]
        if start + len(values) < len(tokens):
            return []  # a prefill chunk: nothing sampled
        sampled = []
        for draft in drafts:
            if draft != true_token(len(tokens) + len(sampled)):
                break
            sampled.append(draft)
        sampled.append(true_token(len(tokens) + len(sampled)))
        tokens.extend(sampled)
        return sampled

    def _chain(self, req_id: str) -> list[int]:
        """KV identities of the request's known tokens (`_extend_chain`), extended as it grows."""
        chain, tokens = self._chains.setdefault(req_id, []), self.tokens[req_id]
        return _extend_chain(chain, tokens[len(chain):])

    def _zero_and_copy_blocks(self, rank: int, out) -> None:
        """What vLLM's runners do to blocks before the forward, in their order: zero the new blocks it
        names (`new_block_ids_to_zero`: with Mamba or mixed-precision caches; in attention layers
        only, `KVBlockZeroer`), then the copy-on-write block copies (`kv_cache_block_copies`: a
        partial prefix-cache hit's shared last block given to the request as a private copy), whole
        blocks of every layer. A store still to read a zeroed block would put zeros in the host tier."""
        zero = getattr(out, "new_block_ids_to_zero", None)
        if zero:
            self.stats.zeroed_blocks += len(zero)
            for name in self._attention_layers:
                self.words[rank][name][zero] = 0
        writers = self._state_writers[rank]
        for copy in getattr(out, "kv_cache_block_copies", None) or ():
            for words in self.words[rank].values():
                words[copy.dst_block_id] = words[copy.src_block_id]
            writers[copy.dst_block_id] = writers.get(copy.src_block_id)  # the copy's state is its source's

    def _forward_all(self, rank: int, forwards) -> None:
        for req_id, (start, _, values) in forwards.items():
            self._check_reads(rank, req_id, start)
            self._forward(rank, req_id, start, values)

    def _execute_v2(self, rank: int, out, forwards):
        """One worker's step as vLLM's V2 model runner runs it (`execute_model`, then `sample_tokens`):
        `no_forward` when nothing is scheduled; else `pre_forward` (preemptions, metadata, synchronous
        loads) and the forward, then after the sampling `post_forward` (asynchronous loads, stores,
        results); with speculative decoding (0.33) the stores wait for the draft model
        (`finalize_step`), after the results and the worker metadata."""
        from vllm.forward_context import set_forward_context

        glue = self.v2_glue[rank]
        with _as_transfer_group(self.workers[rank]):
            self._zero_and_copy_blocks(rank, out)  # `update_requests`: before `pre_forward`, and `no_forward` too
            if out.total_num_scheduled_tokens == 0:
                return glue.no_forward(out).kv_connector_output
            with set_forward_context(None, self.vllm_config):
                glue.pre_forward(out)
                self._forward_all(rank, forwards)
            glue.finish_forward()
            self._postprocess_states(rank)  # V2: `postprocess_state` after the sampling, before `post_forward`
            if self.runner != "v2-spec":
                return glue.post_forward(out.finished_req_ids)
            kv_output = glue.post_forward(out.finished_req_ids, defer_finalize=True)
            glue.finalize_step()  # the draft model has run
            return kv_output

    def _process(self, out, runner_output) -> None:
        self._process_outputs(out, runner_output)
        if self.spec_tokens and not self.async_scheduling and out.total_num_scheduled_tokens:
            # vLLM's engine core hands the drafter's tokens to the scheduler after each step
            # (`EngineCore.post_step`); under async scheduling they stay on the worker
            from vllm.v1.outputs import DraftTokenIds

            req_ids = list(out.num_scheduled_tokens)
            self.scheduler.update_draft_token_ids(DraftTokenIds(
                req_ids, [propose_drafts(self.tokens[r], self.spec_tokens) for r in req_ids]))

    def _process_outputs(self, out, runner_output) -> None:
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
        """What the connector still holds once every request is done (`connector_leaks`). Empty when
        nothing leaked."""
        return connector_leaks(self.scheduler.get_kv_connector()._scheduler, self.scheduler.requests, self.workers)

    def telemetry_mismatches(self) -> list[str]:
        """Where kvscope's stats, as vLLM hands them to its stat loggers, disagree with vLLM's own counts
        or with themselves: hit and looked-up tokens against vLLM's external prefix-cache hits and
        queries; the missed tokens by reason against lookup minus hit tokens; the blocks loaded and
        failed against those the load jobs carried (their scans' pending blocks); the deferral waits
        observed against the loads deferred. Once every job is reported, and a step after the last abort.
        Empty when they agree."""
        data = self.stats.connector.data if self.stats.connector is not None else {}
        hit, looked_up = data.get("hit_tokens", 0), data.get("lookup_tokens", 0)
        missed = sum(data.get("missed_tokens", {}).values())
        problems = []
        pending = sum(len(part.block_ids) for jobs in self.stats.loads.values() for job in jobs for part in job.groups)
        loaded, failed = sum(data.get("loaded_blocks", {}).values()), data.get("load_failures", 0)
        if loaded + failed != pending:
            problems.append(f"telemetry: {loaded} loaded and {failed} failed blocks, the load jobs carried {pending}")
        if hit != self.stats.external_hit_tokens:
            problems.append(f"telemetry: kvscope counted {hit} hit tokens, vLLM {self.stats.external_hit_tokens}")
        if looked_up != self.stats.external_queried_tokens:
            problems.append(f"telemetry: kvscope looked up {looked_up} tokens, vLLM queried "
                            f"{self.stats.external_queried_tokens}")
        if missed != looked_up - hit:
            problems.append(f"telemetry: {missed} missed tokens by reason, lookup - hit is {looked_up - hit}")
        # every deferred load's wait ended (admitted, or aborted: observed with the step after its end)
        waits, deferred = len(data.get("load_deferral_wait_s", ())), data.get("deferred_loads", 0)
        if waits != deferred:
            problems.append(f"telemetry: {waits} deferral waits observed, {deferred} loads deferred")
        return problems

    def kv_event_mismatches(self) -> list[str]:
        """With `kv_events`, where the host tier's events published so far tell a router other than the
        tier holds between two steps (a router counting each block announced and removed): a block it
        holds missing or extra, or device-sized hashes counted wrong. Empty when they agree."""
        sched = self.scheduler.get_kv_connector()._scheduler
        if sched.index.journal is None:
            return []
        from tests.compat.kv_event_views import announced_blocks, router_view, tier_blocks

        tier = tier_blocks(sched.index)
        per_block = [sched.block_size // layout.block_size for layout in sched.layouts]
        try:
            announced = announced_blocks(self.published_events, per_block)
            view = router_view(self.published_events)
        except AssertionError as exc:  # a block announced twice, or removed unannounced
            return [f"kv events: {exc}"]
        problems = [f"kv events: {len(tier - announced)} blocks of the tier never announced, "
                    f"{len(announced - tier)} announced blocks not in it"] if announced != tier else []
        if sum(view.values()) != sum(per_block[g] for g, _ in tier):
            problems.append(f"kv events: {sum(view.values())} device-sized blocks announced for {len(tier)} offloaded")
        if sched.index.journal:
            problems.append(f"kv events: {len(sched.index.journal)} journal entries never published")
        return problems

    def reset_device_prefix_cache(self) -> None:
        assert self.scheduler.reset_prefix_cache(), "vLLM refused to reset its prefix cache"

    def update_weights(self) -> None:
        """New model weights, as an RL loop loads them: every position's KV differs from now on,
        so KV computed before reads as wrong after. vLLM's caches must be reset with it
        (`reset_prefix_cache(reset_running_requests=True, reset_connector=True)`)."""
        self._salts = {key: salt ^ 0x5DEECE66D for key, salt in self._salts.items()}

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
        cached = out.scheduled_cached_reqs
        # vLLM up to 0.33 names resumed requests among the cached ones; 0.34 sends them as new ones
        resumed = set(getattr(cached, "resumed_req_ids", None) or ())
        for new in out.scheduled_new_reqs:
            if new.req_id in self.tables:
                resumed.add(new.req_id)
            self.tables[new.req_id] = [list(ids) for ids in new.block_ids]
            computed[new.req_id] = new.num_computed_tokens
        self._resumed_now = resumed
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
        """Every position the step's first new token (at `computed`) attends to holds the KV the
        forward wrote for the same prefix, each block from its first position."""
        words = self.words[rank]
        want_all = torch.tensor(self._chain(req_id)[:computed], dtype=torch.int64)
        for group, layers in enumerate(self.group_layers):
            table = self.tables[req_id][group]
            loaded = self._loaded.get((req_id, group), ())
            if self.group_kinds[group] == MAMBA:
                read = self._state_steps[req_id][0] if self._mamba_drafts else None
                self._check_state(rank, req_id, group, computed, loaded, read)
                continue
            for i in range(self._first_read(group, computed) // BLOCK, -(-computed // BLOCK)):
                block_id = table[i] if i < len(table) else None
                if not block_id:
                    self.stats.violations.append(Violation(self.stats.steps, rank, req_id, group, i, block_id or 0,
                                                           "no block where the forward reads"))
                    continue
                end = min((i + 1) * BLOCK, computed)
                for layer in layers:
                    self.stats.checked_blocks += 1
                    self.stats.checked_loaded_blocks += block_id in loaded
                    slots = words[layer][block_id].view(BLOCK, WORDS_PER_TOKEN)[:end - i * BLOCK]
                    want = want_all[i * BLOCK:end] ^ self._salts[rank, layer]
                    if not bool((slots == want[:, None]).all()):
                        self.stats.violations.append(Violation(
                            self.stats.steps, rank, req_id, group, i, block_id,
                            f"layer {layer}: KV of tokens [{i * BLOCK}, {end}) is not what the forward wrote"))

    def _forward(self, rank: int, req_id: str, start: int, identities: list[int]) -> None:
        """Write the KV of positions [start, start + len(identities)): each its own slot of its block
        (Mamba groups: the states the step leaves)."""
        words, end = self.words[rank], start + len(identities)
        values = torch.tensor(identities, dtype=torch.int64)
        for group, layers in enumerate(self.group_layers):
            table = self.tables[req_id][group]
            if self.group_kinds[group] == MAMBA:
                self._write_states(rank, req_id, group, start, identities)
                continue
            for i in range(start // BLOCK, -(-end // BLOCK)):
                lo, hi = max(start, i * BLOCK), min(end, (i + 1) * BLOCK)
                for layer in layers:
                    slots = words[layer][table[i]].view(BLOCK, WORDS_PER_TOKEN)
                    written = values[lo - start:hi - start] ^ self._salts[rank, layer]
                    slots[lo - i * BLOCK:hi - i * BLOCK] = written[:, None]

    # ------------------------------------------------------------------ Mamba states (align mode)
    def _check_state(self, rank: int, req_id: str, group: int, computed: int, loaded=(),
                     index: int | None = None) -> None:
        """The step starts from the state after `computed` tokens, in the block holding that
        position (vLLM's runner reads block ``(computed - 1) // block``), or with drafts in block
        `index` (`_plan_state_moves`): it must be that state."""
        if computed == 0:
            return
        if index is None:
            index = (computed - 1) // self.mamba.block
        table = self.tables[req_id][group]
        block_id = table[index] if index < len(table) else 0
        want = self._chain(req_id)[computed - 1]
        local, offered = self._lookups.get(req_id, (0, 0))
        from_vllm_cache = bool(block_id) and block_id not in loaded and not offered and computed <= local \
            and self._state_writers[rank].get(block_id) == "vllm"
        for layer in self.group_layers[group]:
            self.stats.checked_blocks += 1
            self.stats.checked_loaded_blocks += block_id in loaded
            if not block_id or not bool((self.words[rank][layer][block_id] == want ^ self._salts[rank, layer]).all()):
                self.stats.violations.append(Violation(
                    self.stats.steps, rank, req_id, group, index, block_id,
                    f"layer {layer}: not the state after {computed} tokens", from_vllm_cache))

    def _write_states(self, rank: int, req_id: str, group: int, start: int, identities: list[int]) -> None:
        """The states a step leaves, where vLLM's runner puts them: the state after the step in the
        block of its last position; on a prompt's last chunk, the checkpoint state at vLLM's
        checkpoint position in the block before (`compute_mamba_prefill_checkpoints`). With drafts,
        first the runner's copy of the state resumed from, and a step verifying drafts leaves the
        state after each of its tokens instead (`_plan_state_moves`)."""
        from vllm.model_executor.layers.mamba.checkpoint import compute_mamba_prefill_checkpoints
        from vllm.v1.kv_cache_interface import MambaSpec

        mamba, end = self.mamba, start + len(identities)
        writes = [(-(-end // mamba.block) - 1, identities[-1])]
        if self._mamba_drafts:
            read, running, copy, drafted = self._state_steps[req_id]
            if copy:  # `preprocess_mamba`: the state resumed from, into the running block
                self._copy_state(rank, req_id, group, read, running)
            if drafted:
                # a step verifying drafts keeps the state after each of its tokens, one block each from
                # the running block on (`mamba_get_block_table_tensor`: 1 + num_speculative_blocks columns)
                self._fill_states(rank, req_id, group, [(running + j, v) for j, v in enumerate(identities)])
                return
        spec = self.kv_cache_config.kv_cache_groups[group].kv_cache_spec
        assert isinstance(spec, MambaSpec)
        offsets, cols = compute_mamba_prefill_checkpoints(
            [end], [len(identities)], mamba.hash_block, mamba.block, spec.prefill_checkpoint_alignment,
            drop_eagle_block=self._drop_eagle_block, cache_hit_alignment_tokens=mamba.hash_block)
        if cols[0] >= 0:
            writes.append((cols[0], identities[offsets[0] - 1]))
            table = self.tables[req_id][group]
            if self._mamba_drafts and cols[0] < len(table) and table[cols[0]] == table[writes[0][0]]:
                # vLLM's own: its worker exports every valid checkpoint, declined or not, and the column
                # of a relocated speculative block still names it. Mamba2 stores the checkpoint before
                # the final SSM state (`mamba_mixer2`: `store_prefill_checkpoint`, then the final
                # states), so the fake state is the final one; the conv state vLLM leaves there is
                # the checkpoint's. Counted, not failed: no load of kvscope's is involved.
                self.stats.checkpoint_clobbers += rank == 0
                writes.reverse()
                self._fill_states(rank, req_id, group, writes)
                if rank == 0:
                    self._clobbered.add(table[cols[0]])
                return
        self._fill_states(rank, req_id, group, writes)

    def _fill_states(self, rank: int, req_id: str, group: int, writes) -> None:
        """Each (block index, identity): that block of the request's table holds the state `identity`
        (a checkpoint vLLM's scheduler declined lands in the null block, as on vLLM's workers)."""
        table = self.tables[req_id][group]
        for index, identity in writes:
            if self._mamba_drafts and index >= len(table):
                self._no_state_block(rank, req_id, group, index, "the runner writes a state")
                continue
            if rank == 0:
                self._clobbered.discard(table[index])
            self._state_writers[rank][table[index]] = "vllm"
            for layer in self.group_layers[group]:
                self.words[rank][layer][table[index]].fill_(identity ^ self._salts[rank, layer])

    def _no_state_block(self, rank: int, req_id: str, group: int, index: int, what: str) -> None:
        table = self.tables[req_id][group]
        block_id = table[index] if index < len(table) else 0
        self.stats.violations.append(Violation(self.stats.steps, rank, req_id, group, index, block_id,
                                               f"no state block where {what}"))

    def _copy_state(self, rank: int, req_id: str, group: int, source: int, target: int) -> None:
        """The runner's copy of a whole state block (`collect_mamba_copy_meta`, its fused kernels)."""
        table = self.tables[req_id][group]
        for index in (source, target):
            if not 0 <= index < len(table) or not table[index]:
                self._no_state_block(rank, req_id, group, index, f"the runner copies a state ({source} to {target})")
                return
        if rank == 0:
            self._clobbered.discard(table[target])
        writers = self._state_writers[rank]
        writers[table[target]] = writers.get(table[source])  # the copy's state is its source's
        for layer in self.group_layers[group]:
            words = self.words[rank][layer]
            words[table[target]] = words[table[source]]

    def _plan_state_moves(self, out, forwards) -> None:
        """Where the runner reads and moves each request's Mamba state this step, with drafts (V1's
        `preprocess_mamba` and `postprocess_mamba_fused_kernel`, V2's `MambaHybridModelState` alike).

        The running state is kept in the block of the step's last token (drafts included): the state
        to resume from, in the block of the last step's plus its accepted tokens less one (the column
        of the last accepted token), is copied there first when that block moved. A step with drafts
        writes the state after each token from the running block on; after the sampling, when the
        accepted tokens cross a block end, the state at that end is copied into the block it ends
        (vLLM keys it there), and the count resets where that block is the running one."""
        block = self.mamba.block
        for req_id in (*out.finished_req_ids, *(getattr(out, "preempted_req_ids", None) or ()), *self._resumed_now):
            self._state_idx.pop(req_id, None)  # `cleanup_mamba_state_idx`
            self._num_accepted.pop(req_id, None)
        self._state_steps, self._state_copies = {}, []
        for req_id, (start, drafts, values) in forwards.items():
            n = out.num_scheduled_tokens[req_id]
            if req_id in self._state_idx:
                previous, accepted = self._state_idx[req_id], self._num_accepted.get(req_id, 1)
            else:  # new or resumed: the state of its computed tokens, where a hit or a load put it
                previous, accepted = (start - 1) // block, 1
            running = -(-(start + n) // block) - 1
            copy = previous != -1 and previous != running
            self._state_steps[req_id] = (previous + accepted - 1, running, copy, bool(drafts))
            self._state_idx[req_id] = running
            # after the sampling: a prefill chunk counts one token accepted, as vLLM's sampler does
            num_sampled = max(1, self._num_sampled(req_id, start, drafts, values))
            state_tokens = start + n - len(drafts)  # the running state's tokens, drafts aside
            done = state_tokens + num_sampled - 1
            aligned = done // block * block
            if aligned >= state_tokens:
                bias, target = aligned - state_tokens, aligned // block - 1
                if target == running:
                    num_sampled = 1
                if target != running or bias:
                    self._state_copies.append((req_id, running + bias, target))
            self._num_accepted[req_id] = num_sampled

    def _num_sampled(self, req_id: str, start: int, drafts: list[int], values: list[int]) -> int:
        """How many tokens `_sample` will give the request this step (0 for a prefill chunk)."""
        tokens = self.tokens[req_id]
        if start + len(values) < len(tokens):
            return 0
        accepted = 0
        for draft in drafts:
            if draft != true_token(len(tokens) + accepted):
                break
            accepted += 1
        return accepted + 1

    def _postprocess_states(self, rank: int) -> None:
        """The step's postprocess copies (`_plan_state_moves`) on one worker."""
        if not self._mamba_drafts:
            return
        group = self.group_kinds.index(MAMBA)
        for req_id, source, target in self._state_copies:
            self._copy_state(rank, req_id, group, source, target)


def without_load_admission(monkeypatch) -> None:
    """vLLM's own admission alone: every load kvscope finds starts at once (`load_admission` off)."""
    monkeypatch.setattr(LoadAdmission, "may_start", lambda self, *args, **kwargs: True)


def _kv_cache_config(num_blocks: int, window: int, mamba: MambaAlign | None = None, spec_tokens: int = 0):
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    common = dict(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    first = (MambaSpec(shapes=((PAGE,),), dtypes=(torch.int8,), block_size=mamba.block, mamba_cache_mode="align",
                       num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1,
                       num_speculative_blocks=spec_tokens) if mamba
             else SlidingWindowSpec(**common, sliding_window=window))
    groups = [
        KVCacheGroupSpec(["layers.0", "layers.2"], first),
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
    (`fence_compute_stream`), or when a load that must wait for them comes (one writing a block a
    store may still read: `TransferJob.waits_for_stores`), as on CUDA. A fence placed too late, or
    missing, or a load that should wait and does not, lets a later write reach a block a store has
    yet to read, and the host tier then holds what a later load gives the checks as wrong KV."""

    def __init__(self, engine, steps: int = 3, load_steps: int = 0, report_loads_early: bool = False):
        self.engine, self.steps = engine, steps
        # Loads too may land late (`load_steps` > 0): their bytes reach the device blocks only then,
        # and they are done only then, unless `report_loads_early` (a negative control: a copy
        # reported done before it lands).
        self.load_steps, self.report_loads_early = load_steps, report_loads_early
        self._pending: dict[int, list] = {}  # id(result) -> [result, store args, steps left]
        self.loads_after_stores = self.loads_alone = 0  # loads that waited for the stores, and the others
        self._loads: dict[int, list] = {}  # id(result) -> [result, load args, steps left]
        self._copy, self._poll = engine._copy, engine.poll
        engine.store, engine.poll = self._store, self._poll_late
        engine.load, engine.fence_compute_stream = self._load, self._read_all

    def _store(self, group, slots, subs, block_ids):
        from connector.copy_engine import CopyResult

        result = CopyResult(len(block_ids) * self.engine.group_block_bytes(group), len(block_ids), 0, 0,
                            pending_events="pending")
        self._pending[id(result)] = [result, (group, slots, subs, block_ids), self.steps]
        return result

    def _poll_late(self, result) -> bool:
        if id(result) in self._loads:
            return self.report_loads_early
        return id(result) not in self._pending and self._poll(result)

    def tick(self) -> None:
        """An engine step is over: stores issued `steps` steps ago have read their blocks by now,
        and loads issued `load_steps` ago have written theirs."""
        for entry in list(self._pending.values()):
            entry[2] -= 1
            if entry[2] <= 0:
                self._read(entry)
        for entry in list(self._loads.values()):
            entry[2] -= 1
            if entry[2] <= 0:
                result, args, _ = entry
                done = self._copy(*args, to_device=True)
                result.start_ns, result.end_ns, result.pending_events = done.start_ns, done.end_ns, None
                del self._loads[id(result)]

    def _read(self, entry) -> None:
        result, args, _ = entry
        done = self._copy(*args, to_device=False)
        result.start_ns, result.end_ns, result.pending_events = done.start_ns, done.end_ns, None
        del self._pending[id(result)]

    def _read_all(self) -> None:
        for entry in list(self._pending.values()):
            self._read(entry)

    def _load(self, group, slots, subs, block_ids, waits_for_stores: bool = True):
        if waits_for_stores:  # the load stream waits for the store stream
            self.loads_after_stores += 1
            self._read_all()
        else:
            self.loads_alone += 1
        if not self.load_steps:
            return self._copy(group, slots, subs, block_ids, to_device=True)
        from connector.copy_engine import CopyResult

        result = CopyResult(len(block_ids) * self.engine.group_block_bytes(group), len(block_ids), 0, 0,
                            pending_events="pending")
        self._loads[id(result)] = [result, (group, slots, subs, block_ids), self.load_steps]
        return result
