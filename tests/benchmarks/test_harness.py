"""The benchmark harness's results, on the CPU: the card folder from the device name, one JSON + one markdown per
benchmark, and the provenance every result records (commit, dirty paths, card, driver, versions, date). The GPU is
faked (``gpu_info``) and the repository is a throwaway git repo, so no timing runs and nothing is written into ours."""

import datetime
import json
import shlex
import subprocess

import pytest
import torch

from benchmarks import harness

FAKE_H100 = dict(gpu="NVIDIA H100 80GB HBM3", driver="580.159.04", sm_count=132, gpu_mem_gib=79.2)


def _git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
                          capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A one-commit git repo standing in for the checkout; results go to its benchmarks/results."""
    root = tmp_path / "repo"
    (root / "kernels").mkdir(parents=True)
    (root / "kernels" / "op.py").write_text("x = 1\n")
    _git(root, "init", "-q")
    _git(root, "add", ".")
    _git(root, "commit", "-q", "-m", "one")
    monkeypatch.setattr(harness, "REPO_ROOT", root)
    monkeypatch.delenv("TRITRT_COMMIT", raising=False)
    monkeypatch.delenv("TRITRT_DIRTY", raising=False)
    monkeypatch.setenv("TRITRT_RESULTS_DIR", str(root / "benchmarks" / "results"))
    monkeypatch.setattr(harness, "gpu_info", lambda: dict(FAKE_H100))
    return root


@pytest.mark.parametrize("device, card", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", "h100"),
                                          ("NVIDIA H200", "h200"), (None, "cpu"),
                                          ("NVIDIA GeForce RTX 4090", "geforce-rtx-4090")])
def test_card_name(device, card):
    assert harness.card_name(device) == card


def test_layout_and_provenance_of_a_dirty_tree(repo):
    (repo / "kernels" / "op.py").write_text("x = 2\n")
    (repo / "kernels" / "new.py").write_text("")
    rows = [dict(shape="qkv", M=1, ms=0.0125, speedup=2.5), dict(shape="o", M=1, ms=0.0101, speedup=None)]
    md = harness.write_results("bench_fake", rows, ["shape", "M", "ms", "speedup"], meta={"group_size": 128})

    results = repo / "benchmarks" / "results"
    assert md == results / "h100" / "bench_fake.md"
    assert sorted(p.relative_to(results).as_posix() for p in results.rglob("*") if p.is_file()) == [
        "h100/bench_fake.json", "h100/bench_fake.md"]
    payload = json.loads(md.with_suffix(".json").read_text())
    env = payload["env"]
    assert payload["benchmark"] == "bench_fake" and payload["rows"] == rows and payload["meta"] == {"group_size": 128}
    assert env["commit"] == _git(repo, "rev-parse", "HEAD") and env["commit_source"] == "git"
    assert env["dirty"] is True and env["dirty_paths"] == ["M kernels/op.py", "?? kernels/new.py"]
    assert (env["card"], env["gpu"], env["driver"]) == ("h100", FAKE_H100["gpu"], FAKE_H100["driver"])
    assert env["torch"] and env["triton"]
    datetime.datetime.fromisoformat(env["date"])
    text = md.read_text()
    assert env["commit"][:12] in text and "M kernels/op.py" in text and "580.159.04" in text
    assert "| qkv | 1 | 0.0125 | 2.5 |" in text and "| o | 1 | 0.0101 |  |" in text  # None: an empty cell


def test_a_rerun_replaces_the_result_and_its_own_output_is_not_dirt(repo):
    first = harness.write_results("bench_fake", [dict(ms=1.0)], ["ms"])
    # the first result (untracked, inside the repo) and a second benchmark of the same run: still a clean tree
    harness._git_state.cache_clear()
    second = harness.write_results("bench_fake", [dict(ms=2.0)], ["ms"])
    assert first == second
    payload = json.loads(second.with_suffix(".json").read_text())
    assert payload["rows"] == [dict(ms=2.0)]
    assert payload["env"]["dirty"] is False and payload["env"]["dirty_paths"] == []
    assert "clean tree" in second.read_text()


def test_state_taken_once_per_run(repo):
    before = harness.git_state()
    (repo / "kernels" / "op.py").write_text("edited while the benchmark ran\n")
    assert harness.git_state() == before and before["dirty"] is False


def test_no_git_no_environment_is_unknown(repo, tmp_path):
    assert harness.git_state(tmp_path) == dict(commit="unknown", dirty=None, dirty_paths=[], commit_source=None)


def test_environment_wins_over_the_copy_s_git(repo, tmp_path, monkeypatch):
    """On a lent GPU machine the tree is a copy whose .git is not the checkout's: the command's variables count."""
    (repo / "kernels" / "op.py").write_text("x = 2\n")
    (repo / "kernels" / "new.py").write_text("")
    assignments = harness.provenance_env()  # printed here, pasted in front of the command there
    expected = harness._from_git(repo)
    for word in shlex.split(assignments):
        key, value = word.split("=", 1)
        monkeypatch.setenv(key, value)
    copy = tmp_path / "copy"
    copy.mkdir()
    _git(copy, "init", "-q")  # a stale .git of its own
    state = harness.git_state(copy)
    assert state == dict(expected, commit_source="TRITRT_COMMIT")
    assert state["dirty_paths"] == ["M kernels/op.py", "?? kernels/new.py"]

    harness._git_state.cache_clear()
    monkeypatch.delenv("TRITRT_DIRTY")  # commit given, changes not: unknown, not clean
    assert harness.git_state(copy)["dirty"] is None


def test_many_dirty_paths_are_cut_short(repo):
    for i in range(harness.DIRTY_PATHS_SHOWN + 5):
        (repo / "kernels" / f"f{i:02d}.py").write_text("")
    paths = harness.git_state()["dirty_paths"]
    assert len(paths) == harness.DIRTY_PATHS_SHOWN + 1 and paths[-1] == "... and 5 more"


def test_bad_benchmark_name(repo):
    with pytest.raises(ValueError, match="letters, digits"):
        harness.write_results("../bench", [], ["ms"])


def test_bench_gemm_result_names():
    from benchmarks.bench_gemm import result_name

    assert result_name({}) == "bench_gemm"
    assert result_name({"BENCH_GEMM_KERNELS": "routed"}) == "bench_gemm_routed"
    assert result_name({"BENCH_GEMM_KERNELS": "gemv8"}) == "bench_gemm_w8gemv"
    assert result_name({"BENCH_GEMM_KERNELS": "gemv", "BENCH_GEMM_SWEEP": "1"}) == "bench_gemm_gemv_sweep"
    assert result_name({"BENCH_GEMM_KERNELS": "routed", "BENCH_GEMM_SET": "general"}) == "bench_gemm_routed_general"
    with pytest.raises(ValueError, match="BENCH_GEMM_KERNELS"):
        result_name({"BENCH_GEMM_KERNELS": "gemm"})
    with pytest.raises(ValueError, match="BENCH_GEMM_SET"):
        result_name({"BENCH_GEMM_SET": "llama"})


def test_bench_gemm_general_shapes_are_new():
    """The generalization sweep judges plans on shapes they were not tuned on: none of the tuned set, K and N in the
    issue's range, every K a multiple of the group size."""
    from benchmarks.bench_gemm import GENERAL_SHAPES, GROUP, SHAPES

    tuned = {(k, n) for k, n, _ in SHAPES}
    assert len(GENERAL_SHAPES) >= 12
    for k, n, name in GENERAL_SHAPES:
        assert (k, n) not in tuned, name
        assert 2048 <= k <= 28672 and 2048 <= n <= 28672 and k % GROUP == 0, name


def test_after_idle_times_graph_replays_only(repo):
    """The after-idle regime times single CUDA-graph replays; asked of an eager call it refuses rather than time the
    back-to-back regime under the other name."""
    with pytest.raises(ValueError, match="cuda_graph=True"):
        harness.bench(lambda: None, [()], after_idle_s=1.0)


@pytest.mark.parametrize("burst_ms, replay_ms, reps", [
    (0.0, 44.0, 1),     # no burst asked: one replay (bench_e2e's prefill graph)
    (40.0, 44.0, 1),    # a replay longer than the burst: still one
    (40.0, 0.6, 67),    # a 2k-row GEMM: as many as fill the burst
    (40.0, 0.0, 1000),  # a replay too short to time: capped
])
def test_after_idle_burst_size(burst_ms, replay_ms, reps):
    """An after-idle sample replays a short graph until it is as long as a lone prompt's prefill, never less than
    once and never without bound."""
    assert harness._burst_replays(burst_ms, replay_ms) == reps


@pytest.mark.parametrize("pass_ms, n_sets, passes", [
    (0.004, 1, 250),   # a 4 us kernel: 250 calls make a 1 ms replay
    (0.001, 1, 256),   # capped at MAX_GRAPH_CALLS
    (0.004, 64, 4),    # 64 rotating sets: at most 4 passes (256 calls)
    (0.3, 4, 4),       # 0.3 ms a pass: 4 passes
    (1.0, 2, 1),       # a pass already lasts MIN_GRAPH_MS
    (45.0, 1, 1),      # a 2k prefill
    (0.001, 300, 1),   # more sets than MAX_GRAPH_CALLS: still one whole pass
])
def test_graph_passes(pass_ms, n_sets, passes):
    assert harness._graph_passes(pass_ms, n_sets) == passes


@pytest.mark.gpu
def test_graph_of_calls_cycles_through_the_sets_for_whole_passes():
    a, b = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    graph, calls = harness._graph_of_calls(lambda t: t.add_(1), [(a,), (b,)])  # a ~3 us kernel: many passes
    a.zero_(), b.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert 2 < calls <= harness.MAX_GRAPH_CALLS and calls % 2 == 0 and a.item() == b.item() == calls // 2
