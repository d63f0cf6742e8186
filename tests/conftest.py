"""Test tiers as markers turned into skips.

CPU tier (default): kernels run in Triton's interpreter on CPU tensors. The interpreter has to be switched on
before any ``@triton.jit`` function is created, so this file sets ``TRITON_INTERPRET=1`` whenever no CUDA
device is visible, before the tests import ``kernels``.

- ``interpreter``: launches Triton kernels on CPU tensors; needs ``TRITON_INTERPRET=1``.
- ``gpu``: needs a CUDA device (and the real JIT, so not the interpreter).
- ``tensorrt``: the engine-build tier: builds (never runs) engines of our graphs with full TensorRT >= 10.9 where it is
  importable, else with TensorRT-RTX (CPU only, for a fixed compute capability); the ``trt_builder`` fixture says
  which. CI installs TensorRT-RTX, so this tier runs there.
- ``tensorrt_engine``: runs engines: needs ``import tensorrt`` (>= 10.9) and a CUDA device.

Also the tiny LLaMA checkpoints (random, seeded, made with ``transformers``) that the export and runtime tests share:
each made once per session, on first use.
"""

import json
import os
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
from kernels._utils import interpreting  # noqa: E402  (after the variable is set; creates no @triton.jit function)

INTERPRET = interpreting()


def _tensorrt_engine_reason():
    if not HAS_CUDA:
        return "running TensorRT engines needs a CUDA device"
    from export.engine import tensorrt_missing_reason

    return tensorrt_missing_reason()


# TensorRT-RTX's target for the build tier: the newest it shares with our kernels' instruction set (it has no sm_90)
RTX_COMPUTE_CAPABILITY = "SM89"


def trt_build_target():
    """(builder, compute capability or None) of the ``tensorrt`` tier, or (None, why not)."""
    from export.engine import rtx_version, tensorrt_missing_reason

    if HAS_CUDA and tensorrt_missing_reason() is None:
        return "tensorrt", None
    if rtx_version():
        return "tensorrt-rtx", RTX_COMPUTE_CAPABILITY
    return None, ("needs TensorRT >= 10.9 (with a GPU) or TensorRT-RTX (pip install "
                  "tensorrt-rtx-cu13==1.7.1.116, as .ci/run does)")


def pytest_collection_modifyitems(config, items):
    reasons = {}

    def reason(kind):
        if kind not in reasons:
            if kind == "engine":
                reasons[kind] = _tensorrt_engine_reason()
            else:
                builder, why = trt_build_target()
                reasons[kind] = None if builder else why
        return reasons[kind]

    for item in items:
        if "gpu" in item.keywords and (not HAS_CUDA or INTERPRET):
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device with the Triton JIT (run with -m gpu there)"))
        if "interpreter" in item.keywords and not INTERPRET:
            item.add_marker(pytest.mark.skip(reason="needs TRITON_INTERPRET=1 (set automatically without CUDA)"))
        for marker, kind in (("tensorrt_engine", "engine"), ("tensorrt", "build")):
            if marker in item.keywords and reason(kind):
                item.add_marker(pytest.mark.skip(reason=reason(kind)))


@pytest.fixture(scope="session")
def trt_builder():
    """``(builder, compute_capability)`` for ``export.engine.build_engine`` in the ``tensorrt`` tier."""
    builder, cc = trt_build_target()
    if builder is None:
        pytest.skip(cc)
    return builder, cc


def _tier_log_dir(config) -> Path:
    """Where the ``tensorrt`` tier's tests note the engines they built: one dir for the whole run (xdist workers'
    temp dirs are children of the controller's)."""
    base = config._tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "tensorrt_tier"


@pytest.fixture
def record_engines(request):
    """``record_engines(label, [bytes, ...])``: note engines built, for the count printed at the end of the run."""
    log = _tier_log_dir(request.config)
    log.mkdir(parents=True, exist_ok=True)

    def record(label, sizes):
        assert sizes and all(n > 0 for n in sizes), f"{label}: an empty engine among {sizes}"
        name = "".join(c if c.isalnum() else "_" for c in request.node.nodeid)
        (log / f"{name}.json").write_text(json.dumps({"label": label, "bytes": list(sizes)}))

    return record


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    log = _tier_log_dir(config)
    if os.environ.get("PYTEST_XDIST_WORKER") or not log.is_dir():
        return
    notes = [json.loads(f.read_text()) for f in sorted(log.glob("*.json"))]
    if notes:
        sizes = [n for note in notes for n in note["bytes"]]
        builder, cc = trt_build_target()
        terminalreporter.write_line(f"tensorrt tier: {len(sizes)} engines built and serialized with {builder}"
                                    f"{f' for {cc}' if cc else ''} ({min(sizes)}..{max(sizes)} bytes) by "
                                    f"{len(notes)} tests")


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
