"""bench_runtime_host runs on the CPU (its numbers are read on the machine that runs it)."""


def test_bench_runtime_host_times_the_loops_host_work_on_the_cpu():
    """bench_runtime_host's rows run (no GPU needed): a few decode steps' schedule() at batch 2, both cache modes,
    and sample() of two rows, greedy and sampled."""
    from benchmarks.bench_runtime_host import sample_us, schedule_us

    assert schedule_us(2, 5, True) > 0 and schedule_us(2, 5, False) > 0
    assert sample_us(2, 100, True, "cpu", 2) > 0 and sample_us(2, 100, False, "cpu", 2) > 0
