"""W8A16 GEMM kernels (INT8 per-output-channel weights in the ``kernels.quant`` layout, 16-bit activations); which
one runs is ``kernels.gemm.routing.route_w8a16``'s choice."""
