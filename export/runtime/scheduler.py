"""Which sequences run in the next model step, and the packed ``Batch`` for that step.

Policy (simple, and friendly to CUDA graphs): a step is either a *prefill* step or a *decode* step, never both.
Waiting requests are admitted first-come first-served while their tokens fit the step's token budget, the
sequence limit and the free KV blocks; admitted prompts of different lengths are packed into one prefill step.
When nothing can be admitted, every running sequence decodes one token. New requests may be added between steps.

Out of KV blocks during decode: the most recently admitted running sequence is preempted (its blocks freed, its
prompt + generated tokens put back at the head of the queue, recomputed by a later prefill), so memory pressure
delays requests but never corrupts them. A request that could never fit is refused when it is added.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from export.batch import Batch

from .blocks import BlockManager, OutOfBlocks
from .sampling import SamplingParams


@dataclass
class Sequence:
    """One request as it moves through the scheduler."""

    req_id: int
    prompt_ids: list[int]
    params: SamplingParams
    generator: object = None  # torch.Generator of this request (sampled rows only)
    output_ids: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V is already in the cache
    finish_reason: str | None = None  # "stop" | "length"
    num_preemptions: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_new_tokens(self) -> int:
        """Tokens the next step feeds: the whole sequence after (re)admission, then the last sampled token."""
        return len(self.prompt_ids) + len(self.output_ids) - self.num_cached


@dataclass
class Step:
    seqs: list[Sequence]
    batch: Batch  # on CPU; the backend moves it to its device
    is_prefill: bool


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int = 32, max_num_batched_tokens: int = 8192,
                 max_model_len: int | None = None):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len or blocks.num_blocks * blocks.block_size
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
        need = -(-total // self.blocks.block_size)
        if need > self.blocks.num_blocks:
            raise ValueError(f"request needs {need} KV blocks but the cache has only {self.blocks.num_blocks}; "
                             "raise num_blocks or lower max_new_tokens")
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.running.remove(seq)
        self.blocks.free(seq.req_id)

    def schedule(self) -> Step | None:
        admitted, slots = self._admit()
        if admitted:
            return Step(admitted, self._build(admitted, slots), is_prefill=True)
        if not self.running:
            return None
        seqs, slots = self._reserve_decode()
        return Step(seqs, self._build(seqs, slots), is_prefill=False)

    # -- internals -------------------------------------------------------------------------------------------------
    def _admit(self) -> tuple[list[Sequence], list[list[int]]]:
        admitted: list[Sequence] = []
        slots: list[list[int]] = []
        budget = self.max_num_batched_tokens
        while self.waiting and len(self.running) + len(admitted) < self.max_num_seqs:
            seq = self.waiting[0]
            n = seq.num_new_tokens
            # The budget limits packing only: a prompt longer than the budget still runs, alone.
            if admitted and n > budget:
                break
            # Keep one spare block per running sequence so that admitting does not force an immediate preemption.
            spare = len(self.running) + len(admitted)
            if self.blocks.blocks_needed(seq.req_id, n) + spare > self.blocks.num_free_blocks and (admitted or self.running):
                break
            try:
                slots.append(self.blocks.reserve(seq.req_id, n))
            except OutOfBlocks:
                break
            self.waiting.popleft()
            admitted.append(seq)
            budget -= n
        self.running.extend(admitted)
        return admitted, slots

    def _reserve_decode(self) -> tuple[list[Sequence], list[list[int]]]:
        slots: dict[int, list[int]] = {}
        for seq in list(self.running):
            while seq in self.running:
                try:
                    slots[seq.req_id] = self.blocks.reserve(seq.req_id, 1)
                    break
                except OutOfBlocks:
                    self._preempt(self.running[-1])
        seqs = list(self.running)
        return seqs, [slots[s.req_id] for s in seqs]

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.req_id)
        seq.num_cached = 0
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _build(self, seqs: list[Sequence], slots: list[list[int]]) -> Batch:
        input_ids, positions, slot_mapping, seq_lens, cu = [], [], [], [], [0]
        tables = []
        for seq, seq_slots in zip(seqs, slots):
            start, n = seq.num_cached, seq.num_new_tokens
            input_ids += seq.token_ids[start:start + n]
            positions += range(start, start + n)
            slot_mapping += seq_slots
            seq_lens.append(start + n)
            cu.append(cu[-1] + n)
            tables.append(self.blocks.block_table(seq.req_id))
        width = max(len(t) for t in tables)
        block_table = torch.zeros(len(seqs), width, dtype=torch.int32)
        for i, t in enumerate(tables):
            block_table[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        return Batch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int32),
            block_table=block_table,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
            max_seqlen_q=max(cu[i + 1] - cu[i] for i in range(len(seqs))),
        )
