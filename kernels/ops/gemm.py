"""Registered by the gemm work; see kernels/ops/__init__.py for the contract."""
