"""The batch a model step runs on: packed tokens of several sequences against a paged KV cache.

One layout serves prefill, chunked prefill and decode: sequence ``i`` contributes ``q_len_i = cu_seqlens_q[i+1] -
cu_seqlens_q[i]`` new tokens, which are the last ``q_len_i`` of its ``seq_lens[i]`` tokens (so decode is
``q_len_i == 1``). Each new token's K/V goes to cache slot ``slot_mapping[t] = block * block_size + offset``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The tensor fields, in order (also the graph's and the engine's batch inputs).
TENSOR_FIELDS = ("input_ids", "positions", "slot_mapping", "block_table", "seq_lens", "cu_seqlens_q")


@dataclass
class Batch:
    input_ids: torch.Tensor  # [T] int64, the new tokens of all sequences, packed
    positions: torch.Tensor  # [T] int64, position of each new token in its sequence
    slot_mapping: torch.Tensor  # [T] int32, cache slot each new token's K/V is written to
    block_table: torch.Tensor  # [S, max_blocks_per_seq] int32, cache block ids per sequence (unused entries: 0)
    seq_lens: torch.Tensor  # [S] int32, total tokens of each sequence after this step (cached + new)
    cu_seqlens_q: torch.Tensor  # [S+1] int32, offsets of each sequence's new tokens in the packed batch
    max_seqlen_q: int  # max new tokens of one sequence (1 for a pure decode step)

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    def to(self, device) -> "Batch":
        return Batch(*(getattr(self, f).to(device) for f in TENSOR_FIELDS), self.max_seqlen_q)
