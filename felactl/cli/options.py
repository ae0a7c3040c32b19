"""A typer command's parameters as one dataclass, so that a command with many flags stays a short
function (issue 31: typer's parameter lists may use an options dataclass).

Each field of the options class is written as the parameter was
(``name: Annotated[type, typer.Option(...)] = default``); :func:`takes_options` gives typer a
signature built from the fields, in their order, and calls the command with one instance::

    @dataclass(frozen=True, kw_only=True)
    class GreetOptions:
        name: Annotated[str, typer.Option(help="Whom to greet.")] = "world"

    @takes_options(GreetOptions)
    def greet(options: GreetOptions) -> None: ...

With ``context=True`` the command also gets typer's context first: ``greet(ctx, options)``.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from dataclasses import MISSING, fields
from typing import Any

import typer


def takes_options(options_class: type, *, context: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator: typer sees the fields of ``options_class`` (a dataclass) as the command's
    parameters; the command receives them as one ``options_class`` instance."""
    hints = typing.get_type_hints(options_class, include_extras=True)  # resolves `from __future__` strings
    parameters = [
        inspect.Parameter(
            field.name,
            inspect.Parameter.KEYWORD_ONLY,
            default=inspect.Parameter.empty if field.default is MISSING else field.default,
            annotation=hints[field.name],
        )
        for field in fields(options_class)
    ]
    if context:
        parameters.insert(0, inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context))

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        def with_options(**values: Any) -> Any:
            if context:
                ctx = values.pop("ctx")
                return command(ctx, options_class(**values))
            return command(options_class(**values))

        for attribute in ("__module__", "__name__", "__qualname__", "__doc__"):
            setattr(with_options, attribute, getattr(command, attribute))
        with_options.__signature__ = inspect.Signature(parameters)
        with_options.__annotations__ = {p.name: p.annotation for p in parameters}
        return with_options

    return decorate


HELP_SETTINGS = {
    "context_settings": {"help_option_names": ["-h", "--help"], "max_content_width": 100},
    "rich_markup_mode": None,
}
"""How every command's ``--help`` reads: click's plain layout, as argparse and torchrun print
theirs (an option on its line, its help beside it or below a long one), not rich's boxed table,
whose columns left a few words a line for the help at 80 columns."""
