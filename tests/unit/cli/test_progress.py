"""Human-readable sizes and the progress bar's terminal-only drawing."""

from __future__ import annotations

import io

import pytest

from cairn.cli.progress import ProgressBar, human_size


@pytest.mark.parametrize(
    "n, text",
    [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (32 << 20, "32.0 MiB"), (3 << 40, "3.0 TiB")],
)
def test_human_size(n: int, text: str) -> None:
    assert human_size(n) == text


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_draws_on_a_terminal_only() -> None:
    tty, pipe = Tty(), io.StringIO()
    for stream in (tty, pipe):
        bar = ProgressBar("put", 4 << 20, stream=stream)
        bar(2 << 20)
        bar(2 << 20)
        bar.close()
        assert bar.done == 4 << 20
    assert "put [" in tty.getvalue() and "4.0 MiB / 4.0 MiB" in tty.getvalue()
    assert pipe.getvalue() == ""


def test_quiet_bar_is_silent_even_on_a_terminal() -> None:
    tty = Tty()
    bar = ProgressBar("get", 10, stream=tty, enabled=False)
    bar(10)
    bar.close()
    assert tty.getvalue() == ""
