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


def test_every_commands_help_reads_at_80_columns():
    """Each command's ``--help`` in an 80-column terminal: no line past 80, and an option's help
    starts by column 34 (click's layout, as argparse's), where rich's boxed table left it a
    column of a few words on the right."""
    from felactl.cli.main import app

    commands = [[], ["launch"], ["plan"], ["plan", "collectives"], ["scale"], ["profile"], ["agent"], ["status"]]
    commands += [["report"], ["export"], ["testbed"], ["testbed", "up"], ["demo"], ["check"]]
    for command in commands:
        result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
        assert result.exit_code == 0, (command, result.output)
        lines = result.output.splitlines()
        assert max(map(len, lines)) <= 80, (command, max(lines, key=len))
        helped = [line for line in lines if line.startswith("  --") and "  " in line.strip()]
        starts = [len(line) - len(line.lstrip()) for line in lines if line.startswith(" " * 20) and line.strip()]
        assert all(start <= 34 for start in starts), (command, result.output)
        assert helped or command in ([], ["testbed"]), (command, result.output)
