"""`kv_connector_extra_config` parsing: valid configs parse; every bad one names key, value, and what is accepted."""

from __future__ import annotations

import math

import pytest

from connector.config import _ACCEPTED, ConfigError, KVScopeConfig, parse_config

GIB = 1 << 30


def _error(extra) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(extra)
    assert isinstance(info.value, ValueError)  # callers may catch ValueError
    return str(info.value)


def _assert_names(message: str, key: str, value) -> None:
    assert f"kv_connector_extra_config.{key}" in message
    assert repr(value) in message, message
    assert _ACCEPTED[key] in message, message


# --- valid --------------------------------------------------------------------------------------


def test_minimal_config():
    cfg = parse_config({"cpu_bytes": GIB})
    assert cfg == KVScopeConfig(cpu_bytes=GIB)
    assert cfg.block_size is None and cfg.trace_file is None
    assert cfg.trace_sample_ratio is None and cfg.metrics_port is None
    assert cfg.mamba_decode_states is False


def test_full_config():
    cfg = parse_config(
        {
            "cpu_bytes": 4 * GIB,
            "block_size": 64,
            "trace_file": "/tmp/trace.jsonl",
            "trace_sample_ratio": 0.25,
            "metrics_port": 9400,
            "mamba_decode_states": True,
        }
    )
    assert cfg == KVScopeConfig(4 * GIB, 64, "/tmp/trace.jsonl", 0.25, 9400, mamba_decode_states=True)


@pytest.mark.parametrize("raw, parsed", [("1073741824", GIB), (" 42 ", 42), ("1_000", 1000), (1, 1)])
def test_cpu_bytes_int_strings_accepted(raw, parsed):
    cfg = parse_config({"cpu_bytes": raw})
    assert cfg.cpu_bytes == parsed and type(cfg.cpu_bytes) is int


def test_other_int_keys_accept_strings():
    cfg = parse_config({"cpu_bytes": "8", "block_size": "32", "metrics_port": "8080"})
    assert (cfg.block_size, cfg.metrics_port) == (32, 8080)


@pytest.mark.parametrize("ratio", [0, 1, 0.0, 1.0, 0.5])
def test_trace_sample_ratio_bounds_inclusive(ratio):
    cfg = parse_config({"cpu_bytes": 1, "trace_sample_ratio": ratio})
    assert cfg.trace_sample_ratio == float(ratio) and type(cfg.trace_sample_ratio) is float


@pytest.mark.parametrize("port", [1, 65535])
def test_metrics_port_bounds_inclusive(port):
    assert parse_config({"cpu_bytes": 1, "metrics_port": port}).metrics_port == port


def test_explicit_none_means_default():
    cfg = parse_config(
        {"cpu_bytes": 1, "block_size": None, "trace_file": None, "trace_sample_ratio": None, "metrics_port": None,
         "mamba_decode_states": None}
    )
    assert cfg == KVScopeConfig(cpu_bytes=1)


def test_input_mapping_not_mutated():
    extra = {"cpu_bytes": "16"}
    parse_config(extra)
    assert extra == {"cpu_bytes": "16"}


# --- cpu_bytes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [None, {}, {"block_size": 16}])
def test_missing_cpu_bytes(extra):
    message = _error(extra)
    assert "kv_connector_extra_config.cpu_bytes" in message and "missing" in message
    assert _ACCEPTED["cpu_bytes"] in message


@pytest.mark.parametrize(
    "value", [0, -1, -GIB, True, False, "abc", "", "1.5", "0", "-5", 1.5, 1e9, float(GIB), None, [1], {"a": 1}]
)
def test_bad_cpu_bytes(value):
    _assert_names(_error({"cpu_bytes": value}), "cpu_bytes", value)


def test_huge_digit_string_is_a_config_error():
    # int() refuses > 4300 digits with ValueError: must surface as a ConfigError, not crash.
    message = _error({"cpu_bytes": "9" * 5000})
    assert "kv_connector_extra_config.cpu_bytes" in message


# --- unknown keys -------------------------------------------------------------------------------


def test_unknown_key_lists_accepted_keys():
    message = _error({"cpu_bytes": GIB, "cpu_byte": 5})
    assert "cpu_byte=5" in message  # the key and its value
    for key, accepted in _ACCEPTED.items():
        assert key in message and accepted in message


def test_unknown_keys_all_named_and_reported_before_other_errors():
    message = _error({"zeta": 1, "alpha": 2})  # cpu_bytes missing too: unknown keys come first
    assert "alpha=2, zeta=1" in message
    assert message.index("unknown key(s)") < message.index("cpu_bytes is missing")


def test_every_problem_is_named_at_once():
    """One at a time, each fix cost an operator another engine start (the model loads first)."""
    message = _error({"cpu_bytes": "8G", "trace_sampel_ratio": 0.5, "block_size": 0, "metrics_port": 70000,
                      "trace_sample_ratio": 2})
    assert message.startswith("kv_connector_extra_config has 5 problems:\n- ")
    assert "trace_sampel_ratio=0.5" in message
    for key, value in (("cpu_bytes", "8G"), ("block_size", 0), ("metrics_port", 70000), ("trace_sample_ratio", 2)):
        _assert_names(message, key, value)


# --- mamba_decode_states -------------------------------------------------------------------------
@pytest.mark.parametrize("value", [True, False])
def test_mamba_decode_states_takes_json_booleans(value):
    assert parse_config({"cpu_bytes": 1, "mamba_decode_states": value}).mamba_decode_states is value


@pytest.mark.parametrize("value", ["false", "true", 0, 1, "off", [], {}])
def test_mamba_decode_states_refuses_anything_but_a_boolean(value):
    """A string "false" is truthy: taken as given it would store what the operator meant to keep out."""
    message = _error({"cpu_bytes": 1, "mamba_decode_states": value})
    _assert_names(message, "mamba_decode_states", value)
    assert "true" in message and "false" in message


# --- block_size ---------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -16, True, "x", 16.0, "16.0"])
def test_bad_block_size(value):
    _assert_names(_error({"cpu_bytes": 1, "block_size": value}), "block_size", value)


def test_offload_block_size_default_is_lcm():
    cfg = parse_config({"cpu_bytes": 1})
    assert cfg.offload_block_size([16]) == (16, None)
    assert cfg.offload_block_size([16, 64, 32]) == (64, None)
    assert cfg.offload_block_size([48, 32]) == (96, None)


@pytest.mark.parametrize("block_size, sizes", [(64, [16]), (128, [16, 64]), (96, [32, 48]), (192, [32, 48])])
def test_offload_block_size_multiple_accepted(block_size, sizes):
    assert parse_config({"cpu_bytes": 1, "block_size": block_size}).offload_block_size(sizes) == (block_size, None)


@pytest.mark.parametrize("block_size, sizes", [(48, [16, 32]), (8, [16]), (64, [32, 48]), (100, [16, 16, 64])])
def test_offload_block_size_not_a_multiple(block_size, sizes):
    cfg = parse_config({"cpu_bytes": 1, "block_size": block_size})
    with pytest.raises(ConfigError) as info:
        cfg.offload_block_size(sizes)
    message = str(info.value)
    assert f"kv_connector_extra_config.block_size={block_size}" in message
    assert str(sorted(set(sizes))) in message
    assert str(math.lcm(*sizes)) in message  # a valid example


def test_an_offload_block_size_must_be_a_multiple_of_vllms_hash_block_size():
    assert parse_config({"cpu_bytes": 1, "block_size": 64}).offload_block_size([16], hash_block_size=32) == (64, None)
    with pytest.raises(ConfigError, match=r"block_size=48 is not accepted: .* prefix-cache hash block size 32"):
        parse_config({"cpu_bytes": 1, "block_size": 48}).offload_block_size([16], hash_block_size=32)


def test_an_offloaded_block_no_request_can_fill_is_refused_when_asked_for_and_said_when_derived():
    """The last token's KV is never computed: a block of max_model_len tokens never fills."""
    with pytest.raises(ConfigError, match=r"block_size=2048 is not accepted: no request .* fewer than 2048 tokens"):
        parse_config({"cpu_bytes": 1, "block_size": 2048}).offload_block_size([16], 16, max_model_len=2048)
    block_size, warning = parse_config({"cpu_bytes": 1}).offload_block_size([2048], 16, max_model_len=2048)
    assert block_size == 2048 and "nothing would ever be stored" in warning
    assert parse_config({"cpu_bytes": 1}).offload_block_size([16], 16, max_model_len=2048) == (16, None)


def test_an_offloaded_block_spanning_checkpointed_mamba_states_is_refused_when_asked_for_and_said_when_derived():
    """vLLM keeps a checkpointed Mamba group's states only at some block ends: an offloaded block
    of several state blocks never holds all of them, so nothing would be stored or served."""
    with pytest.raises(ConfigError, match=r"block_size=32 is not accepted: .* Mamba state blocks of 16 tokens.*"
                                          r"expected block_size 16 \(the Mamba state block\), or vLLM keeping every"):
        parse_config({"cpu_bytes": 1, "block_size": 32}).offload_block_size([16, 16], 16,
                                                                            checkpointed_state_block_sizes=[16])
    with pytest.raises(ConfigError, match=r"expected no block_size with these KV groups, or vLLM keeping every"):
        parse_config({"cpu_bytes": 1, "block_size": 64}).offload_block_size([32, 16], 16,
                                                                            checkpointed_state_block_sizes=[16])
    block_size, warning = parse_config({"cpu_bytes": 1}).offload_block_size([32, 16], 16,
                                                                           checkpointed_state_block_sizes=[16])
    assert block_size == 32 and "no request would ever be served" in warning
    # one state block per offloaded block, or states at every block end (not checkpointed): accepted
    assert parse_config({"cpu_bytes": 1, "block_size": 64}).offload_block_size(
        [16, 64], 16, checkpointed_state_block_sizes=[64]) == (64, None)
    assert parse_config({"cpu_bytes": 1, "block_size": 64}).offload_block_size([16, 16], 16) == (64, None)


def test_the_host_tier_holds_at_least_one_offloaded_block_and_no_more_than_an_index_can_keep():
    from connector.config import MAX_HOST_SLOTS

    assert parse_config({"cpu_bytes": 10_000}).host_slots(3000) == 3
    with pytest.raises(ConfigError, match=r"cpu_bytes=1000 is not accepted: one offloaded block .* needs 3000 bytes"):
        parse_config({"cpu_bytes": 1000}).host_slots(3000)
    with pytest.raises(ConfigError, match=rf"gives {MAX_HOST_SLOTS + 1} host slots of 1 bytes"):
        parse_config({"cpu_bytes": MAX_HOST_SLOTS + 1}).host_slots(1)


# --- trace_sample_ratio -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value", [-0.01, 1.01, 2, -1, float("nan"), float("inf"), float("-inf"), True, False, "0.5", [0.5]]
)
def test_bad_trace_sample_ratio(value):
    message = _error({"cpu_bytes": 1, "trace_sample_ratio": value})
    _assert_names(message, "trace_sample_ratio", value)


# --- metrics_port -------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, 70000, 65536, -1, True, "http", 80.0])
def test_bad_metrics_port(value):
    _assert_names(_error({"cpu_bytes": 1, "metrics_port": value}), "metrics_port", value)


# --- trace_file ---------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["", "   ", 5, b"/tmp/x", ["/tmp/x"]])
def test_bad_trace_file(value):
    _assert_names(_error({"cpu_bytes": 1, "trace_file": value}), "trace_file", value)


@pytest.mark.parametrize("name, said", [
    ("new.jsonl/.", "it names a folder"), ("newdir/..", "it names a folder"),
    (" {dir}/t.jsonl", "it starts or ends with white space"), ("{dir}/t.jsonl\n", "it starts or ends with white space"),
    ("~nosuchuser_kvscope/t.jsonl", "~nosuchuser_kvscope names no user's home here"),
])
def test_a_trace_file_that_would_lose_its_spans_or_land_elsewhere_is_refused(tmp_path, name, said):
    """Accepted before: "x/." failed at the first write (every span lost), " /tmp/t.jsonl" wrote a folder " " in the
    working directory, "~nosuchuser/t.jsonl" a folder "~nosuchuser"."""
    value = name.format(dir=tmp_path) if "{dir}" in name else (name if name.startswith("~") else f"{tmp_path}/{name}")
    message = _error({"cpu_bytes": 1, "trace_file": value})
    _assert_names(message, "trace_file", value)
    assert said in message, message


def test_a_trace_file_that_cannot_be_written_stops_start_up(tmp_path):
    """A folder, or a path through a file: said at start-up, naming the key, not by a warning when
    the first spans are lost."""
    folder = str(tmp_path)
    message = _error({"cpu_bytes": 1, "trace_file": folder})
    _assert_names(message, "trace_file", folder)
    assert "it is a folder" in message
    message = _error({"cpu_bytes": 1, "trace_file": str(tmp_path / "new") + "/"})
    assert "it names a folder" in message
    (tmp_path / "a-file").write_text("")
    under_a_file = str(tmp_path / "a-file" / "deeper" / "t.jsonl")
    message = _error({"cpu_bytes": 1, "trace_file": under_a_file})
    _assert_names(message, "trace_file", under_a_file)
    assert f"{tmp_path / 'a-file'} is a file, not a folder" in message
    for fine in (tmp_path / "t.jsonl", tmp_path / "new" / "folders" / "t.jsonl"):  # folders made at the first write
        assert parse_config({"cpu_bytes": 1, "trace_file": str(fine)}).trace_file == str(fine)


@pytest.mark.parametrize("below", ["x" * 300, "y" * 300 + "/t.jsonl"])
def test_a_trace_file_name_longer_than_its_file_system_takes_stops_start_up(tmp_path, below):
    message = _error({"cpu_bytes": 1, "trace_file": str(tmp_path / below)})
    _assert_names(message, "trace_file", str(tmp_path / below))
    assert "is 300 bytes, longer than the 255 its file system takes" in message


def test_a_trace_file_under_home_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert parse_config({"cpu_bytes": 1, "trace_file": "~/kvscope.jsonl"}).trace_file == str(tmp_path / "kvscope.jsonl")


def test_a_trace_file_path_with_a_nul_byte_is_refused():
    with pytest.raises(ConfigError, match="trace_file="):
        parse_config({"cpu_bytes": 1, "trace_file": "/tmp/a\x00b"})


def test_a_sample_ratio_too_large_for_a_float_is_a_config_error():
    with pytest.raises(ConfigError, match="trace_sample_ratio=.*a number between 0 and 1"):
        parse_config({"cpu_bytes": 1, "trace_sample_ratio": 10**400})


def test_a_host_tier_beyond_host_memory_is_refused_and_several_workers_beyond_it_warned():
    from connector.config import check_host_memory

    with pytest.raises(ConfigError, match="cpu_bytes gives a host tier of 101 bytes per worker, more than this host's 100"):
        check_host_memory(101, 1, 100)
    assert check_host_memory(100, 1, 100) is None
    warning = check_host_memory(40, 3, 100)
    assert "3 workers on this host" in warning and "120 bytes" in warning and "per worker" in warning
    assert check_host_memory(10**30, 8, None) is None  # memory unknown: nothing to compare with


# --- found by the mutation campaign of config.py ------------------------------------------------


def test_a_tier_of_exactly_one_block_holds_it_and_the_index_takes_exactly_2_to_the_32_slots():
    from connector.config import MAX_HOST_SLOTS

    assert parse_config({"cpu_bytes": 3000}).host_slots(3000) == 1  # one block is enough
    assert parse_config({"cpu_bytes": 5999}).host_slots(3000) == 1
    assert MAX_HOST_SLOTS == 1 << 32
    assert parse_config({"cpu_bytes": 1 << 32}).host_slots(1) == 1 << 32


def test_physical_memory_is_the_memory_the_kernel_reports():
    """The tier is checked against it: a wrong size (or None) would let a tier larger than the host start."""
    from connector.config import physical_memory_bytes

    meminfo = {}
    try:
        with open("/proc/meminfo") as f:
            meminfo = dict(line.split(":", 1) for line in f)
    except OSError:
        pytest.skip("no /proc/meminfo")
    total_kib = int(meminfo["MemTotal"].split()[0])
    assert physical_memory_bytes() == total_kib * 1024


def test_a_trace_file_in_a_folder_this_process_cannot_write_stops_start_up():
    import os

    folder = "/proc"  # no file can be made there, even by root (whom os.access tells otherwise)
    if not os.path.isdir(folder):
        pytest.skip("needs /proc")
    path = f"{folder}/kvscope/trace.jsonl"
    message = _error({"cpu_bytes": 1, "trace_file": path})
    _assert_names(message, "trace_file", path)
    assert "it cannot be written by this process" in message


def test_a_trace_file_on_a_file_system_that_does_not_tell_its_name_limit_is_accepted(tmp_path, monkeypatch):
    import os

    def no_limit(path, name):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "pathconf", no_limit)
    path = str(tmp_path / ("z" * 300))  # only the file system could refuse it: not checked here
    assert parse_config({"cpu_bytes": 1, "trace_file": path}).trace_file == path


def test_a_trace_file_no_file_system_can_name_is_one_of_the_problems_named():
    """A lone surrogate (valid JSON) raised UnicodeEncodeError out of the check, hiding the other problems."""
    message = _error({"cpu_bytes": 0, "trace_file": "/tmp/x\ud800.jsonl"})
    assert "2 problems" in message and "surrogates not allowed at character 6" in message
    _assert_names(message, "cpu_bytes", 0)


def test_the_mamba_advice_names_the_smallest_checkpointed_state_block():
    """With several checkpointed groups finer than the offloaded block, only a block no longer than the
    smallest state block holds every state; advising a larger one would be refused again."""
    with pytest.raises(ConfigError, match=r"Mamba state blocks of 16 tokens.* expected block_size 16 \(the Mamba"):
        parse_config({"cpu_bytes": 1, "block_size": 64}).offload_block_size([16], 16,
                                                                            checkpointed_state_block_sizes=[32, 16])
    # 16 is no multiple of the 32-token device block: no block size serves (32 would span two 16-token states)
    with pytest.raises(ConfigError, match=r"expected no block_size with these KV groups"):
        parse_config({"cpu_bytes": 1, "block_size": 64}).offload_block_size([16, 32], 16,
                                                                            checkpointed_state_block_sizes=[32, 16])


def test_a_block_one_token_shorter_than_max_model_len_is_accepted_and_a_longer_one_refused_naming_the_limit():
    assert parse_config({"cpu_bytes": 1, "block_size": 16}).offload_block_size([16], 16, max_model_len=17) == (16, None)
    with pytest.raises(ConfigError, match=r"block_size=4096 is not accepted: .* expected fewer than 2048 tokens"):
        parse_config({"cpu_bytes": 1, "block_size": 4096}).offload_block_size([16], 16, max_model_len=2048)


def test_an_existing_trace_file_is_accepted_for_appending(tmp_path):
    """Restarts append to the same file: an existing writable file is no "file, not a folder"."""
    existing = tmp_path / "t.jsonl"
    existing.write_text('{"earlier": "spans"}\n')
    assert parse_config({"cpu_bytes": 1, "trace_file": str(existing)}).trace_file == str(existing)


def test_an_existing_trace_file_is_checked_for_writing_itself_not_its_folder():
    """/proc/self/comm can be written, but no file can be made in /proc/self (not even by root, for whom
    folder permissions would not tell the two apart). Not a claim that /proc makes a good trace file."""
    import os

    if not os.path.exists("/proc/self/comm"):
        pytest.skip("needs /proc")
    assert parse_config({"cpu_bytes": 1, "trace_file": "/proc/self/comm"}).trace_file == "/proc/self/comm"


def test_the_write_probe_leaves_no_file_and_no_open_descriptor_behind(tmp_path):
    """Each check creates and removes a probe file: a leftover would litter the trace folder, and an
    open descriptor per check would leak (`kvscope check`, each engine start)."""
    import os

    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd")
    open_before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        parse_config({"cpu_bytes": 1, "trace_file": str(tmp_path / "t.jsonl")})
    assert list(tmp_path.iterdir()) == []
    assert len(os.listdir("/proc/self/fd")) == open_before


def test_a_trace_file_name_of_exactly_the_file_systems_limit_is_accepted(tmp_path):
    import os

    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    path = str(tmp_path / ("n" * limit))
    assert parse_config({"cpu_bytes": 1, "trace_file": path}).trace_file == path


def test_tiers_that_exactly_fill_the_memory_available_now_are_not_warned_of():
    from connector.config import check_host_memory

    assert check_host_memory(4 << 30, 2, 16 << 30, available_bytes=8 << 30) is None


def test_available_memory_is_the_kernels_memavailable_in_bytes():
    """Not MemFree (page cache the kernel gives back counts as available), and kB are KiB."""
    from connector.config import available_memory_bytes

    def mem_available() -> int:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))

    try:
        before = mem_available()
    except (OSError, StopIteration):
        pytest.skip("no MemAvailable in /proc/meminfo")
    got = available_memory_bytes()
    after = mem_available()
    assert min(before, after) * 0.995 <= got <= max(before, after) * 1.005  # it moves between the reads


def test_an_unknown_keys_value_is_shown_as_written():
    """A quoted string is shown quoted, as in the JSON: '8G', not 8G."""
    message = _error({"cpu_bytes": GIB, "trace_fiel": "/tmp/t.jsonl", "blocksize": "8"})
    assert "blocksize='8' (did you mean block_size?), trace_fiel='/tmp/t.jsonl' (did you mean trace_file?)" in message


def test_a_misspelt_key_is_given_the_accepted_key_it_is_closest_to_and_a_foreign_one_none():
    """An operator who wrote blok_size, cpu-bytes or TRACE_FILE meant an accepted key; colour meant none."""
    message = _error({"cpu-bytes": GIB, "blok_size": 32, "TRACE_FILE": "t.jsonl", "colour": "red",
                      "sample_ratio": 0.5})
    assert "blok_size=32 (did you mean block_size?)" in message
    assert "cpu-bytes=1073741824 (did you mean cpu_bytes?)" in message
    assert "TRACE_FILE='t.jsonl' (did you mean trace_file?)" in message
    assert "colour='red', " in message  # nothing close: no guess
    assert "sample_ratio=0.5 (did you mean trace_sample_ratio?)" in message


def test_available_memory_is_a_whole_number_of_kib_as_the_kernel_counts_it():
    """MemAvailable's kB are KiB: the bytes are that count times 1024, not a near factor (1000, 1023, 1025),
    which the range that `test_available_memory_is_the_kernels_memavailable_in_bytes` allows the moving
    memory lets pass."""
    from connector.config import available_memory_bytes

    got = available_memory_bytes()
    if got is None:
        pytest.skip("no MemAvailable in /proc/meminfo")
    assert got > 0 and got % 1024 == 0, got


def test_a_parsed_config_cannot_be_changed_so_the_scheduler_and_its_workers_keep_what_was_checked():
    import dataclasses

    cfg = parse_config({"cpu_bytes": GIB})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.cpu_bytes = 2 * GIB
    assert cfg.cpu_bytes == GIB
