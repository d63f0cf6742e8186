"""What ``python -m export.build`` tells the user while it works: progress on stderr when stderr is a terminal, nothing
there when it is not (no third-party progress bars or warnings either), and the total time in the summary."""

import os
import subprocess
import sys

from tests.cli.conftest import ROOT, cli


def test_piped_build_prints_no_progress_and_no_third_party_noise(tmp_path):
    """The built-in tiny model goes through transformers' save_pretrained, whose "Writing model shards" bar used to
    reach our stderr."""
    r = cli("build", "--tiny", "--out", tmp_path / "out", "--no-engine")
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    assert "total time:" in r.stdout and "--tiny: built-in tiny LLaMA" in r.stdout


def test_progress_on_a_terminal(tiny_llama_dir, tmp_path):
    import pty

    master, slave = pty.openpty()
    cmd = [sys.executable, "-m", "export.build", "--checkpoint", str(tiny_llama_dir), "--out", str(tmp_path / "out"),
           "--quant", "int8", "--no-engine"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 1 << 16)
        except OSError:  # EIO: the build exited and closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    stdout, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0
    drawn = b"".join(chunks).decode(errors="replace")
    for step in ("loading and quantizing the weights", "writing weights.safetensors", "exporting model.plugin.onnx"):
        assert step in drawn, drawn
    assert "total time:" in stdout.decode()
