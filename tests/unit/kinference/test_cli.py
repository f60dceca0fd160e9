"""The ``kinference`` dispatcher: version, help, and a clear message when an extra is missing."""

from __future__ import annotations

import pytest

import kinference
from kinference import cli


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"kinference {kinference.__version__}"


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    for name in ("serve", "topics", "healthcheck", "broker", "loadgen", "demo", "bench"):
        assert f"  {name} " in out


@pytest.mark.parametrize("argv", [[], ["frobnicate"]])
def test_a_missing_or_unknown_command_exits_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2


def test_a_missing_extra_names_the_install_command(monkeypatch, capsys):
    def missing(name: str):
        raise ModuleNotFoundError("No module named 'rich'", name="rich")

    monkeypatch.setattr(cli.importlib, "import_module", missing)
    assert cli.main(["loadgen", "--help"]) == 2
    assert "pip install 'kinference[loadgen]'" in capsys.readouterr().err


def test_a_missing_module_of_our_own_is_a_bug_not_an_extra(monkeypatch):
    def missing(name: str):
        raise ModuleNotFoundError("No module named 'kinference.nope'", name="kinference.nope")

    monkeypatch.setattr(cli.importlib, "import_module", missing)
    with pytest.raises(ModuleNotFoundError):
        cli.main(["serve"])
