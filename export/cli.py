"""What the ``python -m export.*`` command lines share: an argument parser whose errors are one line and whose ``-h``
shows every option's default, the one-line error printer, and progress on stderr for steps that take a while.

Progress is drawn (``rich``) only when stderr is a terminal: piped or captured output gets the commands' own log lines
and, on failure, exactly one ``error: ...`` line on stderr, which is what scripts and the CLI tests read.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to an option's help unless the help already names its default or there is none."""

    def _get_help_string(self, action):
        help_ = action.help or ""
        default = action.default
        if "default" in help_ or not action.option_strings or default is None or default is False or \
                default == argparse.SUPPRESS:
            return help_
        return f"{help_} (default: %(default)s)"


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with ``DefaultsHelpFormatter`` and one-line errors (no usage block), exit code 2."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see --help)\n")


def one_line(message) -> str:
    """``message`` on one line: an error some library formatted over several lines stays one ``error:`` line."""
    return " ".join(str(message).split())


def print_error(message) -> None:
    print(f"error: {one_line(message)}", file=sys.stderr)


class Progress:
    """Steps of a long job: ``with progress.step("loading weights") as advance:`` shows a spinner and the elapsed time
    (with ``total=N``, a bar that ``advance()`` moves) on stderr, and removes it when the step ends. A no-op unless
    stderr is a terminal (or ``enabled=True``)."""

    def __init__(self, enabled: bool | None = None):
        self.enabled = sys.stderr.isatty() if enabled is None else enabled

    @contextmanager
    def step(self, description: str, total: int | None = None):
        if not self.enabled:
            yield lambda n=1: None
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, SpinnerColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as RichProgress

        columns = [SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn()]
        if total is not None:
            columns[2:2] = [BarColumn(), MofNCompleteColumn()]
        with RichProgress(*columns, console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task(description, total=total)
            yield lambda n=1: bar.advance(task, n)

