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

from .config import ConfigError, parse_config
from .metadata import KVScopeMetadata
from .scheduler import KVScopeScheduler
from .sides import (
    build_scheduler,
    build_worker,
    check_host_tier_fits,
    check_start_up,
    engine_index,
    store_fence,
    tier_shape,
)
from .telemetry.failures import telemetry_failed
from .telemetry.metrics import KVScopePromMetrics, KVScopeStats, serve_metrics_port
from .telemetry.span_records import ENGINE_RESOURCE_ATTRIBUTE
from .telemetry.tracing import KVScopeTracing
from .vllm_logging import log_through_vllm
from .worker import KVScopeWorker

logger = logging.getLogger(__name__)


class KVScopeConnector(KVConnectorBase_V1, SupportsHMA):
    # vLLM's `vllm:prompt_tokens_cached_by_source` files our hits under the host-memory tier.
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        check_vllm_version()
        log_through_vllm()
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.config = check_start_up(vllm_config)
        shape = tier_shape(vllm_config, kv_cache_config, self.config)
        if role != KVConnectorRole.SCHEDULER:
            check_host_tier_fits(vllm_config, shape)  # before anything starts that would then need stopping
        # Spans name their engine as vLLM's metrics do (`engine` label: its data-parallel index), so a
        # trace file or backend fed by several engines tells which tier a request met. Not
        # `data_parallel_rank`: vLLM resets that to 0 in each engine of a dense (non-MoE) model.
        engine = engine_index(vllm_config.parallel_config)
        self.tracing = KVScopeTracing.from_config(self.config.trace_file, self.config.trace_sample_ratio,
                                                  resource_attributes={ENGINE_RESOURCE_ATTRIBUTE: engine})
        self._scheduler: KVScopeScheduler | None = None
        self._worker: KVScopeWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = build_scheduler(vllm_config, kv_cache_config, self.config, shape, self.tracing,
                                              kv_cache_manager_getter=lambda: self._kv_cache_manager, engine=engine)
        else:
            self._worker = build_worker(kv_cache_config, shape, self.tracing)

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
            self._worker.store_fence = store_fence(self._vllm_config, self._kv_cache_config)

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
