"""Helpers of the CLI tests: run ``python -m export.<cli>`` in a subprocess, judge a refusal (exit code 2, one line on
stderr, no traceback), and hash a directory tree to show that a refused or killed command changed nothing.

Subprocesses inherit ``TRITON_INTERPRET=1`` and the session's ``TRITRT_AOT_CACHE`` from ``tests/conftest.py``, so a
build skips the AOT kernels unless a test unsets the variable. stderr is a pipe, so no progress bar is drawn: what is
on stderr is only what the command reports.
"""

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def cli(module: str, *args, cwd=None, env=None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``python -m export.<module> args`` from ``cwd`` (default: the repository) and capture its output."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    full_env = {k: v for k, v in full_env.items() if v is not None}
    return subprocess.run([sys.executable, "-m", f"export.{module}", *map(str, args)], cwd=cwd or ROOT,
                          capture_output=True, text=True, timeout=timeout, env=full_env)


def assert_refused(r: subprocess.CompletedProcess, *fragments: str, stdout_empty: bool = True) -> str:
    """Exit code 2, exactly one line on stderr holding every fragment, no traceback; returns that line."""
    where = f"\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}"
    assert r.returncode == 2, f"exit code {r.returncode}{where}"
    assert "Traceback" not in r.stderr, where
    lines = r.stderr.splitlines()
    assert len(lines) == 1, f"{len(lines)} lines on stderr{where}"
    assert "error: " in lines[0], where
    for f in fragments:
        assert f in lines[0], f"{f!r} not in the message{where}"
    if stdout_empty:
        assert r.stdout == "", f"output before the refusal{where}"
    return lines[0]


def tree(root: Path) -> dict:
    """Every path under ``root`` (hidden ones too): sha256 for a file, "dir" / "link -> X" otherwise."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = f"link -> {os.readlink(p)}"
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def stray(parent: Path, name: str = "out") -> list[str]:
    """Temp dirs of builds of ``parent/name`` left beside it."""
    return sorted(p.name for p in parent.iterdir() if p.name.startswith((f".{name}.tmp-", f".{name}.old-")))


def build_out(ckpt: Path, out: Path, *extra, env=None) -> Path:
    """``python -m export.build`` of ``ckpt`` into ``out``, float32 (the CPU references), no engine."""
    r = cli("build", "--checkpoint", ckpt, "--out", out, "--dtype", "float32", "--no-engine", *extra, env=env)
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture
def ckpt_copy(tiny_llama_dir, tmp_path):
    """A private copy of the tiny checkpoint, for tests that might (if the CLI were wrong) damage it."""
    return Path(shutil.copytree(tiny_llama_dir, tmp_path / "ckpt"))


@pytest.fixture(scope="session")
def built_out(tiny_llama_dir, tmp_path_factory):
    """One OUT of the tiny checkpoint (float32, no engine), for the commands that read an OUT. Treat as read-only."""
    return build_out(tiny_llama_dir, tmp_path_factory.mktemp("cli_built") / "out")
