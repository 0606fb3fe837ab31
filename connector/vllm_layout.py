"""Translate vLLM's KV cache configuration into kvscope's plain group layouts and slot sizes."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    KVCacheConfig,
    KVCacheSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.core.single_type_kv_cache_manager import (
    FullAttentionManager,
    MambaManager,
    SinkFullAttentionManager,
    SlidingWindowManager,
)
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from .groups import GroupKind, GroupLayout


class UnsupportedKVCache(RuntimeError):
    """A KV cache layout kvscope cannot offload correctly: refuse instead of guessing."""


# vLLM's hit rule for a group is its manager's (`KVCacheSpecRegistry`): kvscope's lookup follows
# these and no other. A spec another manager serves (a subclass with rules of its own, e.g. R-SWA,
# or a platform's custom spec) is refused, not taken for its base class. A group of several layer
# specs (`UniformTypeKVCacheSpecs`) has its first layer's manager, as in vLLM.
_KIND_OF_MANAGER = {
    FullAttentionManager: GroupKind.FULL_ATTENTION,
    SinkFullAttentionManager: GroupKind.FULL_ATTENTION,  # sink KV lives outside request blocks
    SlidingWindowManager: GroupKind.SLIDING_WINDOW,
    MambaManager: GroupKind.MAMBA,
}


def _kind(spec: KVCacheSpec, role=None) -> tuple[GroupKind, int | None]:
    if isinstance(spec, UniformTypeKVCacheSpecs):
        for layer_spec in spec.kv_cache_specs.values():
            _check_reusable(layer_spec)
        return _kind(spec.first_spec, role)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        raise UnsupportedKVCache("chunked local attention groups are not supported by kvscope")
    if isinstance(spec, CircularBufferSpec):
        # one block per request, rewritten every step: a stored copy would be stale at once
        raise UnsupportedKVCache("circular-buffer KV groups (one block per request, rewritten in place "
                                 "every step) are not supported by kvscope")
    _check_reusable(spec)
    manager = KVCacheSpecRegistry.get_manager_class(spec, role)
    kind = _KIND_OF_MANAGER.get(manager)
    if kind is None:
        raise UnsupportedKVCache(
            f"KV cache spec {type(spec).__name__} (vLLM's {getattr(manager, '__name__', 'no manager')}) "
            "is not supported "
            "by kvscope: accepted are the specs of vLLM's full-attention, sliding-window and Mamba managers")
    if kind is GroupKind.SLIDING_WINDOW:
        # vLLM also keeps `extra_retained_tokens` behind the window (multi-module MTP): those
        # blocks are allocated, so a hit must have them stored and a load fills them
        return kind, spec.sliding_window + getattr(spec, "extra_retained_tokens", 0)
    if kind is GroupKind.MAMBA and spec.mamba_cache_mode != "align":
        # vLLM's "none" mode (prefix caching off): one state per request, rewritten every step,
        # so no state at a block boundary is ever kept to offload
        raise UnsupportedKVCache(
            f"Mamba groups with mamba_cache_mode={spec.mamba_cache_mode!r} are not supported by kvscope: "
            "it keeps one state per request, rewritten every step; accepted is 'align', which vLLM "
            "sets when prefix caching is on (--enable-prefix-caching)")
    return kind, None


def _check_reusable(spec: KVCacheSpec) -> None:
    """Refuse KV that is not a function of its prefix alone, which vLLM itself never reuses: a load
    would give a later request KV computed for another."""
    if getattr(spec, "non_causal", False):
        # Prefix-LM attention: a prompt's KV depends on the whole prompt; vLLM turns off prefix
        # caching and chunked prefill for it
        raise UnsupportedKVCache(f"non-causal attention ({type(spec).__name__} with non_causal=True, Prefix-LM) "
                                 "is not supported by kvscope: a prompt's KV depends on its later tokens, so "
                                 "no prefix of it can be reused; accepted is causal attention")
    if not getattr(spec, "prefix_cacheable", True):
        raise UnsupportedKVCache(f"KV cache spec {type(spec).__name__} is not prefix-cacheable in vLLM (its KV "
                                 "is replayed or rebuilt, not reused): kvscope cannot offload it; accepted are "
                                 "specs vLLM's prefix cache reuses")


def workers_per_scheduler(parallel_config) -> int:
    """How many workers report each job to this engine's scheduler: vLLM's `world_size`, except
    with the external launcher, where `world_size` also counts the data-parallel ranks and each
    rank's scheduler hears only its own worker (a single-process executor, no output aggregator)."""
    world_size = getattr(parallel_config, "world_size", 1)
    if getattr(parallel_config, "distributed_executor_backend", None) == "external_launcher":
        return world_size // max(1, getattr(parallel_config, "data_parallel_size", 1))
    return world_size


def workers_on_this_host(parallel_config) -> int:
    """About how many workers (each with its own host tier) run on this host: the engine's workers
    spread over `nnodes`, times the engines of this host (local data parallelism). An estimate:
    multi-node Ray without `nnodes` counts every worker as local; other engines are not seen."""
    engines = max(1, getattr(parallel_config, "data_parallel_size_local", 1) or 1)
    local = None
    if getattr(parallel_config, "distributed_executor_backend", None) != "external_launcher":
        try:  # vLLM's own count of one engine's workers on a node (a node may hold several replicas)
            local = int(parallel_config.local_world_size)
        except Exception:  # not a vLLM ParallelConfig, or one that cannot say
            local = None
    if local is None:
        nodes = max(1, getattr(parallel_config, "nnodes", 1) or 1)
        local = -(-workers_per_scheduler(parallel_config) // nodes)
    return max(1, local) * engines


def check_parallelism(parallel_config) -> None:
    """Refuse context parallelism: a device block then holds more tokens than its spec's block size
    (each rank's share of a longer span), which kvscope's block arithmetic does not follow. Refuse
    pipeline parallelism: each stage holds other layers, but vLLM's scheduler sees the first
    stage's, so its host slots would be sized for them and would not fit the other stages' buffers."""
    backend = getattr(parallel_config, "distributed_executor_backend", None)
    ranks = workers_per_scheduler(parallel_config)
    if backend == "external_launcher" and ranks > 1:
        # every rank runs its own scheduler and hears only its own worker; a job counts as done
        # when all `world_size` workers reported it, so none ever would
        raise UnsupportedKVCache(f"distributed_executor_backend='external_launcher' with {ranks} ranks per data-"
                                 "parallel rank is not supported by kvscope: each rank's scheduler hears only "
                                 "its own worker; accepted are 1 rank per data-parallel rank (one GPU each) "
                                 "and the other executor backends (mp, ray, uni)")
    stages = getattr(parallel_config, "pipeline_parallel_size", 1)
    if stages > 1:
        raise UnsupportedKVCache(f"pipeline_parallel_size={stages} is not supported by kvscope: the scheduler "
                                 "sizes host slots from the first stage's layers, which other stages do not "
                                 "share; accepted is 1 (tensor parallelism is supported)")
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = getattr(parallel_config, name, 1)
        if size > 1:
            raise UnsupportedKVCache(f"{name}={size} is not supported by kvscope: context parallelism "
                                     "shards each device block's tokens across ranks; accepted is 1")


def check_sleep_mode(model_config) -> None:
    """Refuse sleep mode: it frees the KV cache's memory and maps it again, while the copy engine
    holds views of it (vLLM 0.33 refuses first, through `supports_sleep_mode`; 0.32 does not ask)."""
    if getattr(model_config, "enable_sleep_mode", False):
        raise UnsupportedKVCache("enable_sleep_mode=True is not supported by kvscope: sleep mode remaps "
                                 "the KV cache the host tier copies from and to; accepted is False")


def group_layouts(kv_cache_config: KVCacheConfig) -> list[GroupLayout]:
    if not kv_cache_config.kv_cache_groups:
        raise UnsupportedKVCache("this model has no KV cache groups (attention-free or encoder-only): "
                                 "kvscope has nothing to offload; run it without the connector")
    layouts = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        if getattr(group, "host_resident", False):
            raise UnsupportedKVCache(f"KV group {index} is host-resident (HiSparse): not supported")
        kind, window = _kind(group.kv_cache_spec, getattr(group, "role", None))
        _check_one_page_size(index, group.kv_cache_spec)
        layouts.append(
            GroupLayout(
                index=index,
                kind=kind,
                block_size=group.kv_cache_spec.block_size,
                sliding_window=window,
            )
        )
    return layouts


def speculative_draft_tokens(vllm_config) -> int:
    """Drafts vLLM schedules per decode step (0 without speculative decoding)."""
    spec = getattr(vllm_config, "speculative_config", None)
    return 0 if spec is None else max(1, int(getattr(spec, "num_speculative_tokens", None) or 1))


def eagle_proof_groups(vllm_config, kv_cache_config: KVCacheConfig, layouts: list[GroupLayout]) -> frozenset[int]:
    """The attention groups whose hits must prove the token after them (`lookup.find_hit_tokens`):
    those vLLM drops a hit's last block in for EAGLE-style drafters, which keep KV of their own
    computed from the next token. vLLM flags them (`is_eagle_group`); with none flagged, its prefix
    cache drops in every group, and so does this. Empty without such a drafter, with the drop
    turned off (`disable_eagle_block_drop`), or when block hashes already cover the next token
    (`num_hash_lookahead_tokens`)."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or getattr(vllm_config, "num_hash_lookahead_tokens", 0):
        return frozenset()
    drops = getattr(spec, "use_eagle_block_drop", None)  # 0.32 to 0.34 (0.33 on: not for dflash/dspark)
    if not (drops() if callable(drops) else spec.use_eagle()):
        return frozenset()
    attention = {layout.index for layout in layouts if layout.kind is not GroupKind.MAMBA}
    flagged = {i for i, group in enumerate(kv_cache_config.kv_cache_groups) if getattr(group, "is_eagle_group", False)}
    return frozenset((flagged & attention) or attention)


def checkpointed_state_block_sizes(layouts: list[GroupLayout], kv_cache_config: KVCacheConfig) -> list[int]:
    """The state block sizes of the Mamba groups whose states vLLM keeps only at its checkpoints:
    every Mamba group, unless `prefix_cache_retention_interval` is None (dense: a state at every
    block end). vLLM's KV cache manager reads the KV cache config's copy (from the cache config's)."""
    if getattr(kv_cache_config, "prefix_cache_retention_interval", None) is None:
        return []
    return [layout.block_size for layout in layouts if layout.kind is GroupKind.MAMBA]


def _check_one_page_size(index: int, spec: KVCacheSpec) -> None:
    """Refuse a group whose layers' pages differ in size (vLLM's `UniformTypeKVCacheSpecs`: other
    head counts or sizes). vLLM's scheduler sees only its first layer's spec, so the scheduler would
    size host slots differently from the workers and address slots past their host buffers."""
    if not isinstance(spec, UniformTypeKVCacheSpecs):
        return
    sizes = sorted({layer.page_size_bytes for layer in spec.kv_cache_specs.values()})
    if len(sizes) > 1:
        raise UnsupportedKVCache(
            f"KV group {index} mixes layers whose device blocks take {sizes} bytes: not supported by "
            "kvscope, whose scheduler (vLLM gives it the first layer's size only) would size host slots "
            "differently from the workers; accepted are groups of layers with one page size")


def layer_page_bytes(kv_cache_config: KVCacheConfig, group_index: int) -> dict[str, int]:
    """Bytes of one device block for each layer of a group (padded pages, copied as-is)."""
    group = kv_cache_config.kv_cache_groups[group_index]
    spec = group.kv_cache_spec
    per_layer = spec.kv_cache_specs if isinstance(spec, UniformTypeKVCacheSpecs) else {}
    return {name: per_layer.get(name, spec).page_size_bytes for name in group.layer_names}


@dataclass(frozen=True, slots=True)
class SlotLayout:
    """How one host slot is laid out: a group's layers, each with `factor` device blocks."""

    slot_bytes: int
    # per group: [(layer name, byte offset in slot, page bytes)], and its factor
    group_layers: list[list[tuple[str, int, int]]]
    group_factors: list[int]


def slot_layout(kv_cache_config: KVCacheConfig, offload_block_size: int) -> SlotLayout:
    group_layers, factors, sizes = [], [], []
    for index, layout in enumerate(group_layouts(kv_cache_config)):
        factor = layout.blocks_per_offload_block(offload_block_size)
        offset, layers = 0, []
        for name, page in layer_page_bytes(kv_cache_config, index).items():
            layers.append((name, offset, page))
            offset += factor * page
        group_layers.append(layers)
        factors.append(factor)
        sizes.append(offset)
    return SlotLayout(slot_bytes=max(sizes), group_layers=group_layers, group_factors=factors)
