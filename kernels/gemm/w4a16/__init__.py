"""W4A16 GEMM kernels (INT4 group-wise weights in the ``kernels.quant`` layout, 16-bit activations); which one runs
is ``kernels.gemm.routing.route_w4a16``'s choice."""
