"""The connector's two sides built from vLLM's config: the checks every process makes at start-up, the
host tier's shape both sides agree on, and the scheduler side or the worker side with what each needs."""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import Callable

from .config import (
    ConfigError,
    KVScopeConfig,
    available_memory_bytes,
    check_host_memory,
    parse_config,
    physical_memory_bytes,
)
from .groups import GroupKind, GroupLayout
from .scheduler import KVScopeScheduler
from .telemetry.tracing import KVScopeTracing
from .vllm_layout import (
    SlotLayout,
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
from .worker import FENCE_AT_NEXT_STEP, FENCE_AT_ONCE, FENCE_WHEN_REUSED, KVScopeWorker

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TierShape:
    """What the scheduler side and every worker must agree on: the KV groups, the offloaded block's
    size in tokens, one host slot's layout and the number of slots."""

    layouts: list[GroupLayout]
    hash_block_size: int
    offload_block_size: int
    slot_layout: SlotLayout
    num_slots: int


def check_start_up(vllm_config) -> KVScopeConfig:
    """The connector's config, after what every process refuses before building a side: a role, a
    `kv_connector_extra_config`, parallelism or sleep mode this connector does not take. In the
    order `kvscope check` names them (`config_check`), so both name the same problem first."""
    transfer = vllm_config.kv_transfer_config
    if transfer.kv_role != "kv_both":
        # A host-tier cache both stores and loads; producer/consumer roles are for
        # disaggregated prefill, which this connector does not do.
        raise ConfigError(f"kv_role={transfer.kv_role!r} is not accepted by KVScopeConnector: "
                          "accepted is 'kv_both' (it stores to and loads from its host tier)")
    config = parse_config(transfer.kv_connector_extra_config)
    check_parallelism(vllm_config.parallel_config)
    check_sleep_mode(vllm_config.model_config)
    return config


def tier_shape(vllm_config, kv_cache_config, config: KVScopeConfig) -> TierShape:
    """The host tier's shape from vLLM's KV cache config and the connector's (`block_size`, `cpu_bytes`);
    a warning where the offloaded block size is a poor fit for the model."""
    layouts = group_layouts(kv_cache_config)
    cache_config = vllm_config.cache_config
    hash_block_size = (kv_cache_config.hash_block_size or getattr(cache_config, "hash_block_size", None)
                       or cache_config.block_size)
    block_size, warning = config.offload_block_size(
        [g.block_size for g in layouts], hash_block_size, getattr(vllm_config.model_config, "max_model_len", None),
        checkpointed_state_block_sizes(layouts, kv_cache_config))
    if warning:
        logger.warning(warning)
    slots = slot_layout(kv_cache_config, block_size)
    return TierShape(layouts, hash_block_size, block_size, slot_layout=slots,
                     num_slots=config.host_slots(slots.slot_bytes))


def build_scheduler(vllm_config, kv_cache_config, config: KVScopeConfig, shape: TierShape, tracing: KVScopeTracing,
                    kv_cache_manager_getter: Callable, engine: int) -> KVScopeScheduler:
    """The scheduler side; ``kv_cache_manager_getter`` returns vLLM's KV cache manager, which vLLM binds
    after it builds the connector."""
    transfer = vllm_config.kv_transfer_config
    if transfer.kv_load_failure_policy != "recompute":
        # The host tier is a cache: a failed load must mean recompute, never a failed request.
        logger.info("kvscope: setting kv_load_failure_policy='recompute'")
        transfer.kv_load_failure_policy = "recompute"
    layouts = shape.layouts
    scheduler = KVScopeScheduler(
        layouts=layouts,
        offload_block_size=shape.offload_block_size,
        hash_block_size=shape.hash_block_size,
        num_slots=shape.num_slots,
        slot_bytes=shape.slot_layout.slot_bytes,
        world_size=workers_per_scheduler(vllm_config.parallel_config),
        tracing=tracing,
        kv_cache_manager_getter=kv_cache_manager_getter,
        reprefillable_tokens=max(0, getattr(vllm_config, "num_prefill_lookahead_tokens", 0) - 1),
        draft_tokens=speculative_draft_tokens(vllm_config),
        eagle_groups=eagle_proof_groups(vllm_config, kv_cache_config, layouts),
        host_events=_host_tier_events(vllm_config, kv_cache_config, layouts, shape.offload_block_size,
                                      shape.hash_block_size),
        mamba_decode_states=config.mamba_decode_states,
        engine=engine,
    )
    _log_shape("scheduler", shape)
    if config.mamba_decode_states:
        if any(g.kind is GroupKind.MAMBA for g in layouts):
            logger.info("kvscope: mamba_decode_states true: the Mamba states decode steps leave are stored too "
                        "(loads through a reply; outputs may part from a recompute's by bf16 rounding)")
        else:
            logger.warning("kvscope: mamba_decode_states true changes nothing: this model has no Mamba group")
    return scheduler


def check_host_tier_fits(vllm_config, shape: TierShape) -> None:
    """A worker's check of its host's memory before it allocates its tier (each worker allocates its own,
    on its own host): refused where one tier cannot fit, warned of where this host's workers' tiers
    together leave little (by the engine's tensor-parallel rank 0 only: once per engine)."""
    local_workers = workers_on_this_host(vllm_config.parallel_config)
    tier_bytes = shape.num_slots * shape.slot_layout.slot_bytes
    crowded = check_host_memory(tier_bytes, local_workers, physical_memory_bytes(), available_memory_bytes())
    if crowded and worker_rank() == 0:
        logger.warning(crowded)


def build_worker(kv_cache_config, shape: TierShape, tracing: KVScopeTracing) -> KVScopeWorker:
    """A worker side: its host tier and copy engine, for this tensor-parallel rank."""
    worker = KVScopeWorker(kv_cache_config, shape.slot_layout, shape.num_slots,
                           [g.kind.value for g in shape.layouts], rank=worker_rank(), tracing=tracing)
    _log_shape("worker", shape)
    return worker


def _log_shape(side: str, shape: TierShape) -> None:
    logger.info(
        "kvscope %s: %d KV group(s) %s, offload block %d tokens, %d host slots of %d bytes",
        side, len(shape.layouts), [g.kind.value for g in shape.layouts], shape.offload_block_size,
        shape.num_slots, shape.slot_layout.slot_bytes,
    )


def _host_tier_events(vllm_config, kv_cache_config, layouts, block_size: int, hash_block_size: int):
    """The host tier's KV cache events when vLLM publishes its own (`--kv-events-config` with
    `enable_kv_cache_events`), else None: nothing is described or recorded."""
    events_config = getattr(vllm_config, "kv_events_config", None)
    if not (events_config is not None and events_config.enable_kv_cache_events):
        return None
    from .host_tier_events import HostTierEvents

    return HostTierEvents(layouts, kv_cache_config.kv_cache_groups, block_size, hash_block_size)


def store_fence(vllm_config, kv_cache_config) -> str:
    """Where a CUDA worker fences its stores (`worker.FENCE_*`).

    Both of vLLM's runners call handle_preemptions before their forward. Only where a cache's
    blocks are written in place (Mamba states) or zeroed when allocated (Mamba, mixed precision:
    the V2 runner zeroes before handle_preemptions) must every step wait for the stores before it;
    elsewhere only a step that allocates a block a store still reads. Unknown runner: at once."""
    v2 = uses_v2_model_runner(vllm_config)
    if v2 is None:
        return FENCE_AT_ONCE
    if not getattr(kv_cache_config, "needs_kv_cache_zeroing", True):
        return FENCE_WHEN_REUSED
    return FENCE_AT_ONCE if v2 else FENCE_AT_NEXT_STEP


def uses_v2_model_runner(vllm_config) -> bool | None:
    """Whether vLLM runs its V2 model runner; None when that cannot be told."""
    try:
        return bool(vllm_config.use_v2_model_runner)
    except AttributeError:  # vLLM 0.34 on has no V1 runner, and no switch between them
        return None if has_v1_model_runner() else True
    except Exception:  # a config the property rejects
        return None


def has_v1_model_runner() -> bool:
    """Whether this vLLM has its V1 model runner (up to 0.33)."""
    return importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is not None


def worker_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except Exception:  # not initialised (unit tests)
        return 0


def engine_index(parallel_config) -> int:
    """This engine's index among the data-parallel engines, as vLLM labels its metrics (`engine`):
    `data_parallel_index`, set in each engine process; the configured rank where it is not set."""
    index = getattr(parallel_config, "data_parallel_index", None)
    return int(index) if index is not None else int(getattr(parallel_config, "data_parallel_rank", 0) or 0)
