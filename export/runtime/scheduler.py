"""Which sequences run in the next model step, and the packed ``Batch`` for that step.

Policy (as vLLM's chunked prefill): every step first gives each running sequence that decodes its one token, then
spends the rest of the step's token budget on prompt tokens: the rest of partly prefilled prompts, then waiting
requests, admitted first-come first-served while the budget, the sequence limit and the free KV blocks allow. A
prompt longer than what is left of the budget is prefilled in chunks over several steps, and running sequences
keep decoding meanwhile (a step may mix decode rows and prompt chunks: a long prompt never stalls the others'
tokens). A step of decode rows only is what CUDA graphs and pipelined decode replay. New requests may be added
between steps. With prefix caching, an admitted request starts after the registered blocks its tokens begin with
(``export.runtime.blocks``): a shared system prompt, or a preempted request's own blocks, are not computed again.

Out of KV blocks for a decode token: the most recently admitted running sequence is preempted (its blocks freed,
its prompt + generated tokens put back at the head of the queue, recomputed by a later prefill), so memory pressure
delays requests but never corrupts them. A request that could never fit is refused when it is added.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from export.batch import Batch

from .blocks import BlockManager, OutOfBlocks, block_keys
from .sampling import SamplingParams


@dataclass(eq=False)
class Sequence:
    """One request as it moves through the scheduler. Compared by identity (``seq in running``, ``remove``): a
    field-wise ``==`` would compare whole token lists, every step, for every running sequence."""

    req_id: int
    prompt_ids: list[int]
    params: SamplingParams
    generator: object = None  # torch.Generator of this request (sampled rows only)
    output_ids: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V is already in the cache
    num_prefix_cached: int = 0  # of those, tokens found in the prefix cache at the last admission
    block_keys: list[bytes] = field(default_factory=list)  # content keys of its first full blocks (blocks.block_keys)
    num_registered: int = 0  # leading blocks of its table registered in the prefix cache
    finish_reason: str | None = None  # "stop" | "length" | "error" | "abort"
    num_preemptions: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        """``len(token_ids)``, without building the list (the scheduler asks every step)."""
        return len(self.prompt_ids) + len(self.output_ids)

    def tokens(self, start: int, n: int) -> list[int]:
        """``token_ids[start:start + n]``, without building the whole list (a decode step feeds one token)."""
        p = len(self.prompt_ids)
        if start >= p:
            return self.output_ids[start - p:start - p + n]
        return self.prompt_ids[start:start + n] + self.output_ids[:max(0, start + n - p)]

    @property
    def num_new_tokens(self) -> int:
        """Tokens the next step feeds: the whole sequence after (re)admission, then the last sampled token."""
        return self.num_tokens - self.num_cached


@dataclass
class Step:
    seqs: list[Sequence]
    num_tokens: list[int]  # new tokens each sequence feeds in this step (a prompt chunk, or 1 when decoding)
    batch: Batch  # on CPU; the backend moves it to its device
    is_prefill: bool  # some sequence feeds prompt tokens (or recomputes after preemption); else every row decodes

    @property
    def samples(self) -> list[bool]:
        """Whether each sequence's chunk reaches its last token, so that its logits give the next token."""
        return [s.num_cached + n == s.num_tokens for s, n in zip(self.seqs, self.num_tokens)]


def blocks_for_request(prompt_len: int, max_new_tokens: int, block_size: int) -> int:
    """KV blocks a request holds at most: its prompt and all but the last of its new tokens, which is sampled and
    never fed back (so never cached)."""
    return -(-(prompt_len + max_new_tokens - 1) // block_size)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int = 32, max_num_batched_tokens: int = 8192,
                 max_model_len: int | None = None, prefix_caching: bool = True):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:  # else nothing is ever admitted, and generate() spins
            raise ValueError(f"max_num_seqs ({max_num_seqs}) and max_num_batched_tokens ({max_num_batched_tokens}) "
                             "must be >= 1")
        if max_num_batched_tokens < max_num_seqs:  # a step decodes every running sequence, one token each
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({max_num_seqs}): a decode step feeds one token per sequence; lower max_num_seqs")
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len or blocks.num_blocks * blocks.block_size
        self.prefix_caching = prefix_caching
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        """Queue a request; refuse at once one that could never run (so the loop cannot wait on it forever)."""
        n = len(seq.prompt_ids)
        if n == 0:
            raise ValueError("empty prompt: give at least one token (e.g. the tokenizer's BOS)")
        total = n + seq.params.max_new_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt ({n} tokens) + max_new_tokens ({seq.params.max_new_tokens}) = {total} exceeds "
                             f"the maximum sequence length {self.max_model_len}; shorten the prompt or max_new_tokens")
        need = blocks_for_request(n, seq.params.max_new_tokens, self.blocks.block_size)
        if need > self.blocks.num_blocks:
            raise ValueError(f"request needs {need} KV blocks but the cache has only {self.blocks.num_blocks}; "
                             "raise num_blocks or lower max_new_tokens")
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.running.remove(seq)
        self._release(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop ``seq`` wherever it is (running or waiting), freeing any blocks it holds."""
        seq.finish_reason = "abort"
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.req_id in self.blocks:
            self._release(seq)

    def schedule(self) -> Step | None:
        """The next step: one token for every running sequence that decodes, then prompt chunks within the rest of
        the token budget (see the module docstring); None when nothing runs or waits."""
        if not self.running and not self.waiting:
            return None
        if self.prefix_caching:
            bs = self.blocks.block_size
            for seq in self.running:  # blocks the steps launched so far have filled
                if seq.num_cached // bs > seq.num_registered:
                    self._register(seq)
        self._reserve_decode()
        # Decode rows first: at most max_num_seqs <= max_num_batched_tokens of them, so they always fit. (Each
        # sequence's new tokens are read once: this runs between two GPU steps, 32 sequences in ~0.15 ms here.)
        new = [seq.num_new_tokens for seq in self.running]
        budget = self.max_num_batched_tokens - new.count(1)
        seqs, counts = [], []
        is_prefill = False
        for seq, n in zip(self.running, new):
            # A decode row feeds the last sampled token of a sequence that has output; anything else feeds prompt
            # tokens (a prompt's last chunk may be one token) or recomputes a preempted sequence.
            if n > 1:  # the rest of a partly prefilled prompt or recompute (its blocks were reserved at admission)
                n = min(n, budget)
                budget -= n
                if not n:  # no budget left this step
                    continue
                is_prefill = True
            elif not seq.output_ids:
                is_prefill = True
            seqs.append(seq)
            counts.append(n)
        for seq, n in self._admit(budget):
            is_prefill = is_prefill or n != 1 or not seq.output_ids or seq.num_new_tokens != 1
            seqs.append(seq)
            counts.append(n)
        if not seqs:  # nothing runs, and the first waiting request's blocks are not free (add() refuses one that
            return None  # could never fit, so only a caller's own BlockManager use gets here)
        return Step(seqs, counts, self._build(seqs, counts), is_prefill=is_prefill)

    # -- internals -------------------------------------------------------------------------------------------------
    def _admit(self, budget: int) -> list[tuple[Sequence, int]]:
        """Admit waiting requests into ``budget`` prompt tokens: each one's first chunk.

        A prompt longer than the budget left is prefilled in chunks over several steps (chunked prefill), so no step
        exceeds ``max_num_batched_tokens`` (an engine's profile limit). Its KV blocks are reserved whole at
        admission, so a half-prefilled sequence never waits for memory.
        """
        chosen = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits = self._cached_prefix(seq)
            if not self._fits(seq, hits):
                break
            try:
                self.blocks.admit(seq.req_id, hits, seq.num_tokens)
            except OutOfBlocks:
                break
            self.waiting.popleft()
            self.running.append(seq)
            seq.num_cached = len(hits) * self.blocks.block_size
            # prompt tokens only: a preempted sequence may find its own output's blocks too
            seq.num_prefix_cached = min(seq.num_cached, len(seq.prompt_ids))
            seq.num_registered = len(hits)
            n = min(seq.num_new_tokens, budget)
            chosen.append((seq, n))
            budget -= n
        return chosen

    def can_admit(self, reserved: int = 0) -> bool:
        """Whether the next ``schedule`` would admit the first waiting request, ``reserved`` more blocks taken first
        (the generator's pipelined decode asks, with its next step's decode slots: a step that admits is not the
        same batch)."""
        if not self.waiting or len(self.running) >= self.max_num_seqs:
            return False
        seq = self.waiting[0]
        return self._fits(seq, self._cached_prefix(seq), reserved)

    def _fits(self, seq: Sequence, hits: list[int], reserved: int = 0) -> bool:
        """Admission's block rule: beside running sequences, keep one spare block each so that admitting does not
        force an immediate preemption (alone, a request only needs its blocks: ``reserve`` says)."""
        return not self.running or (self.blocks.admit_cost(hits, seq.num_tokens) + len(self.running)
                                    <= self.blocks.num_free_blocks - reserved)

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The registered blocks ``seq`` may start from: the longest cached run of its full blocks before its last
        token (fed whatever the cache holds: its logits give the next token)."""
        if not self.prefix_caching:
            return []
        n = (seq.num_tokens - 1) // self.blocks.block_size
        self._key(seq, n)
        return self.blocks.cached_prefix(seq.block_keys[:n])

    def _key(self, seq: Sequence, n: int) -> None:
        """Extend ``seq.block_keys`` to its first ``n`` full blocks (fewer where a token is not known yet), reading
        only the blocks not keyed yet: building ``token_ids`` cost a decoding sequence O(length) per block (32
        sequences of 16k tokens in blocks of 16, on a 2-core CPU: every 16th step 4.1 -> 2.1 ms of scheduling)."""
        have, bs = len(seq.block_keys), self.blocks.block_size
        if have < n:
            block_keys(seq.block_keys, seq.tokens(have * bs, (n - have) * bs), bs, n, offset=have * bs)

    def _register(self, seq: Sequence) -> None:
        """Register ``seq``'s full blocks whose K/V the steps launched so far compute, and whose tokens the host
        knows (a pipelined step's token is not known yet: its block waits for a later call)."""
        if not self.prefix_caching:
            return
        n = min(seq.num_cached, seq.num_tokens) // self.blocks.block_size
        if n <= seq.num_registered:
            return
        self._key(seq, n)
        n = min(n, len(seq.block_keys))
        self.blocks.register(seq.req_id, seq.block_keys, seq.num_registered, n)
        seq.num_registered = max(seq.num_registered, n)

    def _release(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks, registering its full computed ones first (a later request may start from them)."""
        self._register(seq)
        self.blocks.free(seq.req_id)
        seq.num_registered = 0

    def _reserve_decode(self) -> None:
        """A KV slot for every running sequence's next token, preempting the newest sequence while blocks lack."""
        preempted = set()
        for seq in list(self.running):
            while seq not in preempted:
                try:
                    # The new token needs a slot unless its chunk was reserved at admission (a prompt's tokens).
                    self.blocks.reserve(seq.req_id, seq.num_tokens - self.blocks.num_tokens(seq.req_id))
                    break
                except OutOfBlocks:
                    preempted.add(self.running[-1])
                    self._preempt(self.running[-1])

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_cached = 0
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _build(self, seqs: list[Sequence], counts: list[int]) -> Batch:
        # One numpy op per field, whatever the step's size: this runs on the host between two GPU steps, and per-token
        # Python lists cost a 2048-token prompt ~0.5 ms before its step could launch (0.08 ms so, on a 2-core host;
        # decode at batch 32 0.13 -> 0.06 ms).
        bs = self.blocks.block_size
        tables = [self.blocks.block_table(seq.req_id) for seq in seqs]
        n_seqs = len(seqs)
        new = np.array(counts, dtype=np.int64)
        start = np.fromiter((seq.num_cached for seq in seqs), dtype=np.int64, count=n_seqs)
        cu = np.zeros(n_seqs + 1, dtype=np.int64)
        np.cumsum(new, out=cu[1:])
        # Token i of the step, of sequence r, sits at position start[r] + i - cu[r].
        positions = np.arange(cu[-1], dtype=np.int64) + np.repeat(start - cu[:-1], new)
        block_table = np.zeros((n_seqs, max(map(len, tables))), dtype=np.int32)
        for r, table in enumerate(tables):
            block_table[r, :len(table)] = table
        rows = np.repeat(np.arange(n_seqs), new)
        slot_mapping = block_table[rows, positions // bs] * bs + (positions % bs).astype(np.int32)
        input_ids = np.fromiter(chain.from_iterable(seq.tokens(seq.num_cached, n) for seq, n in zip(seqs, counts)),
                                dtype=np.int64, count=int(cu[-1]))
        return Batch(
            input_ids=torch.from_numpy(input_ids),
            positions=torch.from_numpy(positions),
            slot_mapping=torch.from_numpy(slot_mapping),
            block_table=torch.from_numpy(block_table),
            seq_lens=torch.from_numpy((start + new).astype(np.int32)),
            cu_seqlens_q=torch.from_numpy(cu.astype(np.int32)),
            max_seqlen_q=max(counts),
        )
