"""Launch an AOT artifact through the CUDA driver API, as the TensorRT plugin does: no Triton JIT involved.

``AotKernel(artifact).launch(grid, *args)`` loads the cubin (or, with ``use_ptx=True``, the PTX, which the driver
JIT-assembles the way TensorRT does with a plugin's PTX) with ``cuModuleLoadData``, raises the dynamic shared memory
limit when the kernel needs more than 48 KB, and calls ``cuLaunchKernel`` on torch's current stream with the runtime
arguments in the artifact's order, then null for each hidden Triton scratch pointer. The divisibility assumptions the
artifact was compiled under are checked on every launch: a violated one would silently read wrong data.

``cuda.bindings`` (``pip install 'tritrt[driver]'``) is imported on first use only.
"""

from __future__ import annotations

import ctypes
import functools

from .compile import TENSOR_MAP, TENSOR_MAP_BYTES, AotError, Artifact, strip_hidden_params

_SHARED_DEFAULT_LIMIT = 48 * 1024


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError:
        raise ImportError("the AOT launcher needs cuda-python's driver bindings: pip install 'tritrt[driver]' "
                          "(or pip install cuda-python)") from None
    return driver


@functools.lru_cache(maxsize=None)
def _pdl_attrs() -> list:
    """The launch attribute list of a programmatic dependent launch (built once: a launch is on the hot path)."""
    drv = _driver()
    attr = drv.CUlaunchAttribute()
    attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    return [attr]


def _check(result):
    """cuda.bindings returns (CUresult, *values); raise on an error, return the values."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        drv = _driver()
        _, msg = drv.cuGetErrorString(err)
        raise RuntimeError(f"CUDA driver error {int(err)}: {msg.decode() if msg else err}")
    return values[0] if len(values) == 1 else values


def tensor_map_fp16_2d(ptr: int, rows: int, cols: int, row_stride: int, box_rows: int, box_cols: int,
                       swizzle: int = 128) -> ctypes.Array:
    """The ``CUtensorMap`` of a row-major fp16 ``[rows, cols]`` matrix at ``ptr`` (rows ``row_stride`` elements apart)
    that a kernel's ``cp.async.bulk.tensor.2d`` copies ``box_rows x box_cols`` boxes from, ``swizzle``-byte swizzled
    (0, 32, 64 or 128) in shared memory, boxes past the edge zero-filled; as the 128 bytes a ``tmap`` parameter takes
    by value (``AotKernel.launch``). The encoding is a driver call: cache it per buffer and shape."""
    drv = _driver()
    modes = {0: "NONE", 32: "32B", 64: "64B", 128: "128B"}
    if swizzle not in modes:
        raise ValueError(f"swizzle must be one of {sorted(modes)} bytes, got {swizzle}")
    u32, u64 = drv.cuuint32_t, drv.cuuint64_t
    tmap = _check(drv.cuTensorMapEncodeTiled(
        drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16, u32(2), ptr, [u64(cols), u64(rows)],
        [u64(row_stride * 2)], [u32(box_cols), u32(box_rows)], [u32(1), u32(1)],
        drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        getattr(drv.CUtensorMapSwizzle, f"CU_TENSOR_MAP_SWIZZLE_{modes[swizzle]}"),
        drv.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE))
    return (ctypes.c_uint64 * (TENSOR_MAP_BYTES // 8))(*(int(w) for w in tmap.opaque))


def _current_device() -> int:
    """torch's current CUDA device: the one whose stream a launch goes to, and whose context the function must be
    loaded in."""
    import torch

    return torch.cuda.current_device()


def _raw_stream(device: int) -> int:
    """torch's current stream on ``device``, as the raw handle ``torch.cuda.current_stream().cuda_stream`` gives,
    through the call Triton's own launcher makes: the public one builds a Stream object and resolves the device in
    Python, ~10 us of host time on every launch (H200 host, cProfile)."""
    from torch._C import _cuda_getCurrentRawStream as raw_stream

    return raw_stream(device)


class AotKernel:
    """An artifact bound to the GPUs it runs on: loaded into a device's context on its first ``launch`` there (a
    module, and so its function handle, belongs to one context: the one made current when it was loaded), launched
    many times."""

    def __init__(self, artifact: Artifact, use_ptx: bool = False):
        self.art = artifact
        self.use_ptx = use_ptx
        self._funcs: dict[int, object] = {}  # torch device index -> CUfunction in that device's primary context
        self._modules: dict[int, object] = {}

    def _load(self, device: int):
        import torch

        from .._utils import device_sm  # lazily, like torch: importing kernels.aot stays free of torch/triton

        drv = _driver()
        torch.cuda.init()
        _check(drv.cuInit(0))
        # The module must live in torch's context for the device (its primary context), or torch's pointers and
        # stream would be foreign to it: torch makes that context current when it switches devices, and a thread on
        # which the runtime has not run yet has none, so make it current then.
        if int(_check(drv.cuCtxGetCurrent())) == 0:
            dev = _check(drv.cuDeviceGet(device))
            _check(drv.cuCtxSetCurrent(_check(drv.cuDevicePrimaryCtxRetain(dev))))
        sm = device_sm(device)
        if self.art.sm != sm and not (self.use_ptx and self.art.sm < sm):
            raise AotError(f"{self.art.name} was compiled for sm_{self.art.sm} but this GPU is sm_{sm}: recompile "
                           f"with --sm {sm}")
        if self.use_ptx:
            # The hidden-params-stripped PTX is what the plugin embeds; it takes exactly the declared arguments.
            image = (strip_hidden_params(self.art) + "\0").encode()
        else:
            image = self.art.cubin
        module = _check(drv.cuModuleLoadData(image))
        func = _check(drv.cuModuleGetFunction(module, self.art.name.encode()))
        if self.art.shared > _SHARED_DEFAULT_LIMIT:
            attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            _check(drv.cuFuncSetAttribute(func, attr, self.art.shared))
        self._modules[device] = module
        self._funcs[device] = func
        return func

    @functools.cached_property
    def _params(self) -> tuple:
        """(name, kind, assumed divisible by 16) of each runtime parameter, kind ``"ptr"``, ``"tmap"`` or ``"int"``:
        worked out once, since ``_pack`` runs on every launch."""
        div16 = set(self.art.div16)
        return tuple((name, "ptr" if ty.startswith("*") else "tmap" if ty == TENSOR_MAP else "int", name in div16)
                     for name, ty in self.art.params)

    def _pack(self, args):
        params = self._params
        if len(args) != len(params):
            raise TypeError(f"{self.art.name} takes {len(params)} runtime arguments "
                            f"({', '.join(p[0] for p in params)}), got {len(args)}")
        values = []
        for (name, kind, div16), a in zip(params, args):
            if kind == "ptr":
                if not (hasattr(a, "data_ptr") and a.is_cuda):
                    raise TypeError(f"{self.art.name}: argument {name} must be a CUDA tensor, got {type(a).__name__}")
                ptr = a.data_ptr()
                if div16 and ptr % 16:
                    raise AotError(f"{self.art.name}: {name} is not 16-byte aligned (compiled assuming it is); "
                                   "pass a contiguous, freshly allocated tensor")
                values.append(ctypes.c_uint64(ptr))
            elif kind == "tmap":  # a tensor map (cuTensorMapEncodeTiled) passed by value, as ctypes bytes
                if not isinstance(a, ctypes.Array) or ctypes.sizeof(a) != TENSOR_MAP_BYTES:
                    raise TypeError(f"{self.art.name}: argument {name} must be a tensor map's {TENSOR_MAP_BYTES} "
                                    f"bytes as a ctypes array (tensor_map_fp16_2d), got {type(a).__name__}")
                values.append(a)
            else:
                v = int(a)
                if not -(2**31) <= v < 2**31:
                    raise AotError(f"{self.art.name}: {name}={v} does not fit int32")
                if div16 and v % 16:
                    raise AotError(f"{self.art.name}: {name}={v} is not a multiple of 16 (compiled assuming it is)")
                values.append(ctypes.c_int32(v))
        if not self.use_ptx:
            values += [ctypes.c_uint64(0) for _ in range(self.art.num_hidden)]
        return values

    def launch(self, grid, *args, stream=None, pdl: bool = False):
        """Launch on ``grid`` (1-3 ints) with the runtime ``args`` (tensors, ints, tensor maps as 128-byte ctypes
        arrays), on torch's current stream. ``pdl``: as a programmatic dependent of the previous kernel
        (``cuLaunchKernelEx``; the kernel must call ``griddepcontrol.wait`` before touching anything an earlier kernel
        writes: ``kernels._launch``)."""
        device = _current_device()
        func = self._funcs.get(device)
        if func is None:
            func = self._load(device)
        values = self._pack(args)
        ptrs = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
        g = tuple(int(x) for x in grid) + (1,) * (3 - len(grid))
        if min(g) <= 0:
            return  # an empty batch: nothing to launch (TensorRT skips it too)
        if stream is None:
            stream = _raw_stream(device)
        drv = _driver()
        if pdl:
            cfg = drv.CUlaunchConfig()
            cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = g
            cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = self.art.block, 1, 1
            cfg.sharedMemBytes = self.art.shared
            cfg.hStream = drv.CUstream(stream)
            cfg.attrs = _pdl_attrs()
            cfg.numAttrs = 1
            _check(drv.cuLaunchKernelEx(cfg, func, ctypes.addressof(ptrs), 0))
            return
        _check(drv.cuLaunchKernel(func, g[0], g[1], g[2], self.art.block, 1, 1, self.art.shared,
                                  drv.CUstream(stream), ctypes.addressof(ptrs), 0))
