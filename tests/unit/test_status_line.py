"""``io.progress.status``: one line on stderr while a slow step runs, as the progress bar's rules
say (a terminal gets a line erased afterwards, a log one plain line, quiet nothing)."""

from __future__ import annotations

import io

import pytest

from ckptools.io import progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _shown(monkeypatch: pytest.MonkeyPatch, stream: io.StringIO, **kw: bool) -> str:
    monkeypatch.setattr("sys.stderr", stream)
    with progress.status("deriving rules", **kw):
        during = stream.getvalue()
    assert stream.getvalue().startswith(during)
    return stream.getvalue()


def test_a_log_gets_one_plain_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(progress.NO_PROGRESS_ENV, raising=False)
    assert _shown(monkeypatch, io.StringIO()) == "deriving rules\n"


def test_a_terminal_gets_a_line_erased_when_the_step_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(progress.NO_PROGRESS_ENV, raising=False)
    assert _shown(monkeypatch, _Terminal()) == "deriving rules\r\x1b[K"


@pytest.mark.parametrize("env", ["1", "yes"])
def test_quiet_or_no_progress_show_nothing(monkeypatch: pytest.MonkeyPatch, env: str) -> None:
    monkeypatch.delenv(progress.NO_PROGRESS_ENV, raising=False)
    assert _shown(monkeypatch, _Terminal(), quiet=True) == ""
    monkeypatch.setenv(progress.NO_PROGRESS_ENV, env)
    assert _shown(monkeypatch, _Terminal()) == ""
    monkeypatch.setenv(progress.NO_PROGRESS_ENV, "0")
    assert _shown(monkeypatch, io.StringIO()) == "deriving rules\n"
