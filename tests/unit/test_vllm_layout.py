"""What kvscope refuses to offload, with a message naming it: layouts its block arithmetic does not follow."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    RSWASpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from connector.groups import GroupKind
from connector.vllm_layout import (
    UnsupportedKVCache,
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

COMMON = dict(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)


def _config(*specs) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"layers.{i}"], spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)


def test_full_attention_and_sliding_window_groups_are_taken():
    layouts = group_layouts(_config(FullAttentionSpec(**COMMON), SlidingWindowSpec(**COMMON, sliding_window=64)))
    assert [(g.kind, g.sliding_window) for g in layouts] == [(GroupKind.FULL_ATTENTION, None),
                                                           (GroupKind.SLIDING_WINDOW, 64)]


@pytest.mark.parametrize("extra", [0, 1, 3])
def test_a_window_keeps_the_blocks_vllm_keeps_for_multi_module_mtp(extra):
    """With multi-module MTP vLLM keeps `extra_retained_tokens` more behind the window: the lookup
    must find them stored and the load fill them, as vLLM allocates them (not null)."""
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    spec = SlidingWindowSpec(**COMMON, sliding_window=64, extra_retained_tokens=extra)
    layout = group_layouts(_config(FullAttentionSpec(**COMMON), spec))[1]
    for computed in (0, 10, 63, 64, 65, 66, 67, 1000):
        vllm_skips = SlidingWindowManager.get_num_skipped_tokens(spec, computed)
        assert layout.first_retained_token(computed) == vllm_skips, computed


@pytest.mark.parametrize("spec, named", [
    (CircularBufferSpec(**COMMON), "circular-buffer"),
    (ChunkedLocalAttentionSpec(**COMMON, attention_chunk_size=64), "chunked local attention"),
])
def test_groups_rewritten_in_place_or_chunked_are_refused(spec, named):
    with pytest.raises(UnsupportedKVCache, match=named):
        group_layouts(_config(FullAttentionSpec(**COMMON), spec))


def _refused_specs():
    return [
        # Prefix-LM: a prompt's KV depends on its later tokens (vLLM turns prefix caching off for it)
        pytest.param(FullAttentionSpec(**COMMON, non_causal=True), "non-causal attention", id="prefix-lm"),
        pytest.param(UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={
            "layers.0": FullAttentionSpec(**COMMON), "layers.1": FullAttentionSpec(**COMMON, non_causal=True)}),
            "non-causal attention", id="prefix-lm-layer-in-a-group"),
        # R-SWA: a FullAttentionSpec subclass whose decode KV is windowed (its own manager)
        pytest.param(RSWASpec(**COMMON, rswa_window=64),
                     "RSWASpec \\(vLLM's RSWAManager\\) is not supported.*accepted are", id="r-swa"),
        # DeepSeek-V4.1's bounded replay: vLLM recomputes the window rather than reuse it
        pytest.param(SlidingWindowMLASpec(**COMMON, sliding_window=64, bounded_replay=True), "not prefix-cacheable",
                     id="bounded-replay"),
        pytest.param(CrossAttentionSpec(**COMMON), "CrossAttentionSpec \\(vLLM's CrossAttentionManager\\)",
                     id="cross-attention"),
    ]


@pytest.mark.parametrize("spec, named", _refused_specs())
def test_kv_that_vllm_never_reuses_or_serves_with_other_rules_is_refused(spec, named):
    """Only specs of the managers whose hit rules kvscope's lookup follows, and only KV that is a
    function of its prefix: anything else would load another request's KV, or the wrong blocks."""
    with pytest.raises(UnsupportedKVCache, match=named):
        group_layouts(_config(FullAttentionSpec(**COMMON), spec))


def test_full_attention_variants_with_the_full_attention_rule_are_taken():
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SinkFullAttentionSpec

    layouts = group_layouts(_config(MLAAttentionSpec(**COMMON), SinkFullAttentionSpec(**COMMON, sink_len=4),
                                    SlidingWindowMLASpec(**COMMON, sliding_window=64)))
    assert [(g.kind, g.sliding_window) for g in layouts] == [
        (GroupKind.FULL_ATTENTION, None), (GroupKind.FULL_ATTENTION, None), (GroupKind.SLIDING_WINDOW, 64)]


@pytest.mark.parametrize("name", ["decode_context_parallel_size", "prefill_context_parallel_size"])
def test_context_parallelism_is_refused(name):
    check_parallelism(SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=1))
    with pytest.raises(UnsupportedKVCache, match=f"{name}=2 .*accepted is 1"):
        check_parallelism(SimpleNamespace(**{"decode_context_parallel_size": 1, "prefill_context_parallel_size": 1,
                                             name: 2}))


def test_pipeline_parallelism_is_refused():
    """Each stage holds other layers, but the scheduler sizes host slots from the first stage's."""
    single = dict(decode_context_parallel_size=1, prefill_context_parallel_size=1)
    check_parallelism(SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=4, **single))
    with pytest.raises(UnsupportedKVCache, match="pipeline_parallel_size=2 .*accepted is 1"):
        check_parallelism(SimpleNamespace(pipeline_parallel_size=2, **single))


def test_an_external_launcher_with_several_ranks_is_refused():
    """torchrun-style: every rank schedules alone and hears only its own worker, so a job that waits
    for every worker's report would never finish."""
    single = dict(decode_context_parallel_size=1, prefill_context_parallel_size=1, pipeline_parallel_size=1)
    check_parallelism(SimpleNamespace(distributed_executor_backend="external_launcher", world_size=1, **single))
    check_parallelism(SimpleNamespace(distributed_executor_backend="mp", world_size=4, **single))
    # torchrun data parallel, one GPU a rank: each rank's scheduler and worker are self-contained
    check_parallelism(SimpleNamespace(distributed_executor_backend="external_launcher", world_size=4,
                                      data_parallel_size=4, **single))
    with pytest.raises(UnsupportedKVCache, match="external_launcher.* 2 ranks per data-parallel rank.*accepted are"):
        check_parallelism(SimpleNamespace(distributed_executor_backend="external_launcher", world_size=2, **single))


def test_each_job_waits_for_the_workers_that_report_to_its_scheduler():
    """vLLM's `world_size` counts data-parallel ranks too under the external launcher, but each
    rank's scheduler hears its own worker only: waiting for `world_size` reports, no job would end."""
    single = dict(decode_context_parallel_size=1, prefill_context_parallel_size=1, pipeline_parallel_size=1)
    launched = SimpleNamespace(distributed_executor_backend="external_launcher", world_size=4,
                               data_parallel_size=4, **single)
    assert workers_per_scheduler(launched) == 1
    assert workers_per_scheduler(SimpleNamespace(distributed_executor_backend="mp", world_size=4,
                                                 data_parallel_size=2, **single)) == 4  # DP not in world_size
    assert workers_per_scheduler(SimpleNamespace(world_size=2)) == 2


def test_a_model_without_kv_cache_groups_is_refused_by_name():
    with pytest.raises(UnsupportedKVCache, match="no KV cache groups"):
        group_layouts(KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[]))


def test_a_host_resident_group_is_refused():
    """HiSparse keeps such a group's KV in host memory, outside the device blocks kvscope copies:
    taken as a device group, its loads and stores would copy blocks that hold none of its KV."""
    config = _config(FullAttentionSpec(**COMMON))
    config.kv_cache_groups.append(KVCacheGroupSpec(["layers.1"], FullAttentionSpec(**COMMON), host_resident=True))
    with pytest.raises(UnsupportedKVCache, match="KV group 1 is host-resident"):
        group_layouts(config)


@pytest.mark.parametrize("uniform", [False, True], ids=["one-spec", "layers-of-one-type"])
def test_a_group_whose_role_vllm_serves_with_another_manager_is_refused(uniform):
    """vLLM picks a group's manager by its role first (HiSparse's source groups): such a group follows
    that manager's hit rules, not full attention's, whether its spec is one spec or several layers'."""
    from vllm.v1.kv_cache_interface import KVCacheGroupRole

    spec = FullAttentionSpec(**COMMON)
    if uniform:
        spec = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"layers.1": spec})
    config = _config(FullAttentionSpec(**COMMON))
    config.kv_cache_groups.append(KVCacheGroupSpec(["layers.1"], spec, role=KVCacheGroupRole.HISPARSE_SOURCE))
    with pytest.raises(UnsupportedKVCache, match="HiSparseSourceManager"):
        group_layouts(config)


def test_a_group_of_layers_with_different_page_sizes_is_refused():
    """vLLM's scheduler sees such a group (`UniformTypeKVCacheSpecs`) as its first layer's spec: its
    host slots would be smaller than the workers', and it would address slots past their buffers."""
    def uniform(heads_of_second: int) -> KVCacheConfig:
        specs = {"layers.0": FullAttentionSpec(**COMMON),
                 "layers.1": FullAttentionSpec(**{**COMMON, "num_kv_heads": heads_of_second})}
        group = KVCacheGroupSpec(list(specs), UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs=specs))
        return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[group])

    assert [g.kind for g in group_layouts(uniform(1))] == [GroupKind.FULL_ATTENTION]
    with pytest.raises(UnsupportedKVCache, match=r"KV group 0 mixes layers whose device blocks take \[4096, 36864\] bytes"):
        group_layouts(uniform(9))


def test_sleep_mode_is_refused():
    """vLLM 0.32 does not ask the connector (`supports_sleep_mode`, 0.33+): the connector refuses it."""
    check_sleep_mode(SimpleNamespace(enable_sleep_mode=False))
    with pytest.raises(UnsupportedKVCache, match="enable_sleep_mode=True .*accepted is False"):
        check_sleep_mode(SimpleNamespace(enable_sleep_mode=True))


def test_mamba_groups_need_vllms_align_mode():
    """With prefix caching off vLLM keeps one Mamba state per request, rewritten every step."""
    state = dict(shapes=((4096,),), dtypes=(torch.int8,), block_size=64)
    layouts = group_layouts(_config(MambaSpec(**state, mamba_cache_mode="align"), FullAttentionSpec(**COMMON)))
    assert [g.kind for g in layouts] == [GroupKind.MAMBA, GroupKind.FULL_ATTENTION]
    with pytest.raises(UnsupportedKVCache, match="mamba_cache_mode='none' .*accepted is 'align'.*enable-prefix-caching"):
        group_layouts(_config(MambaSpec(**state, mamba_cache_mode="none"), FullAttentionSpec(**COMMON)))


def _speculative(method: str, disable_drop: bool = False):
    """vLLM's own SpeculativeConfig methods on a config without a draft model to load."""
    from vllm.config import SpeculativeConfig

    spec = object.__new__(SpeculativeConfig)
    for name, value in (("method", method), ("disable_eagle_block_drop", disable_drop),
                        ("draft_model_config", None)):
        object.__setattr__(spec, name, value)
    return spec


def _hybrid(eagle_flags=(False, False, False)):
    config = _config(FullAttentionSpec(**COMMON), SlidingWindowSpec(**COMMON, sliding_window=64),
                     MambaSpec(block_size=16, shapes=((2, 64),), dtypes=(torch.float32,), mamba_cache_mode="align"))
    for group, flag in zip(config.kv_cache_groups, eagle_flags):
        group.is_eagle_group = flag
    return config


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp"])
def test_eagle_drafters_make_every_attention_group_prove_its_next_token(method):
    config = _hybrid()
    vllm_config = SimpleNamespace(speculative_config=_speculative(method), num_hash_lookahead_tokens=0)
    assert eagle_proof_groups(vllm_config, config, group_layouts(config)) == {0, 1}  # not the Mamba group


def test_only_the_groups_vllm_flags_for_the_drop_when_it_flags_any():
    config = _hybrid(eagle_flags=(False, True, False))
    vllm_config = SimpleNamespace(speculative_config=_speculative("eagle"), num_hash_lookahead_tokens=0)
    assert eagle_proof_groups(vllm_config, config, group_layouts(config)) == {1}


def test_a_drafter_flagging_only_a_mamba_group_makes_every_attention_group_prove_its_next_token():
    """vLLM flags the group of the model's last layer for MTP drafters, which may be a Mamba group:
    no attention group is flagged then, so the drop (and the proof) is in every attention group."""
    config = _hybrid(eagle_flags=(False, False, True))
    vllm_config = SimpleNamespace(speculative_config=_speculative("mtp"), num_hash_lookahead_tokens=0)
    assert eagle_proof_groups(vllm_config, config, group_layouts(config)) == {0, 1}


def test_a_vllm_without_hash_lookahead_tokens_is_one_whose_hashes_do_not_cover_the_next_token():
    """vLLM 0.32's config has no `num_hash_lookahead_tokens`: its EAGLE drop is in force, so the
    attention groups must prove their next token there too."""
    config = _hybrid()
    vllm_config = SimpleNamespace(speculative_config=_speculative("eagle"))
    assert eagle_proof_groups(vllm_config, config, group_layouts(config)) == {0, 1}


@pytest.mark.parametrize("vllm_config", [
    SimpleNamespace(speculative_config=None),
    SimpleNamespace(speculative_config=_speculative("ngram"), num_hash_lookahead_tokens=0),
    SimpleNamespace(speculative_config=_speculative("eagle", disable_drop=True), num_hash_lookahead_tokens=0),
    SimpleNamespace(speculative_config=_speculative("eagle"), num_hash_lookahead_tokens=1),
], ids=["no-drafter", "ngram", "drop-disabled", "lookahead-hashes"])
def test_no_proof_without_a_drafter_that_needs_vllms_drop(vllm_config):
    config = _hybrid()
    assert eagle_proof_groups(vllm_config, config, group_layouts(config)) == frozenset()


@pytest.mark.parametrize("flags, workers", [
    ({"tensor_parallel_size": 8, "data_parallel_size": 2, "nnodes": 2, "data_parallel_size_local": 1}, 8),
    ({"data_parallel_size": 8, "nnodes": 8, "data_parallel_size_local": 1}, 1),
    ({"data_parallel_size": 8, "nnodes": 2, "data_parallel_size_local": 4}, 4),
    ({"tensor_parallel_size": 4}, 4),
])
def test_workers_on_this_host_follow_vllms_own_count_of_a_nodes_workers(flags, workers):
    """Nodes may hold several data-parallel replicas, or one replica may span nodes: vLLM's ParallelConfig
    knows (`local_world_size`), times the engines of this node."""
    from vllm.config import ParallelConfig

    assert workers_on_this_host(ParallelConfig(**flags)) == workers


def test_workers_on_this_host_spread_over_nodes_times_local_engines():
    assert workers_on_this_host(SimpleNamespace(world_size=8)) == 8
    assert workers_on_this_host(SimpleNamespace(world_size=8, nnodes=2)) == 4
    assert workers_on_this_host(SimpleNamespace(world_size=3, nnodes=2, data_parallel_size_local=2)) == 4


def test_a_host_counts_at_least_the_worker_asking_whatever_vllms_count_says():
    """vLLM's `local_world_size` is `world_size // nnodes_within_dp`, 0 for a replica spread over more
    nodes than it has workers: the host-memory check must still count this worker's host tier."""
    assert workers_on_this_host(SimpleNamespace(world_size=1, local_world_size=0)) == 1
    assert workers_on_this_host(SimpleNamespace(world_size=1, local_world_size=0, data_parallel_size_local=2)) == 2


def test_under_the_external_launcher_a_host_holds_one_worker_per_local_data_parallel_rank():
    """Each torchrun rank is one engine with one worker (`world_size` also counts the data-parallel
    ranks there): the host's workers are its local engines, not `world_size` of them each."""
    launched = SimpleNamespace(distributed_executor_backend="external_launcher", world_size=4, data_parallel_size=4,
                               data_parallel_size_local=4)
    assert workers_on_this_host(launched) == 4


def test_a_group_of_layers_of_one_type_has_its_first_layers_managers_rules():
    """As in vLLM, a group of several layer specs is served by its first layer's manager: a full-attention
    layer then an R-SWA one (a full-attention subclass) is a full-attention group."""
    specs = {"layers.0": FullAttentionSpec(**COMMON), "layers.1": RSWASpec(**COMMON, rswa_window=64)}
    group = KVCacheGroupSpec(list(specs), UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs=specs))
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[group])
    assert [layout.kind for layout in group_layouts(config)] == [GroupKind.FULL_ATTENTION]


def test_draft_tokens_per_step_are_vllms_speculative_tokens_and_none_without_a_drafter():
    """The scheduler side counts drafted tokens as not final: without speculative decoding there are none."""
    assert speculative_draft_tokens(SimpleNamespace(speculative_config=None)) == 0
    assert speculative_draft_tokens(SimpleNamespace()) == 0
    for drafts, per_step in ((3, 3), (1, 1), (None, 1)):
        spec = SimpleNamespace(num_speculative_tokens=drafts)
        assert speculative_draft_tokens(SimpleNamespace(speculative_config=spec)) == per_step


@pytest.mark.parametrize("interval, checkpointed", [(None, []), (0, [16]), (64, [16])])
def test_mamba_states_are_checkpointed_unless_vllm_keeps_one_at_every_block_end(interval, checkpointed):
    """vLLM keeps Mamba states densely only with `prefix_cache_retention_interval=None`; its default 0
    keeps only its semantic checkpoints, so a hit must end at one of them, not at any block end."""
    config = _hybrid()
    config.prefix_cache_retention_interval = interval
    assert checkpointed_state_block_sizes(group_layouts(config), config) == checkpointed


def test_a_host_slot_holds_every_layers_device_blocks_of_one_offload_block_per_group():
    """Per group, each layer's `factor` device blocks lie back to back in a slot, which is as large as
    its largest group. Laid out or sized otherwise, a group's copies overlap another layer's bytes or
    run past the slot: a load would give a layer another layer's (or another slot's) KV."""
    page = FullAttentionSpec(**COMMON).page_size_bytes
    specs = {"layers.0": FullAttentionSpec(**COMMON), "layers.1": FullAttentionSpec(**COMMON)}
    uniform = KVCacheGroupSpec(list(specs), UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs=specs))
    window = KVCacheGroupSpec(["layers.2"], SlidingWindowSpec(**{**COMMON, "block_size": 32}, sliding_window=64))
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[window, uniform])

    layout = slot_layout(config, offload_block_size=64)

    assert layout.group_factors == [2, 4]
    assert layout.group_layers == [[("layers.2", 0, 2 * page)],  # a 32-token block: twice the page
                                   [("layers.0", 0, page), ("layers.1", 4 * page, page)]]
    assert layout.slot_bytes == 8 * page  # the uniform group's: 2 layers x 4 blocks
