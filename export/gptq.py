"""GPTQ: calibrated int4 weights in ``kernels.quant``'s layout, layer by layer on the CPU in float32.

Round-to-nearest rounds each weight alone; GPTQ (Frantar et al., 2022) rounds the columns of a weight ``[N, K]`` one
at a time and spreads each column's rounding error over the columns not yet rounded, weighted by the inverse Hessian
``H = 2 X^T X`` of the layer's inputs X on calibration text, so that ``X W_q^T`` stays close to ``X W^T`` rather than
``W_q`` close to ``W``. Here:

- **Sequential, quantized inputs.** ``gptq_state_dict`` runs the calibration tokens through ``decoder_forward`` (the
  one decoder) on ``CalibrationOps``, a ``TorchOps`` whose ``linear`` quantizes its weight from the input it is
  handed before computing with it. The walk visits wqkv, wo, w13, w2 of layer 0, then layer 1, ...: each linear sees
  the outputs of the already-quantized ones before it, as GPTQ does. One Hessian per linear input: q|k|v share theirs
  (wqkv is one fused weight), gate|up theirs (w13).
- **Static groups in K order** (no act-order: our fused q|k|v and gate|up read one input order, and the kernels'
  groups are contiguous in K): a group's scale and zero point are chosen from the partly-updated weights when GPTQ
  reaches its first column. Scales are rounded to the storage dtype before any weight is rounded against them, as in
  ``kernels.quant.quantize_int4``, so ``dequantize`` is exactly what the kernels compute.
- **Clipping search** (``clip=True``): each group's [min, max] may shrink (ratios ``CLIP_RATIOS``) to whichever range
  rounds the group with the least error, weighted by the Hessian diagonal (how much each input column matters).
- Dampening: 1% of the mean of diag(H) is added to the diagonal; inputs that are always zero get a unit diagonal and
  their weights are zeroed (they multiply nothing, and would only widen the group's range).

Calibration text (``calibration_ids``): the shipped As You Like It (``export.data``, disjoint from the evaluation
text) tokenized with the checkpoint's ``tokenizer.json``; a checkpoint without one gets seeded random token ids.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from kernels.quant import stored_scale

from .model import TorchOps, make_batch, rope_cache
from .quantize import choose_group_size, is_quantizable

# 32k tokens: ~500 GFLOP a layer for SmolLM2-135M (forward + Hessians); 113 s for its 30 layers on the quiet 2-core
# machine, and +15.6% perplexity against +16.4% with half the tokens (benchmarks/results/cpu/eval_smollm2_gptq.md).
CALIB_SEQS, CALIB_LEN = 64, 512
BLOCK = 128  # columns per lazy update (a multiple of every group size)
DAMP = 0.01
CLIP_RATIOS = tuple(1.0 - 0.02 * i for i in range(16))  # shrink [min, max] by up to 30%


# --- one weight -----------------------------------------------------------------------------------------------------
def group_grid(w: torch.Tensor, scale_dtype: torch.dtype, col_weight: Optional[torch.Tensor] = None,
               ratios=(1.0,)) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit grid of each row of ``w [N, G]``: fp32 ``(scale [N], zero [N])``, the scale already rounded to
    ``scale_dtype``. With several ``ratios``, the range ``[r * min, r * max]`` with the least squared rounding error
    (each column weighted by ``col_weight [G]``) wins per row; ``ratios=(1.0,)`` is ``quantize_int4``'s grid."""
    lo0, hi0 = w.amin(dim=1).clamp(max=0), w.amax(dim=1).clamp(min=0)  # the range holds 0, as quantize_int4's
    best = None
    for r in ratios:
        s = stored_scale((hi0 - lo0) * r / 15.0, scale_dtype).float()
        z = torch.round(-lo0 * r / s).clamp_(0, 15)
        if len(ratios) == 1:
            return s, z
        err = (fake_quant(w, s, z) - w).square_()
        err = (err @ col_weight) if col_weight is not None else err.sum(dim=1)
        if best is None:
            best = (err, s, z)
            continue
        better = err < best[0]
        best = (torch.where(better, err, best[0]), torch.where(better, s, best[1]), torch.where(better, z, best[2]))
    return best[1], best[2]


def _q(w: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Integer codes 0..15 of ``w [N, *]`` on the grid ``(s, z) [N]`` (``quantize_int4``'s rounding)."""
    s, z = (s, z) if w.dim() == 1 else (s[:, None], z[:, None])
    return (torch.round(w / s) + z).clamp_(0, 15)


def fake_quant(w: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    s2, z2 = (s, z) if w.dim() == 1 else (s[:, None], z[:, None])
    return (_q(w, s, z) - z2) * s2


def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, group_size: int, scale_dtype: torch.dtype,
                  clip: bool = True, damp: float = DAMP):
    """GPTQ of one weight ``w [N, K]`` given the Hessian ``[K, K]`` of its inputs; returns a 4-bit
    ``kernels.quant.QuantizedWeight`` (asymmetric, groups of ``group_size`` along K, scales in ``scale_dtype``)."""
    from kernels.quant import QuantizedWeight, pack_int4

    n, k = w.shape
    if k % group_size or BLOCK % group_size:
        raise ValueError(f"in_features={k} is not a multiple of group_size={group_size}")
    W = w.detach().float().clone()
    H = hessian.detach().float().clone()
    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    col_weight = torch.diagonal(H).clone()  # before dampening: the inputs' energy, for the clipping search
    H.diagonal().add_(damp * torch.diagonal(H).mean())
    # U: upper Cholesky factor of H^-1. Row i of U (right of the diagonal) says how rounding column i moves the
    # optimal values of the columns after it; U[i, i] scales its error.
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    Q = torch.empty(n, k)
    scales, zeros = torch.empty(k // group_size, n), torch.empty(k // group_size, n)
    ratios = CLIP_RATIOS if clip else (1.0,)
    for b0 in range(0, k, BLOCK):
        b1 = min(b0 + BLOCK, k)
        Wb, Ub = W[:, b0:b1], U[b0:b1, b0:b1]  # Wb is a view: in-block updates land in W
        err = torch.empty(n, b1 - b0)
        for i in range(b1 - b0):
            col = b0 + i
            if col % group_size == 0:  # a group starts: its grid from the weights as updated so far
                s, z = group_grid(Wb[:, i:i + group_size], scale_dtype, col_weight[col:col + group_size], ratios)
                scales[col // group_size], zeros[col // group_size] = s, z
            q = _q(Wb[:, i], s, z)
            Q[:, col] = q
            err[:, i] = (Wb[:, i] - (q - z) * s) / Ub[i, i]
            Wb[:, i + 1:] -= err[:, i:i + 1] * Ub[i:i + 1, i + 1:]
        W[:, b1:] -= err @ U[b0:b1, b1:]  # the lazy update of every later column, once per block
    return QuantizedWeight(4, pack_int4(Q.to(torch.int32).t()), scales.to(scale_dtype).contiguous(),
                           zeros.to(torch.int8).contiguous(), group_size, k, n)


# --- the model --------------------------------------------------------------------------------------------------------
class CalibrationOps(TorchOps):
    """``TorchOps`` whose ``linear`` GPTQ-quantizes each quantizable float weight from its first input (all the
    calibration tokens at once), stores the result in ``quantized`` and computes with the dequantized weight."""

    def __init__(self, weights: dict, cos_sin_cache: torch.Tensor, group_sizes: dict, scale_dtype: torch.dtype,
                 clip: bool, on_weight: Callable[[str], None]):
        super().__init__(weights, cos_sin_cache)
        self.group_sizes, self.scale_dtype, self.clip, self.on_weight = group_sizes, scale_dtype, clip, on_weight
        self.quantized: dict = {}

    def linear(self, x, weight, bias=None):
        if weight in self.group_sizes and weight not in self.quantized:
            from kernels.quant import dequantize

            xf = x.reshape(-1, x.shape[-1]).float()
            hessian = (2.0 / xf.shape[0]) * (xf.t() @ xf)
            qw = gptq_quantize(self.w[weight], hessian, self.group_sizes[weight], self.scale_dtype, self.clip)
            self.quantized[weight] = qw
            self.w[weight] = dequantize(qw, torch.float32)
            self.on_weight(weight)
        return super().linear(x, weight, bias)

    # Calibration runs equal-length fresh sequences: causal attention over each one's own K/V, with no paged cache
    # (the CPU reference's per-sequence cache walk took 10 of the 18 s of the tiny model's 64 x 512 calibration).
    def rope_write_kv_cache(self, q, k, v, positions, layer, caches, slot_mapping, name):
        q, k = self.ops.rotary_embedding(q, k, positions, self.cos_sin_cache, False)
        return q, (k, v)

    def paged_attention(self, q, caches, block_table, seq_lens, cu_seqlens_q, max_seqlen_q, scale, name):
        k, v = caches
        n, (t, hq, d), hk = seq_lens.numel(), q.shape, k.shape[1]
        split = lambda x: x.reshape(n, t // n, x.shape[1], d).transpose(1, 2)  # noqa: E731  [n, heads, L, D]
        k, v = (split(x).repeat_interleave(hq // hk, dim=1) for x in (k, v))
        out = torch.nn.functional.scaled_dot_product_attention(split(q), k, v, is_causal=True, scale=scale)
        return out.transpose(1, 2).reshape(t, hq, d)


def gptq_state_dict(config, state: dict, input_ids: torch.Tensor, group_size: int = 128,
                    scale_dtype: torch.dtype = torch.float16, clip: bool = True,
                    on_weight: Callable[[str], None] = lambda name: None) -> dict:
    """A copy of ``state`` (float32 tensors, internal names) with every linear weight GPTQ-quantized to int4, from
    ``input_ids [num_seqs, seq_len]`` run through the model layer by layer. ``group_size`` is the largest group size
    (``choose_group_size`` picks each weight's, as for round-to-nearest); ``on_weight(name)`` is called after each
    weight (for progress)."""
    from .decoder import decoder_forward

    # Every weight's group size first: a K that none divides is refused before the (slow) calibration.
    group_sizes = {name: choose_group_size(w.shape[-1], group_size, name) for name, w in state.items()
                   if is_quantizable(name) and isinstance(w, torch.Tensor)}
    weights = {k: (v.float() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
    if state.get("lm_head") is state.get("embed"):
        weights["lm_head"] = weights["embed"]
    num_seqs, seq_len = input_ids.shape
    batch = make_batch([seq_len] * num_seqs, input_ids=input_ids.reshape(-1))
    ops = CalibrationOps(weights, rope_cache(config), group_sizes, scale_dtype, clip, on_weight)
    with torch.inference_mode():
        decoder_forward(ops, config, batch.input_ids, batch.positions, batch.slot_mapping, batch.block_table,
                        batch.seq_lens, batch.cu_seqlens_q, batch.max_seqlen_q, [(None, None)] * config.num_layers)
    out = dict(state)
    out.update(ops.quantized)
    return out


# --- calibration data -------------------------------------------------------------------------------------------------
def calibration_ids(checkpoint_dir, vocab_size: int, num_seqs: int = CALIB_SEQS, seq_len: int = CALIB_LEN,
                    seed: int = 0) -> tuple[torch.Tensor, str]:
    """``([n, seq_len] int64 token ids, description)``: consecutive pieces of the calibration text (As You Like It)
    tokenized with the checkpoint's ``tokenizer.json``, each starting with BOS when the tokenizer adds one; ``n`` is
    ``num_seqs`` or fewer when the text runs out. Without a tokenizer.json: ``num_seqs`` rows of random ids drawn
    with ``seed``."""
    from pathlib import Path

    from .data import CALIBRATION_TEXT, TEXTS, calibration_text

    if (Path(checkpoint_dir) / "tokenizer.json").is_file():
        from .eval import tokenize
        from .runtime.tokenizer import load_tokenizer

        ids, bos = tokenize(load_tokenizer(checkpoint_dir), calibration_text())
        step = seq_len - (bos is not None)
        rows = [([bos] if bos is not None else []) + ids[i:i + step]
                for i in range(0, (len(ids) // step) * step, step)][:num_seqs]
        if rows:
            what = f"{len(rows)} x {seq_len} tokens of {TEXTS[CALIBRATION_TEXT][1]}"
            return torch.tensor(rows, dtype=torch.int64), what
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, vocab_size, (num_seqs, seq_len), generator=gen),
            f"{num_seqs} x {seq_len} random token ids (seed {seed}; the checkpoint has no tokenizer.json)")


def timed_gptq(config, state: dict, checkpoint_dir, group_size: int, scale_dtype: torch.dtype,
               num_seqs: int = CALIB_SEQS, seq_len: int = CALIB_LEN, clip: bool = True,
               on_weight: Callable[[str], None] = lambda name: None) -> tuple[dict, dict]:
    """``gptq_state_dict`` on the calibration text; returns ``(weights, info)`` with what build.json records."""
    seq_len = min(seq_len, config.max_position_embeddings)
    ids, what = calibration_ids(checkpoint_dir, config.vocab_size, num_seqs, seq_len)
    t0 = time.perf_counter()
    weights = gptq_state_dict(config, state, ids, group_size, scale_dtype, clip, on_weight)
    info = dict(method="gptq", calibration=what, sequences=int(ids.shape[0]), tokens_per_sequence=int(ids.shape[1]),
                clip_search=clip, seconds=round(time.perf_counter() - t0, 1))
    return weights, info
