"""Test tiers as markers turned into skips.

CPU tier (default): kernels run in Triton's interpreter on CPU tensors. The interpreter has to be switched on
before any ``@triton.jit`` function is created, so this file sets ``TRITON_INTERPRET=1`` whenever no CUDA
device is visible, before the tests import ``kernels``.

- ``interpreter``: launches Triton kernels on CPU tensors; needs ``TRITON_INTERPRET=1``.
- ``gpu``: needs a CUDA device (and the real JIT, so not the interpreter).
- ``tensorrt``: needs ``import tensorrt`` (>= 10.9) and a CUDA device.

Also the tiny LLaMA checkpoints (random, seeded, made with ``transformers``) that the export and runtime tests share:
each made once per session, on first use.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
from kernels._utils import interpreting  # noqa: E402  (after the variable is set; creates no @triton.jit function)

INTERPRET = interpreting()


def _tensorrt_reason():
    if not HAS_CUDA:
        return "TensorRT tier needs a CUDA device"
    from export.engine import tensorrt_missing_reason

    return tensorrt_missing_reason()


def pytest_configure(config):
    config.addinivalue_line("markers", "interpreter: launches Triton kernels on CPU tensors (TRITON_INTERPRET=1)")


def pytest_collection_modifyitems(config, items):
    trt_reason = None
    trt_checked = False
    for item in items:
        if "gpu" in item.keywords and (not HAS_CUDA or INTERPRET):
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device with the Triton JIT (run with -m gpu there)"))
        if "interpreter" in item.keywords and not INTERPRET:
            item.add_marker(pytest.mark.skip(reason="needs TRITON_INTERPRET=1 (set automatically without CUDA)"))
        if "tensorrt" in item.keywords:
            if not trt_checked:
                trt_reason, trt_checked = _tensorrt_reason(), True
            if trt_reason:
                item.add_marker(pytest.mark.skip(reason=trt_reason))


@pytest.fixture(scope="session", autouse=True)
def _aot_cache_dir(tmp_path_factory):
    """AOT artifacts (and generated plugin entry modules) go to a per-session cache, never to ~/.cache."""
    old = os.environ.get("TRITRT_AOT_CACHE")
    os.environ["TRITRT_AOT_CACHE"] = str(tmp_path_factory.mktemp("aot_cache"))
    yield
    if old is None:
        os.environ.pop("TRITRT_AOT_CACHE", None)
    else:
        os.environ["TRITRT_AOT_CACHE"] = old


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """Lazily made checkpoint dirs, one per (variant, seed): ``tiny_dirs("tied")``; variants in ``tests.helpers``."""
    from export.checkpoint import make_tiny_llama
    from tests.helpers import TINY_VARIANTS

    made = {}

    def get(name="llama", seed=0):
        if (name, seed) not in made:
            made[name, seed] = make_tiny_llama(tmp_path_factory.mktemp(f"tiny_{name}_{seed}"), seed=seed,
                                               **TINY_VARIANTS[name])
        return made[name, seed]

    return get


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_dirs):
    """The plain tiny LLaMA the export tests use (seed 0)."""
    return tiny_dirs("llama")


@pytest.fixture(scope="session")
def tiny_dir(tiny_dirs):
    """The plain tiny LLaMA the runtime tests use: seed 3, the weights those tests were written and checked with."""
    return tiny_dirs("llama", seed=3)
