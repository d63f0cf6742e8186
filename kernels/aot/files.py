"""Writing a file so that it is never seen half written: the one helper every layer that writes artifacts uses
(``kernels.aot.wrapper``'s generated entries, ``trt_plugins.aot``'s kernel files and manifest, ``export``'s engines
and reports)."""

from __future__ import annotations

import os
from pathlib import Path


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
