"""Progress on stderr while a long step runs (a forward pass, a figure): a spinner saying what is
happening, only when stderr is a terminal, so pipes, logs and --json runs stay silent; cleared
when the step is done. The app layer reports through a plain callback and never imports rich."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


def stderr_console() -> Any:
    from rich.console import Console

    return Console(stderr=True, highlight=False)


def _silent(message: str) -> None:
    del message


@contextmanager
def progress(enabled: bool = True) -> Iterator[Callable[[str], None]]:
    """A callback that shows its latest message beside a spinner on stderr (a no-op when
    disabled or when stderr is not a terminal); the spinner is gone when the block ends."""
    console = stderr_console()
    if not enabled or not console.is_terminal or console.is_dumb_terminal:
        yield _silent
        return
    from rich.live import Live
    from rich.spinner import Spinner
    from rich.text import Text

    spinner = Spinner("dots", text="")
    # stdout is never redirected through the spinner's console: it may be a pipe.
    live = Live(spinner, console=console, transient=True, redirect_stdout=False,
                redirect_stderr=False, refresh_per_second=10)

    def show(message: str) -> None:
        spinner.update(text=Text(message))  # never markup: messages hold paths and tokens
        if not live.is_started:
            live.start()
        live.refresh()

    try:
        yield show
    finally:
        if live.is_started:
            live.stop()
