"""`kvscope check`: the `--kv-transfer-config` an operator will give `vllm serve`, checked before any model loads.

vLLM builds the connector, and so reports its configuration errors, only after loading the model
(unless it asks `requires_piecewise_for_cudagraph` first, on GPUs with full CUDA graphs). This runs
the same checks, in the same words, on the JSON alone: vLLM's own parsing and validation of it, the
connector's name and role, `kv_connector_extra_config` (`config.parse_config`), the host tier against
this host's memory, and the installed vLLM's version. What needs the model (block sizes, the size of
one offloaded block) is still checked at start-up.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from . import CONNECTOR_NAME
from .config import (
    ConfigError,
    KVScopeConfig,
    available_memory_bytes,
    check_host_memory,
    parse_config,
    physical_memory_bytes,
)
from .telemetry.otel_env import REMOTE_PARENT_AND_RATIO, REMOTE_PARENT_FOLLOWED, REMOTE_PARENT_IGNORED

_MODULE_PATHS = (None, "connector", "connector.connector")


@dataclass
class CheckResult:
    config: KVScopeConfig
    warnings: list[str] = field(default_factory=list)
    otlp: str | None = None  # the OTLP export the OTEL_* variables ask for, as the engine would set it up
    sample_ratio: float = 1.0  # trace_sample_ratio, else OTEL_TRACES_SAMPLER's
    remote_parent: str = REMOTE_PARENT_AND_RATIO  # how a traceparent samples (`otel_env.REMOTE_PARENT_*`)


@dataclass(frozen=True)
class EngineShape:
    """What `vllm serve` flags say of the engine that start-up checks without the model (vLLM's flag names)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_size_local: int | None = None  # None: as vLLM derives it
    nnodes: int = 1
    distributed_executor_backend: str | None = None
    enable_sleep_mode: bool = False

    def parallel_config(self):
        """vLLM's own `ParallelConfig` of these flags (its validation runs: `ConfigError` naming its refusal);
        with the external launcher, which reads torchrun's environment, as much of it as start-up reads."""
        from types import SimpleNamespace

        fields = {name: getattr(self, name) for name in (
            "tensor_parallel_size", "pipeline_parallel_size", "decode_context_parallel_size",
            "prefill_context_parallel_size", "data_parallel_size", "nnodes", "distributed_executor_backend")}
        fields["data_parallel_size_local"] = self._data_parallel_size_local()
        ranks = self.tensor_parallel_size * self.pipeline_parallel_size * self.prefill_context_parallel_size
        if self.distributed_executor_backend == "external_launcher":  # every rank, data-parallel ones too
            return SimpleNamespace(**fields, world_size=ranks * self.data_parallel_size)
        from pydantic import ValidationError
        from vllm.config import ParallelConfig

        try:
            parallel = ParallelConfig(**fields)
            # what vLLM's engine start reads of it next (`nnodes_within_dp` raises; the multiprocessing
            # executor asserts one replica's ranks split evenly over its nodes), before the model loads
            nodes = parallel.nnodes_within_dp
            if parallel.distributed_executor_backend == "mp" and parallel.world_size % nodes:
                raise ValueError(f"world_size ({parallel.world_size}) must be divisible by the nodes one "
                                 f"data-parallel replica spans ({nodes} of --nnodes {self.nnodes})")
        except (ValidationError, ValueError) as exc:
            raise ConfigError(f"vLLM refuses these parallel flags: {exc}") from None
        return parallel

    def _data_parallel_size_local(self) -> int:
        if self.data_parallel_size_local is not None:
            return self.data_parallel_size_local
        if self.nnodes > 1:  # vLLM's engine/arg_utils.py: the replicas of this node
            ranks = self.tensor_parallel_size * self.pipeline_parallel_size * self.prefill_context_parallel_size
            return max((self.data_parallel_size * ranks // self.nnodes) // ranks, 1)
        return self.data_parallel_size


def check_transfer_config(text: str, engine: EngineShape = EngineShape(),
                          env: Mapping[str, str] | None = None) -> CheckResult:
    """Check the JSON of ``--kv-transfer-config`` for ``engine`` and the ``OTEL_*`` variables of ``env``
    (default: this process's); raises `ConfigError` naming what is wrong and what is accepted."""
    transfer = _parse_as_vllm_does(text)
    if transfer.kv_connector != CONNECTOR_NAME:
        raise ConfigError(f"kv_connector={transfer.kv_connector!r} is not kvscope's: expected {CONNECTOR_NAME!r}")
    if transfer.kv_role != "kv_both":
        raise ConfigError(f"kv_role={transfer.kv_role!r} is not accepted by {CONNECTOR_NAME}: accepted is "
                          "'kv_both' (it stores to and loads from its host tier)")
    if transfer.kv_connector_module_path not in _MODULE_PATHS:
        raise ConfigError(f"kv_connector_module_path={transfer.kv_connector_module_path!r} does not hold "
                          f"{CONNECTOR_NAME}: give 'connector', or leave it out (the plugin registers the name)")
    config = parse_config(transfer.kv_connector_extra_config)
    parallel = engine.parallel_config()
    _check_engine(parallel, engine.enable_sleep_mode)
    result = CheckResult(config, sample_ratio=1.0 if config.trace_sample_ratio is None else config.trace_sample_ratio)
    from .vllm_layout import workers_on_this_host

    crowded = check_host_memory(config.cpu_bytes, workers_on_this_host(parallel), physical_memory_bytes(),
                                available_memory_bytes())
    if crowded:
        result.warnings.append(crowded)
    port_problem = None if config.metrics_port is None else _port_problem(config.metrics_port)
    if port_problem:
        why = "is in use on this host now" if port_problem == "in use" else f"cannot be bound here ({port_problem})"
        result.warnings.append(f"metrics_port {config.metrics_port} {why}: an engine started here would be refused")
    environment = env if env is not None else os.environ
    # vLLM's own test, to the letter (0.32 to 0.34): it refuses any KV connector then
    if "expandable_segments:True" in environment.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        result.warnings.append("PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True: vLLM refuses a KV connector "
                               "with it unless started with --enable-cumem-allocator")
    result.otlp = _otlp_export(environment, result.warnings)
    if config.trace_file or result.otlp:
        from .telemetry.otel_env import exporter_warnings, sampler_from_env
        from .telemetry.sinks import truthy
        from .telemetry.tracing import export_mode

        if not truthy(environment.get("OTEL_SDK_DISABLED")):  # start-up reads it only when something is traced
            try:
                export_mode(environment)
                if config.trace_sample_ratio is None:
                    result.sample_ratio, result.remote_parent = sampler_from_env(environment)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
            result.warnings.extend(exporter_warnings(environment))
    return result


def _port_problem(port: int) -> str | None:
    """Why this process cannot bind ``port`` now ("in use", "Permission denied" for a privileged port), or None."""
    import errno
    import socket

    with socket.socket() as probe:  # as serve_metrics_port's server binds it (http.server reuses addresses)
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as exc:
            return "in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
    return None


def _otlp_export(env: Mapping[str, str], warnings: list[str]) -> str | None:
    """What OTLP export ``env`` sets up, built as the engine builds it (nothing is sent); its warnings
    (e.g. a timeout it ignores) go to ``warnings``."""
    import logging

    from .telemetry.otel_env import check_otlp_env
    from .telemetry.sinks import build_otlp_exporter, otlp_requested

    if not otlp_requested(env):
        return None
    try:
        check_otlp_env(env)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    sinks_logger, keep = logging.getLogger("connector.telemetry.sinks"), Keep(logging.WARNING)
    sinks_logger.addHandler(keep)
    try:
        exporter = build_otlp_exporter(env)
    finally:
        sinks_logger.removeHandler(keep)
    if exporter is None:
        return "off (the exporter could not be created)"
    description = exporter.description
    exporter.shutdown()
    return description


def _parse_as_vllm_does(text: str):
    """The `KVTransferConfig` vLLM's argument parser makes of ``text`` (`engine/arg_utils.py`: human-readable
    numbers such as 8G expanded, then pydantic's JSON validation), after checking the vLLM version."""
    from .version_check import UnsupportedVLLMVersion, check_vllm_version

    try:
        check_vllm_version()
    except UnsupportedVLLMVersion as exc:
        raise ConfigError(str(exc)) from None
    except ImportError as exc:
        raise ConfigError(f"vLLM is not installed here ({exc}): install a supported vLLM, then check") from None
    from pydantic import TypeAdapter, ValidationError
    from vllm.config import KVTransferConfig
    from vllm.engine import arg_utils

    expand = getattr(arg_utils, "_expand_json_human_readable_numbers", lambda value: value)
    try:
        transfer = TypeAdapter(KVTransferConfig).validate_json(expand(text))
    except ValidationError as exc:
        raise ConfigError(f"vLLM refuses this --kv-transfer-config: {exc}") from None
    except (ValueError, RecursionError, OverflowError, argparse.ArgumentTypeError) as exc:
        # ArgumentTypeError: vLLM's number expander refuses 1.5G (a decimal with a binary suffix)
        raise ConfigError(f"vLLM cannot read this --kv-transfer-config ({type(exc).__name__}: {exc})") from None
    if transfer.kv_connector is None:
        raise ConfigError(f"kv_connector is missing: expected {CONNECTOR_NAME!r}")
    return transfer


def _check_engine(parallel, enable_sleep_mode: bool) -> None:
    """Start-up's own checks of the engine's parallelism and sleep mode (`vllm_layout`)."""
    from types import SimpleNamespace

    from .vllm_layout import UnsupportedKVCache, check_parallelism, check_sleep_mode

    try:
        check_parallelism(parallel)
        check_sleep_mode(SimpleNamespace(enable_sleep_mode=enable_sleep_mode))
    except UnsupportedKVCache as exc:
        raise ConfigError(str(exc)) from None


# How `describe` says a sampler treats an upstream traceparent (`otel_env.REMOTE_PARENT_*`)
_REMOTE_PARENT_WORDS = {
    REMOTE_PARENT_AND_RATIO: "",
    REMOTE_PARENT_FOLLOWED: " of new traces; a sampled traceparent is always followed",
    REMOTE_PARENT_IGNORED: ", whatever a traceparent says",
}


def describe(result: CheckResult) -> str:
    """What the engine will run with, in an operator's words."""
    c = result.config
    ratio = result.sample_ratio
    lines = [f"host tier: {c.cpu_bytes:,} bytes ({c.cpu_bytes / 2**30:.2f} GiB) per worker",
             f"offloaded block: {c.block_size} tokens" if c.block_size else
             "offloaded block: the device block size (checked against the model at start-up)",
             f"trace file: {c.trace_file} (sample ratio {ratio}{_REMOTE_PARENT_WORDS[result.remote_parent]})"
             if c.trace_file else
             "trace file: none"]
    lines.append(f"OTLP export: {result.otlp}" if result.otlp else "OTLP export: none (no OTEL_* variable asks for it)")
    if c.metrics_port is not None:
        lines.append(f"metrics port: {c.metrics_port} (offline vllm.LLM runs; `vllm serve` has /metrics)")
    if c.mamba_decode_states:
        lines.append("Mamba states: those decode steps leave are stored too (a conversation's next turn loads "
                     "through the previous reply; outputs may part from a recompute's by bf16 rounding)")
    return "\n".join(lines)
