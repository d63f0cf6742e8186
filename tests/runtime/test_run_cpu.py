"""export.run on the CPU: the KV cache sized to the request, and OpenMP threads that sleep rather than spin."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from export.run import kv_blocks_needed, make_backend, parse_args
from tests.runtime.test_generate_hf import _torch_output_dir

ROOT = Path(__file__).resolve().parents[2]


def test_kv_blocks_needed():
    # A sequence caches its prompt and all but the last of its new tokens: 3 + 8 - 1 = 10 tokens -> 3 blocks of 4;
    # 1 + 8 - 1 = 8 -> 2 (a block multiple takes no extra block); 8 + 8 - 1 = 15 -> 4; + the scheduler's spare block
    # per sequence
    assert kv_blocks_needed([[1, 2, 3], [7], list(range(8))], 8, 4) == 3 + 2 + 4 + 3
    assert kv_blocks_needed([[1]], 1, 16) == 1 + 1


def test_prompts_in_a_cache_of_kv_blocks_needed_run_as_one_batch():
    """Sized exactly (no spare blocks), two short prompts ran one at a time: the scheduler keeps a block free per
    running sequence when it admits another."""
    from export.runtime import Generator, SamplingParams
    from tests.runtime.test_scheduler import ToyPagedBackend

    prompts = [[5, 6, 7], [8, 9, 10]]
    backend = ToyPagedBackend(kv_blocks_needed(prompts, 4, 16), 16)
    Generator(backend).generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert backend.max_batch_seen == 2


def test_cpu_kv_cache_is_what_the_prompts_need(tiny_dir, tmp_path):
    out = _torch_output_dir(tiny_dir, tmp_path / "out")
    prompts = [[5, 6, 7], list(range(1, 20))]
    args = parse_args([str(out), "--prompt", "x", "--max-new-tokens", "13", "--device", "cpu"])
    backend = make_backend(args, json.loads((out / "build.json").read_text()), "cpu", prompts)
    assert backend.num_blocks == kv_blocks_needed(prompts, 13, 16) == 1 + 2 + 2
    assert backend.kv_cache[0][0].shape[0] == 5
    args = parse_args([str(out), "--prompt", "x", "--device", "cpu", "--num-blocks", "7"])  # the user's size wins
    assert make_backend(args, {}, "cpu", prompts).num_blocks == 7


@pytest.mark.parametrize("argv, env, want", [
    (["--device", "cpu"], {}, "PASSIVE"),
    ([], {}, "PASSIVE"),  # no --device: may run on the CPU
    (["--device", "cuda"], {}, None),
    (["--device", "cpu"], {"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE"),  # the user's setting wins
])
def test_openmp_wait_policy_is_set_before_torch_loads(argv, env, want):
    code = ("import os, sys; from export.run import parse_args, _passive_openmp; "
            f"_passive_openmp(parse_args(['OUT', '--prompt', 'x', *{argv!r}])); "
            "assert 'torch' not in sys.modules, 'torch imported before the policy was set'; "
            "print(os.environ.get('OMP_WAIT_POLICY'))")
    full_env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    full_env.update(env, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(want)
