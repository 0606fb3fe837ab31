"""kvscope: a vLLM KV connector that offloads multi-group KV cache to a host-memory tier."""

__version__ = "0.1.0"

CONNECTOR_NAME = "KVScopeConnector"


def register() -> None:
    """`vllm.general_plugins` entry point: make `KVScopeConnector` loadable by name.

    Re-entrant: vLLM calls plugins in every process, sometimes more than once.
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from .version_check import check_vllm_version

    check_vllm_version()
    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "connector.connector", CONNECTOR_NAME)


def __getattr__(name: str):
    # Lazy: importing the package (entry-point discovery) must not pull in torch/vLLM.
    if name == "KVScopeConnector":
        from .connector import KVScopeConnector

        return KVScopeConnector
    raise AttributeError(name)
