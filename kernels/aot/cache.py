"""Content-addressed on-disk cache of AOT artifacts (PTX, cubin, metadata).

The key is a hash of everything that decides the machine code: the kernel's source (Triton's ``cache_key`` covers the
kernel and the jit functions it calls), the explicit signature, divisibility hints, constexprs, warps, stages, SM and
the compilers (Triton's version and its ptxas's, or nvcc's and its flags) with the environment settings Triton's
compiler reads. A hit therefore never needs Triton's JIT, and two processes that compile the same thing share
it. Root: ``$TRITRT_AOT_CACHE``, else ``aot`` in tritrt's cache directory (``kernels.aot.files.cache_dir``:
``$TRITRT_CACHE`` or ``~/.cache/tritrt``). Entries are written to a temp dir and renamed, so a
reader never sees half an entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from .files import cache_dir, new_dir


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
        tmp = new_dir(final, "tmp")
        try:
            (tmp / "kernel.ptx").write_text(ptx)
            (tmp / "kernel.cubin").write_bytes(cubin)
            (tmp / "meta.json").write_text(json.dumps(meta, sort_keys=True, indent=1, default=repr))
            try:
                os.rename(tmp, final)
            except OSError:
                if not (final.is_dir() and self.get(key) is None):
                    raise
                # a damaged entry (a file lost or unreadable, which get() reported as a miss): put this one in its place
                trash = new_dir(final, "trash")
                os.replace(final, trash)
                os.rename(tmp, final)
                shutil.rmtree(trash, ignore_errors=True)
        except OSError:
            # Either another process won the race (its entry is identical by construction) or a write failed (a full
            # disk), which is raised; no temp dir is left behind in either case.
            shutil.rmtree(tmp, ignore_errors=True)
            if self.get(key) is None:
                raise
        return final
