"""Texts shipped with tritrt: an English evaluation text for ``export.eval`` and a disjoint calibration text (for
GPTQ / AWQ). Both are public-domain works from the Canterbury Corpus; ``SOURCES.md`` beside this file records where
they come from, their licenses and checksums. Read from the package directory; never downloaded."""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent
# name -> (file, description)
TEXTS = {
    "alice": ("alice29.txt", "Lewis Carroll, Alice's Adventures in Wonderland (public domain)"),
    "as-you-like-it": ("asyoulik.txt", "William Shakespeare, As You Like It (public domain)"),
}
EVAL_TEXT = "alice"
CALIBRATION_TEXT = "as-you-like-it"


def text_path(name: str) -> Path:
    """The file of a shipped text (``TEXTS``)."""
    if name not in TEXTS:
        raise ValueError(f"no shipped text '{name}'; choose one of {', '.join(TEXTS)} or pass a file path")
    return DATA_DIR / TEXTS[name][0]


def read_text(name: str) -> str:
    return text_path(name).read_text(encoding="utf-8")


def eval_text() -> str:
    """The evaluation text (Alice's Adventures in Wonderland, ~148 KB)."""
    return read_text(EVAL_TEXT)


def calibration_text() -> str:
    """The calibration text (As You Like It, ~125 KB); shares no passage with ``eval_text``."""
    return read_text(CALIBRATION_TEXT)
