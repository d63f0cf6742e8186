"""Triton (and a little CUDA C++) kernels for LLaMA inference, each with a torch reference.

Importing this package imports neither CUDA nor TensorRT: kernels query the GPU only when launched.
``kernels.ops`` registers every kernel as a torch custom op (``torch.ops.tritrt.*``) with a fake impl;
``kernels.aot`` compiles kernels ahead of time and launches the artifacts through the CUDA driver API.
"""
