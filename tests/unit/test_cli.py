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
