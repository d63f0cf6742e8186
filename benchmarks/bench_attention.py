"""Attention benchmarks: flash prefill (TFLOP/s vs SDPA flash) and paged decode (GB/s vs copy bandwidth and vs
gather + SDPA), all measured in one run on one card.

Run on the GPU from the repo root: ``python3 -m benchmarks.bench_attention [--sweep [--sweep-prefill]]``;
``--one-launch``: the engine's one-launch paged attention against the torch op's kernels, per step kind. ``--sweep``
first times a few decode tile configurations (``--sweep-prefill``: prefill tiles too); these are the numbers behind
the defaults in ``kernels/prefill_attention.py`` and ``kernels/decode_attention.py``. Results:
``benchmarks/results/<card>/bench_attention_{prefill,decode,sweep}.{json,md}``.

Prefill: causal bf16, packed sequences of length S with batch 16384 // S (16k tokens per call); FLOPs counted as
``2 * 2 * S^2 * Hq * D / 2`` per sequence (causal half). Baseline: ``F.scaled_dot_product_attention`` forced onto
the flash backend on the same memory ([B, S, H, D] viewed as [B, H, S, D]), with K/V expanded to Hq heads
beforehand (the flash backend takes no GQA), so it does the same FLOPs.

Decode: one token per sequence, 32 q / 8 kv heads, d128, block 16, bf16; block tables are random permutations.
Bytes = K + V of every sequence + q + out. Baseline: gather the pages (``cache[block_table]``) then SDPA.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import torch
import torch.nn.functional as F

from benchmarks.harness import bench, copy_bandwidth_gbs, rotating_inputs, write_results
from kernels.decode_attention import alloc_decode_scratch, decode_attention, decode_attention_launch_config
from kernels.prefill_attention import prefill_attention_launch_config, varlen_attention

DT = torch.bfloat16
TOKENS = 16384


def _prefill_inputs(seq, hq, hk, d):
    b = TOKENS // seq
    q = torch.randn(b * seq, hq, d, device="cuda", dtype=DT)
    k = torch.randn(b * seq, hk, d, device="cuda", dtype=DT)
    v = torch.randn(b * seq, hk, d, device="cuda", dtype=DT)
    cu = torch.arange(0, b * seq + 1, seq, dtype=torch.int32, device="cuda")
    return b, q, k, v, cu


def _run_prefill_cfg(cfg, q, k, v, cu, out):
    cfg.launch(q, k, v, out, cu, cu, cu, cu.shape[0] - 1, q.shape[0], 1, q.stride(0), k.stride(0), v.stride(0),
               out.stride(0), 0)


def bench_prefill(rows_out):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for hq, hk, d in ((32, 8, 128), (32, 8, 64), (32, 32, 128)):
        for seq in (1024, 2048, 4096, 8192, 16384):
            b, q, k, v, cu = _prefill_inputs(seq, hq, hk, d)
            scale = d ** -0.5
            out = torch.empty_like(q)
            # default args bind this iteration's tensors: the names are del-ed below to free memory
            ms = bench(lambda q=q, k=k, v=v, out=out: varlen_attention(q, k, v, cu, seq, scale, True, out=out), [()])
            q4 = q.view(b, seq, hq, d).transpose(1, 2)
            k4 = k.repeat_interleave(hq // hk, dim=1).view(b, seq, hq, d).transpose(1, 2)
            v4 = v.repeat_interleave(hq // hk, dim=1).view(b, seq, hq, d).transpose(1, 2)
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                ms_ref = bench(lambda q4=q4, k4=k4, v4=v4: F.scaled_dot_product_attention(q4, k4, v4, is_causal=True,
                                                                                        scale=scale), [()])
                ref = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale).transpose(1, 2)
            err = float((out.view(b, seq, hq, d).float() - ref.float()).abs().max())
            flops = 2 * 2 * seq * seq * hq * d / 2 * b
            tf, tf_ref = flops / ms / 1e9, flops / ms_ref / 1e9
            rows_out.append(dict(heads=f"{hq}/{hk}", d=d, seq=seq, batch=b, ms=ms, tflops=tf, sdpa_ms=ms_ref,
                                 sdpa_tflops=tf_ref, ratio=tf / tf_ref, max_diff_vs_sdpa=err))
            print(rows_out[-1], flush=True)
            del q, k, v, q4, k4, v4, out
    torch.cuda.empty_cache()


def _decode_set(bs, kv, hq, hk, d, page):
    nblk = kv // page
    k_cache = torch.randn(bs * nblk, page, hk, d, device="cuda", dtype=DT)
    v_cache = torch.randn_like(k_cache)
    block_table = torch.randperm(bs * nblk, device="cuda", dtype=torch.int32).view(bs, nblk)
    seq_lens = torch.full((bs,), kv, dtype=torch.int32, device="cuda")
    cu = torch.arange(bs + 1, dtype=torch.int32, device="cuda")
    q = torch.randn(bs, hq, d, device="cuda", dtype=DT)
    return (q, k_cache, v_cache, block_table, seq_lens, cu, torch.empty_like(q),
            alloc_decode_scratch(bs, hq, hk, d, "cuda"))


def _gather_sdpa(q, k_cache, v_cache, block_table, seq_lens, cu, out, scratch):
    bs, hq, d = q.shape
    hk = k_cache.shape[2]
    k = k_cache[block_table].view(bs, -1, hk, d).transpose(1, 2)
    v = v_cache[block_table].view(bs, -1, hk, d).transpose(1, 2)
    return F.scaled_dot_product_attention(q.view(bs, hq, 1, d), k, v, scale=d ** -0.5, enable_gqa=True)


def bench_decode(rows_out, copy_gbs):
    hq, hk, d, page = 32, 8, 128, 16
    for bs in (1, 16, 64):
        for kv in (1024, 4096, 16384):
            set_bytes = 2 * bs * kv * hk * d * 2
            sets = rotating_inputs(lambda: _decode_set(bs, kv, hq, hk, d, page), set_bytes)

            def ours(q, kc, vc, bt, sl, cu, out, scratch):
                return decode_attention(q, kc, vc, bt, sl, cu, d ** -0.5, out=out, scratch=scratch)

            ms_eager = bench(ours, sets)
            ms = bench(ours, sets, cuda_graph=True)
            ms_ref = bench(_gather_sdpa, sets, cuda_graph=True)
            s0 = sets[0]
            err = float((ours(*s0).float() - _gather_sdpa(*s0).view(bs, hq, d).float()).abs().max())
            nbytes = set_bytes + 2 * bs * hq * d * 2
            gbs = nbytes / ms / 1e6
            splits = decode_attention_launch_config(bs, hq, hk, d, page, kv // page, 1.0).grid[2]
            rows_out.append(dict(bs=bs, kv=kv, splits=splits, us=ms * 1e3, us_eager=ms_eager * 1e3, gbs=gbs,
                                 pct_copy=100 * gbs / copy_gbs,
                                 baseline_us=ms_ref * 1e3, speedup=ms_ref / ms, max_diff_vs_sdpa=err))
            print(rows_out[-1], flush=True)
            del sets
            torch.cuda.empty_cache()


def sweep(rows_out, prefill: bool):
    """Time tile configs on representative shapes (no defaults are changed by this)."""
    for hq, hk, d, configs in ((32, 8, 128, [(128, 128, 8, 3), (128, 128, 8, 4), (128, 64, 8, 3), (64, 128, 4, 3)]),
                               (32, 8, 64, [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 4), (64, 64, 4, 4)])):
        for seq in (2048, 16384) if prefill else ():
            b, q, k, v, cu = _prefill_inputs(seq, hq, hk, d)
            out = torch.empty_like(q)
            base = prefill_attention_launch_config(q.shape[0], b, hq, hk, d, d ** -0.5, True, paged=False)
            for bm, bn, w, st in configs:
                cfg = dataclasses.replace(base, grid=(math.ceil(q.shape[0] / bm) + b, hq), num_warps=w, num_stages=st,
                                          constexprs={**base.constexprs, "BLOCK_M": bm, "BLOCK_N": bn})
                try:
                    ms = bench(lambda: _run_prefill_cfg(cfg, q, k, v, cu, out), [()])
                except Exception as e:  # out of shared memory etc.: record, keep sweeping
                    rows_out.append(dict(kernel="prefill", shape=f"d{d} S{seq}", cfg=f"{bm}/{bn}/w{w}/s{st}",
                                         error=str(e)[:60]))
                    continue
                tf = 2 * 2 * seq * seq * hq * d / 2 * b / ms / 1e9
                rows_out.append(dict(kernel="prefill", shape=f"d{d} S{seq}", cfg=f"{bm}/{bn}/w{w}/s{st}", metric=tf))
                print(rows_out[-1], flush=True)
    hq, hk, d, page = 32, 8, 128, 16
    for bs, kv in ((1, 16384), (16, 1024), (16, 4096), (64, 1024), (64, 4096)):
        sets = rotating_inputs(lambda: _decode_set(bs, kv, hq, hk, d, page), 2 * bs * kv * hk * d * 2)
        auto = decode_attention_launch_config(bs, hq, hk, d, page, kv // page, d ** -0.5).grid[2]
        for bn, w, st, splits, pf in ((64, 4, 2, auto, True), (64, 4, 2, auto, False), (64, 4, 3, auto, True),
                                      (64, 4, 3, auto, False), (32, 4, 3, auto, True), (128, 8, 2, auto, True),
                                      (64, 8, 2, auto, True), (64, 4, 2, 2 * auto, True)):
            splits = min(64, splits)
            base = decode_attention_launch_config(bs, hq, hk, d, page, kv // page, d ** -0.5, num_splits=splits)
            cfg = dataclasses.replace(base, num_warps=w, num_stages=st,
                                      constexprs={**base.constexprs, "BLOCK_N": bn, "PREFETCH_PAGES": pf})

            def run(q, kc, vc, bt, sl, cu, out, scratch, cfg=cfg):
                cfg.launch(q, kc, vc, out, bt, sl, cu, *scratch, q.shape[0], kc.shape[0], q.stride(0), out.stride(0),
                           bt.stride(0))

            ms = bench(run, sets, cuda_graph=True)
            gbs = (2 * bs * kv * hk * d * 2 + 2 * bs * hq * d * 2) / ms / 1e6
            rows_out.append(dict(kernel="decode", shape=f"bs{bs} kv{kv}",
                                 cfg=f"N{bn}/w{w}/s{st}/splits{splits}/pf{int(pf)}",
                                 metric=gbs))
            print(rows_out[-1], flush=True)
        del sets
        torch.cuda.empty_cache()


def sweep_small_batch(rows_out):
    """Decode as a Llama-3-8B decode step runs it: 32 layers' calls back to back in one CUDA graph, each on its own
    cache (fp16, 32q/8kv d128, block 16), the block table as wide as the runtime's (137 blocks: a 2k prompt + 128 new
    tokens), at small batches where a call is a chain of memory round trips rather than bandwidth. Times the default
    launch and variants of splits / BLOCK_N / warps / stages. (The dev-log's "previous kernel" rows came from a copy of
    the older kernel file present for that run only.)"""
    from kernels._launch import LaunchConfig

    hq, hk, d, page, width, layers = 32, 8, 128, 16, 137, 32
    for bs, ctx in ((1, 512), (1, 2048), (8, 512), (32, 512)):
        sets = []
        for _ in range(layers):
            nblk = bs * width + 8
            kc = torch.randn(nblk, page, hk, d, device="cuda", dtype=torch.float16)
            bt = torch.randperm(nblk, device="cuda", dtype=torch.int32)[: bs * width].view(bs, width).contiguous()
            q = torch.randn(bs, hq, d, device="cuda", dtype=torch.float16)
            sets.append((q, kc, torch.randn_like(kc), torch.empty_like(q), bt,
                         torch.full((bs,), ctx, dtype=torch.int32, device="cuda"),
                         torch.arange(bs + 1, dtype=torch.int32, device="cuda")))
        scratch = alloc_decode_scratch(bs, hq, hk, d, "cuda")
        q0, kc0, vc0, _, bt0, sl0, cu0 = sets[0]
        ref = _gather_sdpa(q0, kc0, vc0, bt0[:, :ctx // page], sl0, cu0, None, None)  # the blocks holding ctx

        def timed(cfg, tag, sets=sets):
            def f(q, kc, vc, out, bt, sl, cu):
                cfg.launch(q, kc, vc, out, bt, sl, cu, *scratch, q.shape[0], kc.shape[0], q.stride(0), out.stride(0),
                           bt.stride(0))
            try:
                us = bench(f, sets, cuda_graph=True) * 1e3
            except Exception as e:  # out of registers / shared memory: record, keep sweeping
                rows_out.append(dict(shape=f"bs{bs} ctx{ctx}", cfg=tag, error=f"{type(e).__name__}: {str(e)[:60]}"))
                return
            f(*sets[0])
            err = float((sets[0][3].float() - ref.view(bs, hq, d).float()).abs().max())
            rows_out.append(dict(shape=f"bs{bs} ctx{ctx}", cfg=tag, us=us, max_diff_vs_sdpa=err))
            print(rows_out[-1], flush=True)

        base = decode_attention_launch_config(bs, hq, hk, d, page, width, d ** -0.5)
        timed(base, f"default splits{base.grid[2]}")
        for splits in (1, 2, 4, 8, 16, 32):
            for bn, warps, stages in ((64, 4, 2), (64, 4, 1), (32, 4, 2), (32, 2, 2), (16, 2, 2), (128, 8, 2)):
                c = decode_attention_launch_config(bs, hq, hk, d, page, width, d ** -0.5, num_splits=splits)
                cfg = LaunchConfig(c.kernel, c.grid, {**c.constexprs, "BLOCK_N": bn}, warps, stages)
                timed(cfg, f"splits{splits} N{bn} w{warps} s{stages}")
        sets.clear()
        torch.cuda.empty_cache()


def bench_one_launch(rows_out):
    """The engine's attention kernel (``kernels.paged_attention``: one launch that picks decode or prefill on the
    device, launched for either q_hint) against the kernel the torch op picks on the host for the same step
    (``decode_attention`` when every sequence has one new token, else ``paged_prefill_attention``), same inputs, each
    in CUDA graphs over rotating input sets. fp16, 32q/8kv d128, block 16, each table 8 blocks wider than its context
    (the table's width sets the decode splits of both: the one-launch kernel's by ``one_launch_splits``, the decode
    kernel's by ``decode_launch_splits``, which may take more).
    ``bench_plugin_layer`` judges bs 1 x 512 inside a layer; these are the other shapes."""
    from kernels.paged_attention import paged_attention_one_launch, paged_attention_scratch
    from kernels.prefill_attention import paged_prefill_attention

    hq, hk, d, page = 32, 8, 128, 16
    steps = [(f"decode bs{bs} ctx{ctx}", [1] * bs, [ctx] * bs) for bs in (1, 8, 32, 128) for ctx in (512, 2048, 8192)
             if bs * ctx <= 128 * 2048]
    steps += [("prefill 1x2048", [2048], [0]), ("prefill 4x512", [512] * 4, [0] * 4),
              ("mixed 512-chunk + 31 decode", [512] + [1] * 31, [1024] * 32)]
    for name, q_lens, ctx in steps:
        s, t = len(q_lens), sum(q_lens)
        width = max(-(-(q + c) // page) for q, c in zip(q_lens, ctx)) + 8
        set_bytes = 2 * s * width * page * hk * d * 2
        cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        seq_lens = torch.tensor([q + c for q, c in zip(q_lens, ctx)], dtype=torch.int32, device="cuda")
        scratch = paged_attention_scratch(s, hq, hk, d, "cuda")
        decode_scratch = alloc_decode_scratch(s, hq, hk, d, "cuda")

        def make():
            kc = torch.randn(s * width, page, hk, d, device="cuda", dtype=torch.float16)
            bt = torch.randperm(s * width, device="cuda", dtype=torch.int32).view(s, width)
            q = torch.randn(t, hq, d, device="cuda", dtype=torch.float16)
            return q, kc, torch.randn_like(kc), bt, torch.empty_like(q)

        sets = rotating_inputs(make, set_bytes)
        decode = max(q_lens) == 1

        def torch_path(q, kc, vc, bt, out):
            if decode:
                return decode_attention(q, kc, vc, bt, seq_lens, cu, d ** -0.5, out=out, scratch=decode_scratch)
            return paged_prefill_attention(q, kc, vc, bt, seq_lens, cu, d ** -0.5, out=out, max_seqlen_q=max(q_lens))

        def one_launch(q_hint):
            def run(q, kc, vc, bt, out):
                return paged_attention_one_launch(q, kc, vc, bt, seq_lens, cu, d ** -0.5, scratch, out=out,
                                                  q_hint=q_hint)
            return run

        def prefill_kernel(q, kc, vc, bt, out):  # what the engine ran for every step before the one-launch kernel
            return paged_prefill_attention(q, kc, vc, bt, seq_lens, cu, d ** -0.5, out=out)

        us_torch = bench(torch_path, sets, cuda_graph=True) * 1e3
        us_q1 = bench(one_launch(1), sets, cuda_graph=True) * 1e3
        us_q128 = bench(one_launch(128), sets, cuda_graph=True) * 1e3
        us_prefill = bench(prefill_kernel, sets, cuda_graph=True) * 1e3
        tuned = one_launch(1 if decode else 128)
        diff = float((torch_path(*sets[0]).float() - tuned(*sets[0]).float()).abs().max())
        rows_out.append(dict(step=name, tokens=t, seqs=s, table_width=width, torch_us=us_torch, one_launch_q1_us=us_q1,
                             one_launch_q128_us=us_q128, torch_over_q1=us_torch / us_q1,
                             torch_over_q128=us_torch / us_q128, prefill_kernel_us=us_prefill, max_abs_diff=diff))
        print(rows_out[-1], flush=True)
        del sets
        torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time decode tile configurations")
    parser.add_argument("--sweep-prefill", action="store_true", help="with --sweep: prefill tiles too")
    parser.add_argument("--skip-prefill", action="store_true")
    parser.add_argument("--sweep-small", action="store_true",
                        help="only the small-batch decode sweep (32 layers' calls in one graph)")
    parser.add_argument("--one-launch", action="store_true",
                        help="only the engine's one-launch kernel against the torch op's choice, per step")
    args = parser.parse_args()
    if args.one_launch:
        rows = []
        bench_one_launch(rows)
        write_results("bench_attention_one_launch", rows,
                      ["step", "tokens", "seqs", "table_width", "torch_us", "one_launch_q1_us", "one_launch_q128_us",
                       "torch_over_q1", "torch_over_q128", "prefill_kernel_us", "max_abs_diff"],
                      notes="torch_us: the kernel tritrt::paged_attention picks for the step (decode_attention or "
                            "paged_prefill_attention); one_launch_q*_us: kernels.paged_attention (the PagedAttention "
                            "plugin's kernel) launched for q_hint 1 / 128, its two tactics (an engine runs one per "
                            "optimization profile, the one TensorRT timed faster at the profile's opt shape); "
                            "torch_over_q*: torch_us over each (>= 1: as fast as the torch path); max_abs_diff: torch "
                            "path vs the q_hint of the step's kind (1 for decode steps, else 128); prefill_kernel_us: "
                            "paged_prefill_attention on the same step with its long-prompt tiles, the engine's kernel "
                            "for every step before 154d2dc. Each a CUDA graph over rotating input sets "
                            "larger than L2, fp16 32q/8kv d128 block 16.")
        return
    if args.sweep_small:
        rows = []
        sweep_small_batch(rows)
        write_results("bench_attention_sweep_small", rows, ["shape", "cfg", "us", "max_diff_vs_sdpa", "error"],
                      notes="us: one call, = a CUDA graph of 32 calls (one per layer cache) / 32, fp16 32q/8kv d128, "
                            "block 16, block table 137 wide.")
        return
    copy_gbs = copy_bandwidth_gbs()
    print(f"copy bandwidth {copy_gbs:.0f} GB/s", flush=True)
    if args.sweep:
        rows = []
        sweep(rows, args.sweep_prefill)
        write_results("bench_attention_sweep", rows, ["kernel", "shape", "cfg", "metric", "error"],
                      notes="metric: TFLOP/s (prefill, causal bf16) or GB/s (decode, bf16, 32q/8kv d128 block 16).")
    decode_rows = []
    bench_decode(decode_rows, copy_gbs)
    write_results("bench_attention_decode", decode_rows,
                  ["bs", "kv", "splits", "us", "gbs", "pct_copy", "baseline_us", "speedup", "us_eager",
                   "max_diff_vs_sdpa"],
                  meta=dict(copy_gbs=copy_gbs, heads="32q/8kv", head_dim=128, block_size=16, dtype="bf16"),
                  notes="us / baseline_us: CUDA-graph replay (harness.bench: calls cycling through rotating "
                        "input sets, a replay of >= 1 ms), as deployed; "
                        "us_eager: our Python launcher without graphs. gbs counts K+V+q+out bytes; pct_copy is of "
                        "the device copy bandwidth (read+write) measured in the same run; baseline = gather pages + "
                        "SDPA (enable_gqa).")
    if not args.skip_prefill:
        prefill_rows = []
        bench_prefill(prefill_rows)
        write_results("bench_attention_prefill", prefill_rows,
                      ["heads", "d", "seq", "batch", "ms", "tflops", "sdpa_tflops", "ratio", "max_diff_vs_sdpa"],
                      meta=dict(dtype="bf16", causal=True, tokens_per_call=TOKENS),
                      notes="FLOPs = 2*2*S^2*Hq*D/2 per sequence; baseline = SDPA flash backend, K/V expanded to Hq.")


if __name__ == "__main__":
    main()
