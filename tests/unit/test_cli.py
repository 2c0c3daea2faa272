"""The command line as users type it: options before or after the subcommand, the version."""

from __future__ import annotations

from importlib import metadata

import pytest

from helpers import REPO
from servegrid.pipeline import cli

DEMO = str(REPO / "config" / "cpu-demo.yaml")


@pytest.mark.parametrize(
    "argv",
    [
        ["--config", DEMO, "validate"],
        ["validate", "--config", DEMO],
        ["--config", "config.yaml", "validate", "--config", DEMO],  # the one after the subcommand wins
        ["--config", DEMO, "server", "status"],
        ["server", "status", "--config", DEMO, "--log-level", "DEBUG"],
        ["cell", "run", "ngram/decode/ctx512_c1", "--config", DEMO, "--keep-server"],
    ],
)
def test_config_and_log_level_go_before_or_after_the_subcommand(argv):
    args = cli.build_parser().parse_args(argv)
    assert args.config == DEMO
    assert args.log_level == ("DEBUG" if "DEBUG" in argv else None)


def test_without_config_the_default_is_config_yaml():
    assert cli.build_parser().parse_args(["aggregate"]).config == "config.yaml"


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"servegrid {metadata.version('servegrid')}"


def test_validate_takes_its_config_after_the_subcommand(capsys):
    assert cli.main(["validate", "--config", DEMO]) == 0
    assert capsys.readouterr().out.startswith(f"{DEMO}: valid")
