"""Generation on a paged KV cache: block manager (with prefix caching), scheduler (chunked prefill mixed with
decode), batched sampling, the loop, and the torch / TensorRT backends.

``Generator(backend, tokenizer).generate(prompts, SamplingParams(...), on_token=...)``; backends:
``TorchBackend(LlamaModel)`` (``export.runtime.backends``) and ``TrtBackend(out_dir)`` (``export.runtime.trt_backend``,
imports TensorRT only when constructed).
"""

from .backends import TorchBackend
from .blocks import BlockManager, OutOfBlocks
from .generator import GenerationResult, GenerationStats, Generator
from .sampling import SamplingParams
from .trt_backend import TrtBackend  # imports TensorRT only when a TrtBackend is constructed

__all__ = ["BlockManager", "OutOfBlocks", "GenerationResult", "GenerationStats", "Generator", "SamplingParams",
           "TorchBackend", "TrtBackend"]
