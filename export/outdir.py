"""Where ``export.build`` may write, and how OUT is replaced without ever losing a user's files.

``check_out`` refuses, before anything is created: an OUT that is a file, a mount point, the current directory (or one
above it), one that overlaps the checkpoint, one on a read-only or unwritable disk, and an existing directory that is
neither empty nor a previous output of ours. "Ours" means ``build.json`` has the ``tritrt_version`` key, every entry
of OUT is one that build.json lists (plus ``kernels/`` and ``model.engine``), and every entry of ``kernels/`` one that
its ``manifest.json`` lists: a file a user dropped into an old OUT makes it theirs again. There is no ``--force``:
what is refused is for the user to move or delete.

``WorkDir`` is the build's temp dir beside OUT, ``.OUT.tmp-<pid>-<random>``, locked (``flock``) while the build runs.
``commit`` re-checks OUT and swaps the two atomically (``renameat2(RENAME_EXCHANGE)``; elsewhere OUT is first moved to
``.OUT.old-<pid>-<random>``), then deletes the old contents. A build killed at any point leaves OUT as it was (or, in
the non-atomic fallback, in ``.OUT.old-*``, which the next build puts back); the next build of the same OUT removes
temp dirs whose pid is gone and whose lock is free. Parent directories the build created are removed if it fails.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable, Optional

from kernels.aot.files import new_dir

MARKER_KEY = "tritrt_version"  # build.json of every OUT we write has it; its absence means "not ours"
# Entries that belong to an OUT besides those build.json lists: the AOT kernels and an engine built later with
# --from-onnx (and its atomic-write temp file, should that build have been killed).
_ALWAYS_OURS = re.compile(r"^(kernels|model\.engine|build\.json|\.model\.engine\.\d+\.tmp)$")


class OutDirError(ValueError):
    """OUT cannot be written or replaced; the message says what to do instead."""


def _is_within(path: Path, other: Path) -> bool:
    return path == other or other in path.parents


def our_output(out: Path) -> tuple[bool, str]:
    """(True, "") when ``out`` is a previous output of ``export.build``; else (False, why not)."""
    try:
        build = json.loads((out / "build.json").read_text())
    except FileNotFoundError:
        return False, "it has no build.json"
    except (OSError, ValueError) as e:
        return False, f"its build.json cannot be read ({e.__class__.__name__})"
    if not isinstance(build, dict) or MARKER_KEY not in build:
        return False, f"its build.json lacks the '{MARKER_KEY}' key"
    listed = {f.split("/")[0] for f in build.get("files", []) if isinstance(f, str)}
    foreign = sorted(p.name for p in out.iterdir() if p.name not in listed and not _ALWAYS_OURS.match(p.name))
    kernels = out / "kernels"
    if os.path.lexists(kernels):
        foreign += _foreign_kernels(kernels)
    if foreign:
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        return False, f"it holds files that export.build did not write ({', '.join(foreign[:3])}{more})"
    return True, ""


def _foreign_kernels(kernels: Path) -> list[str]:
    """Entries of OUT/kernels that its manifest.json does not list: the build writes only the manifest and the files
    it names there, so anything else (a user's notes, another SM's ``sm_XX/`` from ``python -m trt_plugins.aot``) is
    not ours."""
    if kernels.is_symlink() or not kernels.is_dir():
        return ["kernels (not the directory export.build writes)"]
    try:
        manifest = json.loads((kernels / "manifest.json").read_text())
        listed = {"manifest.json"} | {e[k] for e in manifest["kernels"] for k in ("ptx", "trt_ptx", "cubin")}
    except FileNotFoundError:
        listed = set()
    except (OSError, ValueError, KeyError, TypeError):
        return ["kernels/manifest.json (unreadable)"]
    return sorted(f"kernels/{p.name}" for p in kernels.iterdir()
                  if p.name not in listed or p.is_symlink() or not p.is_file())


def _first_existing(path: Path) -> Path:
    while not os.path.lexists(path) and path.parent != path:
        path = path.parent
    return path


def _writable(directory: Path) -> Optional[str]:
    """None if files can be created in ``directory``, else why not (``access`` reports a read-only mount too)."""
    if os.access(directory, os.W_OK | os.X_OK):
        return None
    try:
        if os.statvfs(directory).f_flag & os.ST_RDONLY:
            return "read-only file system"
    except OSError:
        pass
    return "permission denied"


def check_out(out: Path, checkpoint: Optional[Path] = None) -> None:
    """Raise ``OutDirError`` unless ``out`` (absolute, resolved) may be created or replaced by a build. Creates
    nothing."""
    fix = "pass another --out (a new or empty directory)"
    cwd = Path.cwd().resolve()
    if _is_within(cwd, out):
        raise OutDirError(f"--out {out} is the current directory or holds it; {fix}, e.g. --out build/NAME")
    if checkpoint is not None:
        ckpt = checkpoint.resolve()
        if _is_within(out, ckpt) or _is_within(ckpt, out):
            raise OutDirError(f"--out {out} overlaps the checkpoint {ckpt}; {fix} outside the checkpoint")
    anchor = _first_existing(out.parent)
    if not anchor.is_dir():
        raise OutDirError(f"--out {out}: {anchor} is not a directory; {fix}")
    why = _writable(anchor)
    if why:
        raise OutDirError(f"--out {out}: cannot create files in {anchor} ({why}); {fix} on a writable disk")
    if not os.path.lexists(out):
        return
    if not out.is_dir():
        raise OutDirError(f"--out {out} is an existing file, not a directory; export.build never replaces a file: "
                          f"{fix}")
    if os.path.ismount(out):
        raise OutDirError(f"--out {out} is a mount point and cannot be replaced; pass a directory inside it")
    if not any(out.iterdir()):
        return
    ours, why = our_output(out)
    if not ours:
        raise OutDirError(f"--out {out} is not empty and not an output of export.build ({why}); move its files "
                          f"away or {fix}")


def make_output_hint(path: Path) -> str:
    """What to run, for a command given ``path`` as a build output that it is not: ``python -m export.build --out
    PATH`` only where ``check_out`` takes PATH (nothing there, an empty directory, an earlier build); a checkpoint is
    built from, into a new directory beside it, and anything else is left alone the same way. Telling the user to
    build into a checkpoint or a directory of other files sent them to check_out's refusal."""
    try:
        check_out(path.resolve())
        return f"make one with python -m export.build --out {path}"
    except OutDirError:
        pass
    p = path.resolve()
    new = p.parent / f"{(p.stem if p.is_file() else p.name) or 'out'}-build"
    if _is_checkpoint(p):
        return (f"{path} is a checkpoint: build from it (python -m export.build --checkpoint {path} --out {new}) "
                f"and pass that directory")
    return (f"export.build does not write over {path}: build into a new directory (python -m export.build --out "
            f"{new}) and pass that")


def _is_checkpoint(p: Path) -> bool:
    """What ``--checkpoint`` takes: a directory with config.json, or a GGUF file (by its suffix or its magic)."""
    if p.is_dir():
        return (p / "config.json").is_file()
    try:
        with open(p, "rb") as f:
            return p.suffix.lower() == ".gguf" or f.read(4) == b"GGUF"
    except OSError:
        return False


# --- the temp dir, the swap and stale temp dirs ------------------------------------------------------------------

def _stale_name(out: Path) -> re.Pattern:
    return re.compile(rf"^\.{re.escape(out.name)}\.(tmp|old)-(\d+)-[0-9a-f]+$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _lock(path: Path) -> Optional[int]:
    """An ``flock``-ed fd on the directory ``path``; None if another process holds the lock. File systems without
    flock count as unlocked (the pid check still guards them)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            os.close(fd)
            return None
    return fd


def clean_stale(out: Path, log: Callable[[str], None], restorable: Optional[Callable[[Path], bool]] = None,
                what: str = "build") -> None:
    """Remove temp dirs of killed writers of ``out`` (``new_dir``'s names whose pid is gone and lock free); put a
    ``.old`` dir back if ``out`` itself is missing (a writer killed between the two renames of the non-atomic swap)
    and ``restorable`` says it is a complete one (default: an output of export.build). ``what`` names the writer in
    the notes ("build", "conversion")."""
    restorable = restorable or (lambda p: our_output(p)[0])
    if not out.parent.is_dir():
        return
    pattern = _stale_name(out)
    stale = []
    for p in out.parent.iterdir():
        m = pattern.match(p.name)
        if not m or p.is_symlink() or not p.is_dir() or _pid_alive(int(m.group(2))):
            continue
        fd = _lock(p)
        if fd is None:
            continue
        stale.append((p, m.group(1), fd))
    olds = sorted((p for p, kind, _ in stale if kind == "old"), key=lambda p: p.stat().st_mtime)
    if olds and not os.path.lexists(out) and restorable(olds[-1]):
        os.rename(olds[-1], out)
        log(f"note: restored {out} from {olds[-1].name} (a {what} was killed while replacing it)")
    for p, _, fd in stale:
        if p.exists():
            shutil.rmtree(p, ignore_errors=True)
            log(f"note: removed {p.name}, left by a killed {what}")
        os.close(fd)
    legacy = re.compile(rf"^\.{re.escape(out.name)}\.(tmp-[a-z0-9_]{{8}}|old-\d+)$")
    for p in sorted(out.parent.iterdir()):
        if legacy.match(p.name):
            log(f"note: {p} looks like a leftover of an older tritrt's {what}; check it and delete it yourself")


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two directories (Linux renameat2 RENAME_EXCHANGE); False where that is unavailable."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


class WorkDir:
    """The build's temp dir beside OUT: ``with WorkDir(out, checkpoint, log) as work: ... work.commit()``.

    On entry: stale temp dirs of OUT are cleaned, missing parents of OUT made, the temp dir made and locked. On an
    exception: the temp dir and the parents this build made (still empty) are removed; OUT is untouched."""

    def __init__(self, out: Path, checkpoint: Optional[Path], log: Callable[[str], None]):
        self.out, self.checkpoint, self.log = out, checkpoint, log
        self.path: Optional[Path] = None
        self._made: list[Path] = []
        self._fd: Optional[int] = None

    def __enter__(self) -> "WorkDir":
        clean_stale(self.out, self.log)
        missing = []
        p = self.out.parent
        while not p.exists():
            missing.append(p)
            p = p.parent
        try:
            for p in reversed(missing):
                p.mkdir()
                self._made.append(p)
            self.path = new_dir(self.out, "tmp")
        except OSError as e:  # the first write: where access() said yes but the file system says no (/proc, /sys)
            self.__exit__(None, None, None)
            raise OutDirError(f"--out {self.out}: cannot create {e.filename} ({e.strerror}); pass another --out "
                              f"on a writable disk") from e
        self._fd = _lock(self.path)
        return self

    def commit(self) -> None:
        """Put the temp dir in OUT's place (re-checking OUT first: the build may have taken hours)."""
        check_out(self.out, self.checkpoint)
        out, tmp = self.out, self.path
        if not os.path.lexists(out):
            os.rename(tmp, out)  # fails (ENOTEMPTY) rather than replace a directory that appeared meanwhile
        elif not _exchange(tmp, out):
            old = new_dir(out, "old")
            old.rmdir()
            os.rename(out, old)
            try:
                os.rename(tmp, out)
            except OSError:
                os.rename(old, out)
                raise
            tmp = old
        self.path = None
        self._made = []
        shutil.rmtree(tmp, ignore_errors=True)  # the previous OUT, now under the temp name

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
        for p in reversed(self._made):
            try:
                p.rmdir()
            except OSError:
                pass
        if self._fd is not None:
            os.close(self._fd)
