"""kvscope: a vLLM KV connector that offloads multi-group KV cache to a host-memory tier."""

__version__ = "0.1.0"

CONNECTOR_NAME = "KVScopeConnector"


def register() -> None:
    """`vllm.general_plugins` entry point: make `KVScopeConnector` loadable by name.

    Re-entrant: vLLM calls plugins in every process, sometimes more than once. Never raises:
    vLLM runs every installed general plugin at every start, whether or not the connector is
    configured, and does not catch what one raises. On a vLLM outside the supported range it
    only warns; the connector itself refuses to start there (`KVScopeConnector.__init__`).
    """
    import logging

    from .version_check import UnsupportedVLLMVersion, check_vllm_version

    logger = logging.getLogger(__name__)
    try:
        check_vllm_version()
    except UnsupportedVLLMVersion as exc:
        logger.warning("kvscope: %s KVScopeConnector will refuse to start on it.", exc)
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        if CONNECTOR_NAME not in KVConnectorFactory._registry:
            KVConnectorFactory.register_connector(CONNECTOR_NAME, "connector.connector", CONNECTOR_NAME)
    except Exception:  # another vLLM's factory API: only kvscope is unavailable, not vLLM
        logger.warning("kvscope: could not register %s with this vLLM's connector factory; name it with "
                       "kv_connector_module_path=\"connector\" instead", CONNECTOR_NAME, exc_info=True)


def __getattr__(name: str):
    # Lazy: importing the package (entry-point discovery) must not pull in torch/vLLM.
    if name == "KVScopeConnector":
        from .connector import KVScopeConnector

        return KVScopeConnector
    raise AttributeError(name)
