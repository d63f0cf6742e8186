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

from export.batch import Batch

log = logging.getLogger(__name__)

DEFAULT_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)


def _kv_bytes_per_block(config, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * elem


class TorchBackend:
    """``LlamaModel.forward`` over a paged cache it allocates; CUDA graphs for decode on CUDA devices."""

    def __init__(self, model, num_blocks: int | None = None, block_size: int = 16, max_model_len: int | None = None,
                 kv_dtype: torch.dtype | None = None, cuda_graphs: bool | None = None,
                 graph_batch_sizes=DEFAULT_GRAPH_BATCH_SIZES, gpu_memory_fraction: float = 0.9):
        self.model = model
        self.config = model.config
        self.device = torch.device(_model_device(model))
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
        per_block = _kv_bytes_per_block(self.config, self.block_size, self.kv_dtype)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return max(1, int(free * fraction) // per_block)
        # CPU: enough for 8 sequences of the full length, a cheap default for the tiny models it runs.
        return 8 * -(-self.max_model_len // self.block_size)

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor:
        if self.cuda_graphs and batch.max_seqlen_q == 1 and batch.num_seqs <= self.graph_batch_sizes[-1]:
            return self._decode_graph(batch)
        return self.model.forward(batch.to(self.device), self.kv_cache)

    # -- CUDA graphs -----------------------------------------------------------------------------------------------
    def capture(self, batch_sizes=None) -> None:
        """Capture decode graphs ahead of time (largest first, sharing one memory pool); else done on first use."""
        for bs in sorted(batch_sizes or self.graph_batch_sizes, reverse=True):
            self._graph_for(bs)

    def _graph_for(self, bs: int):
        if bs in self._graphs:
            return self._graphs[bs]
        dev, W = self.device, self._max_blocks_per_seq
        static = Batch(
            input_ids=torch.zeros(bs, dtype=torch.int64, device=dev),
            positions=torch.zeros(bs, dtype=torch.int64, device=dev),
            slot_mapping=torch.full((bs,), -1, dtype=torch.int32, device=dev),  # capture writes no cache slot
            block_table=torch.zeros(bs, W, dtype=torch.int32, device=dev),
            seq_lens=torch.ones(bs, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.arange(bs + 1, dtype=torch.int32, device=dev),
            max_seqlen_q=1,
        )
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
        # Host staging rows, pinned so the per-step upload is one async copy per field.
        host = {
            "ids": torch.zeros(bs, dtype=torch.int64).pin_memory(),
            "pos": torch.zeros(bs, dtype=torch.int64).pin_memory(),
            "i32": torch.zeros(2 * bs + bs * W, dtype=torch.int32).pin_memory(),  # slot_mapping | seq_lens | table
        }
        self._graphs[bs] = (graph, static, logits, host)
        return self._graphs[bs]

    def _decode_graph(self, batch: Batch) -> torch.Tensor:
        S = batch.num_seqs
        bs = next(b for b in self.graph_batch_sizes if b >= S)
        try:
            graph, static, logits, host = self._graph_for(bs)
        except RuntimeError as e:  # a kernel that syncs or allocates during capture: run eagerly from now on
            log.warning("CUDA graph capture failed (%s); decode runs eagerly", e)
            self.cuda_graphs = False
            return self.model.forward(batch.to(self.device), self.kv_cache)
        W = self._max_blocks_per_seq
        ids, pos, i32 = host["ids"], host["pos"], host["i32"]
        ids.zero_()
        pos.zero_()
        ids[:S] = batch.input_ids
        pos[:S] = batch.positions
        slot, lens = i32[:bs], i32[bs:2 * bs]
        table = i32[2 * bs:].view(bs, W)
        slot.fill_(-1)  # padding rows write nothing ...
        slot[:S] = batch.slot_mapping
        lens.fill_(1)  # ... and attend to one token of block 0, which always exists
        lens[:S] = batch.seq_lens
        table.zero_()
        w = batch.block_table.shape[1]
        if w > W:
            raise ValueError(f"block table of {w} blocks exceeds max_model_len {self.max_model_len}")
        table[:S, :w] = batch.block_table
        static.input_ids.copy_(ids, non_blocking=True)
        static.positions.copy_(pos, non_blocking=True)
        static.slot_mapping.copy_(slot, non_blocking=True)
        static.seq_lens.copy_(lens, non_blocking=True)
        static.block_table.copy_(table, non_blocking=True)
        graph.replay()
        # The pinned staging buffers are reused next step: wait until this step's uploads have left them.
        torch.cuda.current_stream(self.device).synchronize()
        return logits[:S]


def _model_device(model):
    w = model.weights.get("embed") if hasattr(model, "weights") else None
    return w.device if isinstance(w, torch.Tensor) else "cpu"


def _model_dtype(model) -> torch.dtype:
    w = model.weights.get("embed") if hasattr(model, "weights") else None
    return w.dtype if isinstance(w, torch.Tensor) else torch.float32
