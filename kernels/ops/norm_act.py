"""Registered by the norm_act work; see kernels/ops/__init__.py for the contract."""
