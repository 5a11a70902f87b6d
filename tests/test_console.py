"""The console through the standard logging module (issue 33, item 5): levels, the group prefix, and the
libraries beneath held at WARNING unless asked."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from tessera import log


@pytest.fixture(autouse=True)
def _restore_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in (log.LEVEL_ENV, "RUST_LOG", "TRANSFORMERS_VERBOSITY", "TESSERA_GROUP"):
        monkeypatch.delenv(name, raising=False)
    yield
    tessera_logger = logging.getLogger("tessera")  # later tests in this process set up their own
    for handler in [h for h in tessera_logger.handlers if getattr(h, "_tessera", False)]:
        tessera_logger.removeHandler(handler)
    for name in log.NOISY:
        logging.getLogger(name).setLevel(logging.NOTSET)


def test_lines_are_plain_prefixed_by_group_and_filtered_by_level(capsys: pytest.CaptureFixture[str]) -> None:
    log.setup("info", prefix="[group 1] ")
    log.get("train").info("loss %.1f", 2.5)
    log.get("train").warning("one expert took\nmost slots")
    log.get("train").debug("not shown")
    assert capsys.readouterr().out == "[group 1] loss 2.5\n[group 1] warning: one expert took\n[group 1] most slots\n"
    log.setup("warning")  # -q
    log.get("train").info("hidden")
    log.get("train").error("shown")
    assert capsys.readouterr().out == "error: shown\n"
    with pytest.raises(ValueError, match="log level 'loud' is not one of debug, info, warning, error"):
        log.setup("loud")


def test_the_libraries_beneath_speak_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    log.setup("info")
    assert all(logging.getLogger(name).level == logging.WARNING for name in ("torchft", "transformers"))
    import os

    assert os.environ["RUST_LOG"] == "warn" and os.environ[log.LEVEL_ENV] == "info"  # for the ranks, and torchft's Rust
    monkeypatch.delenv("RUST_LOG")
    log.setup("debug")
    assert logging.getLogger("torchft").level == logging.DEBUG and "RUST_LOG" not in os.environ
    monkeypatch.setenv("TESSERA_GROUP", "2")
    assert log.group_prefix() == "[group 2] "
