"""``python -m trt_plugins.aot``: every plugin kernel compiles to PTX and cubin for sm_80 and sm_90 without a GPU, and
the manifest describes what the TensorRT glue and the launcher need. One compile per op per SM (``--first``), in a
subprocess: compiling real kernels needs a process without TRITON_INTERPRET."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.aot.compile import entry_params
from trt_plugins.specs import SPECS

SMS = (80, 90)
ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # one subprocess compiling every plugin twice: ~30 s on 2 CPU cores


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("aot_out")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "trt_plugins.aot", "--sm", ",".join(map(str, SMS)), "--out", str(out),
                        "--first"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    return {sm: (out / f"sm_{sm}", json.loads((out / f"sm_{sm}" / "manifest.json").read_text())) for sm in SMS}


@pytest.mark.parametrize("sm", SMS)
@pytest.mark.parametrize("op", sorted(SPECS))
def test_every_plugin_kernel_compiles(built, sm, op):
    d, manifest = built[sm]
    spec = SPECS[op]
    entries = [e for e in manifest["kernels"] if e["op"] == op]
    assert len(entries) == 1, f"{op} missing from the manifest"
    e = entries[0]
    assert e["sm"] == sm and e["kernel"] == spec.entry_name and e["namespace"] == "tritrt"
    assert [n for n, _ in e["signature"]] == spec.entry_params, "manifest signature is not in plugin order"
    sp = spec.specialise(spec.samples[0].shapes, spec.samples[0].dtypes, spec.samples[0].attrs)
    assert e["constexprs"] == json.loads(json.dumps(sp.constexprs)) and e["num_warps"] == sp.num_warps
    assert e["num_stages"] == sp.num_stages and e["shared"] >= 0 and len(e["source_hash"]) == 64
    ptx = (d / e["ptx"]).read_text()
    assert re.search(rf"\.target\s+sm_{sm}a?\b", ptx)
    assert (d / e["cubin"]).read_bytes()[:4] == b"\x7fELF"
    # The PTX TensorRT embeds takes exactly inputs, scalars, outputs: pointers as u64, scalars as u32.
    trt = (d / e["trt_ptx"]).read_text()
    want = ["u32" if p in spec.scalars else "u64" for p in spec.entry_params]
    assert entry_params(trt, e["kernel"]) == want
    assert e["num_hidden_params"] == len(entry_params(ptx, e["kernel"])) - len(want)


def test_cli_refuses_bad_arguments(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "trt_plugins.aot", "--sm", "75", "--out", str(tmp_path)], cwd=ROOT,
                       env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "not supported" in r.stderr
    r = subprocess.run([sys.executable, "-m", "trt_plugins.aot", "--sm", ",", "--out", str(tmp_path)], cwd=ROOT,
                       env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "give compute capabilities" in r.stderr and not any(tmp_path.iterdir())
    r = subprocess.run([sys.executable, "-m", "trt_plugins.aot", "--sm", "90", "--out", str(tmp_path), "--ops", "Nope"],
                       cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "unknown ops" in r.stderr
    r = subprocess.run([sys.executable, "-m", "trt_plugins.aot", "--sm", "90", "--out", str(tmp_path)], cwd=ROOT,
                       env={**env, "TRITON_INTERPRET": "1"}, capture_output=True, text=True)
    assert r.returncode != 0 and "TRITON_INTERPRET" in r.stderr


def test_cli_never_replaces_another_programs_manifest(tmp_path):
    """--out may be an existing directory, but a manifest.json there that trt_plugins.aot did not write is refused
    before anything is compiled (it would be overwritten), as is an --out that is a file."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "manifest.json").write_text('{"name": "my model", "version": 3}')
    r = subprocess.run([sys.executable, "-m", "trt_plugins.aot", "--sm", "90", "--out", str(theirs), "--first"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "did not write" in r.stderr and "Traceback" not in r.stderr
    assert sorted(p.name for p in theirs.iterdir()) == ["manifest.json"]
    assert (theirs / "manifest.json").read_text() == '{"name": "my model", "version": 3}'
    a_file = tmp_path / "weights.bin"
    a_file.write_bytes(b"w")
    r = subprocess.run([sys.executable, "-m", "trt_plugins.aot", "--sm", "90", "--out", str(a_file), "--first"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "not a directory" in r.stderr and a_file.read_bytes() == b"w"


def test_cli_out_that_cannot_be_created_is_one_error_line():
    """An --out the system will not create (under /proc, even for root) is an error line, exit 2, not a traceback."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "trt_plugins.aot", "--sm", "90", "--out", "/proc/tritrt_test/k",
                        "--first"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "pass a directory this user can write to" in r.stderr


def test_an_earlier_manifest_of_ours_may_be_replaced(tmp_path):
    from trt_plugins.aot import _check_out

    (tmp_path / "manifest.json").write_text(json.dumps(dict(sm=90, card=None, triton="3.6.0", kernels=[], failed=[])))
    _check_out(tmp_path)  # no error: a rerun into the same --out
    _check_out(tmp_path / "new")


def test_every_file_is_written_whole(built):
    """Kernel files and the manifest go through ``write_atomic``: no temp file is left beside them."""
    for d, manifest in built.values():
        names = sorted(p.name for p in d.iterdir())
        assert not [n for n in names if n.endswith(".tmp")], names
        listed = {e[k] for e in manifest["kernels"] for k in ("ptx", "trt_ptx", "cubin")}
        assert set(names) == listed | {"manifest.json"}
