"""The `kvscope` command's arguments: a bad value stops it before any engine starts, naming the option."""

from __future__ import annotations

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


@pytest.mark.parametrize("port", ["0", "65536", "http"])
def test_a_bad_dashboard_port_is_refused_naming_it(port, capsys, monkeypatch):
    monkeypatch.setattr(cli, "dashboard", lambda args: pytest.fail("the dashboard started"))
    with pytest.raises(SystemExit) as info:
        cli.main(["dashboard", "--port", port, "trace.jsonl"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --port" in err and "accepted are 1 to 65535" in err, err


def test_dashboard_options_reach_streamlit(tmp_path, monkeypatch):
    from dashboard import launch

    started = []

    class RecordingPopen:  # the real start is `test_kvscope_dashboard_serves_on_the_port_it_is_given`
        def __init__(self, cmd):
            started.append(cmd)

        def wait(self):
            return 0

    trace = tmp_path / "t.jsonl"
    trace.write_text("")
    monkeypatch.setattr(launch.subprocess, "Popen", RecordingPopen)
    assert cli.main(["dashboard", "--port", "8642", "--address", "127.0.0.1", "--headless",
                     "--streamlit-option=--theme.base=dark", str(trace)]) == 0
    cmd = started[0]
    options, paths = cmd[:cmd.index("--")], cmd[cmd.index("--") + 1:]
    assert options[options.index("--server.port") + 1] == "8642"
    assert options[options.index("--server.address") + 1] == "127.0.0.1"
    assert options[options.index("--server.headless") + 1] == "true"
    assert "--theme.base=dark" in options
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
