"""Dense fp16 GEMM kernels (an unquantized ``nn.Linear`` weight): the tensor-core GEMV for decode sizes
(``gemv_mma``); which one runs, or cuBLAS, is ``kernels.gemm.routing.route_f16``'s choice."""
