"""Registered by the attention work; see kernels/ops/__init__.py for the contract."""
