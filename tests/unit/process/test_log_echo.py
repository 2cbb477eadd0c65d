"""The echo of the workload's log files onto ``cairn run``'s own streams."""

from __future__ import annotations

import io
import threading
from pathlib import Path

from cairn.process.log_echo import LogEcho


class Stream(io.BytesIO):
    """A binary stream that says when something reached it."""

    def __init__(self) -> None:
        super().__init__()
        self.wrote = threading.Event()

    def write(self, data: bytes) -> int:  # type: ignore[override]
        n = super().write(data)
        self.wrote.set()
        return n


def test_shows_what_is_appended_after_the_start_offsets(tmp_path: Path) -> None:
    out, err = tmp_path / "stdout.log", tmp_path / "stderr.log"
    out.write_bytes(b"shown by the try that wrote it\n")
    err.write_bytes(b"")
    streams = Stream(), Stream()
    echo = LogEcho([(str(out), streams[0]), (str(err), streams[1])])
    echo.start_at({str(out): out.stat().st_size})
    try:
        with out.open("ab") as f:
            f.write(b"step 1\n")
        assert streams[0].wrote.wait(10)
        with err.open("ab") as f:
            f.write(b"warning\n")
        assert streams[1].wrote.wait(10)
    finally:
        echo.stop()
    assert streams[0].getvalue() == b"step 1\n"
    assert streams[1].getvalue() == b"warning\n"


def test_what_was_written_before_the_start_shows_without_a_write_after_it(tmp_path: Path
                                                                          ) -> None:
    # The restored workload's first lines may land before the echo starts: they must show
    # then, not wait for the next line.
    out = tmp_path / "stdout.log"
    out.write_bytes(b"old\nstep 7\n")
    stream = Stream()
    echo = LogEcho([(str(out), stream)])
    echo.start_at({str(out): 4})
    try:
        assert stream.wrote.wait(10)
    finally:
        echo.stop()
    assert stream.getvalue() == b"step 7\n"


def test_stop_copies_the_last_lines_and_a_missing_file_is_no_error(tmp_path: Path) -> None:
    out = tmp_path / "stdout.log"
    stream = Stream()
    echo = LogEcho([(str(out), stream), (str(tmp_path / "never-written.log"), Stream())])
    echo.start_at({})
    out.write_bytes(b"last words\n")
    echo.stop()
    assert stream.getvalue() == b"last words\n"
    assert not echo.is_alive()
