"""The ``felactl`` command: sub-commands composed from one small module each.

Errors are mapped to exit codes here and only here: a :class:`FelactlError` prints one line on
stderr and exits with its code (2 for bad input, 1 when the work failed); anything unexpected
prints one line and exits 1. ``--debug`` (or ``FELACTL_DEBUG=1``) shows the traceback instead.
"""

from __future__ import annotations

import signal
import sys
from typing import Annotated

import typer
import typer.core

from felactl.cli.options import HELP_SETTINGS

try:  # typer >= 0.2x runs on its own vendored copy of click
    from typer._click.exceptions import ClickException, UsageError
except ImportError:  # older typer runs on click itself
    from click.exceptions import ClickException, UsageError

from felactl import __version__
from felactl.cli import output
from felactl.errors import EXIT_FAILED, EXIT_INTERRUPTED, FelactlError


class FelactlGroup(typer.core.TyperGroup):
    """The root group: every command runs inside ``invoke``, so errors are mapped in one place."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        """Like click's standalone mode, but a usage error (a wrong flag) is one line, exit 2."""
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except UsageError as exc:
            if type(exc).__name__ == "NoArgsIsHelpError":  # a bare group: its help is the answer
                exc.show()
            else:
                where = exc.ctx.command_path if exc.ctx is not None else "felactl"
                typer.echo(f"{where}: error: {exc.format_message()} (see '{where} --help')", err=True)
            sys.exit(exc.exit_code)
        except ClickException as exc:
            typer.echo(f"felactl: error: {exc.format_message()}", err=True)
            sys.exit(exc.exit_code)
        except typer.Abort:
            typer.echo("Aborted.", err=True)
            sys.exit(EXIT_FAILED)
        sys.exit(rv if isinstance(rv, int) else 0)

    def invoke(self, ctx: typer.Context):
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort, ClickException):
            raise
        except FelactlError as exc:
            if output.debug_enabled(ctx):
                raise
            typer.echo(f"felactl: error: {exc}", err=True)
            ctx.exit(exc.exit_code)
        except KeyboardInterrupt as exc:
            typer.echo(f"felactl: {exc or 'interrupted'}", err=True)
            ctx.exit(EXIT_INTERRUPTED)
        except BrokenPipeError:
            raise  # the reader of our output stopped early (`| head`): click ends quietly (exit 1)
        except Exception as exc:  # a bug: still one line, the traceback behind --debug
            if output.debug_enabled(ctx):
                raise
            typer.echo(
                f"felactl: internal error: {type(exc).__name__}: {exc} (run with --debug for the traceback)", err=True
            )
            ctx.exit(EXIT_FAILED)


app = typer.Typer(
    cls=FelactlGroup,
    name="felactl",
    help="Train PyTorch models on clusters whose devices and links are not alike.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    **HELP_SETTINGS,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"felactl {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    ctx: typer.Context,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks and write solver files.")] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """felactl: profile -> plan -> launch -> scale."""
    ctx.obj = {"debug": debug}


# One module per command, each with a ``register(app)``; add a command by adding its module here.
COMMAND_MODULES: tuple[str, ...] = (
    "check",
    "profile",
    "agent",
    "launch",
    "status",
    "report",
    "plan",
    "demo",
    "scale",
    "export",
    "testbed",
)


def _register_commands() -> None:
    import importlib

    for name in COMMAND_MODULES:
        importlib.import_module(f"felactl.cli.{name}").register(app)


_register_commands()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    # SIGTERM (kill, a scheduler's stop) takes Ctrl-C's path: the launch and agent commands then
    # stop their workers and the coordinator on the way out instead of dying with them running.
    signal.signal(signal.SIGTERM, _interrupt)
    sys.exit(app(standalone_mode=True))
