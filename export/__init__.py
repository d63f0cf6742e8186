"""HF checkpoint -> quantized weights -> ONNX with plugin nodes -> TensorRT engine; the runtime and verification."""

# Weight-only quantization modes, of the decoder's linears (``export.build --quant``) and of the lm_head
# (``--lm-head-quant``): one spelling for the CLI (kept torch-free), the model and the quantizer.
QUANT_MODES = ("none", "int8", "int4")
