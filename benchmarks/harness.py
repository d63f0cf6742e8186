"""The benchmark harness: device-event timing, rotating inputs, the copy-bandwidth ceiling, JSON + markdown results.

Every benchmark script times our kernel and its PyTorch baseline in the same run, on the same inputs, and writes
one results file pair under ``benchmarks/results/`` named after the script and the card.

Timing: ``triton.testing.do_bench`` (CUDA events, median of repeats, L2 flushed between repeats). For memory-bound
kernels whose inputs fit in L2 (50-60 MB on H100/H200) the caller passes several input sets whose total exceeds
L2, and ``bench`` cycles through them so no repeat reads a warm cache.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path
from typing import Callable, Sequence

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
L2_BYTES = 64 << 20  # >= the L2 of H100 (50 MB) and H200 (60 MB)
# Llama-3-8B's config.json fields (the end-to-end and export benchmarks' model shape).
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5,
                 rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                 architectures=["LlamaForCausalLM"], model_type="llama", torch_dtype="float16", hidden_act="silu")


def env_info() -> dict:
    """GPU name, driver, CUDA, torch and triton versions: recorded with every result."""
    import triton

    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, sm_count=props.multi_processor_count, gpu_mem_gib=round(props.total_memory / 2**30, 1))
        try:
            import subprocess

            info["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            info["driver"] = "unknown"
    return info


def card_slug() -> str:
    """A short file-name tag for the card, e.g. 'h100' or 'h200'."""
    name = torch.cuda.get_device_name(0).lower() if torch.cuda.is_available() else "cpu"
    for tag in ("h200", "h100", "a100", "l40", "b200"):
        if tag in name:
            return tag
    return "".join(c for c in name if c.isalnum())[:16] or "gpu"


def rotating_inputs(make: Callable[[], tuple], bytes_per_set: int, min_total: int = 2 * L2_BYTES) -> list[tuple]:
    """Enough independent input sets (from ``make()``) that cycling through them never hits a warm L2."""
    n = max(1, -(-min_total // max(1, bytes_per_set)))
    return [make() for _ in range(min(n, 64))]


def bench(fn: Callable, input_sets: Sequence[tuple], warmup_ms: int = 25, rep_ms: int = 100,
          cuda_graph: bool = False) -> float:
    """Median milliseconds of ``fn(*inputs)``, cycling through ``input_sets`` call by call.

    ``cuda_graph=True``: capture one CUDA graph that calls ``fn`` once per input set, back to back, time its replays
    and divide by the number of sets. This leaves out the host's launch overhead (a decode step runs as a graph or a
    TensorRT engine, not from Python), which otherwise dominates kernels of ~10-50 us; rotation still keeps every
    call's inputs out of L2.
    """
    import triton.testing

    if cuda_graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up (JIT compile, lazy allocations) outside the capture
            for args in input_sets:
                fn(*args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for args in input_sets:
                fn(*args)
        ms = float(triton.testing.do_bench(graph.replay, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
        return ms / len(input_sets)

    state = {"i": 0}

    def call():
        args = input_sets[state["i"] % len(input_sets)]
        state["i"] += 1
        return fn(*args)

    return float(triton.testing.do_bench(call, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def copy_bandwidth_gbs(nbytes: int = 1 << 30, dtype=torch.bfloat16) -> float:
    """Measured device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written: the ceiling."""
    elem = torch.tensor([], dtype=dtype).element_size()
    src = torch.randn(nbytes // elem, device="cuda").to(dtype)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), [()])
    return 2 * nbytes / (ms * 1e-3) / 1e9


def write_results(name: str, rows: list[dict], columns: Sequence[str], meta: dict | None = None, notes: str = "") -> Path:
    """Write ``results/<name>_<card>.json`` and ``.md`` (a markdown table of ``columns``); return the .md path."""
    out_dir = Path(os.environ.get("TRITRT_RESULTS_DIR", RESULTS_DIR))
    out_dir.mkdir(parents=True, exist_ok=True)
    env = env_info()
    stem = out_dir / f"{name}_{card_slug()}"
    payload = {"benchmark": name, "env": env, "meta": meta or {}, "rows": rows}
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=1) + "\n")

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
        return str(v)

    lines = [f"# {name}", "", f"{env.get('gpu', 'no GPU')} | driver {env.get('driver', '-')} | torch {env['torch']} | "
             f"triton {env['triton']} | CUDA {env['cuda']} | {env['date']}", ""]
    for k, v in (meta or {}).items():
        lines.append(f"- {k}: {fmt(v)}")
    if meta:
        lines.append("")
    lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    if notes:
        lines += ["", notes]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return stem.with_suffix(".md")
