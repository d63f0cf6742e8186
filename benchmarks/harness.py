"""The benchmark harness: device-event timing, rotating inputs, the copy-bandwidth ceiling, JSON + markdown results.

Every benchmark script times our kernel and its PyTorch baseline in the same run, on the same inputs, and writes
one result pair per benchmark, ``benchmarks/results/<card>/<name>.{json,md}`` (the card's folder from
``torch.cuda.get_device_name()``: "NVIDIA H100 80GB HBM3" -> ``h100``; ``cpu`` without CUDA), replacing that card's
previous result of the same benchmark: the folder holds what is current, git holds the history. Each result records
what it measured: the commit, whether the tree was dirty (and where), the card, driver, torch, triton and CUDA
versions, the date and the command. ``TRITRT_RESULTS_DIR`` writes the card folders somewhere else (a dev run, or
``$OUT`` on a lent GPU machine, where the command also needs the commit: see ``git_state``).

Timing: ``triton.testing.do_bench`` (CUDA events, median of repeats, L2 flushed between repeats). For memory-bound
kernels whose inputs fit in L2 (50-60 MB on H100/H200) the caller passes several input sets whose total exceeds
L2, and ``bench`` cycles through them so no repeat reads a warm cache.
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Callable, Sequence

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_ROOT = RESULTS_DIR.parents[1]
L2_BYTES = 64 << 20  # >= the L2 of H100 (50 MB) and H200 (60 MB)
# Llama-3-8B's config.json fields (the end-to-end and export benchmarks' model shape).
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5,
                 rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                 architectures=["LlamaForCausalLM"], model_type="llama", torch_dtype="float16", hidden_act="silu")
# Llama-2-13B's (MHA: 40 query and 40 KV heads; the generalization set's 13b_* GEMM shapes are its projections).
LLAMA2_13B = dict(vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                  num_attention_heads=40, num_key_value_heads=40, max_position_embeddings=4096, rms_norm_eps=1e-5,
                  rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                  architectures=["LlamaForCausalLM"], model_type="llama", torch_dtype="float16", hidden_act="silu")
# SmolLM2-135M-Instruct, the default model (export.build with no --checkpoint): its config.json as export.gguf writes it
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                    rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                    architectures=["LlamaForCausalLM"], model_type="llama", torch_dtype="float16", hidden_act="silu")
# Card folders by the first of these found in the device name (more specific before less: l40s before l40).
CARD_TAGS = ("h100", "h200", "b200", "a100", "l40s", "l40")
DIRTY_PATHS_SHOWN = 20
# bench(cuda_graph=True)'s graph: whole passes over the input sets until a replay lasts MIN_GRAPH_MS, at most
# MAX_GRAPH_CALLS calls (a graph's nodes cost host memory and capture time; 256 calls of a 4 us kernel last ~1 ms).
MIN_GRAPH_MS = 1.0
MAX_GRAPH_CALLS = 256


def card_name(device_name: str | None) -> str:
    """The results folder of a card: "NVIDIA H100 80GB HBM3" -> "h100", "NVIDIA H200" -> "h200", no GPU -> "cpu";
    other cards by name ("NVIDIA GeForce RTX 4090" -> "geforce-rtx-4090")."""
    if not device_name:
        return "cpu"
    name = device_name.lower()
    for tag in CARD_TAGS:
        if tag in name:
            return tag
    return re.sub(r"[^a-z0-9]+", "-", name.replace("nvidia", "")).strip("-")[:32] or "gpu"


def gpu_info() -> dict | None:
    """Name, SM count, memory and driver of GPU 0, or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, check=True).stdout.strip().splitlines()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        driver = "unknown"
    return dict(gpu=torch.cuda.get_device_name(0), driver=driver, sm_count=props.multi_processor_count,
                gpu_mem_gib=round(props.total_memory / 2**30, 1))


def git_state(repo: Path | None = None) -> dict:
    """The commit measured and the uncommitted changes on top of it, taken once per process (the first call: the
    first timing or result of the run).

    From ``TRITRT_COMMIT`` and ``TRITRT_DIRTY`` (entries separated by commas or newlines; empty: clean; unset: not
    known) where the command sets them, which it must on a lent GPU machine: the tree there is a copy whose ``.git``,
    if any, is not the checkout's (one had an hours-old HEAD), so ``python -m benchmarks.harness`` prints the two
    assignments to put in front of the command. Otherwise from git: ``dirty_paths`` lists ``git status --porcelain``
    entries (status code and path) outside the results folder (a run's own output is not a change to what it
    measured), at most ``DIRTY_PATHS_SHOWN`` of them. Neither: the commit is "unknown" and ``dirty`` None.
    """
    return _git_state(Path(repo or REPO_ROOT).resolve())


@functools.lru_cache(maxsize=None)
def _git_state(repo: Path) -> dict:
    commit = os.environ.get("TRITRT_COMMIT")
    if commit:
        dirty = os.environ.get("TRITRT_DIRTY")
        entries = None if dirty is None else [e.strip() for e in re.split(r"[,\n]", dirty) if e.strip()]
        return dict(commit=commit, dirty=None if entries is None else bool(entries), dirty_paths=entries or [],
                    commit_source="TRITRT_COMMIT")
    try:
        return dict(_from_git(repo), commit_source="git")
    except (OSError, subprocess.CalledProcessError):
        return dict(commit="unknown", dirty=None, dirty_paths=[], commit_source=None)


def _from_git(repo: Path) -> dict:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout

    commit = git("rev-parse", "HEAD").strip()
    entries = [ln.strip() for ln in git("status", "--porcelain", "--", ".", ":(exclude)benchmarks/results").splitlines()
               if ln.strip()]
    shown = entries[:DIRTY_PATHS_SHOWN]
    if len(entries) > len(shown):
        shown.append(f"... and {len(entries) - len(shown)} more")
    return dict(commit=commit, dirty=bool(entries), dirty_paths=shown)


def provenance_env(repo: Path | None = None) -> str:
    """``TRITRT_COMMIT=... TRITRT_DIRTY=...`` of this checkout, to put in front of a benchmark that runs on a copy of
    it (``python -m benchmarks.harness`` prints it)."""
    state = _from_git(Path(repo or REPO_ROOT).resolve())
    return f"TRITRT_COMMIT={state['commit']} TRITRT_DIRTY={shlex.quote(','.join(state['dirty_paths']))}"


def _command() -> str:
    """How the benchmark was started: its BENCH_* variables and argv (script path relative to the repository)."""
    argv = list(sys.argv)
    if argv and argv[0]:
        try:
            argv[0] = str(Path(argv[0]).resolve().relative_to(REPO_ROOT))
        except ValueError:
            pass
    env = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("BENCH_")]
    return " ".join(env + ["python", *argv])


def run_info() -> dict:
    """Recorded with every result: date, host, card, GPU, driver, torch / triton / CUDA versions, commit, dirty
    paths and command."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    gpu = gpu_info()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "card": card_name(gpu["gpu"] if gpu else None),
        **(gpu or {}),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        **git_state(),
        "command": _command(),
    }


def rotating_inputs(make: Callable[[], tuple], bytes_per_set: int, min_total: int = 2 * L2_BYTES) -> list[tuple]:
    """Enough independent input sets (from ``make()``) that cycling through them never hits a warm L2."""
    n = max(1, -(-min_total // max(1, bytes_per_set)))
    return [make() for _ in range(min(n, 64))]


def bench(fn: Callable, input_sets: Sequence[tuple], warmup_ms: int = 25, rep_ms: int = 100,
          cuda_graph: bool = False, after_idle_s: float = 0.0, idle_burst_ms: float = 0.0) -> float:
    """Median milliseconds of ``fn(*inputs)``, cycling through ``input_sets`` call by call.

    ``cuda_graph=True``: capture one CUDA graph that calls ``fn`` back to back, cycling through the input sets, time
    its replays and divide by the number of calls. This leaves out the host's launch overhead (a decode step runs as a
    graph or a TensorRT engine, not from Python), which otherwise dominates short kernels (``ms`` vs ``ms_eager`` in
    ``results/<card>/bench_gemm_routed.md``); rotation still keeps every call's inputs out of L2. The graph holds
    whole passes over the sets, as many as make a replay last ``MIN_GRAPH_MS`` (see ``_graph_of_calls``): a replay
    has a fixed cost, mostly the dirty L2 that do_bench's cache flush leaves, which one pass over 1-2 large sets
    added whole to every call.

    ``after_idle_s`` (with ``cuda_graph``): time replays after the GPU sat idle that long, instead of back to back.
    Replays back to back for a second or more hold a tensor-core-bound GPU at its power limit, where its clock drops
    (an H200 at ~690 W: 1980 -> ~1540 MHz under cuBLAS's fp16 prefill, ~1650-1800 MHz under the W4A16 GEMM's); after
    an idle second a replay runs at the full clock, as a lone request's would. Each sample is one burst of replays
    back to back, as many as take ``idle_burst_ms`` (at least one): a short graph (one GEMM) is timed inside a burst
    as long as a lone prompt's prefill (~45 ms at the Llama-3-8B shape on an H200), not alone, where the first
    kernel's start after the idle pause would be most of what is timed.
    """
    if after_idle_s > 0 and not cuda_graph:
        raise ValueError("after_idle_s times CUDA-graph replays: pass cuda_graph=True")
    import triton.testing

    git_state()  # the tree measured, taken before the first timing (a long run outlives edits to the working tree)

    if cuda_graph:
        graph, calls = _graph_of_calls(fn, input_sets)
        if after_idle_s > 0:
            return _median_after_idle(graph.replay, after_idle_s, idle_burst_ms) / calls
        ms = float(triton.testing.do_bench(graph.replay, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
        return ms / calls

    state = {"i": 0}

    def call():
        args = input_sets[state["i"] % len(input_sets)]
        state["i"] += 1
        return fn(*args)

    return float(triton.testing.do_bench(call, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def _graph_of_calls(fn: Callable, input_sets: Sequence[tuple]) -> tuple[torch.cuda.CUDAGraph, int]:
    """A CUDA graph of ``fn`` called on each input set in turn, for whole passes over the sets: one pass, or as many
    as make a replay last at least ``MIN_GRAPH_MS`` (at most ``MAX_GRAPH_CALLS`` calls); returns it and its number of
    calls. A replay's fixed cost is then ~1-2% of what is timed, on our kernels and the baseline alike. That cost is
    mostly the L2 left dirty by do_bench's flush before each replay (a 256 MB memset): the first kernel writes back
    ~50 MB as it reads, ~17 us on an H100. One pass charged it to a call divided by the number of sets, which
    differs between a baseline and ours (fp16 weights are 4x int4's: fewer sets), so ratios were biased both ways:
    H100, M = 1, one pass at 3866c73 -> passes at 83e7b65: 13b_gate_up cuBLAS (1 set) 114.9 -> 98.3 us, our W4A16
    (2 sets) 35.7 -> 29.3 us, 3.22 -> 3.36x; 1b_o cuBLAS (16 sets) 7.10 -> 6.24 us, ours (64) 3.12 -> 2.96 us,
    2.26 -> 2.11x."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (JIT compile, lazy allocations) outside the capture
        for args in input_sets:
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)

    def capture(passes: int) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(passes):
                for args in input_sets:
                    fn(*args)
        return graph

    graph = capture(1)
    graph.replay()  # the first replay uploads the graph
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    end.synchronize()
    pass_ms = start.elapsed_time(end) / 3
    passes = _graph_passes(pass_ms, len(input_sets))
    if passes == 1:
        return graph, len(input_sets)
    del graph
    return capture(passes), passes * len(input_sets)


def _graph_passes(pass_ms: float, n_sets: int) -> int:
    """Passes over ``n_sets`` input sets in one graph: enough for ``MIN_GRAPH_MS`` at ``pass_ms`` a pass, at most
    ``MAX_GRAPH_CALLS`` calls, at least one pass."""
    return max(1, min(math.ceil(MIN_GRAPH_MS / max(pass_ms, 1e-4)), MAX_GRAPH_CALLS // n_sets))


def _median_after_idle(replay: Callable, idle_s: float, burst_ms: float = 0.0, samples: int = 5) -> float:
    """Median ms per ``replay()`` of ``samples`` bursts, each after ``idle_s`` seconds of an idle GPU: one burst is
    as many replays back to back as take ``burst_ms`` (at least one; sized by a replay before the samples)."""
    import time

    replay()  # first-replay costs (graph upload) out of the samples
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    replay()  # sizes the burst
    end.record()
    end.synchronize()
    reps = _burst_replays(burst_ms, start.elapsed_time(end))
    times = []
    for _ in range(samples):
        time.sleep(idle_s)
        start.record()
        for _ in range(reps):
            replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return float(statistics.median(times))


def _burst_replays(burst_ms: float, replay_ms: float, cap: int = 1000) -> int:
    """Replays in one after-idle burst: enough to take ``burst_ms`` at ``replay_ms`` each, 1 to ``cap``."""
    return max(1, min(cap, round(burst_ms / max(replay_ms, 1e-3))))


def copy_bandwidth_gbs(nbytes: int = 1 << 30, dtype=torch.bfloat16) -> float:
    """Measured device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written: the ceiling."""
    elem = torch.tensor([], dtype=dtype).element_size()
    src = torch.randn(nbytes // elem, device="cuda").to(dtype)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), [()])
    return 2 * nbytes / (ms * 1e-3) / 1e9


def results_dir(card: str) -> Path:
    """``benchmarks/results/<card>`` (or ``$TRITRT_RESULTS_DIR/<card>``)."""
    return Path(os.environ.get("TRITRT_RESULTS_DIR") or RESULTS_DIR) / card


def _provenance_line(info: dict) -> str:
    commit = info["commit"] if info["commit"] == "unknown" else info["commit"][:12]
    if info["dirty"] is None:
        state = "uncommitted changes unknown"
    elif info["dirty"]:
        state = "plus uncommitted changes: " + ", ".join(info["dirty_paths"])
    else:
        state = "clean tree"
    return f"commit {commit}, {state} | `{info['command']}`"


def write_results(name: str, rows: list[dict], columns: Sequence[str], meta: dict | None = None,
                  notes: str = "") -> Path:
    """Write ``<card>/<name>.json`` (``run_info()``, ``meta`` and ``rows``) and ``<card>/<name>.md`` (the same with a
    markdown table of ``columns``) under ``results_dir``, replacing the card's previous result; return the .md path."""
    if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
        raise ValueError(f"benchmark name {name!r}: letters, digits, '_' and '-' only (it names the result files)")
    info = run_info()
    out_dir = results_dir(info["card"])
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / name
    payload = {"benchmark": name, "env": info, "meta": meta or {}, "rows": rows}
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=1) + "\n")

    def fmt(v):
        if v is None:  # a value not measured (or not comparable) in this row
            return ""
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
        return str(v)

    lines = [f"# {name}", "",
             f"{info.get('gpu', 'no GPU')} | driver {info.get('driver', '-')} | torch {info['torch']} | "
             f"triton {info['triton']} | CUDA {info['cuda']} | {info['date']}", "", _provenance_line(info), ""]
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


if __name__ == "__main__":
    print(provenance_env())
