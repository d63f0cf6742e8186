"""The generation loop's host work between two model steps: ``Scheduler.schedule`` and ``sampling.sample``.

No model runs: the scheduler plans decode steps of ``bs`` sequences (448-token prompts, blocks of 16, a cache that
never preempts), each step's sequences advanced as the generator advances them; ``sample`` draws from random logits
of a Llama-3 / SmolLM2 vocabulary on the chosen device. Each row is the median of many calls, in microseconds. On a
GPU machine the decode step hides this work only where pipelined decode runs it during the previous step (greedy);
a sampled step waits for ``sample``.

    python benchmarks/bench_runtime_host.py [--device cpu|cuda] [--steps 500]

Results: ``benchmarks/results/<card>/bench_runtime_host.{json,md}`` (``cpu`` without a GPU).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import write_results  # noqa: E402

PROMPT_LEN, BLOCK_SIZE = 448, 16
VOCABS = {"smollm2": 49152, "llama3": 128256}
SAMPLED = dict(temperature=0.8, top_k=50, top_p=0.95)


def schedule_us(bs: int, steps: int, prefix_caching: bool) -> float:
    """Median host time of one decode step's ``schedule()`` for ``bs`` running sequences."""
    from export.runtime.blocks import BlockManager
    from export.runtime.sampling import SamplingParams
    from export.runtime.scheduler import Scheduler, Sequence

    blocks = BlockManager(bs * (PROMPT_LEN + steps + 2) // BLOCK_SIZE + 2 * bs, BLOCK_SIZE)
    sch = Scheduler(blocks, max_num_seqs=bs, max_num_batched_tokens=max(8192, bs * PROMPT_LEN),
                    prefix_caching=prefix_caching)
    for i in range(bs):  # distinct prompts: no prefix-cache hits, only its bookkeeping
        sch.add(Sequence(i, [i + 1] + list(range(1, PROMPT_LEN)), SamplingParams(max_new_tokens=steps + 2)))
    times = []
    for step in range(steps + 1):
        t0 = time.perf_counter()
        planned = sch.schedule()
        if step:  # the first step is the prefill
            times.append(time.perf_counter() - t0)
        for seq, n in zip(planned.seqs, planned.num_tokens):  # what Generator.step does after the model step
            seq.num_cached += n
            if seq.num_cached == seq.num_tokens:
                seq.output_ids.append(7)
    return statistics.median(times) * 1e6


def sample_us(rows: int, vocab: int, sampled: bool, device: str, reps: int) -> float:
    """Median time of one ``sample()`` of ``rows`` rows (greedy, or temperature + top-k + top-p, seeded)."""
    from export.runtime.sampling import SamplingParams, make_generator, sample

    logits = torch.randn(rows, vocab, device=device, generator=torch.Generator(device).manual_seed(0)) * 3
    params = [SamplingParams(**SAMPLED, seed=i) if sampled else SamplingParams() for i in range(rows)]
    gens = [make_generator(i, device) if sampled else None for i in range(rows)]
    sample(logits, params, gens)  # warm-up (CUDA: kernels loaded)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        sample(logits, params, gens)  # returns host ints: the device work is inside the time
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="sample()'s device")
    p.add_argument("--steps", type=int, default=500, help="decode steps timed per schedule() row")
    p.add_argument("--reps", type=int, default=20, help="calls timed per sample() row")
    args = p.parse_args(argv)
    rows = []
    for bs in (1, 8, 32):
        for prefix in (True, False):
            rows.append(dict(what="schedule", rows=bs, prefix_caching=prefix,
                             us=schedule_us(bs, args.steps, prefix)))
    for name, vocab in VOCABS.items():
        for n in (1, 8, 32):
            for sampled in (False, True):
                rows.append(dict(what="sample", rows=n, vocab=f"{name} {vocab}",
                                 params="top-k 50, top-p 0.95, T 0.8" if sampled else "greedy",
                                 us=sample_us(n, vocab, sampled, args.device, args.reps)))
    write_results("bench_runtime_host", rows, ["what", "rows", "prefix_caching", "vocab", "params", "us"],
                  meta=dict(sample_device=args.device, torch_threads=torch.get_num_threads(),
                            prompt_len=PROMPT_LEN, block_size=BLOCK_SIZE))


if __name__ == "__main__":
    main()
