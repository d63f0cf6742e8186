"""Where tritrt keeps its files, writing one so that it is never seen half written, and telling an earlier file of
ours (which a run may replace) from anyone else's: helpers for every layer that writes artifacts (``kernels.aot``'s
cache and generated entries, ``trt_plugins.aot``'s kernel files and manifest, ``export``'s GGUF conversions, timing
cache, engines and reports)."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """tritrt's cache directory, ``$TRITRT_CACHE`` or else ``~/.cache/tritrt``, joined with ``parts`` (``aot``,
    ``gguf``, ...); nothing is created."""
    base = os.environ.get("TRITRT_CACHE")
    return Path(base if base else Path.home() / ".cache" / "tritrt", *parts)


def new_dir(beside: Path, kind: str) -> Path:
    """A new empty directory ``.NAME.<kind>-<pid>-<random>`` beside ``beside`` (NAME its name), to fill and then rename
    into place (``export.outdir.clean_stale`` knows these names).

    os.mkdir, not mkdtemp: mkdtemp makes mode 0700, and what is renamed into place would keep it (a cache or an OUT
    that users share would become private to one); this one follows the umask."""
    while True:
        path = beside.with_name(f".{beside.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue


def write_atomic(path: Path, data) -> None:
    """``data`` (``str``, written as UTF-8, or bytes-like) as the file ``path``: written under a temp name beside it
    (``.NAME.<pid>.tmp``, per process: two writers may race on one path), then renamed over it, so that ``path`` is
    never half written; the temp file does not outlive a failure."""
    path = Path(path)
    if isinstance(data, str):
        data = data.encode()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def holds_json_with(path: Path, keys) -> bool:
    """Whether ``path`` is a regular file (not a link) holding a JSON object with every one of ``keys``: how a CLI
    recognises a file an earlier run of its own wrote, before replacing it. Anything unreadable is not."""
    path = Path(path)
    try:
        data = path.is_file() and not path.is_symlink() and json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(data, dict) and set(keys) <= data.keys()
