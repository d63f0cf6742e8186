"""Choosing the next token from logits: greedy, temperature, top-k, top-p, each request with its own seeded generator.

The order matches Hugging Face ``generate``: temperature, then top-k, then top-p, then a draw from the softmax.
``temperature == 0`` means greedy (argmax), as does ``top_k == 1``. Masked logits become ``-inf``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


GREEDY_TEMPERATURE = 1e-5  # temperatures below this sample greedily (vLLM's _SAMPLING_EPS)
# What ``sample`` gives a row it cannot choose from: one whose largest logit is not finite (a NaN, which argmax takes
# for the largest, an overflow to +inf, or every logit -inf). The generator ends that request with finish_reason
# "error" and the batch's other requests go on.
NO_TOKEN = -2


@dataclass
class SamplingParams:
    """How one request is decoded. ``seed`` None draws from a fresh nondeterministic generator."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False  # benchmarks decode a fixed number of tokens

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        """Argmax: temperature 0 (below GREEDY_TEMPERATURE, as vLLM rounds it: a float32 quotient by a temperature of
        ~1e-45 is 0 / 0 for the top logit) or top-k 1."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def top_k_mask(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Bool mask [..., V] of the logits kept by top-k: those >= the k-th largest (ties at the boundary all kept)."""
    if k <= 0 or k >= logits.shape[-1]:
        return torch.ones_like(logits, dtype=torch.bool)
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits >= kth


def top_p_mask(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Bool mask [..., V]: the smallest set of most likely tokens whose probability mass reaches ``p``.

    A token is dropped when the mass of the tokens strictly more likely than it already reaches ``p``; the most
    likely token is always kept.
    """
    if p >= 1.0:
        return torch.ones_like(logits, dtype=torch.bool)
    probs = torch.softmax(logits.float(), dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    keep_sorted = mass_before < p
    keep_sorted[..., 0] = True
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def make_generator(seed: int | None, device) -> torch.Generator:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def sample_one(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Next token of one sequence from its logits [V]."""
    if params.greedy:
        return int(torch.argmax(logits))
    # shifted so the largest is 0 first: a tiny temperature then scales the rest toward -inf, not the top to +inf (a
    # NaN in softmax)
    x = logits.float()
    x = (x - x.max()) / params.temperature
    x = x.masked_fill(~top_k_mask(x, params.top_k), float("-inf"))
    # top-p over what top-k kept (renormalised), as HF's warpers and vLLM apply them
    x = x.masked_fill(~top_p_mask(x, params.top_p), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def flag_unusable(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``tokens`` [S], the argmax of ``logits`` [S, V], with ``NO_TOKEN`` on rows whose chosen logit is not finite:
    argmax picks a row's NaN (NaN ranks above every number), its +inf, or a -inf when all are -inf, so that one
    gathered logit a row tells what a reduction over the vocabulary would (three small kernels, no host sync)."""
    picked = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return torch.where(torch.isfinite(picked), tokens, torch.full_like(tokens, NO_TOKEN))


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list) -> list[int]:
    """Next token of every sequence from logits [S, V], ``NO_TOKEN`` for a row that has none (see there); greedy rows
    share one argmax and one device sync. A row without a token draws nothing from its generator."""
    tokens = flag_unusable(logits, torch.argmax(logits, dim=-1)).tolist()
    return [t if p.greedy or t == NO_TOKEN else sample_one(logits[i], p, g)
            for i, (t, p, g) in enumerate(zip(tokens, params, generators))]
