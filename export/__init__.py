"""HF checkpoint -> quantized weights -> ONNX with plugin nodes -> TensorRT engine; the runtime and verification."""
