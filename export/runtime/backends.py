"""The backend interface the generation loop runs on, and the torch backend (``LlamaModel`` on ``kernels.ops``).

A backend owns the KV cache and turns one ``Batch`` (built on the host by the scheduler) into the logits of each
sequence's last new token, ``[S, vocab]``. Attributes the loop reads: ``device``, ``vocab_size``, ``num_blocks``,
``block_size``, ``max_model_len``, ``config`` and ``eos_token_ids`` (the stop tokens of the directory the model came
from, ``LlamaModel.eos_token_ids``); the loop sets ``cache_writer``, a weak reference to the Generator that wrote the
cache last (another one's prefix-cache registrations are stale then).

The torch backend runs decode steps through CUDA graphs, one per batch-size bucket (1, 2, 4, 8, ...) and block-table
width (2048 tokens, 8192, 32768, ... and ``max_model_len``): the step's inputs are copied into static buffers padded to
the bucket (padding rows write no cache slot and attend to one token of block 0) and the graph replays the whole model
as one launch, which removes the per-kernel launch overhead that dominates batch-1 decode. Prefill steps of up to
``max(prefill_graph_tokens)`` tokens replay a graph too, one per (token bucket, sequence bucket), padded the same way
(``StagedBatch``); a bucket is captured the ``prefill_graph_after``-th time a step falls into it, so a one-off prompt
runs eagerly rather than paying for a capture; where its replay turns out to take longer than the host takes to launch
the forward eagerly (a GPU-bound prefill, which the padding only slows down), padded steps of that bucket run eagerly
from then on. Longer prefills, and keys past ``max_prefill_graphs`` graphs, run eagerly. On CPU everything is eager and
the ops run their torch references.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from export.batch import TENSOR_FIELDS, Batch

log = logging.getLogger(__name__)

DEFAULT_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)


def _prefill_token_buckets(largest: int) -> tuple[int, ...]:
    """Multiples of 16 up to 256, then eight steps per doubling (288, 320, ..., 512, 576, ..., 1024, 1152, ...) up to
    ``largest``: past 128 tokens a step is padded by less than an eighth of its tokens."""
    out, b = [], 16
    while b <= largest:
        out.append(b)
        b += max(16, 1 << (b.bit_length() - 4))
    return tuple(out)


# Prefill token buckets that replay a CUDA graph, up to the generator's default step budget (8192 tokens, so that
# no step of a default generator prefills eagerly for want of a bucket). Eager prefill is host-bound (each of ~10
# launches a layer costs tens of us on the host) until its GPU work outgrows that: SmolLM2-135M's 2k-token prefill
# is 3.2 ms replayed and 11 ms eager on the lent H200; a Llama-3-8B-shaped one is GPU-bound from ~600 tokens, where
# the padding is the cost (fp16, 1100 tokens padded to 1280: 31.5 ms against 28.0 eager), hence the fine steps there
# and the rule that sends a losing bucket's padded steps back to eager (dev-logs/h200/prefill_graphs.md).
DEFAULT_PREFILL_GRAPH_TOKENS = _prefill_token_buckets(8192)
# Default cache size: this many sequences of max_model_len (CPU: few, its cache is host memory).
DEFAULT_SEQS = {"cuda": 64, "cpu": 8}


def _kv_bytes_per_block(config, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * elem


# Block-table widths (tokens) decode steps are padded to, below max_model_len (always the last): the decode attention
# takes its split count from the table's width, and at a width of 8192 tokens a 512-token context took 6.1 us a layer
# (SmolLM2-135M's shape) and 11.3 (Llama-3-8B's) against 4.0-4.7 / 6.7-7.4 at 512-2208 on the lent H200
# (dev-logs/h200/decode_trim_splits.md). Four times wider each, 2048 first: with max_model_len 8192, bs 1 decode steps
# at 128-1000 tokens ran 0.91-0.94x of tables of max_model_len, bs 8 1.00x, and one row 1.03x (SmolLM2, bs 1 x 2000);
# 1024 first measured as well there, but at bench_e2e's max_model_len (2208) it took a 512-token step from 17 splits
# to 8 and SmolLM2's decode step 3-6% slower (dev-logs/h200/decode_width_buckets.md). A model of 8192 tokens has 2
# decode graphs per batch bucket.
DEFAULT_DECODE_GRAPH_WIDTHS = (2048, 8192, 32768, 131072)


def _decode_graph_widths(max_model_len: int, block_size: int, widths=DEFAULT_DECODE_GRAPH_WIDTHS) -> tuple[int, ...]:
    """The widths in blocks: each of ``widths`` (tokens) below ``max_model_len``, then ``max_model_len``'s."""
    blocks = {-(-t // block_size) for t in widths if t < max_model_len}
    return tuple(sorted(blocks | {-(-max_model_len // block_size)}))


def runtime_fuses_swiglu(device) -> bool:
    """Whether ``TorchBackend`` runs a model on ``device`` with SwiGLU fused into its quantized gate/up GEMMs
    (``LlamaModel.fuse_swiglu_``) unless told otherwise: on CUDA devices. ``export.eval`` scores builds the same
    way."""
    return torch.device(device).type == "cuda"


class TorchBackend:
    """``LlamaModel.forward`` over a paged cache it allocates; CUDA graphs for decode and short prefills on CUDA
    devices.

    ``prefill_graph_tokens``: the token buckets a prefill step is padded to and replayed from a graph (``()``: every
    prefill eager); ``prefill_graph_after``: a bucket's graph is captured the ``n``-th time a step falls into it (1:
    at once; the default 2 keeps a one-off prompt from paying for a capture); ``max_prefill_graphs``: prefill graphs
    kept at most (first come; steps of further keys run eagerly), which bounds their memory;
    ``decode_graph_widths``: block-table widths (tokens) a decode step is padded to, the narrowest that holds it
    (``max_model_len`` is always one).

    ``fuse_swiglu`` (default: on CUDA devices) applies ``model.fuse_swiglu_()``: the quantized gate/up GEMMs run
    SwiGLU in their epilogue. It re-lays out the model's gate/up weights in place, after which the model can no
    longer be saved or exported (load it again for that)."""

    def __init__(self, model, num_blocks: int | None = None, block_size: int = 16, max_model_len: int | None = None,
                 kv_dtype: torch.dtype | None = None, cuda_graphs: bool | None = None,
                 graph_batch_sizes=DEFAULT_GRAPH_BATCH_SIZES, gpu_memory_fraction: float = 0.9,
                 fuse_swiglu: bool | None = None, prefill_graph_tokens=DEFAULT_PREFILL_GRAPH_TOKENS,
                 prefill_graph_after: int = 2, max_prefill_graphs: int = 64,
                 decode_graph_widths=DEFAULT_DECODE_GRAPH_WIDTHS):
        self.model = model
        self.config = model.config
        self.device = torch.device(_model_device(model))
        fuse = runtime_fuses_swiglu(self.device) if fuse_swiglu is None else fuse_swiglu
        if fuse and hasattr(model, "fuse_swiglu_"):
            model.fuse_swiglu_()
            if self.device.type == "cuda":  # the re-layout's freed copies, before free memory sizes the KV cache
                torch.cuda.empty_cache()
        self.vocab_size = self.config.vocab_size
        self.eos_token_ids = tuple(getattr(model, "eos_token_ids", ()))  # the generation loop's stop tokens
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
        self.prefill_graph_tokens = tuple(sorted(prefill_graph_tokens))
        if prefill_graph_after < 1:
            raise ValueError(f"prefill_graph_after must be >= 1 (1: capture at the first use); got "
                             f"{prefill_graph_after}")
        self.prefill_graph_after = prefill_graph_after
        if max_prefill_graphs < 0:
            raise ValueError(f"max_prefill_graphs must be >= 0 (0: every prefill eager); got {max_prefill_graphs}")
        # (num_tokens, num_seqs, max_seqlen_q, block-table columns) -> (graph, staged inputs, logits): decode keys are
        # (bs, bs, 1, one of _decode_widths), prefill keys (token bucket, sequence bucket, bound, _max_blocks_per_seq)
        self._graphs: dict[tuple[int, int, int, int], tuple] = {}
        self._prefill_seen: dict[tuple[int, int, int, int], int] = {}  # prefill bucket -> steps that fell into it
        # prefill bucket -> host ms of launching its forward eagerly / device ms of its second replay / replays
        self._prefill_host_ms: dict[tuple[int, int, int, int], float] = {}
        self._replay_ms: dict[tuple[int, int, int, int], float] = {}
        self._replay_events: dict[tuple[int, int, int, int], tuple] = {}
        self._replays: dict[tuple[int, int, int, int], int] = {}
        self._graph_pool = None
        # One side stream for every capture's warm-up: torch keeps a cuBLAS workspace per (handle, stream) for the
        # life of the process, so a new stream per capture held ~32 MB more each (SmolLM2-135M, int4, on the H200:
        # dev-logs/h200/prefill_graph_mem.md).
        self._warmup_stream = None
        # Prefill graphs kept at most (decode has its own: one per batch bucket and width); past it new keys run
        # eagerly: each graph holds its logits ([sequences, vocab]) and staged inputs, and keys are many (token bucket
        # x sequence bucket x bound).
        self.max_prefill_graphs = max_prefill_graphs
        # Prefill block tables are padded to the longest sequence the engine allows; a decode step's to the narrowest
        # of a few widths that holds it: the decode attention takes its split count from the table's width (a shape,
        # so that a graph replays it), and a table as wide as max_model_len ran mostly empty splits at short contexts.
        self._max_blocks_per_seq = -(-self.max_model_len // block_size)
        self._decode_widths = _decode_graph_widths(self.max_model_len, block_size, decode_graph_widths)

    def _default_num_blocks(self, fraction: float) -> int:
        # Enough for DEFAULT_SEQS full-length sequences, but on a GPU no more than `fraction` of free memory.
        blocks = DEFAULT_SEQS.get(self.device.type, 8) * -(-self.max_model_len // self.block_size)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            per_block = _kv_bytes_per_block(self.config, self.block_size, self.kv_dtype)
            blocks = min(blocks, int(free * fraction) // per_block)
        return max(1, blocks)

    @property
    def supports_device_tokens(self) -> bool:
        """``forward`` takes ``input_ids`` on the device (the generation loop's pipelined decode): on CUDA."""
        return self.device.type == "cuda"

    @torch.inference_mode()
    def forward(self, batch: Batch, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of each sequence's last new token. ``input_ids``: the step's tokens as a tensor on the model's
        device, used instead of ``batch.input_ids`` (the previous step's sampled tokens, never read by the host)."""
        if self.cuda_graphs and batch.max_seqlen_q == 1 and batch.num_seqs <= self.graph_batch_sizes[-1]:
            return self._decode_graph(batch, input_ids)
        if self.cuda_graphs and batch.max_seqlen_q > 1 and input_ids is None:
            key = self._prefill_bucket(batch)
            if key is not None:
                return self._prefill_graph(batch, key)
        return self._eager(batch, input_ids)

    def _eager(self, batch: Batch, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        dev = batch.to(self.device)
        if input_ids is not None:
            dev.input_ids = input_ids
        return self.model.forward(dev, self.kv_cache)

    # -- CUDA graphs -----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self, batch_sizes=None, prefill_tokens=()) -> None:
        """Capture graphs ahead of time, as a server does at start-up (else a decode bucket is captured at its first
        use, a prefill bucket at its ``prefill_graph_after``-th): decode for ``batch_sizes`` (default: all of
        ``graph_batch_sizes``, each at every decode table width), and the prefill of one prompt for the token buckets
        ``prefill_tokens`` (values of ``prefill_graph_tokens``). Largest first, sharing one memory pool."""
        if not self.cuda_graphs:
            raise ValueError("capture() needs cuda_graphs (a CUDA device)")
        unknown = sorted(set(prefill_tokens) - set(self.prefill_graph_tokens))
        if unknown:
            raise ValueError(f"prefill_tokens {unknown} are not buckets of prefill_graph_tokens "
                             f"{self.prefill_graph_tokens}")
        for t in sorted(prefill_tokens, reverse=True):
            # _prefill_bucket's key of one prompt of (t's bucket of) tokens
            self._graph_for((t, 2, t, self._max_blocks_per_seq))
        for bs in sorted(batch_sizes or self.graph_batch_sizes, reverse=True):
            for blocks in reversed(self._decode_widths):
                self._graph_for((bs, bs, 1, blocks))

    def _prefill_bucket(self, batch: Batch) -> tuple[int, int, int, int] | None:
        """The graph key of a prefill ``batch``: its tokens rounded up to a bucket, its sequences plus one (the owner
        of the padding tokens) rounded up to a power of two, and the longest sequence's new tokens (padding sequences
        included) rounded up to a bucket: the bound ``max_seqlen_q`` the graph is captured with, which picks the
        attention's tiles as the eager step's own value would (so a batch of short prompts keeps the short-prompt
        tiles); and the full block-table width. None (eager): longer than the largest bucket, or padding the spare
        sequences cannot hold."""
        T, S = int(batch.input_ids.shape[0]), batch.num_seqs
        tokens = self._round_up(T)
        if tokens is None:
            return None
        seqs = 1 << S.bit_length()
        per_padding_seq = -(-(tokens - T) // (seqs - S))
        # the padding tokens fit the spare sequences' block-table rows unless max_model_len is tiny
        if per_padding_seq > self._max_blocks_per_seq * self.block_size:
            return None
        bound = self._round_up(max(batch.max_seqlen_q, per_padding_seq, 2))  # <= tokens
        return tokens, seqs, bound, self._max_blocks_per_seq

    def _round_up(self, n: int) -> int | None:
        i = bisect.bisect_left(self.prefill_graph_tokens, n)
        return self.prefill_graph_tokens[i] if i < len(self.prefill_graph_tokens) else None

    def _prefill_graph(self, batch: Batch, key: tuple[int, int, int, int]) -> torch.Tensor:
        seen = self._prefill_seen[key] = self._prefill_seen.get(key, 0) + 1
        if key not in self._graphs and (seen < self.prefill_graph_after
                                        or self._num_prefill_graphs() >= self.max_prefill_graphs):
            return self._eager(batch)
        try:
            graph, staged, logits = self._graph_for(key)
        except RuntimeError as e:  # as for decode: a kernel that syncs or allocates during capture
            log.warning("CUDA graph capture of a prefill failed (%s); prefill runs eagerly", e)
            self.prefill_graph_tokens = ()
            return self._eager(batch)
        if batch.input_ids.shape[0] < key[0] and self._replay_loses(key):
            return self._eager(batch)
        n = self._replays[key] = self._replays.get(key, 0) + 1
        timed = n == 2  # the second replay: the first may pay the graph's upload
        if timed:
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        staged.load(batch)
        graph.replay()
        if timed:
            events[1].record()
            self._replay_events[key] = events
        return logits[:batch.num_seqs]  # a view of the graph's output buffer: valid until the next step

    def _num_prefill_graphs(self) -> int:
        return sum(1 for key in self._graphs if key[2] > 1)  # a decode key's bound max_seqlen_q is 1

    def _replay_loses(self, key: tuple[int, int, int, int]) -> bool:
        """Whether a padded step of this prefill bucket runs eagerly: its replay (device time of the staged copy and
        the replay, its second) took at least what launching the forward eagerly takes the host (the warm-up before
        the capture). Then the step is GPU-bound, the eager forward costs its GPU time alone, and a replay adds the
        padding's work to it (a Llama-3-8B-shaped fp16 prefill of 1200 tokens: 29.8 ms eager, 31.7 replayed at 1280;
        dev-logs/h200/prefill_graphs.md). A step without padding replays either way."""
        events = self._replay_events.get(key)
        if events is not None and events[1].query():
            self._replay_ms[key] = events[0].elapsed_time(events[1])
            del self._replay_events[key]
        return self._replay_ms.get(key, 0.0) >= self._prefill_host_ms.get(key, float("inf"))

    def _graph_for(self, key: tuple[int, int, int, int]):
        if key in self._graphs:
            return self._graphs[key]
        dev = self.device
        num_tokens, num_seqs, max_seqlen_q, blocks = key
        # all padding: capture writes no cache slot
        staged = StagedBatch(num_tokens, num_seqs, blocks, dev, max_seqlen_q, blocks * self.block_size)
        static = staged.device_batch
        # Warm up on a side stream (allocator and Triton JIT settle), then capture.
        if self._warmup_stream is None:
            self._warmup_stream = torch.cuda.Stream(dev)
        side = self._warmup_stream
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                t0 = time.perf_counter()
                self.model.forward(static, self.kv_cache)
            if max_seqlen_q > 1:  # the second, warm forward's launches: a prefill's eager host cost (_replay_loses)
                self._prefill_host_ms[key] = (time.perf_counter() - t0) * 1e3
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            logits = self.model.forward(static, self.kv_cache)
        if self._graph_pool is None:
            self._graph_pool = graph.pool()
        self._graphs[key] = (graph, staged, logits)
        return self._graphs[key]

    def _decode_key(self, batch: Batch) -> tuple[int, int, int, int]:
        """A decode step's graph key: its sequences rounded up to a batch bucket, its block table's width to the
        narrowest of ``_decode_widths`` that holds it."""
        bs = self.graph_batch_sizes[bisect.bisect_left(self.graph_batch_sizes, batch.num_seqs)]
        return bs, bs, 1, self._decode_widths[bisect.bisect_left(self._decode_widths, batch.block_table.shape[1])]

    def _decode_graph(self, batch: Batch, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        S = batch.num_seqs
        try:
            graph, staged, logits = self._graph_for(self._decode_key(batch))
        except RuntimeError as e:  # a kernel that syncs or allocates during capture: run eagerly from now on
            log.warning("CUDA graph capture failed (%s); decode runs eagerly", e)
            self.cuda_graphs = False
            return self.forward(batch, input_ids)
        staged.load(batch)
        if input_ids is not None:  # after the host copy, in stream order
            staged.device_batch.input_ids[:S].copy_(input_ids)
        graph.replay()
        return logits[:S]  # a view of the graph's output buffer: valid until the next step


class StagedBatch:
    """A graph's static inputs: a batch padded to ``num_tokens`` tokens, ``num_seqs`` sequences and ``max_blocks``
    block-table columns, as views of ONE device buffer with a pinned host twin of the same layout: ``load(batch)``
    writes the step's batch into the host twin and moves it with one asynchronous copy, where separate tensors cost
    six pageable copies plus the padded tensors' allocation on the host between two GPU steps. ``device_batch`` is
    the ``Batch`` the graph is captured on (all padding until the first ``load``); its ``max_seqlen_q`` is the bound
    the graph was captured with (1 for decode, where ``num_tokens == num_seqs``).

    The padding rule: padding tokens write no cache slot (slot -1) and sit at position 0; they are spread evenly over
    the padding sequences after the real ones (a decode pads one token per padding row; a prefill's padding tokens
    need at least one spare sequence, and at most ``max_seq_len`` and ``max_seqlen_q`` of them may land in one). A
    padding sequence's length is its token count (at least 1) and its block-table row is zeros, so it attends
    causally to keys in block 0: garbage but finite logits, dropped by the caller, and no real sequence's cache or
    attention is touched.
    ``max_seq_len``: what one block-table row holds (``max_blocks`` x the block size; default ``max_blocks``)."""

    _LAYOUT = (("input_ids", torch.int64), ("positions", torch.int64), ("slot_mapping", torch.int32),
               ("block_table", torch.int32), ("seq_lens", torch.int32), ("cu_seqlens_q", torch.int32))

    def __init__(self, num_tokens: int, num_seqs: int, max_blocks: int, device, max_seqlen_q: int,
                 max_seq_len: int | None = None):
        if not 1 <= max_seqlen_q <= num_tokens or (max_seqlen_q == 1 and num_tokens != num_seqs):
            raise ValueError(f"a staged batch is a decode (one token per sequence, max_seqlen_q 1) or a prefill "
                             f"(max_seqlen_q in 2..num_tokens); got {num_tokens} tokens, {num_seqs} sequences, "
                             f"max_seqlen_q {max_seqlen_q}")
        self.num_tokens, self.num_seqs, self.max_blocks, self.max_seqlen_q = num_tokens, num_seqs, max_blocks, \
            max_seqlen_q
        self.max_seq_len = max_seq_len or max_blocks
        shapes = {"input_ids": (num_tokens,), "positions": (num_tokens,), "slot_mapping": (num_tokens,),
                  "block_table": (num_seqs, max_blocks), "cu_seqlens_q": (num_seqs + 1,)}
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
        self.device_batch = Batch(**views(self._device_buf), max_seqlen_q=max_seqlen_q)
        self._copied = None  # event of the last host -> device copy: the host twin is reused only after it
        h = self._host
        h["input_ids"].zero_()
        h["positions"].zero_()
        h["slot_mapping"].fill_(-1)
        h["block_table"].zero_()
        h["cu_seqlens_q"][0] = 0
        self._pad(0, 0)
        self._template = self._host_buf.clone()  # all padding: what every load starts from
        self._device_buf.copy_(self._host_buf)

    def fits(self, num_tokens: int, num_seqs: int) -> bool:
        """Whether a batch of ``num_tokens`` tokens in ``num_seqs`` sequences pads to this shape by the rule (a
        padding sequence is held by its block-table row and by the bound ``max_seqlen_q``)."""
        P, n = self.num_seqs - num_seqs, self.num_tokens - num_tokens
        return P >= 0 and n >= 0 and (n == 0 or (P > 0 and -(-n // P) <= min(self.max_seq_len, self.max_seqlen_q)))

    def _pad(self, T: int, S: int) -> None:
        """Lay out the padding sequences S.. over the padding tokens T.. in the host twin (see the class). Padding
        that does not fit the rule (only the all-padding batch a graph is captured on can be such) gets its lengths
        capped at ``max_seq_len``: its first queries then see no key, harmless in a capture that writes nothing."""
        h, P, n = self._host, self.num_seqs - S, self.num_tokens - T
        if P == 0:  # no padding sequence, so no padding token (load refuses padding tokens without an owner)
            return
        q = torch.full((P,), n // P, dtype=torch.int32)
        q[:n % P] += 1
        h["cu_seqlens_q"][S + 1:] = T + torch.cumsum(q, 0, dtype=torch.int32)
        h["seq_lens"][S:] = q.clamp(1, self.max_seq_len)

    def load(self, batch: Batch) -> None:
        """Make ``device_batch`` hold ``batch`` (a batch on the host), padded; asynchronous on the current stream (the
        graph replayed after it sees the new values)."""
        T, S, w = int(batch.input_ids.shape[0]), batch.num_seqs, batch.block_table.shape[1]
        decode = self.max_seqlen_q == 1
        if decode and (batch.max_seqlen_q != 1 or T != S):
            raise ValueError("a decode graph's staged batch takes a pure decode batch (one new token per sequence)")
        if batch.max_seqlen_q > self.max_seqlen_q:
            raise ValueError(f"a sequence of {batch.max_seqlen_q} new tokens exceeds the bound {self.max_seqlen_q} "
                             "the graph was captured with")
        if not self.fits(T, S) or w > self.max_blocks:
            raise ValueError(f"batch of {T} tokens, {S} sequences x {w} blocks exceeds the padded shape "
                             f"{self.num_tokens} tokens, {self.num_seqs} sequences x {self.max_blocks} blocks (padding "
                             f"tokens need a spare sequence, at most {min(self.max_seq_len, self.max_seqlen_q)} in "
                             "each); raise max_model_len or the largest graph bucket")
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has read the host twin (normally long done)
        h = self._host
        self._host_buf.copy_(self._template)
        for f in ("input_ids", "positions", "slot_mapping"):
            h[f][:T] = getattr(batch, f)
        h["seq_lens"][:S] = batch.seq_lens
        h["block_table"][:S, :w] = batch.block_table
        if not decode:  # decode: the template's cu_seqlens_q (0, 1, 2, ...) is already the batch's, padding included
            h["cu_seqlens_q"][:S + 1] = batch.cu_seqlens_q
            self._pad(T, S)
        self._device_buf.copy_(self._host_buf, non_blocking=self._cuda)
        if self._cuda:
            self._copied = self._copied or torch.cuda.Event()
            self._copied.record()


def pad_batch(batch: Batch, num_tokens: int, num_seqs: int, max_blocks: int, max_seqlen_q: int,
              max_seq_len: int | None = None) -> Batch:
    """``batch`` padded to a graph's static shape (``StagedBatch``'s layout and padding rule), as host tensors."""
    staged = StagedBatch(num_tokens, num_seqs, max_blocks, "cpu", max_seqlen_q, max_seq_len)
    staged.load(batch)
    return staged.device_batch


def pad_decode_batch(batch: Batch, num_seqs: int, max_blocks: int) -> Batch:
    """A decode ``batch`` padded to ``num_seqs`` rows and ``max_blocks`` block-table columns (static graph shapes), as
    host tensors: ``StagedBatch``'s layout and padding rule.

    Padding rows write no cache slot (slot -1) and attend to the one token at block 0, slot 0, which exists in every
    cache: their logits are garbage but finite and are dropped, and no real sequence's cache is touched.
    """
    return pad_batch(batch, num_seqs, num_seqs, max_blocks, 1)


def copy_batch_(dst: Batch, src: Batch) -> None:
    """Copy ``src`` into the (static, same-shape) tensors of ``dst``."""
    for f in TENSOR_FIELDS:
        getattr(dst, f).copy_(getattr(src, f), non_blocking=True)


def _model_device(model):
    return getattr(model, "device", None) or model.weights["embed"].device


def _model_dtype(model) -> torch.dtype:
    return getattr(model, "dtype", None) or model.weights["embed"].dtype
