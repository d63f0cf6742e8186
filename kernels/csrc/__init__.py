"""CUDA C++ kernels (``*.cu``) and their Python launchers; compiled with nvcc through ``kernels.aot.compile_cuda``
(content-addressed cache) and launched through the CUDA driver (``kernels.aot.launcher.AotKernel``). Nothing here
touches CUDA at import time."""
