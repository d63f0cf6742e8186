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


def make_generator(seed: int | None, device) -> torch.Generator:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def sample_one(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Next token of one sequence from its logits [V]: ``sample`` of a batch of one."""
    return sample(logits.unsqueeze(0), [params], [generator])[0]


def flag_unusable(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``tokens`` [S], the argmax of ``logits`` [S, V], with ``NO_TOKEN`` on rows whose chosen logit is not finite:
    argmax picks a row's NaN (NaN ranks above every number), its +inf, or a -inf when all are -inf, so that one
    gathered logit a row tells what a reduction over the vocabulary would (three small kernels, no host sync)."""
    picked = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return torch.where(torch.isfinite(picked), tokens, torch.full_like(tokens, NO_TOKEN))


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list) -> list[int]:
    """Next token of every sequence from logits [S, V], ``NO_TOKEN`` for a row that has none (see there). One argmax
    and one host sync for the batch, and where rows sample, one more batched pass (``_draw``) and sync: no kernels or
    syncs per row but the draw of each row's random numbers from its own generator. A row without a token draws
    nothing from its generator."""
    tokens = flag_unusable(logits, torch.argmax(logits, dim=-1)).tolist()
    rows = [i for i, (t, p) in enumerate(zip(tokens, params)) if not p.greedy and t != NO_TOKEN]
    if rows:
        index = torch.tensor(rows, device=logits.device)
        drawn = _draw(logits.index_select(0, index), [params[i] for i in rows], [generators[i] for i in rows])
        for i, t in zip(rows, drawn):
            tokens[i] = t
    return tokens


def warp(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each sampled row of ``logits`` [R, V] draws from, as HF's warpers and vLLM apply them:
    temperature, then top-k (the tokens >= the k-th largest: ties at the boundary all kept), then top-p over what
    top-k kept, renormalised (a token is dropped once the mass of the tokens before it reaches p; the most likely is
    always kept). Returns the probabilities [R, V], 0 where top-k or top-p drop a token (not renormalised after
    top-p). Batched: one top-k where a row asks for top-k, one sort where a row asks for top-p; a row's result does
    not depend on the other rows (they only widen the top-k or add rows to the sort)."""
    dev = logits.device
    vocab = logits.shape[-1]
    # shifted so that the largest is 0 first: a tiny temperature then scales the rest toward -inf, not the top to
    # +inf (a NaN in softmax)
    x = logits.float()
    x = (x - x.amax(dim=-1, keepdim=True)) / torch.tensor([[p.temperature] for p in params], device=dev)
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    widest = max((k for k in top_k if k < vocab), default=0)
    if widest:  # each row's k-th largest logit, off one top-k of the widest k (a row without top-k: no threshold)
        k = torch.tensor(top_k, device=dev).unsqueeze(-1)
        kth = torch.topk(x, widest, dim=-1).values.gather(-1, k.clamp(max=widest) - 1)
        x = x.masked_fill(x < kth.masked_fill(k == vocab, float("-inf")), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if all(p.top_p >= 1.0 for p in params):
        return probs
    top_p = torch.tensor([[p.top_p] for p in params], device=dev, dtype=torch.float64)
    # stable: equal probabilities, which top-p's boundary may split, are taken in token order whatever the batch
    ordered, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    # float64 sums, as _draw's: CUDA sums one row and several in other orders, and a float32 mass at p's boundary
    # could flip with the batch; p = 1 keeps all (sums may round to 1 before the tail)
    keep = (torch.cumsum(ordered, dim=-1, dtype=torch.float64) - ordered < top_p) | (top_p >= 1.0)
    keep[:, 0] = True
    return probs.masked_fill(~torch.empty_like(keep).scatter_(-1, order, keep), 0.0)


def _draw(logits: torch.Tensor, params: list[SamplingParams], generators: list) -> list[int]:
    """A token of each row of ``logits`` [R, V] (usable, sampled rows) from ``warp``'s distribution, by inverse CDF:
    one uniform number a row, drawn from the row's own generator (R tiny draws; the rest is batched), and the first
    token whose cumulative mass passes it (a token of probability 0 never does).

    The CDF and the uniform numbers are float64. In float32 (ulp 6e-8 at 0.5) a token of less mass than half an ulp
    had no share of the draw (128k tokens, logits of sd 2-4: 3k-82k tokens never drawn, total variation 5e-4 to
    9e-4), and the rounding depends on the order of the sum, which CUDA's cumsum changes with the rows (one row: cub's
    device scan; several: a per-row block scan): a blocked float32 sum against a sequential one moved 0.12% of the
    draws of a 128k row on the CPU, so a row's token could depend on how many rows sampled beside it."""
    cdf = torch.cumsum(warp(logits, params), dim=-1, dtype=torch.float64)
    u = torch.cat([torch.rand(1, generator=gen, device=logits.device, dtype=torch.float64) for gen in generators])
    token = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True)
    return token.clamp_(max=cdf.shape[-1] - 1).squeeze(-1).tolist()
