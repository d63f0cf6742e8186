// One kernel body, two entry points. The torch launchers compile a kernel's .cu as it is: TRITRT_ENTRY(attrs) is
// `extern "C" __global__ void attrs`, the kernel they launch. Built with -DTRITRT_PLUGIN_ENTRY (trt_plugins, through
// kernels.aot.compile_cuda), the same function becomes a __device__ function, and the .cu's plugin entry -- a
// __global__ whose parameters are in the TensorRT plugin's order (inputs, int32 extra args, outputs) -- calls it. So
// the plugin runs the torch path's kernel body, and the torch build stays token for token what it was (its PTX and
// cubin are unchanged by the plugin entries).
#pragma once

#ifdef TRITRT_PLUGIN_ENTRY
#define TRITRT_ENTRY(...) __device__ __forceinline__ void
#else
#define TRITRT_ENTRY(...) extern "C" __global__ void __VA_ARGS__
#endif
