"""kernels.aot on the CPU: compile to PTX + cubin for sm_80 / sm_90 without a GPU, the cache, the refusals, the
plugin entry wrapper, the PTX for TensorRT's argument list, nvcc, and the launcher's argument checks."""

import re
import shutil

import pytest

from kernels.aot import AotCache, AotError, compile_cuda, compile_triton, strip_hidden_params
from kernels.aot.compile import entry_params, ptxas
from kernels.aot.launcher import AotKernel
from kernels.aot.wrapper import make_entry
from tests.aot.toy_kernels import _axpb_kernel

SIG = {"x_ptr": "*bf16", "y_ptr": "*fp32", "out_ptr": "*bf16", "n": "i32", "stride_x": "i32"}
CONST = {"A": 2.0, "B": -1.0, "BLOCK": 256}
_ARTS = {}


def _axpb(sm, cache=None, **kw):
    """Compile the toy kernel once per (sm, options) per session: compiles cost ~1 s each on this machine."""
    key = (sm, tuple(sorted(kw.items())), cache is None)
    if key not in _ARTS or cache is not None:
        _ARTS[key] = compile_triton(_axpb_kernel, SIG, CONST, sm=sm, div16=("x_ptr", "y_ptr", "out_ptr"), cache=cache,
                                    **kw)
    return _ARTS[key]


@pytest.mark.parametrize("sm", [80, 90])
def test_ptx_and_cubin_for_sm(sm):
    art = _axpb(sm)
    assert re.search(rf"\.target\s+sm_{sm}a?\b", art.ptx), "PTX targets the wrong architecture"
    assert art.cubin[:4] == b"\x7fELF", "cubin is not an ELF image"
    assert art.name == "_axpb_kernel" and art.kind == "triton" and art.sm == sm
    assert art.params == [(n, t) for n, t in SIG.items()]
    # Triton 3.6 appends global + profile scratch pointers; the launcher passes null for them.
    assert art.num_hidden == 2
    assert len(entry_params(art.ptx, art.name)) == len(SIG) + art.num_hidden
    assert art.num_warps == 4 and art.shared == 0 and art.constexprs == CONST  # an elementwise kernel


def test_cache_hit_skips_the_compiler(tmp_path, monkeypatch):
    cache = AotCache(tmp_path)
    first = _axpb(90, cache=cache)
    import triton

    def boom(*a, **k):
        raise AssertionError("triton.compile called on a cache hit")

    monkeypatch.setattr(triton, "compile", boom)
    again = _axpb(90, cache=cache)
    assert again.key == first.key and again.cubin == first.cubin and again.ptx == first.ptx
    assert again.params == first.params
    # A different specialisation is a different key (and would need the compiler).
    with pytest.raises(Exception) as err:
        compile_triton(_axpb_kernel, SIG, {**CONST, "BLOCK": 128}, sm=90, cache=cache)
    assert "cache hit" in str(err.value) + str(err.value.__cause__)


def test_damaged_cache_entry_is_recompiled_and_replaced(tmp_path):
    cache = AotCache(tmp_path)
    art = _axpb(80, cache=cache)
    (cache._dir(art.key) / "meta.json").write_text("{not json")
    assert cache.get(art.key) is None
    again = _axpb(80, cache=cache)  # a miss: compiled again, and the whole entry takes the damaged one's place
    assert again.key == art.key and cache.get(art.key) is not None and cache.get(art.key)[2] == art.cubin
    assert [p.name for p in cache._dir(art.key).parent.iterdir()] == [art.key]  # no temp or trash dir left


def test_cache_entries_follow_the_umask(tmp_path):
    """Entries are directories other users of a shared cache can read (mkdtemp's 0700 would make them private)."""
    import os

    old = os.umask(0o022)
    try:
        path = AotCache(tmp_path).put("ab" * 32, {"k": 1}, "ptx", b"cubin")
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o755


@pytest.mark.parametrize("var, value", [("TRITON_DEFAULT_FP_FUSION", "0"), ("PTXAS_OPTIONS", "-O0"),
                                        ("DISABLE_PTXAS_OPT", "1")])
def test_triton_key_follows_the_compiler_settings(var, value, monkeypatch):
    """Settings Triton's compiler reads change the binary (fp fusion: fma.rn or not), so they change the key: a cache
    filled under one setting is not reused under another."""
    from kernels.aot.compile import _triton_toolchain

    monkeypatch.delenv(var, raising=False)
    before = _triton_toolchain(90)
    monkeypatch.setenv(var, value)
    after = _triton_toolchain(90)
    assert before != after and after["env"][var] == value
    assert "ptxas" in before and before["ptxas"] and not before["ptxas"].startswith("unknown")


class _KeyAsked(Exception):
    """Raised by ``_KeyProbe.get``: carries the cache key a compile computed, before anything is compiled."""


class _KeyProbe(AotCache):
    """A cache that answers the first lookup by raising ``_KeyAsked(key)``: the compile's real key, with no compiler
    (and no nvcc) run."""

    def __init__(self):
        super().__init__("/nonexistent-aot-key-probe")

    def get(self, key):
        raise _KeyAsked(key)


def _key(compile_fn, *args, **kw) -> str:
    with pytest.raises(_KeyAsked) as asked:
        compile_fn(*args, cache=_KeyProbe(), **kw)
    return asked.value.args[0]


TRITON_BASE = dict(signature=SIG, constexprs=CONST, sm=90, num_warps=4, num_stages=3, div16=("x_ptr",))


@pytest.mark.parametrize("change", [dict(num_warps=8), dict(num_stages=2), dict(sm=80),
                                    dict(constexprs={**CONST, "BLOCK": 128}), dict(div16=("x_ptr", "y_ptr")),
                                    dict(signature={**SIG, "x_ptr": "*fp16"})], ids=lambda c: next(iter(c)))
def test_triton_cache_key_changes_with_each_compile_input(change):
    """Each input of a Triton AOT compile changes the binary (warps and stages: the schedule, shared memory and the
    launch's block size), so each changes the cache key, one at a time: a key that left one out would hand back the
    cubin of another specialisation, which launches with the wrong block size or misreads its arguments."""
    def key(**kw):
        a = {**TRITON_BASE, **kw}
        return _key(compile_triton, _axpb_kernel, a.pop("signature"), a.pop("constexprs"), **a)

    base = key()
    assert key() == base, "the same compile inputs must give the same key"
    assert key(**change) != base, f"{change} left the key unchanged"


@pytest.mark.parametrize("bad, match", [
    (dict(constexprs={"A": 1.0, "B": 0.0}), "BLOCK"),  # a constexpr without a value
    (dict(signature={**SIG, "n": "fp32"}), "floats must be constexprs"),
    (dict(signature={k: v for k, v in SIG.items() if k != "n"}), "exactly the runtime parameters"),
    (dict(sm=75), "not supported"),
    (dict(div16=("nope",)), "not runtime parameters"),
    (dict(constexprs={**CONST, "C": 1}), "not constexpr parameters"),
])
def test_bad_specialisation_is_refused(bad, match):
    args = dict(signature=SIG, constexprs=CONST, sm=90)
    args.update(bad)
    with pytest.raises(AotError, match=match):
        compile_triton(_axpb_kernel, args["signature"], args["constexprs"], sm=args["sm"], div16=bad.get("div16", ()))


def test_kernel_needing_scratch_is_refused(monkeypatch, tmp_path):
    """A kernel whose metadata asks for global scratch cannot run as a plugin: refused, with the fix in the message."""
    import triton

    real = triton.compile

    def with_scratch(*a, **k):
        ck = real(*a, **k)
        ck.metadata = ck.metadata._replace(global_scratch_size=128)
        return ck

    monkeypatch.setattr(triton, "compile", with_scratch)
    with pytest.raises(AotError, match="explicit tensor argument"):
        compile_triton(_axpb_kernel, SIG, CONST, sm=90, cache=AotCache(tmp_path))


def test_kernel_over_the_sm_shared_memory_limit_is_refused(monkeypatch, tmp_path):
    """A kernel that needs more shared memory than the SM allows per block compiles but could never launch there:
    refused at compile time (metadata patched to ~192 KB, fine on sm_90's 227 KB, not on sm_86's 99 KB)."""
    import triton

    real = triton.compile

    def big(*a, **k):
        ck = real(*a, **k)
        ck.metadata = ck.metadata._replace(shared=192 * 1024)
        return ck

    monkeypatch.setattr(triton, "compile", big)
    with pytest.raises(AotError, match="sm_86 allows"):
        compile_triton(_axpb_kernel, SIG, CONST, sm=86, cache=AotCache(tmp_path))
    assert compile_triton(_axpb_kernel, SIG, CONST, sm=90, cache=AotCache(tmp_path)).shared == 192 * 1024


@pytest.mark.parametrize("sm", [80, 90])
def test_stripped_ptx_takes_exactly_the_declared_args_and_assembles(sm):
    art = _axpb(sm)
    ptx = strip_hidden_params(art)
    assert entry_params(ptx, art.name) == ["u64", "u64", "u64", "u32", "u32"]
    assert ptxas(ptx, sm)[:4] == b"\x7fELF"


def test_entry_wrapper_reorders_and_compiles(tmp_path):
    """The plugin order (inputs, scalars, outputs) differs from the kernel's; one entry param may feed two."""
    entry = make_entry(_axpb_kernel, "toy_entry", ["x", "y", "n", "stride", "out"],
                       {"x_ptr": "x", "y_ptr": "y", "out_ptr": "out", "n": "n", "stride_x": "stride"}, root=tmp_path)
    sig = {"x": "*bf16", "y": "*fp32", "n": "i32", "stride": "i32", "out": "*fp16"}
    art = compile_triton(entry, sig, CONST, sm=90, cache=AotCache(tmp_path))
    assert art.name == "toy_entry"
    assert entry_params(strip_hidden_params(art), art.name) == ["u64", "u64", "u32", "u32", "u64"]
    with pytest.raises(AotError, match="runtime parameters"):
        make_entry(_axpb_kernel, "toy_bad", ["x", "out"], {"x_ptr": "x", "out_ptr": "out"}, root=tmp_path)
    with pytest.raises(AotError, match="not entry parameters"):
        make_entry(_axpb_kernel, "toy_bad2", ["x", "y", "out", "n"],
                   {"x_ptr": "x", "y_ptr": "y", "out_ptr": "out", "n": "n", "stride_x": "s"}, root=tmp_path)


CU = r"""
extern "C" __global__ void scale_add(const float* x, float* y, int n, int k) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] * k + 1.0f;
}
"""


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cuda_cpp_compiles_with_nvcc(tmp_path):
    src = tmp_path / "k.cu"
    src.write_text(CU)
    params = [("x", "*fp32"), ("y", "*fp32"), ("n", "i32"), ("k", "i32")]
    art = compile_cuda(src, "scale_add", params, sm=80, threads=128, cache=AotCache(tmp_path / "c"))
    assert art.cubin[:4] == b"\x7fELF" and ".entry scale_add" in art.ptx and art.num_hidden == 0 and art.block == 128
    with pytest.raises(AotError, match="declared"):
        compile_cuda(src, "scale_add", params[:3], sm=90, threads=128, cache=AotCache(tmp_path / "c"))
    (tmp_path / "m.cu").write_text(CU.replace('extern "C" ', ""))
    with pytest.raises(AotError, match='extern "C"'):
        compile_cuda(tmp_path / "m.cu", "scale_add", params, sm=90, threads=128)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cuda_cache_key_follows_local_headers(tmp_path):
    """A kernel's ``#include "x.cuh"`` (and what that includes) is part of its cache key: editing a shared header
    must recompile, not return the artifact built from the old one."""
    (tmp_path / "y.cuh").write_text("#define OFFSET 1.0f\n")
    (tmp_path / "x.cuh").write_text('#include "y.cuh"\n__device__ __forceinline__ float scale() { return 3.0f; }\n')
    src = tmp_path / "k.cu"
    src.write_text('#include "x.cuh"\n' + CU.replace("x[i] * k + 1.0f", "x[i] * scale() + OFFSET"))
    params = [("x", "*fp32"), ("y", "*fp32"), ("n", "i32"), ("k", "i32")]
    cache = AotCache(tmp_path / "c")
    first = compile_cuda(src, "scale_add", params, sm=90, threads=128, cache=cache)
    assert "0f40400000" in first.ptx  # 3.0f: the header's value is compiled in
    # Nothing changed: a cache hit, which never runs the compiler (this nvcc reports nvcc's version, compiles nothing)
    same = _fake_nvcc(tmp_path / "same-nvcc", version_of=shutil.which("nvcc"))
    assert compile_cuda(src, "scale_add", params, sm=90, threads=128, cache=cache, nvcc=same).key == first.key
    (tmp_path / "x.cuh").write_text('#include "y.cuh"\n__device__ __forceinline__ float scale() { return 5.0f; }\n')
    second = compile_cuda(src, "scale_add", params, sm=90, threads=128, cache=cache)
    assert second.key != first.key and "0f40A00000" in second.ptx and "0f40400000" not in second.ptx
    # Another toolkit is another key: its headers and ptxas build different code
    other = _fake_nvcc(tmp_path / "other-nvcc", version_of=None)
    with pytest.raises(AotError, match="nvcc failed"):
        compile_cuda(src, "scale_add", params, sm=90, threads=128, cache=cache, nvcc=other)
    # A header included by a header counts too: the key misses, so the (failing) compiler is asked for.
    (tmp_path / "y.cuh").write_text("#define OFFSET 2.0f\n")
    with pytest.raises(AotError, match="nvcc failed"):
        compile_cuda(src, "scale_add", params, sm=90, threads=128, cache=cache, nvcc=same)


def _fake_nvcc(path, version_of):
    """An 'nvcc' that answers ``--version`` as ``version_of`` does (None: as a toolkit 0.0) and fails to compile."""
    answer = f'exec "{version_of}" --version' if version_of else 'echo "Cuda compilation tools, release 0.0"'
    path.write_text(f'#!/bin/sh\nif [ "$1" = "--version" ]; then {answer}; fi\necho "fake: no compiling" >&2\nexit 1\n')
    path.chmod(0o755)
    return str(path)


CUDA_PARAMS = [("x", "*fp32"), ("y", "*fp32"), ("n", "i32"), ("k", "i32")]
CUDA_BASE = dict(sm=90, threads=128, shared=0, extra_flags=(), arch_specific=False, div16=())


@pytest.mark.parametrize("change", [dict(threads=256), dict(shared=16384), dict(extra_flags=("-lineinfo",)),
                                    dict(arch_specific=True), dict(sm=80), dict(div16=("x",)),
                                    dict(params=CUDA_PARAMS[:3]), dict(kernel_name="other")],
                         ids=lambda c: next(iter(c)))
def test_cuda_cache_key_changes_with_each_compile_input(change, tmp_path):
    """Each input of an nvcc AOT compile changes the cubin or how it is launched (block size, dynamic shared memory,
    flags, sm_90 vs sm_90a, the entry and its parameters), so each changes the cache key, one at a time. The key is
    read before nvcc would run, so this needs no CUDA toolkit."""
    src = tmp_path / "k.cu"
    src.write_text(CU)

    def key(kernel_name="scale_add", params=CUDA_PARAMS, **kw):
        return _key(compile_cuda, src, kernel_name, params, **{**CUDA_BASE, **kw})

    base = key()
    assert key() == base, "the same compile inputs must give the same key"
    assert key(**change) != base, f"{change} left the key unchanged"


class _FakeCuda:
    """Stands in for a CUDA tensor in the launcher's argument packing (no GPU here)."""

    is_cuda = True

    def __init__(self, ptr):
        self._ptr = ptr

    def data_ptr(self):
        return self._ptr


def test_launcher_checks_arguments_against_the_compiled_assumptions():
    art = compile_triton(_axpb_kernel, SIG, CONST, sm=90, div16=("x_ptr", "y_ptr", "out_ptr", "stride_x"))
    k = AotKernel(art)
    ok = [_FakeCuda(256), _FakeCuda(512), _FakeCuda(1024), 7, 16]
    values = k._pack(ok)
    assert len(values) == len(SIG) + 2 and values[-1].value == 0 and values[-2].value == 0  # null scratch pointers
    with pytest.raises(AotError, match="multiple of 16"):
        k._pack([*ok[:4], 24])
    with pytest.raises(AotError, match="16-byte aligned"):
        k._pack([_FakeCuda(258), *ok[1:]])
    with pytest.raises(TypeError, match="5 runtime arguments"):
        k._pack(ok[:4])
    with pytest.raises(AotError, match="int32"):
        k._pack([*ok[:3], 2**31, 16])
    with pytest.raises(TypeError, match="CUDA tensor"):
        k._pack([1, *ok[1:]])


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_tensor_map_params_are_declared_checked_and_passed_by_value(tmp_path):
    """A ``tmap`` parameter (a 128-byte tensor map by value, as WG_TMA takes x's): the PTX entry declares it as
    ``.b8 [128]``, compile_cuda checks that against the declaration, AotKernel passes a ctypes array of 128 bytes
    as it is and refuses anything else."""
    import ctypes

    src = tmp_path / "t.cu"
    src.write_text('struct alignas(64) Map { unsigned long long w[16]; };\n'
                   'extern "C" __global__ void first_word(unsigned long long* y, const __grid_constant__ Map m) '
                   '{ *y = m.w[0]; }\n')
    art = compile_cuda(src, "first_word", [("y", "*i64"), ("m", "tmap")], sm=90, threads=32,
                       cache=AotCache(tmp_path / "c"))
    assert entry_params(art.ptx, "first_word") == ["u64", "b8[128]"]
    with pytest.raises(AotError, match="declared"):
        compile_cuda(src, "first_word", [("y", "*i64"), ("m", "i32")], sm=90, threads=32,
                     cache=AotCache(tmp_path / "c"))
    words = (ctypes.c_uint64 * 16)(*range(16))
    assert AotKernel(art)._pack([_FakeCuda(256), words])[1] is words
    with pytest.raises(TypeError, match="128 bytes"):
        AotKernel(art)._pack([_FakeCuda(256), list(range(16))])


class _FakeDriver:
    """The few cuda.bindings driver calls AotKernel makes, against fake per-device contexts: a module and its
    function belong to the context current when the module was loaded, as in CUDA."""

    class CUfunction_attribute:
        CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8

    def __init__(self):
        self.device = 0  # the device whose primary context is current (torch makes it so when it switches devices)
        self.loaded, self.launched = [], []

    def CUstream(self, s):
        return s

    def cuInit(self, flags):
        return (0,)

    def cuCtxGetCurrent(self):
        return (0, 100 + self.device)

    def cuModuleLoadData(self, image):
        self.loaded.append(self.device)
        return (0, ("module", 100 + self.device))

    def cuModuleGetFunction(self, module, name):
        return (0, ("function", module[1]))

    def cuLaunchKernel(self, func, *args):
        assert func[1] == 100 + self.device, "a function launched outside the context it was loaded in"
        self.launched.append(self.device)
        return (0,)


def test_launcher_loads_the_kernel_once_per_device(monkeypatch):
    """A module belongs to one CUDA context: the same artifact launched on a second GPU is loaded again there (one
    AotKernel is shared by every device of an SM: kernels.gemm.cuda.cached_kernel keys by SM and variant), and each
    device's launches use its own function."""
    import torch

    from kernels import _utils
    from kernels.aot import launcher

    drv = _FakeDriver()
    monkeypatch.setattr(launcher, "_driver", lambda: drv)
    monkeypatch.setattr(launcher, "_current_device", lambda: drv.device)
    monkeypatch.setattr(launcher, "_raw_stream", lambda device: 7)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(_utils, "device_sm", lambda device=None: 90)
    k = AotKernel(_axpb(90))
    args = [_FakeCuda(256), _FakeCuda(512), _FakeCuda(1024), 7, 16]
    for device in (0, 1, 0, 1):
        drv.device = device
        k.launch((1,), *args)
    assert drv.loaded == [0, 1] and drv.launched == [0, 1, 0, 1]
