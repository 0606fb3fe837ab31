"""`kv_connector_extra_config` parsing: every bad key or value stops start-up with a clear message."""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


class ConfigError(ValueError):
    """A `kv_connector_extra_config` key or value that kvscope does not accept."""


# More host slots than any host could hold (the scheduler's index has one entry per slot); the
# workers check the tier against their host's memory.
MAX_HOST_SLOTS = 1 << 32


@dataclass(frozen=True, slots=True)
class KVScopeConfig:
    cpu_bytes: int
    block_size: int | None = None  # tokens per offloaded block; None: the device block size
    trace_file: str | None = None
    trace_sample_ratio: float | None = None
    metrics_port: int | None = None  # offline runs: serve /metrics on this port
    # also store the Mamba states decode steps leave at block ends (a conversation's next turn loads past
    # its previous prompt); False: only states a prefill computed, as vLLM's own prefix cache keeps them
    # (`state_blocks`), so that loads give a recompute's outputs
    mamba_decode_states: bool = False

    def offload_block_size(self, device_block_sizes: Sequence[int], hash_block_size: int | None = None,
                           max_model_len: int | None = None,
                           checkpointed_state_block_sizes: Sequence[int] = ()) -> tuple[int, str | None]:
        """Tokens per offloaded block, from `block_size` or else the groups' device block sizes, and a
        warning (or None). It must be a multiple of every group's device block size and of vLLM's
        prefix-cache hash block size (an offloaded block's key is the hash of its last hash block),
        shorter than ``max_model_len`` (the last token's KV is never computed: no longer block fills),
        and no longer than the state block of a Mamba group whose states vLLM keeps only at its
        checkpoints (``checkpointed_state_block_sizes``: `prefix_cache_retention_interval` not None).
        An offloaded block is stored only when every device block in it holds its state, which a
        checkpointed group never has past one block, and a hit needs the Mamba state."""
        lcm = math.lcm(*device_block_sizes)
        block_size = lcm if self.block_size is None else self.block_size
        if block_size % lcm:
            raise ConfigError(
                f"kv_connector_extra_config.block_size={block_size} is not accepted: it must "
                f"be a multiple of every KV group's device block size {sorted(set(device_block_sizes))}"
                f" (e.g. {lcm}, {2 * lcm}, ...)"
            )
        if hash_block_size and block_size % hash_block_size:
            raise ConfigError(
                f"kv_connector_extra_config.block_size={block_size} is not accepted: it must be a "
                f"multiple of vLLM's prefix-cache hash block size {hash_block_size}"
            )
        finer = sorted({size for size in checkpointed_state_block_sizes if size < block_size})
        if finer:
            useless = (f"an offloaded block of {block_size} tokens spans several Mamba state blocks of {finer[0]} "
                       "tokens, and vLLM keeps a Mamba state only at its checkpoints (its "
                       "prefix_cache_retention_interval is set), so no offloaded block would ever hold all its "
                       "states and no request would ever be served")
            if self.block_size is not None:
                accepted = (f"block_size {finer[0]} (the Mamba state block)" if finer[0] % lcm == 0 else
                            "no block_size with these KV groups")
                raise ConfigError(f"kv_connector_extra_config.block_size={block_size} is not accepted: {useless}; "
                                  f"expected {accepted}, or vLLM keeping every state "
                                  "(prefix_cache_retention_interval None)")
            return block_size, (f"kvscope: {useless} (the block size follows the KV groups' device block sizes; "
                                "vLLM keeping every state, prefix_cache_retention_interval None, would serve)")
        if max_model_len and block_size >= max_model_len:
            useless = (f"no request of this engine (max_model_len {max_model_len}) fills an offloaded block of "
                       f"{block_size} tokens, so nothing would ever be stored")
            if self.block_size is not None:
                raise ConfigError(f"kv_connector_extra_config.block_size={block_size} is not accepted: {useless}; "
                                  f"expected fewer than {max_model_len} tokens")
            return block_size, f"kvscope: {useless} (the block size follows the KV groups' device block sizes)"
        return block_size, None

    def host_slots(self, slot_bytes: int) -> int:
        """How many offloaded blocks of ``slot_bytes`` the tier of `cpu_bytes` holds (at least one, and
        no more than an index could keep)."""
        num_slots = self.cpu_bytes // slot_bytes
        if num_slots < 1:
            raise ConfigError(
                f"kv_connector_extra_config.cpu_bytes={self.cpu_bytes} is not accepted: one "
                f"offloaded block of this model needs {slot_bytes} bytes; use at least that"
            )
        if num_slots > MAX_HOST_SLOTS:
            raise ConfigError(
                f"kv_connector_extra_config.cpu_bytes={self.cpu_bytes} is not accepted: it gives "
                f"{num_slots} host slots of {slot_bytes} bytes; expected at most {MAX_HOST_SLOTS} slots' worth")
        return num_slots


_ACCEPTED = {
    "cpu_bytes": ("an integer number of bytes > 0 (required; in --kv-transfer-config vLLM expands an "
                  "unquoted 8G to GiB and 8g to GB, not a quoted \"8G\")"),
    "block_size": "a positive integer number of tokens, a multiple of the device block size",
    "trace_file": "a path (string) of a file to append OTLP/JSON lines to (missing folders are made)",
    "trace_sample_ratio": "a number between 0 and 1",
    "metrics_port": "a TCP port 1..65535 to serve Prometheus metrics on (offline runs)",
    "mamba_decode_states": ("false (store only the Mamba states a prefill computed, as vLLM's prefix cache "
                            "keeps them: the default) or true (also those decode steps leave)"),
}


def _bad(key: str, value: Any) -> ConfigError:
    return ConfigError(
        f"kv_connector_extra_config.{key}={value!r} is not accepted: expected {_ACCEPTED[key]}"
    )


def _positive_int(key: str, value: Any, upper: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise _bad(key, value)
    try:
        number = int(value)
    except ValueError:
        raise _bad(key, value) from None
    if number <= 0 or (upper is not None and number > upper):
        raise _bad(key, value)
    return number


# A "file name" that is one of these was meant to turn something off (or on), not to name a file
_SWITCH_WORDS = frozenset({"false", "true", "none", "null", "off", "on", "no", "yes", "0", "1", "disabled"})


def _writable_file(key: str, value: Any) -> str:
    """A file path the engine can append to (``~`` expanded): checked at start-up, because a sink
    that cannot write is otherwise only noticed, by a warning, when the first spans are lost."""
    if not isinstance(value, str) or not value.strip() or "\0" in value:
        raise _bad(key, value)
    try:
        os.fsencode(value)
    except UnicodeEncodeError as exc:  # a lone surrogate (valid JSON): no file system name holds it
        raise ConfigError(f"kv_connector_extra_config.{key}={value!r} is not accepted: {exc.reason} at character "
                          f"{exc.start}; expected {_ACCEPTED[key]}") from None
    if value.strip().lower() in _SWITCH_WORDS:
        raise ConfigError(f"kv_connector_extra_config.{key}={value!r} is not accepted: it reads as a switch, not a "
                          f"file name (for no file, leave {key} out); expected {_ACCEPTED[key]}")
    if value != value.strip():  # " /tmp/t.jsonl" would be a folder " " in the working directory
        raise ConfigError(f"kv_connector_extra_config.{key}={value!r} is not accepted: it starts or ends with "
                          f"white space; expected {_ACCEPTED[key]}")
    if value.endswith(("/", os.sep)) or os.path.basename(value) in (".", ".."):
        raise ConfigError(f"kv_connector_extra_config.{key}={value!r} is not accepted: it names a folder; "
                          f"expected {_ACCEPTED[key]}")
    path = os.path.expanduser(value)
    if path.startswith("~"):  # ~user of no such user: it would be a folder "~user" in the working directory
        raise ConfigError(f"kv_connector_extra_config.{key}={value!r} is not accepted: "
                          f"{path.split(os.sep, 1)[0]} names no user's home here; expected {_ACCEPTED[key]}")
    existing = os.path.dirname(os.path.abspath(path))  # missing folders are made at the first write
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    too_long = _name_too_long(existing, os.path.relpath(os.path.abspath(path), existing))
    if os.path.isdir(path):
        problem = "it is a folder"
    elif not os.path.isdir(existing):
        problem = f"{existing} is a file, not a folder"
    elif too_long:
        problem = too_long
    elif not (os.access(path, os.W_OK) if os.path.exists(path) else _can_create_in(existing)):
        problem = "it cannot be written by this process"
    else:
        return path
    raise ConfigError(f"kv_connector_extra_config.{key}={value!r} is not accepted: {problem}; "
                      f"expected {_ACCEPTED[key]}")


def _can_create_in(folder: str) -> bool:
    """Whether this process can create a file in ``folder``: tried (and removed at once), since
    ``os.access`` says yes to root everywhere, /proc and read-only mounts included."""
    import tempfile

    try:
        fd, name = tempfile.mkstemp(prefix=".kvscope-probe-", dir=folder)
    except OSError:
        return False
    os.close(fd)
    try:
        os.unlink(name)
    except OSError:
        pass
    return True


def _name_too_long(folder: str, below: str) -> str | None:
    """Which name of the path ``below`` the existing ``folder`` its file system cannot take, if any."""
    try:
        limit = os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return None
    for name in below.split(os.sep):
        if len(os.fsencode(name)) > limit:
            return (f"the name {name[:16]}... is {len(os.fsencode(name))} bytes, longer than the {limit} its "
                    "file system takes")
    return None


def check_host_memory(tier_bytes: int, local_workers: int, physical_bytes: int | None,
                      available_bytes: int | None = None) -> str | None:
    """Refuse a host tier larger than this host's memory (it could never be allocated: the engine
    would fail after loading the model, or be killed once the tier fills). Return a warning when
    the tiers of every worker on this host together exceed it (an estimate: a multi-node engine
    vLLM is not told about counts every worker as local; other engines on the host are not seen).
    ``tier_bytes`` is one worker's tier."""
    if physical_bytes is None:
        return None
    if tier_bytes > physical_bytes:
        raise ConfigError(
            f"kv_connector_extra_config.cpu_bytes gives a host tier of {tier_bytes} bytes per worker, more "
            f"than this host's {physical_bytes} bytes of memory; expected {_ACCEPTED['cpu_bytes']}, per "
            "worker, that fits in host memory beside the engine")
    if tier_bytes * local_workers > physical_bytes:
        return (f"kvscope: {local_workers} workers on this host with a host tier of {tier_bytes} bytes each "
                f"need {tier_bytes * local_workers} bytes, more than this host's {physical_bytes}: lower "
                "kv_connector_extra_config.cpu_bytes (it is per worker)")
    if available_bytes is not None and tier_bytes * local_workers > available_bytes:
        # The tier's pages are taken as it fills, not at start-up: the shortage shows hours later
        return (f"kvscope: the host tiers of this host's {local_workers} worker(s) need "
                f"{tier_bytes * local_workers} bytes, more than the {available_bytes} available now: as they "
                "fill, the host may run out of memory; lower kv_connector_extra_config.cpu_bytes (it is per worker)")
    return None


def available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def physical_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # not a POSIX system that tells
        return None


def _sample_ratio(ratio: Any) -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
        raise _bad("trace_sample_ratio", ratio)
    try:
        in_range = 0.0 <= float(ratio) <= 1.0  # False for NaN
    except OverflowError:  # an int too large for a float
        in_range = False
    if not in_range:
        raise _bad("trace_sample_ratio", ratio)
    return float(ratio)


def parse_config(extra: Mapping[str, Any] | None) -> KVScopeConfig:
    """The connector's config from ``kv_connector_extra_config``; a `ConfigError` names every problem
    at once (an operator whose engine takes a minute to load the model fixes them in one go)."""
    extra = dict(extra or {})
    problems: list[str] = []

    def checked(check, *args):
        try:
            return check(*args)
        except ConfigError as exc:
            problems.append(str(exc))
            return None

    unknown = sorted(set(extra) - set(_ACCEPTED))
    if unknown:
        problems.append(
            "kv_connector_extra_config has unknown key(s) "
            + ", ".join(f"{k}={extra[k]!r}{_did_you_mean(k)}" for k in unknown)
            + "; accepted keys: "
            + ", ".join(f"{k} ({v})" for k, v in _ACCEPTED.items())
        )
    cpu_bytes = None
    if "cpu_bytes" not in extra:
        problems.append("kv_connector_extra_config.cpu_bytes is missing: expected " + _ACCEPTED["cpu_bytes"])
    else:
        cpu_bytes = checked(_positive_int, "cpu_bytes", extra["cpu_bytes"])
    block_size = extra.get("block_size")
    if block_size is not None:
        block_size = checked(_positive_int, "block_size", block_size)
    trace_file = extra.get("trace_file")
    if trace_file is not None:
        trace_file = checked(_writable_file, "trace_file", trace_file)
    ratio = extra.get("trace_sample_ratio")
    if ratio is not None:
        ratio = checked(_sample_ratio, ratio)
    port = extra.get("metrics_port")
    if port is not None:
        port = checked(_positive_int, "metrics_port", port, 65535)
    decode_states = extra.get("mamba_decode_states")
    if decode_states is None:
        decode_states = False
    elif not isinstance(decode_states, bool):  # a string "false" would read as true
        problems.append(str(_bad("mamba_decode_states", decode_states)))
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"kv_connector_extra_config has {len(problems)} problems:\n- " + "\n- ".join(problems))
    return KVScopeConfig(
        cpu_bytes=cpu_bytes,
        block_size=block_size,
        trace_file=trace_file,
        trace_sample_ratio=ratio,
        metrics_port=port,
        mamba_decode_states=decode_states,
    )


def _did_you_mean(key) -> str:
    """`` (did you mean block_size?)`` for a misspelt accepted key (``blok_size``, ``Block-Size``), else ``""``."""
    close = difflib.get_close_matches(str(key).lower().replace("-", "_"), list(_ACCEPTED), n=1, cutoff=0.75)
    return f" (did you mean {close[0]}?)" if close else ""
