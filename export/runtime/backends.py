"""The backend interface the generation loop runs on, and the torch backend (``LlamaModel`` on ``kernels.ops``).

A backend owns the KV cache and turns one ``Batch`` (built on the host by the scheduler) into the logits of each
sequence's last new token, ``[S, vocab]``. Attributes the loop reads: ``device``, ``vocab_size``, ``num_blocks``,
``block_size``, ``max_model_len`` and ``config`` (for ``eos_token_id``).

The torch backend runs decode steps through CUDA graphs, one per batch-size bucket (1, 2, 4, 8, ...): the step's
inputs are copied into static buffers padded to the bucket (padding rows write no cache slot and attend to one
token of block 0) and the graph replays the whole model as one launch, which removes the per-kernel launch
overhead that dominates batch-1 decode. Prefill steps (variable token counts) run eagerly. On CPU everything is
eager and the ops run their torch references.
"""

from __future__ import annotations

import logging

import torch

from export.batch import TENSOR_FIELDS, Batch

log = logging.getLogger(__name__)

DEFAULT_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)
# Default cache size: this many sequences of max_model_len (CPU: few, its cache is host memory).
DEFAULT_SEQS = {"cuda": 64, "cpu": 8}


def _kv_bytes_per_block(config, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * elem


def runtime_fuses_swiglu(device) -> bool:
    """Whether ``TorchBackend`` runs a model on ``device`` with SwiGLU fused into its quantized gate/up GEMMs
    (``LlamaModel.fuse_swiglu_``) unless told otherwise: on CUDA devices. ``export.eval`` scores builds the same
    way."""
    return torch.device(device).type == "cuda"


class TorchBackend:
    """``LlamaModel.forward`` over a paged cache it allocates; CUDA graphs for decode on CUDA devices.

    ``fuse_swiglu`` (default: on CUDA devices) applies ``model.fuse_swiglu_()``: the quantized gate/up GEMMs run
    SwiGLU in their epilogue. It re-lays out the model's gate/up weights in place, after which the model can no
    longer be saved or exported (load it again for that)."""

    def __init__(self, model, num_blocks: int | None = None, block_size: int = 16, max_model_len: int | None = None,
                 kv_dtype: torch.dtype | None = None, cuda_graphs: bool | None = None,
                 graph_batch_sizes=DEFAULT_GRAPH_BATCH_SIZES, gpu_memory_fraction: float = 0.9,
                 fuse_swiglu: bool | None = None):
        self.model = model
        self.config = model.config
        self.device = torch.device(_model_device(model))
        fuse = runtime_fuses_swiglu(self.device) if fuse_swiglu is None else fuse_swiglu
        if fuse and hasattr(model, "fuse_swiglu_"):
            model.fuse_swiglu_()
            if self.device.type == "cuda":  # the re-layout's freed copies, before free memory sizes the KV cache
                torch.cuda.empty_cache()
        self.vocab_size = self.config.vocab_size
        self.block_size = block_size
        self.max_model_len = max_model_len or self.config.max_position_embeddings
        self.kv_dtype = kv_dtype or _model_dtype(model)
        if num_blocks is None:
            num_blocks = self._default_num_blocks(gpu_memory_fraction)
        self.num_blocks = num_blocks
        self.kv_cache = model.allocate_kv_cache(num_blocks, block_size, self.device, self.kv_dtype)
        self.cuda_graphs = (self.device.type == "cuda") if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and self.device.type != "cuda":
            raise ValueError("cuda_graphs=True needs the model on a CUDA device")
        self.graph_batch_sizes = tuple(sorted(graph_batch_sizes))
        self._graphs: dict[int, tuple] = {}
        self._graph_pool = None
        # Decode block tables are padded to the longest sequence the engine allows, so one graph serves every step.
        self._max_blocks_per_seq = -(-self.max_model_len // block_size)

    def _default_num_blocks(self, fraction: float) -> int:
        # Enough for DEFAULT_SEQS full-length sequences, but on a GPU no more than `fraction` of free memory.
        blocks = DEFAULT_SEQS.get(self.device.type, 8) * -(-self.max_model_len // self.block_size)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            per_block = _kv_bytes_per_block(self.config, self.block_size, self.kv_dtype)
            blocks = min(blocks, int(free * fraction) // per_block)
        return max(1, blocks)

    @torch.inference_mode()
    @property
    def supports_device_tokens(self) -> bool:
        """``forward`` takes ``input_ids`` on the device (the generation loop's pipelined decode): on CUDA."""
        return self.device.type == "cuda"

    def forward(self, batch: Batch, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of each sequence's last new token. ``input_ids``: the step's tokens as a tensor on the model's
        device, used instead of ``batch.input_ids`` (the previous step's sampled tokens, never read by the host)."""
        if self.cuda_graphs and batch.max_seqlen_q == 1 and batch.num_seqs <= self.graph_batch_sizes[-1]:
            return self._decode_graph(batch, input_ids)
        dev = batch.to(self.device)
        if input_ids is not None:
            dev.input_ids = input_ids
        return self.model.forward(dev, self.kv_cache)

    # -- CUDA graphs -----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self, batch_sizes=None) -> None:
        """Capture decode graphs ahead of time (largest first, sharing one memory pool); else done on first use."""
        for bs in sorted(batch_sizes or self.graph_batch_sizes, reverse=True):
            self._graph_for(bs)

    def _graph_for(self, bs: int):
        if bs in self._graphs:
            return self._graphs[bs]
        dev = self.device
        staged = StagedDecodeBatch(bs, self._max_blocks_per_seq, dev)  # all padding: capture writes no cache slot
        static = staged.device_batch
        # Warm up on a side stream (allocator and Triton JIT settle), then capture.
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.model.forward(static, self.kv_cache)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            logits = self.model.forward(static, self.kv_cache)
        if self._graph_pool is None:
            self._graph_pool = graph.pool()
        self._graphs[bs] = (graph, staged, logits)
        return self._graphs[bs]

    def _decode_graph(self, batch: Batch, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        S = batch.num_seqs
        bs = next(b for b in self.graph_batch_sizes if b >= S)
        try:
            graph, staged, logits = self._graph_for(bs)
        except RuntimeError as e:  # a kernel that syncs or allocates during capture: run eagerly from now on
            log.warning("CUDA graph capture failed (%s); decode runs eagerly", e)
            self.cuda_graphs = False
            return self.forward(batch, input_ids)
        staged.load(batch)
        if input_ids is not None:  # after the host copy, in stream order
            staged.device_batch.input_ids[:S].copy_(input_ids)
        graph.replay()
        return logits[:S]  # a view of the graph's output buffer: valid until the next step


class StagedDecodeBatch:
    """A decode graph's static inputs, padded to ``num_seqs`` rows and ``max_blocks`` block-table columns (the
    layout and padding of ``pad_decode_batch``), as views of ONE device buffer with a pinned host twin of the same
    layout: ``load(batch)`` writes the step's batch into the host twin and moves it with one asynchronous copy,
    where separate tensors cost six pageable copies plus the padded tensors' allocation on the host between two GPU
    steps. ``device_batch`` is the ``Batch`` the graph is captured on (all padding until the first ``load``)."""

    _LAYOUT = (("input_ids", torch.int64), ("positions", torch.int64), ("slot_mapping", torch.int32),
               ("block_table", torch.int32), ("seq_lens", torch.int32), ("cu_seqlens_q", torch.int32))

    def __init__(self, num_seqs: int, max_blocks: int, device):
        self.num_seqs, self.max_blocks = num_seqs, max_blocks
        shapes = {"block_table": (num_seqs, max_blocks), "cu_seqlens_q": (num_seqs + 1,)}
        offsets, nbytes = [], 0
        for name, dt in self._LAYOUT:
            shape = shapes.get(name, (num_seqs,))
            offsets.append((name, dt, shape, nbytes))
            nbytes += -(-(dt.itemsize * int(torch.Size(shape).numel())) // 8) * 8  # every view 8-byte aligned
        self._cuda = torch.device(device).type == "cuda"
        self._device_buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self._host_buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._cuda)
        views = lambda buf: {n: buf[o:o + dt.itemsize * torch.Size(sh).numel()].view(dt).view(sh)  # noqa: E731
                             for n, dt, sh, o in offsets}
        self._host = views(self._host_buf)
        self.device_batch = Batch(**views(self._device_buf), max_seqlen_q=1)
        self._copied = None  # event of the last host -> device copy: the host twin is reused only after it
        self._fill(None)
        self._device_buf.copy_(self._host_buf)

    def _fill(self, batch: Batch | None) -> None:
        h, S = self._host, 0 if batch is None else batch.num_seqs
        h["input_ids"].zero_()
        h["positions"].zero_()
        h["slot_mapping"].fill_(-1)  # padding rows write no cache slot ...
        h["block_table"].zero_()  # ... and attend to the one token at block 0, slot 0
        h["seq_lens"].fill_(1)
        torch.arange(self.num_seqs + 1, dtype=torch.int32, out=h["cu_seqlens_q"])
        if batch is not None:
            w = batch.block_table.shape[1]
            for f in ("input_ids", "positions", "slot_mapping", "seq_lens"):
                h[f][:S] = getattr(batch, f)
            h["block_table"][:S, :w] = batch.block_table

    def load(self, batch: Batch) -> None:
        """Make ``device_batch`` hold ``batch`` (a decode batch on the host), padded; asynchronous on the current
        stream (the graph replayed after it sees the new values)."""
        S, w = batch.num_seqs, batch.block_table.shape[1]
        if batch.max_seqlen_q != 1 or batch.input_ids.shape[0] != S:
            raise ValueError("StagedDecodeBatch takes a pure decode batch (one new token per sequence)")
        if S > self.num_seqs or w > self.max_blocks:
            raise ValueError(f"decode batch of {S} sequences x {w} blocks exceeds the padded shape {self.num_seqs} x "
                             f"{self.max_blocks}; raise max_model_len or the largest graph batch size")
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has read the host twin (normally long done)
        self._fill(batch)
        self._device_buf.copy_(self._host_buf, non_blocking=self._cuda)
        if self._cuda:
            self._copied = self._copied or torch.cuda.Event()
            self._copied.record()


def pad_decode_batch(batch: Batch, num_seqs: int, max_blocks: int) -> Batch:
    """A decode ``batch`` padded to ``num_seqs`` rows and ``max_blocks`` block-table columns (static graph shapes), as
    host tensors: ``StagedDecodeBatch``'s layout and padding rule.

    Padding rows write no cache slot (slot -1) and attend to the one token at block 0, slot 0, which exists in every
    cache: their logits are garbage but finite and are dropped, and no real sequence's cache is touched.
    """
    staged = StagedDecodeBatch(num_seqs, max_blocks, "cpu")
    staged.load(batch)
    return staged.device_batch


def copy_batch_(dst: Batch, src: Batch) -> None:
    """Copy ``src`` into the (static, same-shape) tensors of ``dst``."""
    for f in TENSOR_FIELDS:
        getattr(dst, f).copy_(getattr(src, f), non_blocking=True)


def _model_device(model):
    return getattr(model, "device", None) or model.weights["embed"].device


def _model_dtype(model) -> torch.dtype:
    return getattr(model, "dtype", None) or model.weights["embed"].dtype
