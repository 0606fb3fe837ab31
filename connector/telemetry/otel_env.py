"""The standard ``OTEL_*`` variables kvscope follows, checked at start-up.

A value kvscope would act on wrongly (a mistyped protocol, an endpoint that is no URL, a header list
that loses its entries, a sampler it cannot follow) stops start-up with a `ValueError` naming the
variable and what is accepted, instead of a warning at the first export while every span is lost.
Header values are never quoted back: they often hold credentials.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from urllib.parse import unquote, urlsplit

OTLP_PROTOCOLS = ("grpc", "http/protobuf")
# How a span under a sampled remote parent (an upstream `traceparent`, or the scheduler's carrier on a
# worker) is sampled; an unsampled remote parent drops it, except under REMOTE_PARENT_IGNORED.
REMOTE_PARENT_AND_RATIO = "parent_and_ratio"  # `trace_sample_ratio`: the ratio of requests traced, traceparent or not
REMOTE_PARENT_FOLLOWED = "parent"  # the `parentbased_*` samplers: kept; the ratio only decides new traces
REMOTE_PARENT_IGNORED = "ratio"  # `always_on`, `always_off`, `traceidratio`: the ratio alone, flags ignored
# The standard samplers kvscope follows: (ratio, or None for OTEL_TRACES_SAMPLER_ARG's; remote-parent rule)
SAMPLERS: dict[str, tuple[float | None, str]] = {
    "always_on": (1.0, REMOTE_PARENT_IGNORED), "parentbased_always_on": (1.0, REMOTE_PARENT_FOLLOWED),
    "always_off": (0.0, REMOTE_PARENT_IGNORED), "parentbased_always_off": (0.0, REMOTE_PARENT_FOLLOWED),
    "traceidratio": (None, REMOTE_PARENT_IGNORED), "parentbased_traceidratio": (None, REMOTE_PARENT_FOLLOWED),
}
EXPORTERS = ("otlp", "none")
_PROTOCOL_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
# host:port; `_` is allowed in host names (container and compose service names use it)
_HOST_PORT = re.compile(r"(?:[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?|\[[0-9A-Fa-f:.]+\]):(\d{1,5})")
# Schemes of a URL endpoint with a host: gRPC's exporter keeps only its host:port (vLLM's own OpenTelemetry
# example gives grpc://host:4317), and the HTTP exporter posts to it
_URL_SCHEMES = {"grpc": ("http", "https", "grpc"), "http/protobuf": ("http", "https")}
# gRPC name-resolution targets the gRPC exporter hands to gRPC as they are (unix:///path, dns:///host:port)
_GRPC_TARGET_SCHEMES = ("unix", "unix-abstract", "dns", "ipv4", "ipv6")
# A header name the HTTP and gRPC exporters can send (an HTTP token)
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # an HTTP token


def _first_set(env: Mapping[str, str], *names: str) -> tuple[str, str | None]:
    """The first of ``names`` set to a non-empty value, and its value (the last name and None: none is)."""
    for name in names:
        if env.get(name):
            return name, env[name]
    return names[-1], None


def otlp_protocol(env: Mapping[str, str]) -> str:
    _, raw = _first_set(env, *_PROTOCOL_VARIABLES)
    return (raw or "grpc").strip().lower()


def check_otlp_env(env: Mapping[str, str]) -> None:
    """Refuse the protocol, endpoint or headers OTLP export would be built from, where they are wrong."""
    name, raw = _first_set(env, *_PROTOCOL_VARIABLES)
    protocol = otlp_protocol(env)
    if protocol not in OTLP_PROTOCOLS:
        raise ValueError(f"{name}={raw!r} is not accepted: the Python OTLP exporters speak "
                         f"{' or '.join(map(repr, OTLP_PROTOCOLS))}")
    name, endpoint = _first_set(env, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
    if endpoint is not None:
        _check_endpoint(name, endpoint, protocol)
    for name in ("OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS"):
        _check_headers(name, env.get(name))
    if _uses_tls(env, protocol, endpoint):
        _check_tls_files(env, protocol)


def _uses_tls(env: Mapping[str, str], protocol: str, endpoint: str | None) -> bool:
    """Whether the exporter `sinks.build_otlp_exporter` builds speaks TLS: an https:// endpoint, or for gRPC
    ``OTEL_EXPORTER_OTLP_[TRACES_]INSECURE=false`` (the HTTP exporter does not read it)."""
    https = (endpoint or "").strip().lower().startswith("https://")
    if protocol != "grpc":
        return https
    name, flag = _first_set(env, "OTEL_EXPORTER_OTLP_TRACES_INSECURE", "OTEL_EXPORTER_OTLP_INSECURE")
    if flag is not None and flag.strip().lower() not in ("true", "false"):  # "0", "no", "flase": plaintext before
        raise ValueError(f"{name}={flag!r} is not accepted: expected true (plaintext gRPC) or false (TLS)")
    return https or (flag or "").strip().lower() == "false"


def _check_tls_files(env: Mapping[str, str], protocol: str) -> None:
    """The certificate and key files the exporter reads itself (the traces variable where set, else the general
    one), where a missing one is dropped (gRPC: with a logged traceback, and the default certificates used).
    gRPC reads each as a file; the HTTP exporter hands the certificate to requests, which takes a folder of them."""
    for kind in ("CERTIFICATE", "CLIENT_KEY", "CLIENT_CERTIFICATE"):
        name, path = _first_set(env, f"OTEL_EXPORTER_OTLP_TRACES_{kind}", f"OTEL_EXPORTER_OTLP_{kind}")
        if path is None:
            continue
        folder_too = protocol != "grpc" and kind == "CERTIFICATE"
        if not (os.access(path, os.R_OK) and (os.path.isfile(path) or folder_too and os.path.isdir(path))):
            what = "file or folder" if folder_too else "file"
            raise ValueError(f"{name}={path!r} is not accepted: no readable {what} there; expected the path of a "
                             "PEM file")


def _check_endpoint(name: str, endpoint: str, protocol: str) -> None:
    schemes = _URL_SCHEMES[protocol]
    accepted = " or ".join(f"{scheme}://host:port" for scheme in schemes)
    if protocol == "grpc":
        accepted += ", host:port, or a gRPC target (unix:///path, dns:///host:port)"
    problem = None
    scheme = endpoint.partition(":")[0].lower()
    if any(c.isspace() for c in endpoint):
        problem = "it holds a space"
    elif protocol == "grpc" and scheme in _GRPC_TARGET_SCHEMES:
        if not endpoint.partition(":")[2].lstrip("/"):
            problem = "it names no target"
        elif host := urlsplit(endpoint).netloc:  # the exporter would keep only this part (dns://8.8.8.8/x)
            problem = f"the gRPC exporter would send to {host!r} alone (write {scheme}:///... with three slashes)"
    elif "://" not in endpoint:
        match = _HOST_PORT.fullmatch(endpoint)
        if protocol != "grpc" or match is None:
            problem = f"it has no {' or '.join(s + '://' for s in schemes)} scheme"
        elif not 0 < int(match.group(1)) < 65536:
            problem = "its port is not 1..65535"
    else:
        try:
            parts = urlsplit(endpoint)
            port = parts.port  # raises for a port out of range or not a number
        except ValueError as exc:
            problem = str(exc)
        else:
            if parts.scheme.lower() not in schemes:
                problem = f"its scheme is {parts.scheme!r}"
            elif not parts.hostname:
                problem = "it names no host"
            elif port == 0:
                problem = "its port is 0"
    if problem:
        raise ValueError(f"{name}={endpoint!r} is not accepted for OTLP {protocol}: {problem}; expected {accepted}")


def _check_headers(name: str, raw: str | None) -> None:
    for position, item in enumerate((raw or "").split(","), 1):
        key, sep, value = item.partition("=")
        if item.strip() and not (sep and key.strip()):
            raise ValueError(f"{name}: its entry {position} is not key=value (the value is not shown: it may "
                             "be a credential); expected key=value pairs separated by commas, percent-encoded")
        if item.strip() and (not _HEADER_NAME.fullmatch(unquote(key.strip())) or
                             any(c in unquote(value.strip()) for c in "\r\n\0")):
            raise ValueError(f"{name}: its entry {position} has a header name or value no HTTP or gRPC request "
                             "can carry (the value is not shown: it may be a credential); expected a name of "
                             "letters, digits and !#$%&'*+-.^_`|~, and a value without line breaks")


def exporter_warnings(env: Mapping[str, str]) -> list[str]:
    """OTEL_TRACES_EXPORTER names kvscope does not export to (it is not refused: other components of
    the process may read the same variable)."""
    names = [n.strip().lower() for n in (env.get("OTEL_TRACES_EXPORTER") or "").split(",") if n.strip()]
    ignored = [n for n in names if n not in EXPORTERS]
    if not ignored:
        return []
    return [f"kvscope: OTEL_TRACES_EXPORTER names {', '.join(map(repr, ignored))}, which kvscope does not "
            f"export to (accepted: {', '.join(map(repr, EXPORTERS))}); its spans go over OTLP or to trace_file only"]


def sampler_from_env(env: Mapping[str, str], default: float = 1.0) -> tuple[float, str]:
    """The ratio OTEL_TRACES_SAMPLER (and its _ARG) asks for, ``default`` where it is not set, and how it
    treats a sampled remote parent (``REMOTE_PARENT_*``). kvscope's `trace_sample_ratio`, when given,
    wins; this is read only without it."""
    raw = env.get("OTEL_TRACES_SAMPLER")
    if not raw or not raw.strip():
        return default, REMOTE_PARENT_AND_RATIO
    name = raw.strip().lower()
    if name not in SAMPLERS:
        raise ValueError(f"OTEL_TRACES_SAMPLER={raw!r} is not accepted by kvscope: accepted are "
                         f"{', '.join(SAMPLERS)} (or leave it out and set trace_sample_ratio)")
    ratio, remote_parent = SAMPLERS[name]
    if ratio is not None:
        return ratio, remote_parent
    arg = env.get("OTEL_TRACES_SAMPLER_ARG")
    if arg is None or not arg.strip():
        return 1.0, remote_parent  # the specification's default
    try:
        ratio = float(arg)
    except ValueError:
        ratio = float("nan")
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"OTEL_TRACES_SAMPLER_ARG={arg!r} is not accepted for {name}: expected a number from 0 to 1")
    return ratio, remote_parent
