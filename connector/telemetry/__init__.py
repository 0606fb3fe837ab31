"""Telemetry of the connector: spans (``tracing``), the trace file sink (``trace_file``), metrics
(``metrics``) and isolated test helpers (``testing``). Submodules are imported where used, so that
importing the package stays cheap and vLLM-free."""
