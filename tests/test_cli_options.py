"""The options dataclass of a typer command (:func:`felactl.cli.options.takes_options`): typer sees
its fields as the command's parameters, with their names, defaults and checks, and the command
receives one instance."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import typer
from typer.testing import CliRunner

from felactl.cli.options import takes_options


@dataclass(frozen=True, kw_only=True)
class GreetOptions:
    name: Annotated[str, typer.Option(help="Whom to greet.")]
    times: Annotated[int, typer.Option("--times", min=1, help="How often.")] = 1


def _app(received: list) -> typer.Typer:
    app = typer.Typer()

    @app.command()
    @takes_options(GreetOptions, context=True)
    def greet(ctx: typer.Context, options: GreetOptions) -> None:
        """Say hello."""
        received.append((ctx.info_name, options))

    @app.command()
    def other() -> None:  # a second command, so that typer keeps `greet` a sub-command
        pass

    return app


def test_the_command_receives_one_instance_of_its_options():
    received = []
    result = CliRunner().invoke(_app(received), ["greet", "--name", "ada", "--times", "3"])
    assert result.exit_code == 0, result.output
    assert received == [("greet", GreetOptions(name="ada", times=3))]


def test_defaults_required_fields_and_checks_are_typers():
    received = []
    app = _app(received)
    assert CliRunner().invoke(app, ["greet", "--name", "ada"]).exit_code == 0
    assert received == [("greet", GreetOptions(name="ada", times=1))]
    assert CliRunner().invoke(app, ["greet"]).exit_code == 2  # --name is required
    assert CliRunner().invoke(app, ["greet", "--name", "ada", "--times", "0"]).exit_code == 2  # min=1
    assert len(received) == 1


def test_help_lists_every_field_as_an_option_with_its_help():
    result = CliRunner().invoke(_app([]), ["greet", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "Say hello." in result.output
    for line in ("--name", "Whom to greet.", "--times", "How often.", "[default: 1]"):
        assert line in result.output
    assert "--ctx" not in result.output and "--options" not in result.output
