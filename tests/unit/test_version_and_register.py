"""vLLM version gate, plugin registration and packaging of the `vllm.general_plugins` entry point."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

import connector
from connector.version_check import SUPPORTED, UnsupportedVLLMVersion, check_vllm_version


# --- version check (pure) ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "version", ["0.32.0", "0.32.5+cpu", "0.33.1", "0.33.0", "0.34.0", "0.34.2+cu130", "0.32.1.dev3+g1234abc", "0.32"]
)
def test_supported_versions(version):
    assert check_vllm_version(version) == version


@pytest.mark.parametrize(
    "version", ["0.31.9", "0.35.0", "1.0.0", "1.32.0", "0.3.2", "garbage", "", "0", "v0.32.0", "0.x.1", "+cpu"]
)
def test_unsupported_versions(version):
    with pytest.raises(UnsupportedVLLMVersion) as info:
        check_vllm_version(version)
    message = str(info.value)
    assert f"vLLM {version}" in message
    assert "vLLM 0.32.x, 0.33.x and 0.34.x;" in message and "'vllm>=0.32,<0.35'" in message


def test_supported_range_matches_message():
    assert SUPPORTED == ((0, 32), (0, 33), (0, 34))


def test_installed_vllm_is_supported():
    import vllm

    assert check_vllm_version() == vllm.__version__


# --- import is lazy -----------------------------------------------------------------------------


def test_import_connector_is_lazy():
    code = (
        "import connector, sys; "
        "print('vllm' in sys.modules, 'torch' in sys.modules, "
        "any(m.startswith('connector.') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", "False", "False"], out.stdout + out.stderr


def test_unknown_attribute_raises_attribute_error():
    with pytest.raises(AttributeError):
        connector.no_such_thing  # noqa: B018
    assert not hasattr(connector, "no_such_thing")


# --- entry point --------------------------------------------------------------------------------


def test_entry_point_declared():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    ours = [ep for ep in eps if ep.name == "kvscope"]
    assert len(ours) == 1
    assert ours[0].value == "connector:register"
    assert ours[0].load() is connector.register


# --- register (imports vLLM) --------------------------------------------------------------------


def test_register_is_reentrant():
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    connector.register()
    connector.register()  # vLLM calls plugins more than once: must not raise "already registered"
    names = list(KVConnectorFactory._registry)
    assert names.count(connector.CONNECTOR_NAME) == 1
    assert connector.CONNECTOR_NAME == "KVScopeConnector"

    config = KVTransferConfig(kv_connector="KVScopeConnector", kv_role="kv_both")
    assert config.kv_connector_module_path is None
    cls = KVConnectorFactory.get_connector_class(config)
    from connector.connector import KVScopeConnector

    assert cls is KVScopeConnector
    assert cls.__module__ == "connector.connector"
    assert connector.KVScopeConnector is KVScopeConnector  # lazy package attribute


def test_register_never_breaks_vllm_on_an_unsupported_version(monkeypatch, caplog):
    # vLLM runs every installed general plugin at every start and does not catch what it raises:
    # raising here would stop vLLM even where kvscope is not configured.
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from connector.connector import KVScopeConnector  # imported while the version is supported

    monkeypatch.setattr(vllm, "__version__", "0.31.0")
    monkeypatch.setattr(KVConnectorFactory, "_registry", {})
    with caplog.at_level("WARNING", logger="connector"):
        connector.register()
    assert "vLLM 0.31.0" in caplog.text and "refuse to start" in caplog.text
    assert connector.CONNECTOR_NAME in KVConnectorFactory._registry
    # the connector itself still refuses, with the version message
    with pytest.raises(UnsupportedVLLMVersion, match="0.31.0"):
        KVScopeConnector(vllm_config=None, role=None)


def test_importing_the_connector_on_an_unsupported_vllm_names_the_version():
    # vLLM's factory imports `connector.connector` by name. On a vLLM outside the range, a module it
    # imports may be gone (simulated: `cache_hit_source` missing): the version message must come
    # first, not an ImportError.
    code = (
        "import sys, vllm; vllm.__version__ = '0.31.0'; "
        "sys.modules['vllm.v1.metrics.cache_hit_source'] = None\n"
        "try:\n    import connector.connector\n"
        "except Exception as exc:\n    print(type(exc).__name__, exc)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.startswith("UnsupportedVLLMVersion"), out.stdout + out.stderr[-2000:]
    assert "vLLM 0.31.0" in out.stdout and "0.32.x, 0.33.x and 0.34.x" in out.stdout


def test_register_survives_a_factory_it_does_not_know(monkeypatch, caplog):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    def refuse(*args, **kwargs):
        raise TypeError("register_connector() takes other arguments")

    monkeypatch.setattr(KVConnectorFactory, "_registry", {})
    monkeypatch.setattr(KVConnectorFactory, "register_connector", refuse)
    with caplog.at_level("WARNING", logger="connector"):
        connector.register()
    assert "kv_connector_module_path" in caplog.text


def test_the_engine_index_is_vllms_data_parallel_index_not_the_reset_rank():
    """vLLM sets `data_parallel_index` in each engine process and resets `data_parallel_rank` to 0 for
    dense models: spans must name the engine as the metrics' `engine` label does."""
    from vllm.config import ParallelConfig

    from connector.sides import engine_index

    config = ParallelConfig(data_parallel_size=2)
    config.data_parallel_index = 1  # as `EngineCoreProc.run_engine_core` sets it in engine 1
    assert config.data_parallel_rank == 0 and engine_index(config) == 1
    assert engine_index(ParallelConfig()) == 0
    assert engine_index(type("Older", (), {"data_parallel_rank": 3})()) == 3  # no index: the configured rank
    assert engine_index(type("Older", (), {"data_parallel_rank": 0})()) == 0
    assert engine_index(type("Unset", (), {"data_parallel_rank": None})()) == 0  # neither: engine 0


def test_vllm_lays_the_kv_cache_out_as_the_connector_requires():
    """Host slots are copied page by page: vLLM must lay each block's K and V out contiguously, blocks
    outermost ("LBHNC"), which it does when the configured connector class asks for it."""
    from types import SimpleNamespace

    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.utils import get_kv_connector_cache_layout

    connector.register()
    transfer = KVTransferConfig(kv_connector="KVScopeConnector", kv_role="kv_both",
                                kv_connector_extra_config={"cpu_bytes": 1 << 20})
    assert get_kv_connector_cache_layout(SimpleNamespace(kv_transfer_config=transfer)) == "LBHNC"
