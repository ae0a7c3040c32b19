"""The ``felactl`` command: sub-commands composed from one small module each.

Errors are mapped to exit codes here and only here: a :class:`FelactlError` prints one line on
stderr and exits with its code (2 for bad input, 1 when the work failed); anything unexpected
prints one line and exits 1. ``--debug`` (or ``FELACTL_DEBUG=1``) shows the traceback instead.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated

import click
import typer
import typer.core

from felactl import __version__
from felactl.errors import EXIT_FAILED, FelactlError


def _debug_enabled(ctx: click.Context | None) -> bool:
    if os.environ.get("FELACTL_DEBUG") == "1":
        return True
    while ctx is not None:
        if isinstance(ctx.obj, dict) and ctx.obj.get("debug"):
            return True
        ctx = ctx.parent
    return False


class FelactlGroup(typer.core.TyperGroup):
    """The root group: every command runs inside ``invoke``, so errors are mapped in one place."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except FelactlError as exc:
            if _debug_enabled(ctx):
                raise
            click.echo(f"felactl: error: {exc}", err=True)
            ctx.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("felactl: interrupted", err=True)
            ctx.exit(130)
        except Exception as exc:  # a bug: still one line, the traceback behind --debug
            if _debug_enabled(ctx):
                raise
            click.echo(f"felactl: internal error: {type(exc).__name__}: {exc} (run with --debug for the traceback)",
                       err=True)
            ctx.exit(EXIT_FAILED)


app = typer.Typer(
    cls=FelactlGroup,
    name="felactl",
    help="Train PyTorch models on clusters whose devices and links are not alike.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"felactl {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    ctx: typer.Context,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks and write solver files.")] = False,
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """felactl: profile -> plan -> launch -> scale."""
    ctx.obj = {"debug": debug}


# One module per command, each with a ``register(app)``; add a command by adding its module here.
COMMAND_MODULES: tuple[str, ...] = ()


def _register_commands() -> None:
    import importlib

    for name in COMMAND_MODULES:
        importlib.import_module(f"felactl.cli.{name}").register(app)


_register_commands()


def main() -> None:
    sys.exit(app(standalone_mode=True))
