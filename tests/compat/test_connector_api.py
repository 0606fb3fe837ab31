"""KVScopeConnector against the connector API of the vLLM that runs the tests (0.32 here, 0.33's
and 0.34's sources under `scripts/dev compat`): every abstract method implemented, every override callable
the way the base class declares it."""

from __future__ import annotations

import inspect

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA

from connector import KVScopeConnector


def test_no_abstract_method_left():
    assert not getattr(KVScopeConnector, "__abstractmethods__", frozenset())
    assert issubclass(KVScopeConnector, KVConnectorBase_V1) and issubclass(KVScopeConnector, SupportsHMA)


def _overrides():
    for base in (KVConnectorBase_V1, SupportsHMA):
        for name, member in vars(base).items():
            if name.startswith("__") or not callable(getattr(base, name, None)):
                continue
            if name in vars(KVScopeConnector):
                yield pytest.param(base, name, id=f"{base.__name__}.{name}")


@pytest.mark.parametrize("base, name", list(_overrides()))
def test_override_accepts_what_the_base_declares(base, name):
    """vLLM calls a connector method as its base declares it: by position or by keyword."""
    ours = inspect.signature(getattr(KVScopeConnector, name))
    theirs = inspect.signature(getattr(base, name))
    ours_params = list(ours.parameters.values())
    takes_var_kw = any(p.kind is p.VAR_KEYWORD for p in ours_params)
    takes_var_pos = any(p.kind is p.VAR_POSITIONAL for p in ours_params)
    positional = [p for p in ours_params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for i, param in enumerate(theirs.parameters.values()):
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
            assert i < len(positional) or takes_var_pos, f"{name}: no positional slot for {param.name!r}"
        if param.kind is not param.POSITIONAL_ONLY:
            assert param.name in ours.parameters or takes_var_kw, f"{name}: no parameter {param.name!r}"
    required = [p.name for p in ours_params if p.default is p.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    assert set(required) <= set(theirs.parameters), f"{name}: requires {required}, base passes {list(theirs.parameters)}"


def test_the_batched_copy_op_used_on_cuda_is_there():
    """On CUDA, copies go through vLLM's `swap_blocks_batch(src_ptrs, dst_ptrs, sizes)`."""
    from connector.copy_engine import _batched_copy_op

    op = _batched_copy_op()
    assert op is not None
    params = list(inspect.signature(op).parameters.values())
    assert [p.name for p in params[:3]] == ["src_ptrs", "dst_ptrs", "sizes"]
    assert all(p.default is not p.empty for p in params[3:])


def test_vllm_counts_kvscopes_hits_as_host_memory_hits():
    """vLLM's `vllm:prompt_tokens_cached_by_source` files a connector's hits under the source its
    `get_external_cache_hit_sources` names: kvscope's come from host memory, not "external_unspecified"."""
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    connector = object.__new__(KVScopeConnector)  # the base class's method needs no state of the connector
    assert connector.get_external_cache_hit_sources(None, 48) == {CacheHitSource.HOST: 48}


def test_shutdown_still_ends_the_tracing_when_the_workers_shutdown_fails():
    """The engine is going away: a worker whose shutdown raises must not keep the spans still queued
    from being exported (and the trace file from being closed)."""
    class Worker:
        def shutdown(self):
            raise RuntimeError("device gone")

    class Tracing:
        ended = False

        def shutdown(self):
            self.ended = True

    connector = object.__new__(KVScopeConnector)
    connector._worker, connector.tracing = Worker(), Tracing()
    connector.shutdown()
    assert connector.tracing.ended


def test_stats_that_fail_to_build_cost_that_steps_metrics_not_the_step():
    """vLLM asks for stats every step: a telemetry bug must lose that step's metrics, never raise into
    vLLM's step, which would fail the requests of the batch."""
    class Scheduler:
        def take_stats(self):
            raise ValueError("a payload that cannot be built")

    connector = object.__new__(KVScopeConnector)
    connector._scheduler, connector._worker = Scheduler(), None
    assert connector.get_kv_connector_stats() is None


def test_no_host_tier_events_unless_vllm_publishes_its_own():
    """With vLLM's KV cache events off (no config, or one with `enable_kv_cache_events=False`) nothing
    takes the host tier's events: recorded anyway, they would pile up for the life of the engine."""
    from types import SimpleNamespace

    from connector.sides import _host_tier_events

    for events_config in (None, SimpleNamespace(enable_kv_cache_events=False)):
        vllm_config = SimpleNamespace(kv_events_config=events_config)
        assert _host_tier_events(vllm_config, SimpleNamespace(kv_cache_groups=[]), [], 16, 16) is None


def test_kvscope_does_not_ask_vllm_to_deliver_every_transfer():
    """A best-effort cache: vLLM must not drop a preempted request's step output to wait for a KV
    delivery (`requires_kv_delivery`), since a store kvscope drops is only a later miss."""
    assert object.__new__(KVScopeConnector).requires_kv_delivery is False
