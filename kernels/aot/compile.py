"""Compile a kernel ahead of time, for a given SM, to PTX and cubin; no GPU needed.

Triton: ``triton.compile(ASTSource(...), target=GPUTarget("cuda", sm, 32))`` with every choice the JIT would make at
launch time made explicitly here instead: pointer dtypes, 16-divisibility hints (the JIT's ``tt.divisibility``),
constexprs, warps and stages. Integers are never specialised to the constant 1 (the JIT does that); the kernel stays
correct for any value, so one artifact serves every shape of an engine profile. The launcher checks the hints.

Triton >= 3.5 appends hidden pointer parameters (global scratch, profile scratch) to every kernel. We pass null for
them and therefore refuse kernels whose metadata asks for scratch. ``strip_hidden_params`` removes them from the PTX
when they are unreferenced, for launchers (TensorRT's AOT plugins) that pass exactly the declared arguments.

CUDA C++: ``nvcc -ptx`` / ``-cubin`` for an ``extern "C"`` kernel.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .cache import AotCache, make_key

SUPPORTED_SM = (80, 86, 89, 90)
# Opt-in shared memory per block (bytes) by SM (CUDA programming guide, compute capability table): a kernel above it
# compiles but can never launch on that architecture, so the AOT compile refuses it up front.
MAX_SHARED = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
POINTER_TYPES = {"*fp16", "*bf16", "*fp32", "*i8", "*u8", "*i32", "*i64", "*i16"}
SCALAR_TYPES = {"i32"}  # TensorRT passes SymInt32 only; floats are constexprs (trt_plugins.specs)
# A CUDA kernel parameter of this type is a tensor map (``CUtensorMap``) passed by value: a 128-byte struct in the PTX
# entry, 128 bytes from the launcher (kernels.aot.launcher.tensor_map_fp16_2d encodes one).
TENSOR_MAP, TENSOR_MAP_BYTES = "tmap", 128


class AotError(ValueError):
    """A kernel or specialisation that cannot be compiled or launched ahead of time; the message says why."""


@dataclass
class Artifact:
    """One compiled kernel: what a launcher needs, and what ``manifest.json`` records."""

    name: str  # entry symbol in the PTX / cubin
    kind: str  # "triton" or "cuda"
    sm: int
    params: list  # [(name, type)] runtime parameters in launch order (no constexprs, no hidden params)
    constexprs: dict
    div16: list  # parameter names compiled under a divisible-by-16 assumption (pointers: address; ints: value)
    num_warps: int
    num_stages: int
    shared: int  # dynamic shared memory bytes passed at launch
    num_hidden: int  # trailing hidden pointer params the launcher passes as null (Triton >= 3.5: 2)
    source_hash: str
    key: str
    ptx: str = field(repr=False, default="")
    cubin: bytes = field(repr=False, default=b"")

    @property
    def block(self) -> int:
        return 32 * self.num_warps

    def meta(self) -> dict:
        d = asdict(self)
        d.pop("ptx"), d.pop("cubin")
        return d


def _unwrap(fn):
    """The plain ``JITFunction`` under ``@triton.autotune`` / ``@triton.heuristics`` wrappers.

    Under ``TRITON_INTERPRET=1`` (the CPU test tier) ``@triton.jit`` makes interpreter objects, which the compiler
    cannot lower; they are rebuilt as ``JITFunction``s (with the jit functions they call). That covers simple
    kernels only: Triton's own library functions (``tl.sum``...) stay interpreter objects in such a process, so real
    kernels are compiled in a process without ``TRITON_INTERPRET`` (``python -m trt_plugins.aot`` does that).
    """
    while type(fn).__name__ in ("Autotuner", "Heuristics") and hasattr(fn, "fn"):
        fn = fn.fn
    if type(fn).__name__ == "InterpretedFunction":
        fn = _as_jit(fn, {})
    if not hasattr(fn, "arg_names") or not hasattr(fn, "cache_key"):
        raise AotError(f"{fn!r} is not a @triton.jit function")
    return fn


def _as_jit(interp, memo: dict):
    """A ``JITFunction`` for an ``InterpretedFunction``: same code, globals whose jit functions are converted too."""
    import types

    from triton.runtime.jit import JITFunction

    py = interp.fn
    if id(py) in memo:
        return memo[id(py)]
    g = dict(py.__globals__)
    new_py = types.FunctionType(py.__code__, g, py.__name__, py.__defaults__, py.__closure__)
    new_py.__qualname__, new_py.__module__ = py.__qualname__, py.__module__
    new_py.__annotations__ = dict(py.__annotations__)
    jit = JITFunction(new_py, **{k: v for k, v in getattr(interp, "kwargs", {}).items()
                                 if k in ("do_not_specialize", "noinline", "debug")})
    memo[id(py)] = jit
    for name, val in list(g.items()):
        if type(val).__name__ == "InterpretedFunction":
            g[name] = _as_jit(val, memo)
    return jit


def interpreter_enabled() -> bool:
    """True when ``TRITON_INTERPRET`` is on, so ``@triton.jit`` makes interpreter objects the compiler cannot take."""
    from kernels._utils import interpreting

    return interpreting()


def _check_sm(sm: int) -> None:
    if sm not in SUPPORTED_SM:
        raise AotError(f"sm {sm} is not supported; pick one of {SUPPORTED_SM} (sm_80 A100, 86/89 Ampere/Ada, 90 H100)")


def entry_params(ptx: str, name: str) -> list[str]:
    """PTX types of the entry's parameters, in order (e.g. ['u64', 'u32', ..., 'b8[128]'] for a by-value struct)."""
    m = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\(([^)]*)\)", ptx)
    if m is None:
        raise AotError(f"entry {name} not found in the PTX")
    types = []
    for decl in (d.strip() for d in m.group(1).split(",") if d.strip()):  # ".param [.align n] .type [.ptr ...] name[n]"
        ty = re.match(r"\.param\s+(?:\.align\s+\d+\s+)?\.(\w+)", decl).group(1)
        size = re.search(r"(\[\d+\])$", decl)
        types.append(ty + (size.group(1) if size else ""))
    return types


def compile_triton(fn, signature: dict, constexprs: dict, *, sm: int, num_warps: int = 4, num_stages: int = 3,
                   div16=(), cache: AotCache | None = None) -> Artifact:
    """Compile ``fn`` for ``sm``; ``signature`` maps each runtime parameter to a type (``*bf16``, ``i32``...),
    ``constexprs`` gives every ``tl.constexpr`` parameter; ``div16`` names parameters assumed divisible by 16."""
    fn = _unwrap(fn)
    _check_sm(sm)
    names = list(fn.arg_names)
    const_names = [p.name for p in fn.params if p.is_constexpr]
    missing = [n for n in const_names if n not in constexprs]
    if missing:
        raise AotError(f"{fn.__name__}: constexpr parameters {missing} need values (give them in constexprs)")
    runtime = [n for n in names if n not in const_names]
    if sorted(signature) != sorted(runtime):
        raise AotError(f"{fn.__name__}: signature names {sorted(signature)} must be exactly the runtime parameters "
                       f"{runtime}")
    bad = {n: t for n, t in signature.items() if t not in POINTER_TYPES | SCALAR_TYPES}
    if bad:
        raise AotError(f"{fn.__name__}: unsupported parameter types {bad}; use one of "
                       f"{sorted(POINTER_TYPES | SCALAR_TYPES)} (floats must be constexprs)")
    unknown = [n for n in div16 if n not in signature]
    if unknown:
        raise AotError(f"{fn.__name__}: div16 names {unknown} are not runtime parameters")
    extra = [n for n in constexprs if n not in const_names]
    if extra:
        raise AotError(f"{fn.__name__}: {extra} are not constexpr parameters of the kernel")

    params = [(n, signature[n]) for n in runtime]
    cache = cache if cache is not None else AotCache()
    import triton

    key = make_key(kind="triton", source=fn.cache_key, params=params, constexprs=sorted(constexprs.items()),
                   div16=sorted(div16), sm=sm, num_warps=num_warps, num_stages=num_stages, version=triton.__version__,
                   toolchain=_triton_toolchain(sm))
    hit = cache.get(key)
    if hit is not None:
        meta, ptx, cubin = hit
        meta["params"] = [tuple(p) for p in meta["params"]]
        return Artifact(**meta, ptx=ptx, cubin=cubin)

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    full_sig = {n: ("constexpr" if n in const_names else signature[n]) for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
    src = ASTSource(fn, signature=full_sig, constexprs=dict(constexprs), attrs=attrs)
    try:
        ck = triton.compile(src, target=GPUTarget("cuda", sm, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})
    except Exception as e:
        if interpreter_enabled():
            raise AotError(f"{fn.__name__} cannot be compiled in a TRITON_INTERPRET=1 process ({type(e).__name__}); "
                           "compile in a process without it, e.g. python -m trt_plugins.aot") from e
        raise
    md = ck.metadata
    if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
        raise AotError(f"{fn.__name__} needs Triton global/profile scratch memory, which an AOT plugin cannot "
                       "allocate; pass scratch as an explicit tensor argument instead")
    if (getattr(md, "num_ctas", 1) != 1 or getattr(md, "launch_cooperative_grid", False)
            or getattr(md, "launch_pdl", False)):
        raise AotError(f"{fn.__name__}: clusters, cooperative or PDL launches are not supported by the AOT launcher")
    if getattr(md, "tensordesc_meta", None):
        raise AotError(f"{fn.__name__}: TMA tensor descriptors are not supported by the AOT launcher")
    if md.shared > MAX_SHARED[sm]:
        raise AotError(f"{fn.__name__} needs {md.shared} bytes of shared memory but sm_{sm} allows "
                       f"{MAX_SHARED[sm]} per block: choose smaller tiles or fewer stages for sm_{sm}")
    ptx = ck.asm["ptx"]
    num_hidden = len(entry_params(ptx, md.name)) - len(params)
    art = Artifact(name=md.name, kind="triton", sm=sm, params=params, constexprs=dict(constexprs),
                   div16=sorted(div16), num_warps=md.num_warps, num_stages=md.num_stages, shared=md.shared,
                   num_hidden=num_hidden, source_hash=fn.cache_key, key=key, ptx=ptx, cubin=ck.asm["cubin"])
    cache.put(key, art.meta(), art.ptx, art.cubin)
    return art


def strip_hidden_params(art: Artifact) -> str:
    """The artifact's PTX without its trailing hidden parameters, which must be unreferenced in the body.

    TensorRT's AOT plugins pass exactly (inputs, extra int args, outputs); a PTX entry that declares two more params
    would make the driver read past TensorRT's argument array.
    """
    if art.num_hidden == 0:
        return art.ptx
    m = re.search(r"\.entry\s+" + re.escape(art.name) + r"\s*\(([^)]*)\)", art.ptx)
    decls = [d.strip() for d in m.group(1).split(",") if d.strip()]
    hidden = [d.split()[-1] for d in decls[len(decls) - art.num_hidden:]]
    body = art.ptx[m.end():]
    used = [h for h in hidden if re.search(re.escape(h) + r"\b", body)]
    if used:
        raise AotError(f"{art.name}: hidden parameters {used} are used by the kernel; it cannot run without scratch")
    kept = ",\n\t".join(decls[: len(decls) - art.num_hidden])
    return art.ptx[: m.start(1)] + "\n\t" + kept + "\n" + art.ptx[m.end(1):]


def ptxas(ptx: str, sm: int) -> bytes:
    """Assemble PTX to a cubin with Triton's bundled ptxas (the one that produced the PTX)."""
    from triton.backends.nvidia.compiler import get_ptxas

    exe = get_ptxas(sm).path
    with tempfile.TemporaryDirectory() as d:
        src, out = Path(d) / "k.ptx", Path(d) / "k.cubin"
        src.write_text(ptx)
        arch = f"sm_{sm}a" if sm == 90 else f"sm_{sm}"
        r = subprocess.run([exe, f"--gpu-name={arch}", str(src), "-o", str(out)], capture_output=True, text=True)
        if r.returncode != 0:
            raise AotError(f"ptxas failed for sm_{sm}: {r.stderr.strip()}")
        return out.read_bytes()


def _local_headers(source: Path, seen=None) -> list:
    """Contents of the ``#include "..."`` files beside ``source`` (recursively, each once), so that the cache key
    changes when a shared header does."""
    seen = set() if seen is None else seen
    out = []
    for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', source.read_text(), flags=re.M):
        h = (source.parent / name).resolve()
        if h in seen or not h.is_file():
            continue  # a missing header is nvcc's error to report
        seen.add(h)
        out += [h.read_bytes(), *_local_headers(h, seen)]
    return out


NVCC_FLAGS = ("-O3", "-std=c++17")
# Environment settings Triton's compiler reads that change its PTX or cubin (Triton keys its own cache on them too).
TRITON_ENV = ("TRITON_DEFAULT_FP_FUSION", "TRITON_PTXAS_PATH", "PTXAS_OPTIONS", "DISABLE_PTXAS_OPT")


def _triton_toolchain(sm: int) -> dict:
    """What besides Triton's version decides a Triton kernel's binary: the ptxas it runs (its ``--version``; PTX's
    ISA version follows it) and the environment settings ``TRITON_ENV``."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas_version

        ptxas = get_ptxas_version(sm)
    except Exception as e:  # noqa: BLE001 - an internal API of Triton: a change there must not break compiling
        ptxas = f"unknown ({type(e).__name__})"
    return dict(ptxas=ptxas, env={k: os.environ.get(k) for k in TRITON_ENV})


@functools.lru_cache(maxsize=None)
def _nvcc_version(nvcc: str) -> str | None:
    """``nvcc --version`` (the toolkit whose headers and ptxas build the kernel), or None where ``nvcc`` is missing
    (the key then misses, and the compile says nvcc is not found)."""
    try:
        return subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return None


def compile_cuda(source: str | Path, kernel_name: str, params: list, *, sm: int, threads: int, shared: int = 0,
                 cache: AotCache | None = None, nvcc: str = "nvcc", extra_flags=(), arch_specific: bool = False,
                 div16=()) -> Artifact:
    """Compile the ``extern "C" __global__`` function ``kernel_name`` of a .cu file with nvcc to PTX and cubin.

    ``params`` lists its runtime parameters ``[(name, type)]`` in order; ``threads`` the block size it is written for;
    ``shared`` its dynamic shared memory bytes. ``arch_specific``: compile for ``sm_XXa`` (e.g. sm_90a, needed by
    Hopper's wgmma), whose code runs on exactly that SM and no later one. ``div16``: parameters the kernel assumes
    16-byte aligned (pointers) or divisible by 16 (ints); nvcc is not told, the launcher checks them on every launch.
    """
    _check_sm(sm)
    text = Path(source).read_text()
    if 'extern "C"' not in text:
        raise AotError(f"{source}: kernels must be extern \"C\" so that {kernel_name} keeps an unmangled name")
    cache = cache if cache is not None else AotCache()
    import hashlib

    src_hash = hashlib.sha256(text.encode() + b"".join(_local_headers(Path(source)))).hexdigest()
    arch = f"sm_{sm}a" if arch_specific else f"sm_{sm}"
    unknown = [n for n in div16 if n not in dict(params)]
    if unknown:
        raise AotError(f"{kernel_name}: div16 names {unknown} are not parameters")
    key = make_key(kind="cuda", source=src_hash, name=kernel_name, params=[list(p) for p in params], sm=sm,
                   threads=threads, shared=shared, flags=[*NVCC_FLAGS, *extra_flags], arch=arch, div16=sorted(div16),
                   nvcc=_nvcc_version(nvcc))
    hit = cache.get(key)
    if hit is not None:
        meta, ptx, cubin = hit
        meta["params"] = [tuple(p) for p in meta["params"]]
        return Artifact(**meta, ptx=ptx, cubin=cubin)
    outs = {}
    with tempfile.TemporaryDirectory() as d:
        for kind in ("ptx", "cubin"):
            out = Path(d) / f"k.{kind}"
            cmd = [nvcc, f"-{kind}", f"-arch={arch}", *NVCC_FLAGS, *extra_flags, str(source), "-o", str(out)]
            try:
                r = subprocess.run(cmd, capture_output=True, text=True)
            except FileNotFoundError:
                raise AotError(f"{nvcc} not found: install the CUDA toolkit or pass nvcc=<path>") from None
            if r.returncode != 0:
                raise AotError(f"nvcc failed for {source} (sm_{sm}): {r.stderr.strip()[-2000:]}")
            outs[kind] = out.read_text() if kind == "ptx" else out.read_bytes()
    got = entry_params(outs["ptx"], kernel_name)
    want = ["u64" if ty.startswith("*") else f"b8[{TENSOR_MAP_BYTES}]" if ty == TENSOR_MAP else "u32"
            for _, ty in params]
    if [("u64" if g in ("u64", "b64") else "u32" if g in ("u32", "s32", "b32") else g) for g in got] != want:
        raise AotError(f"{kernel_name}: the PTX entry takes ({', '.join(got)}) but ({', '.join(want)}) were declared "
                       f"for {[n for n, _ in params]}")
    art = Artifact(name=kernel_name, kind="cuda", sm=sm, params=[tuple(p) for p in params], constexprs={},
                   div16=sorted(div16), num_warps=threads // 32, num_stages=1, shared=shared, num_hidden=0,
                   source_hash=src_hash, key=key, ptx=outs["ptx"], cubin=outs["cubin"])
    cache.put(key, art.meta(), art.ptx, art.cubin)
    return art


@dataclass(frozen=True)
class CudaBuild:
    """One CUDA C++ kernel variant as nvcc builds it: ``compile_cuda``'s arguments other than the parameter list, the
    SM and the cache. The launchers of ``kernels/gemm`` describe their plugin entries with it (``plugin_build``), and
    ``trt_plugins`` compiles a specialisation that runs a CUDA kernel from it."""

    source: str  # the .cu file
    entry: str  # its extern "C" __global__ function
    flags: tuple = ()  # nvcc flags: the variant's -D macros
    threads: int = 128  # block size the kernel is written for
    shared: int = 0  # dynamic shared memory bytes
    arch_specific: bool = False  # sm_XXa code (wgmma)

    def compile(self, params: list, *, sm: int, cache: AotCache | None = None, div16=()) -> Artifact:
        return compile_cuda(self.source, self.entry, params, sm=sm, threads=self.threads, shared=self.shared,
                            cache=cache, extra_flags=self.flags, arch_specific=self.arch_specific, div16=div16)
