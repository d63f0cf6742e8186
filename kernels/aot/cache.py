"""Content-addressed on-disk cache of AOT artifacts (PTX, cubin, metadata).

The key is a hash of everything that decides the machine code: the kernel's source (Triton's ``cache_key`` covers the
kernel and the jit functions it calls), the explicit signature, divisibility hints, constexprs, warps, stages, SM and
the compiler version. A hit therefore never needs Triton's JIT, and two processes that compile the same thing share
it. Root: ``$TRITRT_AOT_CACHE``, else ``aot`` in tritrt's cache directory (``kernels.aot.files.cache_dir``:
``$TRITRT_CACHE`` or ``~/.cache/tritrt``). Entries are written to a temp dir and renamed, so a
reader never sees half an entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from .files import cache_dir


def default_root() -> Path:
    root = os.environ.get("TRITRT_AOT_CACHE")
    return Path(root) if root else cache_dir("aot")


def make_key(**parts) -> str:
    """sha256 of the canonical JSON of ``parts`` (sorted keys; non-JSON values by ``repr``)."""
    text = json.dumps(parts, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


class AotCache:
    """``get(key)`` / ``put(key, meta, ptx, cubin)``; each entry is a directory ``<root>/<key[:2]>/<key>/``."""

    def __init__(self, root: str | os.PathLike | None = None):
        self.root = Path(root) if root is not None else default_root()

    def _dir(self, key: str) -> Path:
        return self.root / key[:2] / key

    def get(self, key: str):
        """(meta dict, ptx str, cubin bytes) or None on a miss (or a damaged entry, which is then recompiled)."""
        d = self._dir(key)
        try:
            meta = json.loads((d / "meta.json").read_text())
            return meta, (d / "kernel.ptx").read_text(), (d / "kernel.cubin").read_bytes()
        except (OSError, ValueError):
            return None

    def put(self, key: str, meta: dict, ptx: str, cubin: bytes) -> Path:
        final = self._dir(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=final.parent))
        try:
            (tmp / "kernel.ptx").write_text(ptx)
            (tmp / "kernel.cubin").write_bytes(cubin)
            (tmp / "meta.json").write_text(json.dumps(meta, sort_keys=True, indent=1, default=repr))
            os.rename(tmp, final)
        except OSError:
            # Either another process won the race (its entry is identical by construction) or a write failed (a full
            # disk), which is raised; no temp dir is left behind in either case.
            shutil.rmtree(tmp, ignore_errors=True)
            if not final.is_dir():
                raise
        return final
