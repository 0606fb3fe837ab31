"""The `kvscope` command's arguments: a bad value stops it before any engine starts, naming the option."""

from __future__ import annotations

import os

import pytest

from connector import cli


@pytest.mark.parametrize("option, value, accepted", [
    ("--suffix-len", "1", ">= 2"),
    ("--batch", "0", ">= 1"),
    ("--rounds", "0", ">= 1"),
    ("--prefixes", "-3", ">= 1"),
    ("--cpu-mib", "lots", "not an integer"),
])
def test_a_bad_demo_option_is_refused_naming_it(option, value, accepted, capsys, monkeypatch):
    monkeypatch.setattr(cli, "demo", lambda args: pytest.fail("the demo started"))
    with pytest.raises(SystemExit) as info:
        cli.main(["demo", option, value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}" in err and accepted in err, err


def test_good_demo_options_reach_the_demo(monkeypatch):
    seen = {}
    monkeypatch.setattr(cli, "demo", lambda args: seen.update(vars(args)) or 0)
    parser_default_func = cli.main(["demo", "--suffix-len", "2", "--batch", "1"])
    assert parser_default_func == 0 and seen["suffix_len"] == 2 and seen["batch"] == 1
    # the defaults the README's demo describes: window 64, 16 requests (4 prefixes of 700 tokens, 4 each)
    assert {k: seen[k] for k in ("model", "window", "prefixes", "per_prefix", "prefix_len", "rounds", "max_tokens",
                                 "cpu_mib", "trace_file", "seed")} == {
        "model": "gemma3", "window": 64, "prefixes": 4, "per_prefix": 4, "prefix_len": 700, "rounds": 3,
        "max_tokens": 8, "cpu_mib": 256, "trace_file": None, "seed": 0}


@pytest.mark.parametrize("port", ["0", "65536", "http"])
def test_a_bad_dashboard_port_is_refused_naming_it(port, capsys, monkeypatch):
    monkeypatch.setattr(cli, "dashboard", lambda args: pytest.fail("the dashboard started"))
    with pytest.raises(SystemExit) as info:
        cli.main(["dashboard", "--port", port, "trace.jsonl"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --port" in err and "accepted are 1 to 65535" in err, err


@pytest.mark.parametrize("address", ["999.1.1.1", "not an address", "192.0.2.1"])  # the last: not this host's
def test_an_address_the_dashboard_cannot_serve_on_is_refused_naming_it(address, capsys, monkeypatch):
    monkeypatch.setattr(cli, "dashboard", lambda args: pytest.fail("the dashboard started"))
    with pytest.raises(SystemExit) as info:
        cli.main(["dashboard", "--address", address, "trace.jsonl"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --address: {address!r} is not an address of this host" in err and "127.0.0.1" in err, err


def test_dashboard_options_reach_streamlit(tmp_path, monkeypatch):
    from dashboard import launch

    started = []
    # the real start is `test_kvscope_dashboard_serves_on_the_port_it_is_given`
    monkeypatch.setattr(launch.os, "execv", lambda path, cmd: started.append(cmd))
    trace = tmp_path / "t.jsonl"
    trace.write_text("")
    cli.main(["dashboard", "--port", "8642", "--address", "127.0.0.1", "--headless",
              "--streamlit-option=--theme.base=dark", "--streamlit-option", "client.toolbarMode=minimal", str(trace)])
    cmd = started[0]
    options, paths = cmd[:cmd.index("--")], cmd[cmd.index("--") + 1:]
    assert options[options.index("--server.port") + 1] == "8642"
    assert options[options.index("--server.address") + 1] == "127.0.0.1"
    assert options[options.index("--server.headless") + 1] == "true"
    assert "--theme.base=dark" in options
    assert "--client.toolbarMode=minimal" in options  # the separate form, dashes added
    assert paths == [str(trace)]


def test_kvscope_dashboard_serves_on_the_port_it_is_given(tmp_path):
    """The real command: Streamlit answers its health check on the given address and port."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time
    import urllib.request
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "traces" / "two_rounds.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "connector.cli", "dashboard", "--port", str(port),
                             "--address", "127.0.0.1", "--headless", str(fixture)],
                            cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True, env=dict(os.environ))
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read().decode(errors="replace")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2) as reply:
                    assert reply.status == 200 and reply.read() == b"ok"
                    break
            except OSError:
                assert time.monotonic() < deadline, "the dashboard did not answer on its port within 60 s"
                time.sleep(0.5)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _transfer(**extra) -> str:
    import json

    return json.dumps({"kv_connector": "KVScopeConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra})


def test_check_passes_a_good_config_and_says_what_the_engine_will_run_with(tmp_path, capsys):
    assert cli.main(["check", _transfer(cpu_bytes=1 << 30, trace_file=str(tmp_path / "t.jsonl"),
                                        trace_sample_ratio=0.25)]) == 0
    out = capsys.readouterr().out
    assert "host tier: 1,073,741,824 bytes (1.00 GiB) per worker" in out
    assert f"trace file: {tmp_path / 't.jsonl'} (sample ratio 0.25)" in out
    assert out.rstrip().endswith("the KV cache layouts")
    assert not (tmp_path / "t.jsonl").exists()  # checked, not created


@pytest.mark.parametrize("text, said", [
    (_transfer(cpu_byte=1 << 30), "kv_connector_extra_config has unknown key(s) cpu_byte=1073741824 (did you mean "
                                  "cpu_bytes?); accepted keys: cpu_bytes"),
    (_transfer(cpu_bytes=-1), "kv_connector_extra_config.cpu_bytes=-1 is not accepted"),
    (_transfer(cpu_bytes=1, trace_sample_ratio=2), "trace_sample_ratio=2 is not accepted"),
    ('{"kv_connector": "KVScopeConnector", "kv_role": "kv_both", "kv_conector_extra_config": {}}',
     "vLLM refuses this --kv-transfer-config"),
    ('{"kv_connector": "KVScopeConnector", "kv_role": "kv_producer", "kv_connector_extra_config": {"cpu_bytes": 1}}',
     "kv_role='kv_producer' is not accepted by KVScopeConnector: accepted is 'kv_both'"),
    ('{"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}', "kv_connector='OffloadingConnector' is not"),
    ('{"kv_connector": "KVScopeConnector", "kv_role": "kv_both", "kv_connector_module_path": "kvscope"}',
     "kv_connector_module_path='kvscope' does not hold KVScopeConnector"),
    ('{"kv_connector": "KVScopeConnector",', "vLLM refuses this --kv-transfer-config: 1 validation error"),
    ("[1]", "Input should be an object"),
    ('{"kv_role": "kv_both"}', "kv_connector is missing: expected 'KVScopeConnector'"),
    # vLLM's JSON parser refuses half a UTF-16 pair where Python's json takes it
    (_transfer(cpu_bytes=1, trace_file="/tmp/\ud800x.jsonl"), "Invalid JSON"),
    ("[" * 100_000 + "]" * 100_000, "vLLM refuses this --kv-transfer-config"),
    # vLLM's number expander refuses these with errors that are no ValueError
    (_transfer(cpu_bytes=1).replace('"cpu_bytes": 1', '"cpu_bytes": 1.5G'),
     "vLLM cannot read this --kv-transfer-config (ArgumentTypeError: Decimals are not allowed"),
    (_transfer(cpu_bytes=1).replace('"cpu_bytes": 1', '"cpu_bytes": ' + "9" * 400 + "k"),
     "vLLM cannot read this --kv-transfer-config (OverflowError"),
])
def test_check_refuses_a_bad_config_naming_what_is_wrong(text, said, capsys):
    assert cli.main(["check", text]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvscope check: ") and said in err, err


def test_check_says_which_otlp_export_the_otel_variables_set_up_and_what_they_get_wrong(monkeypatch, capsys):
    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    assert cli.main(["check", _transfer(cpu_bytes=1 << 20)]) == 0
    assert "OTLP export: none (no OTEL_* variable asks for it)" in capsys.readouterr().out
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    assert cli.main(["check", _transfer(cpu_bytes=1 << 20)]) == 2
    assert ("OTEL_EXPORTER_OTLP_PROTOCOL='http/json' is not accepted: the Python OTLP exporters speak 'grpc' or "
            "'http/protobuf'") in capsys.readouterr().err
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "500ms")
    assert cli.main(["check", _transfer(cpu_bytes=1 << 20)]) == 0
    captured = capsys.readouterr()
    assert "OTLP export: OTLP http/protobuf http://collector:4318/v1/traces" in captured.out
    assert "ignoring OTLP timeout '500ms'" in captured.err
    for spec_milliseconds in ("10000", "inf"):  # read as seconds, as the Python exporters do: capped, said
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", spec_milliseconds)
        assert cli.main(["check", _transfer(cpu_bytes=1 << 20)]) == 0
        assert f"OTLP timeout '{spec_milliseconds}' is read as seconds" in capsys.readouterr().err


def test_check_reads_human_readable_numbers_as_vllm_does(capsys):
    """vLLM's argument parser expands bare 8G (binary) and 8g (decimal) in --kv-transfer-config."""
    text = '{"kv_connector": "KVScopeConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_bytes": 8G}}'
    assert cli.main(["check", text]) == 0
    assert "host tier: 8,589,934,592 bytes (8.00 GiB) per worker" in capsys.readouterr().out
    assert cli.main(["check", text.replace("8G", '"8G"')]) == 2  # a JSON string: vLLM leaves it as it is
    assert 'vLLM expands an unquoted 8G to GiB and 8g to GB, not a quoted "8G"' in capsys.readouterr().err


@pytest.mark.parametrize("flags, said", [
    (["-pp", "2"], "pipeline_parallel_size=2 is not supported by kvscope"),
    (["-tp", "2", "-dcp", "2"], "decode_context_parallel_size=2 is not supported by kvscope"),
    (["--prefill-context-parallel-size", "2"], "prefill_context_parallel_size=2 is not supported by kvscope"),
    (["--enable-sleep-mode"], "enable_sleep_mode=True is not supported by kvscope"),
    (["-tp", "2", "-dp", "2", "--distributed-executor-backend", "external_launcher"],
     "distributed_executor_backend='external_launcher' with 2 ranks per data-parallel rank"),
])
def test_check_refuses_what_start_up_refuses_of_the_engines_flags(flags, said, capsys):
    assert cli.main(["check", *flags, _transfer(cpu_bytes=1 << 20)]) == 2
    assert said in capsys.readouterr().err


def test_check_accepts_the_engines_kvscope_runs_on(capsys):
    for flags in (["-tp", "4"], ["-dp", "2", "--distributed-executor-backend", "external_launcher"],
                  ["-tp", "2", "--nnodes", "2"], ["--no-enable-sleep-mode"], ["-dp", "2", "-dpl", "0"]):
        assert cli.main(["check", *flags, _transfer(cpu_bytes=1 << 20)]) == 0, (flags, capsys.readouterr().err)


@pytest.mark.parametrize("flags, said", [
    (["--distributed-executor-backend", "ray", "-tp", "2", "--nnodes", "2"], "nnodes > 1 can only be set when"),
    (["-dp", "2", "-dpl", "4"], "data_parallel_size_local (4) must be <= data_parallel_size (2)"),
    # what vLLM's engine start reads next: the nodes a replica spans, and its ranks split evenly over them
    (["-dp", "3", "--nnodes", "2"], "nnodes (2) must be divisible by"),
    (["-tp", "3", "--nnodes", "2"], "world_size (3) must be divisible by the nodes one data-parallel replica spans"),
    (["-tp", "2", "--nnodes", "4"], "world_size (2) must be divisible by the nodes one data-parallel replica spans"),
])
def test_check_runs_vllms_own_validation_of_the_parallel_flags(flags, said, capsys):
    assert cli.main(["check", *flags, _transfer(cpu_bytes=1 << 20)]) == 2
    err = capsys.readouterr().err
    assert "vLLM refuses these parallel flags" in err and said in err, err


def test_check_warns_that_vllm_refuses_a_connector_with_expandable_segments(monkeypatch, capsys):
    """Said when vLLM's own test, a search for the exact text, finds it: only then does vLLM refuse (a
    spaced form turns expandable segments on in PyTorch too, but vLLM lets it pass, and kvscope's copies
    read the KV cache through its tensors, whatever pages back them)."""
    for conf, refused in (("expandable_segments:True", True), ("max_split_size_mb:512,expandable_segments:True", True),
                          ("expandable_segments: True", False), ("expandable_segments:False", False),
                          ("expandable_segments:true", False)):
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
        assert cli.main(["check", _transfer(cpu_bytes=1 << 20)]) == 0
        assert ("unless started with --enable-cumem-allocator" in capsys.readouterr().err) == refused, conf


def test_check_uses_the_connectors_own_words_for_its_extra_config():
    """The same message the engine gives at start-up (both run `parse_config`)."""
    from connector.config import ConfigError, parse_config
    from connector.config_check import check_transfer_config

    with pytest.raises(ConfigError) as at_start_up:
        parse_config({"cpu_bytes": "8G"})
    with pytest.raises(ConfigError) as checked:
        check_transfer_config(_transfer(cpu_bytes="8G"))
    assert str(checked.value) == str(at_start_up.value)


def test_check_warns_when_the_workers_tiers_outgrow_this_hosts_memory(monkeypatch, capsys):
    from connector import config_check

    monkeypatch.setattr(config_check, "physical_memory_bytes", lambda: 16 << 30)
    assert cli.main(["check", "-tp", "4", _transfer(cpu_bytes=8 << 30)]) == 0
    assert "4 workers on this host with a host tier of 8589934592 bytes each" in capsys.readouterr().err
    assert cli.main(["check", "-tp", "2", "-dp", "2", _transfer(cpu_bytes=6 << 30)]) == 0  # two engines here
    assert "4 workers on this host with a host tier of 6442450944 bytes each" in capsys.readouterr().err
    assert cli.main(["check", "-tp", "4", "--nnodes", "2", _transfer(cpu_bytes=6 << 30)]) == 0  # 2 on each node
    assert "workers on this host" not in capsys.readouterr().err
    assert cli.main(["check", "-tp", "4", "--nnodes", "2", _transfer(cpu_bytes=9 << 30)]) == 0  # (vLLM: -dpl 1)
    assert "2 workers on this host with a host tier of 9663676416 bytes each" in capsys.readouterr().err
    # two replicas on two nodes: one whole replica on this one (vLLM derives -dpl 1)
    assert cli.main(["check", "-tp", "4", "-dp", "2", "--nnodes", "2", _transfer(cpu_bytes=6 << 30)]) == 0
    assert "4 workers on this host with a host tier of 6442450944 bytes each" in capsys.readouterr().err
    # four replicas of two workers on two nodes: two replicas here (vLLM derives -dpl 2)
    assert cli.main(["check", "-tp", "2", "-dp", "4", "--nnodes", "2", _transfer(cpu_bytes=6 << 30)]) == 0
    assert "4 workers on this host with a host tier of 6442450944 bytes each" in capsys.readouterr().err
    assert cli.main(["check", _transfer(cpu_bytes=32 << 30)]) == 2  # one worker's tier alone does not fit
    assert "more than this host's 17179869184 bytes of memory" in capsys.readouterr().err


def test_kvscope_check_runs_as_a_command():
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([sys.executable, "-m", "connector.cli", "check", _transfer(cpu_bytes=0)],
                          cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "kv_connector_extra_config.cpu_bytes=0 is not accepted" in done.stderr


def test_check_refuses_a_bad_trace_export_mode_when_something_is_traced(tmp_path, monkeypatch, capsys):
    """As start-up does: it reads KVSCOPE_TRACE_EXPORT only when there is a sink to export to."""
    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("KVSCOPE_TRACE_EXPORT", "proces")
    assert cli.main(["check", _transfer(cpu_bytes=1 << 20)]) == 0
    capsys.readouterr()
    assert cli.main(["check", _transfer(cpu_bytes=1 << 20, trace_file=str(tmp_path / "t.jsonl"))]) == 2
    err = capsys.readouterr().err
    assert "KVSCOPE_TRACE_EXPORT='proces' is invalid: accepted are 'process'" in err and "'thread'" in err
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")  # start-up then traces nothing and reads no export mode
    assert cli.main(["check", _transfer(cpu_bytes=1 << 20, trace_file=str(tmp_path / "t.jsonl"))]) == 0


def test_describe_names_a_metrics_port_only_when_one_is_set_and_a_whole_sample_by_default():
    """A trace file without `trace_sample_ratio` samples every request (1.0), as the engine does; no
    `metrics_port`: no metrics port line (not "None")."""
    from connector.config import parse_config
    from connector.config_check import CheckResult, describe

    plain = describe(CheckResult(parse_config({"cpu_bytes": 1 << 20, "trace_file": "t.jsonl"})))
    assert "trace file: t.jsonl (sample ratio 1.0)" in plain
    assert "metrics port" not in plain and "OTLP export: none" in plain
    served = describe(CheckResult(parse_config({"cpu_bytes": 1 << 20, "metrics_port": 9464})))
    assert "metrics port: 9464 (offline vllm.LLM runs" in served


def test_describe_says_when_mamba_decode_states_are_stored_too():
    from connector.config import parse_config
    from connector.config_check import CheckResult, describe

    assert "Mamba states" not in describe(CheckResult(parse_config({"cpu_bytes": 1 << 20})))
    on = describe(CheckResult(parse_config({"cpu_bytes": 1 << 20, "mamba_decode_states": True})))
    assert "Mamba states: those decode steps leave are stored too" in on


@pytest.mark.parametrize("module_path", ["connector", "connector.connector"])
def test_check_accepts_the_module_paths_that_hold_the_connector(module_path, capsys):
    """vLLM imports `kv_connector_module_path` to find the class: both the package and its module hold it."""
    import json

    text = json.dumps({"kv_connector": "KVScopeConnector", "kv_role": "kv_both",
                       "kv_connector_module_path": module_path, "kv_connector_extra_config": {"cpu_bytes": 1 << 20}})
    assert cli.main(["check", text]) == 0, capsys.readouterr().err


def test_check_refuses_a_vllm_outside_the_supported_range_naming_its_version(monkeypatch, capsys):
    """The connector would refuse to start on it: the check says so, with the same version message."""
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.31.0")
    assert cli.main(["check", _transfer(cpu_bytes=1 << 20)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvscope check: ") and "vLLM 0.31.0" in err and "0.32.x, 0.33.x and 0.34.x" in err, err


def test_check_refuses_a_number_vllm_cannot_expand_naming_the_error(capsys):
    """vLLM's expansion of unquoted 8G-style numbers can raise a ValueError (here: a result longer than
    Python converts to text): refused, with what went wrong, not a traceback."""
    import sys

    limit = sys.get_int_max_str_digits()
    if not limit:
        pytest.skip("this Python has no limit on integer string conversion")
    text = ('{"kv_connector": "KVScopeConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_bytes": '
            + "9" * (limit - 1) + "K}}")
    assert cli.main(["check", text]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvscope check: vLLM cannot read this --kv-transfer-config (ValueError: "), err[:300]


def test_check_says_when_the_otlp_exporter_cannot_be_created(monkeypatch, capsys):
    """The engine starts with OTLP export off when its exporter cannot be built: the check says so, and why."""
    from opentelemetry.exporter.otlp.proto.http import trace_exporter

    def broken(**kwargs):
        raise RuntimeError("broken exporter install")

    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setattr(trace_exporter, "OTLPSpanExporter", broken)
    assert cli.main(["check", _transfer(cpu_bytes=1 << 20)]) == 0
    captured = capsys.readouterr()
    assert "OTLP export: off (the exporter could not be created)" in captured.out.splitlines()
    assert "cannot create the OTLP trace exporter (broken exporter install)" in captured.err


def test_check_of_the_json_alone_is_for_an_engine_of_one_worker(monkeypatch):
    """`check_transfer_config` without an `EngineShape`: vLLM's defaults (one worker, no pipeline
    stages), which kvscope supports; the host memory check counts that one worker."""
    from connector import config_check

    monkeypatch.setattr(config_check, "physical_memory_bytes", lambda: 3 << 30)
    result = config_check.check_transfer_config(_transfer(cpu_bytes=2 << 30), env={})
    assert result.warnings == [] and result.config.cpu_bytes == 2 << 30


@pytest.mark.parametrize("env, said", [
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grcp"},
     "OTEL_EXPORTER_OTLP_PROTOCOL='grcp' is not accepted"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json",
      "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
     "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='http/json' is not accepted"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "not a url"},
     "OTEL_EXPORTER_OTLP_ENDPOINT='not a url' is not accepted for OTLP grpc: it holds a space"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "HTTP/JSON "},
     "OTEL_EXPORTER_OTLP_PROTOCOL='HTTP/JSON ' is not accepted"),  # the value as written, not as read
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "collector"}, "it has no http:// or https:// or grpc:// scheme; expected "
     "http://host:port or https://host:port or grpc://host:port, host:port, or a gRPC target (unix:///path, "
     "dns:///host:port)"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "unix:///run/otel.sock", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"},
     "its scheme is 'unix'; expected http://host:port or https://host:port"),  # gRPC targets are gRPC's alone
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "ftp://x:21"}, "its scheme is 'ftp'; expected http://host:port"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://localhost:99999"}, "Port out of range"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://[::1"}, "Invalid IPv6 URL"),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://:4317", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"},
     "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT='http://:4317' is not accepted for OTLP grpc: it names no host"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:0"}, "its port is 0"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"},
     "it has no http:// or https:// scheme"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:0"}, "its port is not 1..65535"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:65536"}, "its port is not 1..65535"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "grpc://collector:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"},
     "its scheme is 'grpc'; expected http://host:port or https://host:port"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "unix:"}, "it names no target"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "dns:///"}, "it names no target"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "dns://8.8.8.8/collector:4317"}, "would send to '8.8.8.8' alone"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "unix://tmp/otel.sock"}, "would send to 'tmp' alone (write unix:///"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_HEADERS": "a=1,secret-token"},
     "OTEL_EXPORTER_OTLP_HEADERS: its entry 2 is not key=value (the value is not shown"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "a=1, =secret-token"},
     "OTEL_EXPORTER_OTLP_TRACES_HEADERS: its entry 2 is not key=value"),  # a value without its key
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_TRACES_SAMPLER": "xray"},
     "OTEL_TRACES_SAMPLER='xray' is not accepted by kvscope"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_TRACES_SAMPLER": "traceidratio",
      "OTEL_TRACES_SAMPLER_ARG": "abc"}, "OTEL_TRACES_SAMPLER_ARG='abc' is not accepted for traceidratio"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
      "OTEL_TRACES_SAMPLER_ARG": "1.5"},
     "OTEL_TRACES_SAMPLER_ARG='1.5' is not accepted for parentbased_traceidratio: expected a number from 0 to 1"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_TRACES_SAMPLER": "traceidratio",
      "OTEL_TRACES_SAMPLER_ARG": "-0.5"},
     "OTEL_TRACES_SAMPLER_ARG='-0.5' is not accepted for traceidratio: expected a number from 0 to 1"),
    # the SDK takes anything but "true" for TLS where kvscope took all but "false" for plaintext (credentials too)
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_INSECURE": "no"},
     "OTEL_EXPORTER_OTLP_INSECURE='no' is not accepted: expected true (plaintext gRPC) or false (TLS)"),
    # a missing certificate: the gRPC exporter logged a traceback and fell back to the default ones
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "https://c:4317", "OTEL_EXPORTER_OTLP_CERTIFICATE": "/nonexistent.pem"},
     "OTEL_EXPORTER_OTLP_CERTIFICATE='/nonexistent.pem' is not accepted: no readable file there"),
    # header names no request can carry: every export failed
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_HEADERS": "bad key=secret-token"},
     "OTEL_EXPORTER_OTLP_HEADERS: its entry 1 has a header name or value no HTTP or gRPC request can carry"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "a=1,k=secret-token%0D%0A"},
     "OTEL_EXPORTER_OTLP_TRACES_HEADERS: its entry 2 has a header name or value no HTTP or gRPC request"),
])
def test_otel_variables_kvscope_would_act_on_wrongly_are_refused_naming_them(monkeypatch, capsys, env, said):
    """A mistyped protocol sent HTTP to a gRPC port, an endpoint that is no URL lost every span at the
    first export, a header entry without '=' (a credential) vanished: all with the check saying ok."""
    from connector.telemetry.tracing import KVScopeTracing

    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cli.main(["check", _transfer(cpu_bytes=1 << 20)]) == 2
    err = capsys.readouterr().err
    assert said in err and "secret-token" not in err, err
    with pytest.raises(ValueError) as refused:  # the engine's start-up refuses it alike
        KVScopeTracing.from_config(None, None, env=env)
    assert said in str(refused.value)


@pytest.mark.parametrize("endpoint, protocol", [
    ("http://collector:4317", "grpc"), ("https://collector.example.com", "grpc"), ("collector:4317", "grpc"),
    ("[::1]:4317", "grpc"), ("http://[::1]:4318", "http/protobuf"),
    ("https://otlp.example.com/v1/traces", "http/protobuf"),
    # vLLM's OpenTelemetry example's form, which vLLM passes on to its engine processes
    ("grpc://10.0.0.5:4317", "grpc"), ("otel_collector:4317", "grpc"), ("http://otel_collector:4318", "http/protobuf"),
    ("unix:///run/otel/otlp.sock", "grpc"), ("dns:///collector:4317", "grpc"),  # gRPC targets
    ("http://collector:4318", " HTTP/Protobuf "),  # read as the exporters read it
    ("collector:65535", "grpc"), ("collector:1", "grpc"),  # the bounds of a port
    ("_collector:4317", "grpc"),  # `_` anywhere in a host name
    ("unix-abstract:otel", "grpc"), ("ipv4:127.0.0.1:4317", "grpc"), ("ipv6:[::1]:4317", "grpc"),  # gRPC targets
])
def test_endpoints_the_otlp_exporters_take_are_accepted(endpoint, protocol):
    from connector.telemetry.otel_env import check_otlp_env

    check_otlp_env({"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": protocol})


def test_blank_otlp_header_entries_spaces_around_them_or_not_are_skipped_as_the_exporters_skip_them():
    """A header list ending in ", " (as a template leaves it) is one the exporters read: refused, the
    engine would not start."""
    from opentelemetry.util.re import parse_env_headers

    from connector.telemetry.otel_env import check_otlp_env
    from connector.telemetry.sinks import _headers

    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_HEADERS": "a=1, ",
           "OTEL_EXPORTER_OTLP_TRACES_HEADERS": " , b=2"}
    check_otlp_env(env)
    assert parse_env_headers("a=1, ") == {"a": "1"} and parse_env_headers(" , b=2") == {"b": "2"}  # the SDK's reading
    assert _headers(env) == {"a": "1", "b": "2"}


def test_otlp_variables_set_empty_count_as_unset_as_the_exporter_reads_them():
    """Compose files and Helm charts often set a variable to "": the trace-specific one then gives way
    to the general one, in the check as in the exporter built."""
    from connector.telemetry.otel_env import check_otlp_env, otlp_protocol
    from connector.telemetry.sinks import build_otlp_exporter

    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
           "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    check_otlp_env(env)
    assert otlp_protocol(env) == "http/protobuf"
    exporter = build_otlp_exporter(env)
    try:
        assert exporter.inner._endpoint == "http://c:4318/v1/traces"
    finally:
        exporter.shutdown()


@pytest.mark.parametrize("sampler, arg, ratio", [
    ("always_on", None, "1.0, whatever a traceparent says"),
    ("always_off", None, "0.0, whatever a traceparent says"),
    ("parentbased_always_on", None, "1.0 of new traces; a sampled traceparent is always followed"),
    ("parentbased_always_off", None, "0.0 of new traces; a sampled traceparent is always followed"),
    ("traceidratio", "0.25", "0.25, whatever a traceparent says"),
    ("parentbased_traceidratio", None, "1.0 of new traces; a sampled traceparent is always followed"),
    ("ParentBased_TraceIdRatio", "0.5", "0.5 of new traces; a sampled traceparent is always followed"),
])
def test_otel_traces_sampler_sets_the_ratio_without_trace_sample_ratio(monkeypatch, capsys, tmp_path, sampler, arg,
                                                                       ratio):
    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", sampler)
    if arg is not None:
        monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", arg)
    trace_file = str(tmp_path / "t.jsonl")
    assert cli.main(["check", _transfer(cpu_bytes=1 << 20, trace_file=trace_file)]) == 0
    assert f"(sample ratio {ratio})" in capsys.readouterr().out
    assert cli.main(["check", _transfer(cpu_bytes=1 << 20, trace_file=trace_file, trace_sample_ratio=0.75)]) == 0
    assert "(sample ratio 0.75)" in capsys.readouterr().out  # the connector's own key wins


def test_an_otel_traces_exporter_kvscope_does_not_export_to_is_said_not_refused(monkeypatch, capsys, tmp_path):
    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp,jaeger")
    assert cli.main(["check", _transfer(cpu_bytes=1 << 20, trace_file=str(tmp_path / "t.jsonl"))]) == 0
    assert "OTEL_TRACES_EXPORTER names 'jaeger', which kvscope does not export to" in capsys.readouterr().err


def test_otel_traces_exporter_names_kvscope_follows_are_read_in_any_case_and_others_warned_of():
    from connector.telemetry.otel_env import exporter_warnings

    assert exporter_warnings({"OTEL_TRACES_EXPORTER": " OTLP ,None,"}) == []
    assert exporter_warnings({"OTEL_TRACES_EXPORTER": "console"}) == [
        "kvscope: OTEL_TRACES_EXPORTER names 'console', which kvscope does not export to (accepted: 'otlp', 'none'); "
        "its spans go over OTLP or to trace_file only"]


@pytest.mark.parametrize("argv, said", [
    (["--trace-file", "/tmp"], "--trace-file (trace_file)='/tmp' is not accepted: it is a folder"),
    (["--cpu-mib", "100000000"], "--cpu-mib (cpu_bytes) gives a host tier of 104857600000000 bytes"),
    (["--prefix-len", "4000", "--suffix-len", "90"], "= 4097 tokens, more than the demo engine's 4096-token context"),
])
def test_demo_arguments_its_engine_would_refuse_stop_it_at_once_in_one_line(monkeypatch, capsys, argv, said):
    """Before the model is built and loaded (each used to end in a traceback of 80 to 100 lines)."""
    from connector import tiny_models

    monkeypatch.setattr(tiny_models, "build_model", lambda *a, **k: pytest.fail("the model was built"))
    assert cli.main(["demo", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvscope demo: ") and said in err and err.count("\n") == 1, err


def test_check_warns_of_a_metrics_port_in_use_here(capsys):
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        assert cli.main(["check", _transfer(cpu_bytes=1 << 20, metrics_port=port)]) == 0
        assert f"metrics_port {port} is in use on this host now" in capsys.readouterr().err
    assert cli.main(["check", _transfer(cpu_bytes=1 << 20, metrics_port=port)]) == 0
    assert "is in use" not in capsys.readouterr().err


def test_check_finds_a_metrics_port_free_that_a_stopped_metrics_server_left_connections_waiting_on(capsys):
    """Restarting an engine: the metrics server it stopped leaves its scrapes' connections in TIME_WAIT on
    the port. A new metrics server binds it (it reuses addresses), so the check must not warn that it is
    in use, as a probe that does not reuse addresses would."""
    import socket

    from prometheus_client import CollectorRegistry, start_http_server

    server, thread = start_http_server(0, addr="127.0.0.1", registry=CollectorRegistry())
    port = server.server_port
    with socket.create_connection(("127.0.0.1", port), timeout=10) as scrape:
        scrape.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        while scrape.recv(65536):  # to the end: the server closed first, so its side waits on the port
            pass
    server.shutdown()
    server.server_close()
    thread.join()
    assert cli.main(["check", _transfer(cpu_bytes=1 << 20, metrics_port=port)]) == 0
    assert "is in use" not in capsys.readouterr().err
    again, thread = start_http_server(port, addr="127.0.0.1", registry=CollectorRegistry())  # as the check says
    again.shutdown()
    again.server_close()
    thread.join()


@pytest.mark.parametrize("value", ["false", "0", "None", " off ", "TRUE", "1", "on", "yes", "no", "null",
                                   "disabled"])
def test_a_trace_file_that_reads_as_a_switch_is_refused(value):
    from connector.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match=r"reads as a switch, not a file name \(for no file, leave trace_file out\)"):
        parse_config({"cpu_bytes": 1 << 20, "trace_file": value})


def test_a_host_tier_larger_than_the_memory_available_now_is_warned_of():
    from connector.config import check_host_memory

    assert check_host_memory(6 << 30, 1, 16 << 30, available_bytes=8 << 30) is None
    warning = check_host_memory(6 << 30, 2, 16 << 30, available_bytes=8 << 30)
    assert "need 12884901888 bytes, more than the 8589934592 available now" in warning


# --- found by the mutation campaign of config_check.py ------------------------------------------


def test_check_of_nothing_traced_samples_every_request_and_reads_only_the_environment_it_is_given(monkeypatch):
    """`env` replaces this process's environment: {} is an empty one, not "use os.environ"."""
    from connector.config_check import check_transfer_config

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    result = check_transfer_config(_transfer(cpu_bytes=1 << 20), env={})
    assert result.warnings == [] and result.sample_ratio == 1.0
    assert any("expandable_segments" in w for w in check_transfer_config(_transfer(cpu_bytes=1 << 20)).warnings)


def test_check_warns_when_the_tiers_outgrow_the_memory_available_now(monkeypatch):
    from connector import config_check

    monkeypatch.setattr(config_check, "physical_memory_bytes", lambda: 16 << 30)
    monkeypatch.setattr(config_check, "available_memory_bytes", lambda: 1 << 30)
    result = config_check.check_transfer_config(_transfer(cpu_bytes=2 << 30), env={})
    assert len(result.warnings) == 1 and "more than the 1073741824 available now" in result.warnings[0]


def test_check_leaves_no_handler_on_the_sinks_logger(monkeypatch):
    """Its handler collects the exporter's warnings for one check; left on, every later warning of
    the engine's sinks would go to that check's list."""
    import logging

    from connector.config_check import check_transfer_config

    sinks_logger = logging.getLogger("connector.telemetry.sinks")
    handlers = list(sinks_logger.handlers)
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
           "OTEL_EXPORTER_OTLP_TIMEOUT": "500ms"}
    warnings = check_transfer_config(_transfer(cpu_bytes=1 << 20), env=env).warnings
    assert any("ignoring OTLP timeout" in w for w in warnings)
    assert sinks_logger.handlers == handlers


def test_check_without_vllm_installed_says_so(monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    assert cli.main(["check", _transfer(cpu_bytes=1 << 20)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvscope check: vLLM is not installed here (") and "install a supported vLLM" in err, err


def test_describe_names_the_offloaded_block_size_when_set_and_no_trace_file_as_none():
    from connector.config import parse_config
    from connector.config_check import CheckResult, describe

    lines = describe(CheckResult(parse_config({"cpu_bytes": 1 << 20, "block_size": 64}))).splitlines()
    assert "offloaded block: 64 tokens" in lines and "trace file: none" in lines
    lines = describe(CheckResult(parse_config({"cpu_bytes": 1 << 20}))).splitlines()
    assert "offloaded block: the device block size (checked against the model at start-up)" in lines


def test_the_demos_workload_shares_each_prefix_and_adds_a_suffix_of_1_to_suffix_len_minus_1_tokens():
    """The demo's context check counts on it: its longest prompt is prefix_len + suffix_len - 1 tokens."""
    prompts = cli._workload(num_prefixes=3, per_prefix=40, prefix_len=5, suffix_len=4, seed=1)
    assert len(prompts) == 120
    assert len({tuple(p[:5]) for p in prompts}) == 3
    assert {len(p) - 5 for p in prompts} == {1, 2, 3}
    assert all(1 <= t < 500 for p in prompts for t in p)


def test_demo_arguments_that_just_fit_the_demo_engines_context_are_accepted():
    """4000 + 89 - 1 + 8 = 4096 tokens: the whole context, not more (4097 is refused)."""
    from argparse import Namespace

    args = Namespace(prefix_len=4000, suffix_len=89, max_tokens=8)
    assert cli._demo_problem(args, {"cpu_bytes": 1 << 20}) is None


class _FakeEngine:
    """What the demo calls of vLLM's engine: fixed outputs per round; per prompt 10 tokens queried, 4 hit in
    the host tier, 2 in the device cache."""

    def __init__(self, outputs_per_round):
        from types import SimpleNamespace

        self.outputs_per_round, self.round, self.resets, self.flushed = outputs_per_round, 0, 0, 0
        self.counters = {"vllm:external_prefix_cache_queries": 0, "vllm:external_prefix_cache_hits": 0,
                         "vllm:prefix_cache_hits": 0}
        layouts = [SimpleNamespace(index=0, kind=SimpleNamespace(value="sliding_window")),
                   SimpleNamespace(index=1, kind=SimpleNamespace(value="full_attention"))]
        index = SimpleNamespace(used_slots=12, num_slots=64, evicted_total=3)
        tracing = SimpleNamespace(force_flush=lambda: setattr(self, "flushed", self.flushed + 1))
        self.connector = SimpleNamespace(_scheduler=SimpleNamespace(layouts=layouts, index=index), tracing=tracing)

    def reset_prefix_cache(self):
        self.resets += 1
        self.round += 1

    def generate(self, prompts):
        from types import SimpleNamespace

        for name, per_prompt in zip(self.counters, (10, 4, 2)):
            self.counters[name] += per_prompt * len(prompts)
        return [SimpleNamespace(tokens=[self.outputs_per_round[self.round], len(p)]) for p in prompts]


def _run_demo(monkeypatch, outputs_per_round, *argv):
    """`kvscope demo` on `_FakeEngine` (rounds of 10 prompts), a progress bar that records its steps, and
    per-group block counters in Prometheus' registry: (exit code, engine, what make_llm got, progress steps)."""
    import tqdm
    from prometheus_client import REGISTRY
    from prometheus_client.core import CounterMetricFamily

    from connector import engine_runner, tiny_models

    engine = _FakeEngine(outputs_per_round)
    made, steps = {}, []

    class Bar:
        def __init__(self, **kwargs):
            steps.append(kwargs["total"])

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, n):
            steps.append(n)

    class Blocks:  # two engines' series of one group: the demo sums them
        def collect(self):
            loaded = CounterMetricFamily("kvscope_loaded_blocks", "", labels=["group", "kind", "engine"])
            loaded.add_metric(["1", "full_attention", "0"], 5)
            loaded.add_metric(["1", "full_attention", "1"], 7)
            scanned = CounterMetricFamily("kvscope_scan_blocks", "", labels=["group", "kind"])
            scanned.add_metric(["0", "sliding_window"], 30)
            return [loaded, scanned]

    monkeypatch.setattr(engine_runner, "engine_env", lambda: None)
    monkeypatch.setattr(engine_runner, "make_llm", lambda model, extra: made.update(extra) or engine)
    monkeypatch.setattr(engine_runner, "generate", lambda llm, prompts, max_tokens: llm.generate(prompts))
    monkeypatch.setattr(engine_runner, "metric_values", lambda llm: dict(llm.counters))
    monkeypatch.setattr(engine_runner, "get_scheduler_connector", lambda llm: llm.connector)
    monkeypatch.setattr(tiny_models, "build_model", lambda name, window: f"{name}-{window}")
    monkeypatch.setattr(tqdm, "tqdm", Bar)
    collector = Blocks()
    REGISTRY.register(collector)
    try:
        code = cli.main(["demo", "--prefixes", "2", "--per-prefix", "5", "--batch", "4", "--prefix-len", "8",
                         "--suffix-len", "4", *argv])
    finally:
        REGISTRY.unregister(collector)
    return code, engine, made, steps


def test_the_demo_prints_each_rounds_host_tier_hits_and_each_groups_loads(monkeypatch, capsys, tmp_path):
    """A fake engine in place of vLLM's: the report's numbers, the device cache reset between rounds (not before
    the first), the host tier's size in MiB and the trace file handed to the connector and flushed."""
    trace = tmp_path / "demo.jsonl"
    code, engine, made, steps = _run_demo(monkeypatch, [1, 1, 1], "--rounds", "3", "--trace-file", str(trace))
    out = capsys.readouterr().out
    assert code == 0
    assert engine.resets == 2 and engine.flushed == 1
    assert made == {"cpu_bytes": 256 << 20, "trace_file": str(trace)}
    assert steps == [30] + [4, 4, 2] * 3  # 10 prompts a round, in batches of 4
    rows = [line.split() for line in out.splitlines() if line[:5].strip().isdigit()]
    assert [r[:5] + r[-1:] for r in rows] == [[str(i), "100", "40", "20", "40.0%", "True"] for i in range(3)]
    assert "group 0 sliding_window  loaded      0  scanned     30" in out
    assert "group 1 full_attention  loaded     12  scanned      0" in out  # both engines' blocks
    assert "host tier: 12/64 slots used, 3 evicted" in out
    assert f"trace file: {trace} (replay: kvscope dashboard {trace}; in this terminal: kvscope summary {trace})" in out


def test_the_demo_fails_when_a_rounds_outputs_differ_from_round_0s(monkeypatch, capsys):
    """Each round is compared with round 0's outputs, not with the round before."""
    code, *_ = _run_demo(monkeypatch, [1, 2, 2], "--rounds", "3")
    assert code == 1
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line[:5].strip().isdigit()]
    assert [r[-1] for r in rows] == ["True", "False", "False"]


def test_an_address_no_resolver_can_encode_is_refused_naming_it(capsys, monkeypatch):
    """A host label over 63 characters fails to encode (UnicodeError, not OSError): refused, not a traceback."""
    monkeypatch.setattr(cli, "dashboard", lambda args: pytest.fail("the dashboard started"))
    address = "a" * 70 + ".example"
    with pytest.raises(SystemExit) as info:
        cli.main(["dashboard", "--address", address, "trace.jsonl"])
    assert info.value.code == 2
    assert f"argument --address: {address!r} is not an address of this host" in capsys.readouterr().err


def test_kvscope_bench_quick_runs_the_quick_benchmarks(monkeypatch):
    import sys
    from types import ModuleType

    runs = []
    fake = ModuleType("bench.run_all")
    fake.main = lambda quick: runs.append(quick) or 0
    monkeypatch.setitem(sys.modules, "bench.run_all", fake)
    assert cli.main(["bench", "--quick"]) == 0 and cli.main(["bench"]) == 0
    assert runs == [True, False]


def test_check_takes_vllm_serves_flags_as_vllm_serve_does(monkeypatch):
    """-dpl 0 (an API server node that runs no engine of its own) and --no-enable-sleep-mode are vLLM's too."""
    seen = []
    monkeypatch.setattr(cli, "check", lambda args: seen.append(vars(args)) or 0)
    assert cli.main(["check", "{}", "-dpl", "0", "--enable-sleep-mode"]) == 0
    assert cli.main(["check", "{}", "--no-enable-sleep-mode"]) == 0
    assert (seen[0]["data_parallel_size_local"], seen[0]["enable_sleep_mode"]) == (0, True)
    assert (seen[1]["data_parallel_size_local"], seen[1]["enable_sleep_mode"]) == (None, False)


def test_check_counts_an_external_launcher_engines_ranks_as_vllm_does_across_pipeline_and_prefill_context_ranks(
        capsys):
    """vLLM's world size is tp x pp x pcp: start-up refuses such an engine first for its external launcher's
    ranks, so the check names that refusal, with the ranks start-up counts."""
    for flags in (["-tp", "2", "-pp", "2"], ["-tp", "2", "--prefill-context-parallel-size", "2"]):
        argv = ["check", *flags, "--distributed-executor-backend", "external_launcher", _transfer(cpu_bytes=1 << 20)]
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert "distributed_executor_backend='external_launcher' with 4 ranks per data-parallel rank" in err, flags


def test_an_engine_shape_cannot_be_changed_so_the_default_every_check_shares_stays_one_worker():
    import dataclasses
    import inspect

    from connector.config_check import EngineShape, check_transfer_config

    default = inspect.signature(check_transfer_config).parameters["engine"].default
    with pytest.raises(dataclasses.FrozenInstanceError):
        default.tensor_parallel_size = 4
    assert default == EngineShape()


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_check_shuts_down_the_otlp_exporter_it_builds(monkeypatch, protocol):
    """It builds the exporter only to describe it: left open, each check would keep its gRPC channel or HTTP
    session (nothing is sent either way)."""
    from connector.config_check import check_transfer_config
    from connector.telemetry import sinks

    built = []
    build = sinks.build_otlp_exporter
    monkeypatch.setattr(sinks, "build_otlp_exporter", lambda env: built.append(build(env)) or built[-1])
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": protocol}
    result = check_transfer_config(_transfer(cpu_bytes=1 << 20), env=env)
    assert result.otlp == built[0].description and protocol in result.otlp
    assert built[0].inner._shutdown  # the OpenTelemetry exporters' own mark, set by their shutdown()


def test_check_counts_one_worker_here_for_two_one_gpu_replicas_on_two_nodes(monkeypatch, capsys):
    """vLLM derives -dpl 1 (one replica per node) for -dp 2 --nnodes 2: one tier on this host, not the two
    of both replicas, so a tier that fits the host once is not warned of."""
    from connector import config_check

    monkeypatch.setattr(config_check, "physical_memory_bytes", lambda: 16 << 30)
    monkeypatch.setattr(config_check, "available_memory_bytes", lambda: 16 << 30)
    assert cli.main(["check", "-dp", "2", "--nnodes", "2", _transfer(cpu_bytes=9 << 30)]) == 0
    assert capsys.readouterr().err == ""
    assert cli.main(["check", "-dp", "2", _transfer(cpu_bytes=9 << 30)]) == 0  # both replicas here
    assert "2 workers on this host with a host tier of 9663676416 bytes each" in capsys.readouterr().err


@pytest.mark.parametrize("flags, said", [
    (["-pp", "2"], "pipeline_parallel_size=2 is not supported by kvscope"),
    (["--prefill-context-parallel-size", "2"], "prefill_context_parallel_size=2 is not supported by kvscope"),
])
def test_check_refuses_pipeline_and_prefill_context_parallelism_over_several_nodes_naming_them(flags, said, capsys):
    """The replicas per node are derived from every rank of a replica, the pipeline stages and prefill context
    ranks too: the refusal start-up gives, not a traceback."""
    assert cli.main(["check", *flags, "-dp", "2", "--nnodes", "2", _transfer(cpu_bytes=1 << 20)]) == 2
    assert said in capsys.readouterr().err


def test_an_engine_shape_is_on_one_node_unless_told_as_vllm_serve_is(monkeypatch):
    """`EngineShape` takes vLLM serve's defaults for the flags not given: a -tp 2 engine's two workers are
    both on this host."""
    from connector import config_check

    monkeypatch.setattr(config_check, "physical_memory_bytes", lambda: 3 << 30)
    monkeypatch.setattr(config_check, "available_memory_bytes", lambda: 3 << 30)
    result = config_check.check_transfer_config(_transfer(cpu_bytes=2 << 30),
                                                config_check.EngineShape(tensor_parallel_size=2), env={})
    assert len(result.warnings) == 1
    assert "2 workers on this host with a host tier of 2147483648 bytes each" in result.warnings[0]


def test_the_replicas_on_each_node_are_derived_as_vllm_serve_derives_them():
    """Without -dpl, over several nodes, vLLM's arg_utils gives each node max(its ranks // one replica's, 1)
    replicas: a replica wider than a node still counts one, never none."""
    from connector.config_check import EngineShape

    for shape, local in ((dict(tensor_parallel_size=4, nnodes=2), 1), (dict(nnodes=2), 1),
                         (dict(tensor_parallel_size=4, data_parallel_size=2, nnodes=2), 1),
                         (dict(tensor_parallel_size=2, data_parallel_size=4, nnodes=2), 2),
                         (dict(data_parallel_size=8, nnodes=2), 4), (dict(data_parallel_size=3), 3)):
        assert EngineShape(**shape).parallel_config().data_parallel_size_local == local, shape


def test_a_metrics_port_that_cannot_be_bound_is_said_with_the_systems_reason(monkeypatch, capsys):
    """(Faked: as root, which CI is, every port binds.) A privileged port was called "in use"."""
    import errno
    import socket

    real_bind = socket.socket.bind

    def bind(self, address):
        if address[1] == 80:
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_bind(self, address)

    monkeypatch.setattr(socket.socket, "bind", bind)
    assert cli.main(["check", _transfer(cpu_bytes=1 << 20, metrics_port=80)]) == 0
    assert "metrics_port 80 cannot be bound here (Permission denied)" in capsys.readouterr().err


def test_the_export_mode_error_shows_the_value_as_set():
    from connector.telemetry.tracing import EXPORT_MODE_VARIABLE, export_mode

    with pytest.raises(ValueError, match=r"KVSCOPE_TRACE_EXPORT=' Threads ' is invalid"):
        export_mode({EXPORT_MODE_VARIABLE: " Threads "})
    assert export_mode({EXPORT_MODE_VARIABLE: " Thread "}) == "thread"


def test_tls_settings_the_exporter_reads_are_checked_and_no_others(tmp_path):
    """What the exporter kvscope builds would read: INSECURE for gRPC only (the HTTP exporter never reads it), the
    traces certificate where set (the general one then unread), certificates only where TLS is spoken, and a
    folder of CA certificates for HTTP (requests takes one, gRPC reads a file)."""
    from connector.telemetry.otel_env import check_otlp_env

    pem = tmp_path / "ca.pem"
    pem.write_text("-----BEGIN CERTIFICATE-----\n")
    http = {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_ENDPOINT": "https://c:4318"}
    grpc = {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_ENDPOINT": "https://c:4317"}
    check_otlp_env({**http, "OTEL_EXPORTER_OTLP_INSECURE": "1"})
    check_otlp_env({**http, "OTEL_EXPORTER_OTLP_CERTIFICATE": str(tmp_path)})
    check_otlp_env({**grpc, "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE": str(pem),
                    "OTEL_EXPORTER_OTLP_CERTIFICATE": "/old/stale.pem"})
    check_otlp_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_CERTIFICATE": "/none.pem"})
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_CERTIFICATE=.* no readable file there"):
        check_otlp_env({**grpc, "OTEL_EXPORTER_OTLP_CERTIFICATE": str(tmp_path)})
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY='/none.key' .* no readable file"):
        check_otlp_env({**http, "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY": "/none.key"})
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_TRACES_INSECURE='flase' is not accepted"):
        check_otlp_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_TRACES_INSECURE": "flase",
                        "OTEL_EXPORTER_OTLP_INSECURE": "true"})
