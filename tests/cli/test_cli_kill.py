"""A build killed (SIGKILL: no handler runs) at any point leaves the previous OUT intact, byte for byte and loadable,
and the next build of the same OUT removes the killed build's temp dir and leaves no ``.OUT.tmp-*`` / ``.OUT.old-*``.

Deterministic: the test polls the build's temp dir for the file that marks the stage and kills as soon as it appears.
The builds run with Triton's compiler (``TRITON_INTERPRET`` unset), so the AOT kernel step follows the ONNX export and
takes seconds: the swap into OUT is always far behind the stage the test waits for, and the exit status (-SIGKILL, not
0) shows that the build was indeed stopped before it finished.
"""

import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.cli.conftest import ROOT, build_out, cli, stray, tree

STAGES = {
    "temp dir made": lambda tmp: True,
    "weights written": lambda tmp: (tmp / "weights.safetensors").exists(),
    "ONNX written": lambda tmp: (tmp / "model.plugin.onnx").exists(),
    "kernels compiling": lambda tmp: any((tmp / "kernels").glob("*.ptx")),
}


def _logits(out):
    from export.model import LlamaModel, make_batch

    model = LlamaModel.from_output_dir(out)
    batch = make_batch([5], block_size=16, input_ids=torch.arange(3, 8))
    return model(batch, model.allocate_kv_cache(2, 16))


@pytest.fixture(scope="module")
def previous_out(tiny_llama_dir, tmp_path_factory):
    """An earlier OUT (float32, int8) and its logits, copied per test."""
    out = build_out(tiny_llama_dir, tmp_path_factory.mktemp("kill_prev") / "out", "--quant", "int8")
    return out, _logits(out)


def _kill_at(stage, cmd, parent, timeout=240.0) -> subprocess.Popen:
    import os

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    try:
        while True:
            tmps = sorted(parent.glob(".out.tmp-*"))
            if tmps and STAGES[stage](tmps[0]):
                break
            if proc.poll() is not None:
                out, err = proc.communicate()
                pytest.fail(f"the build ended (exit {proc.returncode}) before '{stage}'\n{out}\n{err}")
            if time.monotonic() > deadline:
                pytest.fail(f"'{stage}' not reached in {timeout} s")
            time.sleep(0.005)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    return proc


@pytest.mark.parametrize("stage", list(STAGES))
def test_killed_build_leaves_previous_out_intact(previous_out, tiny_llama_dir, tmp_path, stage):
    import shutil

    prev, want_logits = previous_out
    out = tmp_path / "out"
    shutil.copytree(prev, out)
    before = tree(out)
    cmd = [sys.executable, "-m", "export.build", "--checkpoint", str(tiny_llama_dir), "--out", str(out), "--quant",
           "int4", "--dtype", "float32", "--no-engine"]
    proc = _kill_at(stage, cmd, tmp_path)
    assert proc.returncode == -signal.SIGKILL, f"the build was not killed mid-way (exit {proc.returncode})"
    assert tree(out) == before, "the previous OUT changed"
    torch.testing.assert_close(_logits(out), want_logits, rtol=0, atol=0)
    leftovers = stray(tmp_path)
    assert len(leftovers) == 1, leftovers  # the killed build's temp dir, to be cleaned by the next build

    r = cli("build", "--checkpoint", tiny_llama_dir, "--out", out, "--dtype", "float32", "--no-engine")
    assert r.returncode == 0, r.stderr
    assert f"removed {leftovers[0]}, left by a killed build" in r.stdout
    assert stray(tmp_path) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert tree(out) != before and _logits(out).shape == want_logits.shape
