"""TensorRT plugins for tritrt's kernels, generated from one declarative spec per op (``trt_plugins.specs``).

- ``trt_plugins.specs``: the specs and ``SPECS`` registry (no TensorRT, no CUDA needed).
- ``trt_plugins.reference``: ``run_reference(op_type, inputs, attrs)``, CPU execution of plugin nodes.
- ``trt_plugins.aot``: compile a spec's kernel ahead of time and run it through the CUDA driver launcher.
- ``trt_plugins.trt_glue``: registration with TensorRT's Python plugin API (imports TensorRT >= 10.9 lazily).

Importing this package imports neither TensorRT nor CUDA.
"""

from .specs import SPECS, get_spec  # noqa: F401
