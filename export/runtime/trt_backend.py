"""The TensorRT backend: runs ``OUT/model.engine`` (plugin nodes = our kernels) on the same packed paged ``Batch``.

Written against the documented TensorRT >= 10.9 Python API (``Runtime.deserialize_cuda_engine``, named I/O tensors,
``set_input_shape`` / ``set_tensor_address`` / ``execute_async_v3``); TensorRT is imported only when a backend is
constructed, with a clear error when it is missing. The feeds are exactly the ONNX graph I/O of
``export.onnx_export``: ``input_ids, positions, slot_mapping, block_table, seq_lens, cu_seqlens_q, k_cache_{i},
v_cache_{i}, attn_part_o, attn_part_lse, attn_counter`` in, ``logits`` (fp32) and ``k_cache_out_{i},
v_cache_out_{i}`` out. The cache outputs alias their inputs in the plugin flavour (the RoPE + KV-write plugin writes in
place), so they are bound to the same memory.

The engine has two optimization profiles (``export.engine.PROFILE_NAMES``): "decode" (one token per sequence, up to
``max_num_seqs``) and "prefill" (up to ``max_num_tokens`` packed tokens). A step runs on the first profile whose
bounds hold it (``fitting_profile``): decode steps on the decode profile, padded to batch-size buckets
(``pad_decode_batch``) and captured in CUDA graphs, one execution context per bucket so that each context's shapes
never change after capture; other steps on an eager context per profile, switched to its profile
(``set_optimization_profile_async``) before any shape is set, as TensorRT requires.

Not run in this repository's CI or on the lent GPU (TensorRT is installable on neither); ``engine_feeds`` and the
profile checks are plain torch and are tested on CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from export.batch import TENSOR_FIELDS, Batch
from export.onnx_export import attention_scratch

from .backends import DEFAULT_GRAPH_BATCH_SIZES, copy_batch_, pad_decode_batch


def import_tensorrt():
    """``tensorrt`` (>= 10.9), or an ImportError that says how to get it."""
    from export.engine import tensorrt_missing_reason

    reason = tensorrt_missing_reason()
    if reason:
        raise ImportError(f"the trt backend needs TensorRT >= 10.9 ({reason}): pip install 'tritrt[tensorrt]' on a "
                          "machine with an NVIDIA GPU, or use --backend torch")
    import tensorrt as trt

    return trt


def engine_feeds(batch: Batch, kv_cache, attn_scratch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Input name -> tensor, exactly the engine's (= the ONNX graph's) inputs, contiguous and in the graph dtypes.
    ``attn_scratch``: ``export.onnx_export.attention_scratch`` for at least ``batch.num_seqs`` sequences (leading
    slices are fed)."""
    feeds = {f: getattr(batch, f).contiguous() for f in TENSOR_FIELDS}
    for f, dt in zip(TENSOR_FIELDS, (torch.int64, torch.int64) + (torch.int32,) * 4):
        if feeds[f].dtype != dt:
            raise ValueError(f"batch.{f} is {feeds[f].dtype}; the engine takes {dt}")
    for i, (k, v) in enumerate(kv_cache):
        feeds[f"k_cache_{i}"], feeds[f"v_cache_{i}"] = k, v
    for name, t in attn_scratch.items():
        if t.shape[0] < batch.num_seqs:
            raise ValueError(f"{name} holds {t.shape[0]} sequences, the batch has {batch.num_seqs}")
        feeds[name] = t[:batch.num_seqs]
    return feeds


def fitting_profile(feeds: dict[str, torch.Tensor], profiles: list[dict[str, tuple]]) -> int:
    """The index of the first profile whose bounds hold ``feeds``; else ``check_profile``'s error for the last (the
    widest: prefill)."""
    for i, profile in enumerate(profiles[:-1]):
        try:
            check_profile(feeds, profile)
            return i
        except ValueError:
            continue
    check_profile(feeds, profiles[-1])
    return len(profiles) - 1


def check_profile(feeds: dict[str, torch.Tensor], profile: dict[str, tuple]) -> None:
    """Refuse shapes outside the engine's optimization profile (``name -> (min, opt, max)``) with what to rebuild."""
    for name, t in feeds.items():
        if name not in profile:
            continue
        lo, _, hi = profile[name]
        if len(lo) != t.dim() or any(s < a or s > b for s, a, b in zip(t.shape, lo, hi)):
            raise ValueError(f"input {name} of shape {tuple(t.shape)} is outside the engine's profile "
                             f"[{tuple(lo)} .. {tuple(hi)}]; lower the batch (--max-num-seqs / prompt length) or "
                             "rebuild the engine with larger --max-tokens / --max-seqs / --max-blocks")


class TrtBackend:
    """``Backend`` over a TensorRT engine built by ``python -m export.build``."""

    def __init__(self, out_dir, num_blocks: int | None = None, cuda_graphs: bool = True,
                 graph_batch_sizes=DEFAULT_GRAPH_BATCH_SIZES, max_model_len: int | None = None):
        out = Path(out_dir)
        engine_path = out / "model.engine"
        if not engine_path.is_file():
            raise FileNotFoundError(f"{engine_path} is missing; build it with `python -m export.build` on a machine "
                                    "with TensorRT >= 10.9, or use --backend torch")
        trt = import_tensorrt()
        if not torch.cuda.is_available():
            raise RuntimeError("the trt backend needs a CUDA device")
        from export.checkpoint import LlamaConfig

        from .tokenizer import eos_token_ids

        build = json.loads((out / "build.json").read_text())
        self.config = LlamaConfig.from_build(build, out)
        self.eos_token_ids = eos_token_ids(out)
        self.device = torch.device("cuda")
        self.vocab_size = self.config.vocab_size
        self.block_size = int(build["block_size"])
        _register_plugins()
        self._trt = trt
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self.engine = self._runtime.deserialize_cuda_engine(engine_path.read_bytes())
        if self.engine is None:
            raise RuntimeError(f"TensorRT could not load {engine_path} (built for another TensorRT or GPU?); rebuild "
                               "it")
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self._inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        # (min, opt, max) of each input per profile: decode first, prefill last (export.engine.PROFILE_NAMES); they
        # bound every dynamic dimension, and build.json records the same limits by name.
        self.profiles = [{n: tuple(tuple(s) for s in self.engine.get_tensor_profile_shape(n, p)) for n in self._inputs}
                         for p in range(self.engine.num_optimization_profiles)]
        widest = self.profiles[-1]
        max_blocks_in_cache = widest["k_cache_0"][2][0]
        self.num_blocks = min(num_blocks or int(build.get("num_blocks", max_blocks_in_cache)), max_blocks_in_cache)
        self.max_model_len = max_model_len or min(int(build.get("max_seq_len", self.config.max_position_embeddings)),
                                                  widest["block_table"][2][1] * self.block_size)
        self.max_num_seqs = max(p["seq_lens"][2][0] for p in self.profiles)
        self.max_num_tokens = widest["input_ids"][2][0]  # the prefill profile's: what a chunk may hold
        kv_dtype = _torch_dtype(trt, self.engine.get_tensor_dtype("k_cache_0"))
        shape = (self.num_blocks, self.block_size, self.config.num_kv_heads, self.config.head_dim)
        self.kv_cache = [(torch.zeros(shape, dtype=kv_dtype, device=self.device),
                          torch.zeros(shape, dtype=kv_dtype, device=self.device))
                         for _ in range(self.config.num_layers)]
        # PagedAttention's decode scratch, shared by every context (they run in turn on one stream); counters zeroed
        # once here, left at zero by the plugin.
        self.attn_scratch = attention_scratch(self.config, self.max_num_seqs, self.device)
        # An eager context per profile; a new context is on profile 0, and TensorRT takes the switch only before the
        # context's first set_input_shape.
        self._eager = []
        for p in range(len(self.profiles)):
            context = self.engine.create_execution_context()
            if p:
                context.set_optimization_profile_async(p, torch.cuda.current_stream().cuda_stream)
            self._eager.append(context)
        self.cuda_graphs = cuda_graphs
        self.graph_batch_sizes = tuple(b for b in sorted(graph_batch_sizes) if b <= self.max_num_seqs)
        self._max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        self._graphs: dict[int, tuple] = {}

    def _bind(self, context, feeds: dict[str, torch.Tensor], logits: torch.Tensor, profile: int) -> None:
        check_profile(feeds, self.profiles[profile])
        addresses = {name: t.data_ptr() for name, t in feeds.items()}
        for name, t in feeds.items():
            if not context.set_input_shape(name, tuple(t.shape)):
                raise ValueError(f"TensorRT refused shape {tuple(t.shape)} for {name}")
        addresses["logits"] = logits.data_ptr()
        for i, (k, v) in enumerate(self.kv_cache):  # aliased outputs: the same memory as the cache inputs
            addresses[f"k_cache_out_{i}"], addresses[f"v_cache_out_{i}"] = k.data_ptr(), v.data_ptr()
        for name, ptr in addresses.items():
            if not context.set_tensor_address(name, ptr):  # False: no such I/O tensor (an engine of another export)
                raise RuntimeError(f"the engine has no I/O tensor {name!r}; rebuild it with this version of tritrt")

    def _execute(self, context) -> None:
        if not context.execute_async_v3(torch.cuda.current_stream().cuda_stream):
            raise RuntimeError("TensorRT execute_async_v3 failed; see the TensorRT log above")

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor:
        if self.cuda_graphs and batch.max_seqlen_q == 1 and self.graph_batch_sizes \
                and batch.num_seqs <= self.graph_batch_sizes[-1]:
            return self._decode_graph(batch)
        feeds = engine_feeds(batch.to(self.device), self.kv_cache, self.attn_scratch)
        logits = torch.empty(batch.num_seqs, self.vocab_size, dtype=torch.float32, device=self.device)
        profile = fitting_profile(feeds, self.profiles)
        self._bind(self._eager[profile], feeds, logits, profile)
        self._execute(self._eager[profile])
        return logits

    def _decode_graph(self, batch: Batch) -> torch.Tensor:
        S = batch.num_seqs
        bs = next(b for b in self.graph_batch_sizes if b >= S)
        if bs not in self._graphs:
            static = pad_decode_batch(batch, bs, self._max_blocks_per_seq).to(self.device)
            static.slot_mapping.fill_(-1)  # the warm-up and capture runs must not write the cache
            context = self.engine.create_execution_context()  # on profile 0: decode
            logits = torch.empty(bs, self.vocab_size, dtype=torch.float32, device=self.device)
            self._bind(context, engine_feeds(static, self.kv_cache, self.attn_scratch), logits, 0)
            self._execute(context)  # TensorRT's rule: one run after the shapes are set, before capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._execute(context)
            self._graphs[bs] = (graph, static, logits, context)
        graph, static, logits, _ = self._graphs[bs]
        copy_batch_(static, pad_decode_batch(batch, bs, self._max_blocks_per_seq))
        graph.replay()
        return logits[:S]


def _register_plugins() -> None:
    """Register tritrt's plugins with TensorRT (``trt_plugins.trt_glue``) before the engine is deserialized."""
    try:
        from trt_plugins import trt_glue
    except ImportError as e:
        raise ImportError(f"trt_plugins.trt_glue could not be imported ({e}); "
                          "the engine's plugin nodes cannot run") from e
    for name in ("register_all", "register_plugins", "register"):
        fn = getattr(trt_glue, name, None)
        if callable(fn):
            fn()
            return
    raise ImportError("trt_plugins.trt_glue has no register function (register_all / register_plugins / register)")


def _torch_dtype(trt, dt) -> torch.dtype:
    table = {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16,
             trt.int32: torch.int32, trt.int64: torch.int64, trt.int8: torch.int8}
    return table[dt]
