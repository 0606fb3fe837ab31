"""`KVScopeConnector`: the thin facade vLLM instantiates; it picks a side by role and delegates."""

from __future__ import annotations

import logging
from typing import Any

from .version_check import check_vllm_version

# Before any other import of vLLM's modules: on a vLLM outside the supported range one of them may
# be missing or moved, and the user must get the version message, not an ImportError.
check_vllm_version()

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from .config import (
    ConfigError,
    available_memory_bytes,
    check_host_memory,
    parse_config,
    physical_memory_bytes,
)
from .groups import GroupKind
from .metadata import KVScopeMetadata
from .scheduler import KVScopeScheduler
from .telemetry.failures import telemetry_failed
from .telemetry.metrics import KVScopePromMetrics, KVScopeStats, serve_metrics_port
from .telemetry.span_records import ENGINE_RESOURCE_ATTRIBUTE
from .telemetry.tracing import KVScopeTracing
from .vllm_layout import (
    check_parallelism,
    check_sleep_mode,
    checkpointed_state_block_sizes,
    eagle_proof_groups,
    group_layouts,
    slot_layout,
    speculative_draft_tokens,
    workers_on_this_host,
    workers_per_scheduler,
)
from .vllm_logging import log_through_vllm
from .worker import FENCE_AT_NEXT_STEP, FENCE_AT_ONCE, FENCE_WHEN_REUSED, KVScopeWorker

logger = logging.getLogger(__name__)


class KVScopeConnector(KVConnectorBase_V1, SupportsHMA):
    # vLLM's `vllm:prompt_tokens_cached_by_source` files our hits under the host-memory tier.
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        check_vllm_version()
        log_through_vllm()
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        if transfer.kv_role != "kv_both":
            # A host-tier cache both stores and loads; producer/consumer roles are for
            # disaggregated prefill, which this connector does not do.
            raise ConfigError(f"kv_role={transfer.kv_role!r} is not accepted by KVScopeConnector: "
                              "accepted is 'kv_both' (it stores to and loads from its host tier)")
        self.config = parse_config(transfer.kv_connector_extra_config)
        check_parallelism(vllm_config.parallel_config)
        check_sleep_mode(vllm_config.model_config)
        layouts = group_layouts(kv_cache_config)
        cache_config = vllm_config.cache_config
        hash_block_size = (kv_cache_config.hash_block_size or getattr(cache_config, "hash_block_size", None)
                           or cache_config.block_size)
        block_size, warning = self.config.offload_block_size(
            [g.block_size for g in layouts], hash_block_size, getattr(vllm_config.model_config, "max_model_len", None),
            checkpointed_state_block_sizes(layouts, kv_cache_config))
        if warning:
            logger.warning(warning)
        layout = slot_layout(kv_cache_config, block_size)
        num_slots = self.config.host_slots(layout.slot_bytes)
        if role != KVConnectorRole.SCHEDULER:  # the workers allocate the tiers, each on its own host
            local_workers = workers_on_this_host(vllm_config.parallel_config)
            crowded = check_host_memory(num_slots * layout.slot_bytes, local_workers, physical_memory_bytes(),
                                        available_memory_bytes())
            if crowded and _worker_rank() == 0:
                logger.warning(crowded)
        # Spans name their engine as vLLM's metrics do (`engine` label: its data-parallel index), so a
        # trace file or backend fed by several engines tells which tier a request met. Not
        # `data_parallel_rank`: vLLM resets that to 0 in each engine of a dense (non-MoE) model.
        engine = _engine_index(vllm_config.parallel_config)
        self.tracing = KVScopeTracing.from_config(self.config.trace_file, self.config.trace_sample_ratio,
                                                  resource_attributes={ENGINE_RESOURCE_ATTRIBUTE: engine})
        self._scheduler: KVScopeScheduler | None = None
        self._worker: KVScopeWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            if transfer.kv_load_failure_policy != "recompute":
                # The host tier is a cache: a failed load must mean recompute, never a failed request.
                logger.info("kvscope: setting kv_load_failure_policy='recompute'")
                transfer.kv_load_failure_policy = "recompute"
            self._scheduler = KVScopeScheduler(
                layouts=layouts,
                offload_block_size=block_size,
                hash_block_size=hash_block_size,
                num_slots=num_slots,
                slot_bytes=layout.slot_bytes,
                world_size=workers_per_scheduler(vllm_config.parallel_config),
                tracing=self.tracing,
                kv_cache_manager_getter=lambda: self._kv_cache_manager,
                reprefillable_tokens=max(0, getattr(vllm_config, "num_prefill_lookahead_tokens", 0) - 1),
                draft_tokens=speculative_draft_tokens(vllm_config),
                eagle_groups=eagle_proof_groups(vllm_config, kv_cache_config, layouts),
                host_events=_host_tier_events(vllm_config, kv_cache_config, layouts, block_size, hash_block_size),
                mamba_decode_states=self.config.mamba_decode_states,
                engine=engine,
            )
        else:
            self._worker = KVScopeWorker(
                kv_cache_config,
                layout,
                num_slots,
                [g.kind.value for g in layouts],
                rank=_worker_rank(),
                tracing=self.tracing,
            )
        logger.info(
            "kvscope %s: %d KV group(s) %s, offload block %d tokens, %d host slots of %d bytes",
            role.name.lower(), len(layouts), [g.kind.value for g in layouts], block_size,
            num_slots, layout.slot_bytes,
        )
        if role == KVConnectorRole.SCHEDULER and self.config.mamba_decode_states:
            if any(g.kind is GroupKind.MAMBA for g in layouts):
                logger.info("kvscope: mamba_decode_states true: the Mamba states decode steps leave are stored too "
                            "(loads through a reply; outputs may part from a recompute's by bf16 rounding)")
            else:
                logger.warning("kvscope: mamba_decode_states true changes nothing: this model has no Mamba group")

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is only a later miss

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config) -> bool:
        # vLLM 0.33+ asks (and refuses sleep mode with this connector): the copy engine holds views
        # of the KV cache storage, which sleep mode frees and remaps; refuse rather than copy
        # through stale views. 0.32 does not ask: the constructor refuses it (`check_sleep_mode`).
        return False

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # vLLM asks while it builds its config (on GPUs, with full CUDA graphs), long before it builds
        # the connector after loading the model: a bad key or value stops start-up here, at once.
        parse_config(extra_config)
        return False  # no per-layer work (whole-request loads, per-step stores): full graphs are fine

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        return "LBHNC"  # blocks outermost, each block's K and V contiguous: page copies

    # ---- scheduler side ----
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def may_load_async(self, request) -> bool:
        return self._scheduler.may_load_async(request)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        # Where vLLM's stats are off it builds no metrics, and `metrics_port` would serve nothing.
        if self.config.metrics_port is not None and getattr(kv_cache_manager, "log_stats", True) is False:
            raise ConfigError(
                f"kv_connector_extra_config.metrics_port={self.config.metrics_port} is not accepted: vLLM's "
                "stats are off (disable_log_stats, vllm.LLM's default), so there are no metrics to serve; "
                "start with disable_log_stats=False, or leave metrics_port out")

    def build_connector_meta(self, scheduler_output) -> KVScopeMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self._scheduler.update_connector_output(connector_output)

    def has_pending_push_work(self) -> bool:
        # vLLM keeps stepping while this is True (as for its own offloading connector). On CUDA a
        # store can outlive its request's last step and only a later step reports it; without steps
        # its host blocks would wait, not ready, for the next request, whose lookup comes first.
        # Not for KV cache events or stats waiting to be published (vLLM publishes them with a step): a
        # reset of an idle or paused engine (a weight update) would then keep it from idling, and vLLM's
        # `release_kv_cache_memory` after `pause_generation(clear_cache=True)` requires no work left.
        # They go out with the next step.
        return self._scheduler is not None and self._scheduler.has_unreported_jobs()

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request)

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request)

    def take_events(self):
        """The host tier's KV cache events (`host_tier_events`), published by vLLM with its own."""
        return self._scheduler.take_events() if self._scheduler is not None else ()

    def reset_cache(self) -> bool | None:
        return self._scheduler.reset_cache() if self._scheduler else None

    # ---- worker side ----
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches)
        if self._worker.engine.is_cuda:
            self._worker.store_fence = _store_fence(self._vllm_config, self._kv_cache_config)

    def handle_preemptions(self, kv_connector_metadata) -> None:
        if self._worker is not None:
            self._worker.begin_step(kv_connector_metadata)

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.check_stores_fenced(connector_metadata)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        self._worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole-request and asynchronous, finished before the forward reads them

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return  # stores run once per step in wait_for_save

    def wait_for_save(self) -> None:
        self._worker.wait_for_save(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]):
        # vLLM (0.32 to 0.34) asks `get_transfer_results`. This older form cannot say a load failed:
        # a caller of it would compute on blocks that were never loaded. Refused, not answered.
        raise NotImplementedError(
            "KVScopeConnector reports transfers through get_transfer_results (with failed loads); "
            "get_finished cannot carry a failed load, so a caller of it would use KV that was never "
            "loaded. Call get_transfer_results instead")

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        done, failed = self._worker.transfer_results()
        # Failures are per request: block ids are not unique across KV groups.
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def build_connector_worker_meta(self):
        return self._worker.build_worker_meta() if self._worker else None

    def shutdown(self) -> None:
        try:
            if self._worker is not None:
                self._worker.shutdown()
        except Exception:  # the engine is going away: say so, and still export the spans queued
            logger.exception("kvscope: the worker's shutdown failed")
        self.tracing.shutdown()

    # ---- stats (both sides; vLLM aggregates workers' and the scheduler's) ----
    def get_kv_connector_stats(self) -> KVScopeStats | None:
        side = self._scheduler or self._worker
        try:
            return side.take_stats() if side is not None else None
        except Exception:  # metrics are lost for a step, not the engine (`telemetry_failed`)
            telemetry_failed("get_kv_connector_stats")
            return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVScopeStats:
        return KVScopeStats(data=data) if data is not None else KVScopeStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        log_through_vllm()
        config = parse_config(vllm_config.kv_transfer_config.kv_connector_extra_config)
        # Offline runs have one front end; with several API servers (which serve vLLM's /metrics
        # themselves) only the first binds the port, or the second one would fail to start.
        first_front_end = getattr(getattr(vllm_config, "parallel_config", None), "_api_process_rank", 0) in (0, -1)
        if config.metrics_port is not None and first_front_end:
            try:
                serve_metrics_port(config.metrics_port)  # offline runs: vLLM's and kvscope's metrics
            except OSError as exc:
                raise ConfigError(
                    f"kv_connector_extra_config.metrics_port={config.metrics_port} is not accepted: cannot "
                    f"serve on 127.0.0.1:{config.metrics_port} ({exc.strerror or exc}); expected a free TCP "
                    "port 1..65535 this process may bind") from exc
        return KVScopePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _host_tier_events(vllm_config, kv_cache_config, layouts, block_size: int, hash_block_size: int):
    """The host tier's KV cache events when vLLM publishes its own (`--kv-events-config` with
    `enable_kv_cache_events`), else None: nothing is described or recorded."""
    events_config = getattr(vllm_config, "kv_events_config", None)
    if not (events_config is not None and events_config.enable_kv_cache_events):
        return None
    from .host_tier_events import HostTierEvents

    return HostTierEvents(layouts, kv_cache_config.kv_cache_groups, block_size, hash_block_size)


def _store_fence(vllm_config, kv_cache_config) -> str:
    """Where a CUDA worker fences its stores (`worker.FENCE_*`).

    Both of vLLM's runners call handle_preemptions before their forward. Only where a cache's
    blocks are written in place (Mamba states) or zeroed when allocated (Mamba, mixed precision:
    the V2 runner zeroes before handle_preemptions) must every step wait for the stores before it;
    elsewhere only a step that allocates a block a store still reads. Unknown runner: at once."""
    v2 = _uses_v2_model_runner(vllm_config)
    if v2 is None:
        return FENCE_AT_ONCE
    if not getattr(kv_cache_config, "needs_kv_cache_zeroing", True):
        return FENCE_WHEN_REUSED
    return FENCE_AT_ONCE if v2 else FENCE_AT_NEXT_STEP


def _uses_v2_model_runner(vllm_config) -> bool | None:
    """Whether vLLM runs its V2 model runner; None when that cannot be told."""
    try:
        return bool(vllm_config.use_v2_model_runner)
    except AttributeError:  # vLLM 0.34 on has no V1 runner, and no switch between them
        return None if _has_v1_model_runner() else True
    except Exception:  # a config the property rejects
        return None


def _has_v1_model_runner() -> bool:
    """Whether this vLLM has its V1 model runner (up to 0.33)."""
    import importlib.util

    return importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is not None


def _worker_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except Exception:  # not initialised (unit tests)
        return 0


def _engine_index(parallel_config) -> int:
    """This engine's index among the data-parallel engines, as vLLM labels its metrics (`engine`):
    `data_parallel_index`, set in each engine process; the configured rank where it is not set."""
    index = getattr(parallel_config, "data_parallel_index", None)
    return int(index) if index is not None else int(getattr(parallel_config, "data_parallel_rank", 0) or 0)
