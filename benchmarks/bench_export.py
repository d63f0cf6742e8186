"""Export + verify of a Llama-3-8B-shaped random checkpoint: wall time and peak memory of each step.

What a user runs on a real checkpoint, timed: ``python -m export.build --checkpoint CK --quant int4 --dtype float16``
then ``python -m export.verify OUT --device D``. The checkpoint is random (no download), written as sharded fp16
safetensors with the Llama-3-8B config. Each step runs as a child process so its peak RSS (``ru_maxrss``) is its own
(host memory; verify's GPU use is not in it). The results (``benchmarks/results/<card>/bench_export.{json,md}``, the
card the machine's GPU, ``cpu`` without one) say which device verify's torch parts ran on.

    python benchmarks/bench_export.py [--layers 32] [--quant int4] [--device auto] [--workdir /tmp/bench_export]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import LLAMA3_8B, write_results  # noqa: E402


def write_random_checkpoint(path: Path, layers: int, seed: int = 0) -> float:
    """Sharded fp16 safetensors with HF names (one shard per layer) + config + tokenizer; returns GiB written."""
    from safetensors.torch import save_file

    from export.tiny import make_tokenizer

    cfg = dict(LLAMA3_8B, num_hidden_layers=layers)
    path.mkdir(parents=True, exist_ok=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(dev).manual_seed(seed)
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d

    def rand(*shape, std=0.02):
        return (torch.randn(*shape, generator=gen, device=dev) * std).half().cpu()

    shards = {"model-embed.safetensors": {"model.embed_tokens.weight": rand(v, h),
                                          "model.norm.weight": 1 + rand(h, std=0.1), "lm_head.weight": rand(v, h)}}
    for li in range(layers):
        p = f"model.layers.{li}."
        shards[f"model-layer{li:02d}.safetensors"] = {
            p + "self_attn.q_proj.weight": rand(h, h), p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, h),
            p + "mlp.gate_proj.weight": rand(i, h), p + "mlp.up_proj.weight": rand(i, h),
            p + "mlp.down_proj.weight": rand(h, i), p + "input_layernorm.weight": 1 + rand(h, std=0.1),
            p + "post_attention_layernorm.weight": 1 + rand(h, std=0.1)}
    weight_map, total = {}, 0
    for fname, tensors in shards.items():
        save_file(tensors, str(path / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    make_tokenizer(path)
    return total / 2**30


# Written into --workdir by the run that made it: only a directory carrying it is deleted by a later run.
WORKDIR_MARKER = ".tritrt-bench-export"


def prepare_workdir(workdir: Path) -> None:
    """Make ``workdir`` an empty directory of this benchmark's: created if missing; an existing one is deleted first
    only if it is empty or an earlier run of this benchmark made it (``WORKDIR_MARKER``), so that a mistyped
    ``--workdir`` (a checkpoint, a home directory) is refused, never deleted."""
    if workdir.is_symlink() or (workdir.exists() and not workdir.is_dir()):
        raise SystemExit(f"bench_export: --workdir {workdir} is not a directory; pass a new directory (it is created)")
    if workdir.exists():
        if any(workdir.iterdir()) and not (workdir / WORKDIR_MARKER).is_file():
            raise SystemExit(f"bench_export: --workdir {workdir} is not empty and no run of this benchmark made it, "
                             f"so it is not deleted: pass a new or empty directory")
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    (workdir / WORKDIR_MARKER).write_text("made by benchmarks/bench_export.py, whose next run with this --workdir "
                                          "deletes the whole directory\n")


def run_step(name: str, argv: list[str], log: Path) -> dict:
    """Run one CLI step as a child; its wall time, peak RSS and exit code (output appended to ``log``)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    with log.open("a") as f:
        f.write(f"\n$ {' '.join(argv)}\n")
        f.flush()
        rc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB; max over children so far
    row = dict(step=name, seconds=round(seconds, 1), peak_rss_gib=round(peak / 2**20, 2), exit_code=rc)
    if peak <= before:
        row["peak_rss_gib"] = f"<= {before / 2**20:.2f} (an earlier step's peak)"
    print(row, flush=True)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--quant", default="int4", choices=["none", "int8", "int4"])
    p.add_argument("--workdir", type=Path, default=Path("/tmp/bench_export"),
                   help="scratch directory (checkpoint, engine, log), deleted by the next run: new, empty, or an "
                        "earlier run's")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="export.verify's --device (torch references + fp32 HF model); auto: cuda if available")
    args = p.parse_args()
    # resolved here (export.verify's rule), so that the results name the device verify actually used
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    gpu = torch.cuda.get_device_name() if device == "cuda" else None
    prepare_workdir(args.workdir)
    ck, out = args.workdir / "checkpoint", args.workdir / "out"
    # the steps' output goes straight to the results directory when there is one (beside its card folders, not in
    # them: a log is a development record): a call cut off by its time limit still brings back the log of the step
    # it was in
    results_dir = os.environ.get("TRITRT_RESULTS_DIR")
    log = Path(results_dir) / "bench_export.log" if results_dir else args.workdir / "log.txt"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    t0 = time.perf_counter()
    gib = write_random_checkpoint(ck, args.layers)
    rows = [dict(step="write random checkpoint", seconds=round(time.perf_counter() - t0, 1), size_gib=round(gib, 2))]
    py = sys.executable
    meta = dict(model=f"Llama-3-8B-shaped, random fp16, {args.layers} layers", quant=args.quant, cpus=os.cpu_count(),
                verify_device=device + (f" ({gpu})" if gpu else ""))
    steps = [("export.build", [py, "-m", "export.build", "--checkpoint", str(ck), "--quant", args.quant,
                               "--dtype", "float16", "--out", str(out), "--no-engine"]),
             ("export.verify", [py, "-m", "export.verify", str(out), "--device", device])]
    for name, argv in steps:
        rows.append(run_step(name, argv, log))
        if name == "export.verify":
            rows[-1]["device"] = meta["verify_device"]
            meta["verify_phases"] = "; ".join(ln[len("export.verify: "):] for ln in log.read_text().splitlines()
                                              if ln.startswith("export.verify:") and " in " in ln)
        if name == "export.build" and rows[-1]["exit_code"] == 0:
            rows[-1]["size_gib"] = round(sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 2**30, 2)
        # Results after every step, so that a step cut off by a time limit still leaves the ones before it.
        write_results("bench_export", rows, ["step", "seconds", "peak_rss_gib", "size_gib", "device", "exit_code"],
                      meta=meta,
                      notes=f"Build runs on the CPU. Verify: ONNX Runtime on the CPU ({os.cpu_count()} cores), the "
                            f"plugin nodes' torch references, the lm_head MatMul and the fp32 HF model on {device}. "
                            + ("The GPU also generates the random weights. " if torch.cuda.is_available() else "")
                            + "No TensorRT engine (not installable here). "
                            "peak_rss_gib is host memory only.")
        if rows[-1]["exit_code"] != 0:
            break
    text = log.read_text()
    # verify's own phase timings and error summary, whatever Polygraphy printed around them
    keep = [ln for ln in text.splitlines() if ln.startswith(("export.verify:", "half build:"))]
    print(text[-4000:], "\n".join(keep), sep="\n")
    return 0 if all(r.get("exit_code", 0) == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
