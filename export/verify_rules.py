"""The tolerance rule of ``export.verify`` and its report: one row per (runner pair, feed, output), PASS or FAIL.

Every runner computes the same model; what may separate two of them is each one's own rounding. A runner's budget on an
output is relative to that output's scale, ``max |hf output|`` in the same feed (the fp32 HF model: the exact values):

- an fp32 runner (``hf``; ``onnxrt`` on fp32 builds and, upcast, on bf16 builds): ``FP32_REL`` -- fp32 summation
  order only;
- a half runner (fp16/bf16 activations: the plugin path, ``onnxrt`` on fp16 builds):
  ``HALF_ULPS x eps(dtype) x sqrt(depth)``, with ``depth`` the layers the output has gone through (``k_cache_out_i``:
  i + 1; logits: all layers + the final norm and lm_head).

Why that form: every op rounds its output to the activation dtype, a relative error of at most eps / 2 of the values
it rounds, and the residual stream carries each layer's rounding on to the next. Independent roundings add like a
random walk, so the error relative to the output's scale grows as sqrt(depth) times a constant that depends on how
many roundings a layer has and how much the network amplifies them (measured, see ``HALF_ULPS``). Two runners may
differ by the sum of their budgets (the triangle inequality through the exact result), plus ``atol`` (``--atol``,
default ``FP32_ATOL``) for outputs whose scale is ~0. ``--rtol`` replaces every pair's relative budget by one number.

A real defect -- a wrong weight, a cache slot off by one, a wrong mask -- moves an output by a sizeable fraction of its
scale (the tamper tests of ``tests/export/test_verify.py`` move it by >= 0.3 of max), far above these budgets.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

# fp32 runners: the tiny fp32 models' logits differ by ~2e-7 of ~0.5 (a few fp32 ulps after 2 layers); 1e-4 of the
# output's max keeps > 100x over that and stays far below a real defect (>= 1e-3 relative on the tiny models).
FP32_REL = 1e-4
FP32_ATOL = 1e-5
# Half runners: allowed max abs error = HALF_ULPS x eps x sqrt(depth) x max|hf| per runner. Measured, the ratio
# err / (eps x sqrt(depth) x max|hf|) of a runner vs the fp32 HF model, worst output over 3 feeds (CPU, this repo's
# references): tiny 2-layer fp16/bf16 builds <= 0.8; SmolLM2-135M (30 layers), fp16: none 1.3, int8 1.7, int4 (64/128)
# 2.0, int4 g32 1.3 (ONNX Runtime's own fp16 graph up to 2.0 as well); bf16 (the plugin path; ORT runs in fp32 there):
# none 1.3, int4 1.9, int4 g32 1.7, int8 4.1 (v_cache_out_11, 11% of its max: bf16 at depth 12 of a real model).
# 12 keeps ~3x over the worst of these and >= 6x over the rest; what it still catches: a tampered weight or a cache
# slot off by one moves an output by >= 0.3 of its max, against 12 x eps x sqrt(31) = 6.5e-2 of max at fp16 and 30
# layers (0.52 at bf16: bf16 rounding itself reaches 0.1 there, so a bf16 build's check is that coarse).
HALF_ULPS = 12.0
EPS = {"float32": float(np.finfo(np.float32).eps), "float16": float(np.finfo(np.float16).eps), "bfloat16": 2.0**-7}
FEED_NAMES = ("prefill", "decode", "chunk")
_CACHE = re.compile(r"^([kv])_cache_out_(\d+)$")


def output_depth(name: str, num_layers: int) -> int:
    """Layers an output has gone through: ``k/v_cache_out_i`` i + 1, the logits all of them + 1 (final norm, head)."""
    m = _CACHE.match(name)
    return int(m.group(2)) + 1 if m else num_layers + 1


def output_group(name: str) -> str:
    """``logits``, ``k_cache_out_*`` or ``v_cache_out_*``: what the short report shows one row for."""
    m = _CACHE.match(name)
    return f"{m.group(1)}_cache_out_*" if m else name


@dataclass(frozen=True)
class Rule:
    """What each runner computes in (``precision[name]``: float32, float16 or bfloat16) and the user's overrides."""

    precision: dict
    num_layers: int
    atol: float = FP32_ATOL
    rtol: float | None = None  # None: the per-runner budgets above

    def relative(self, a: str, b: str, output: str) -> float:
        """Allowed max abs error between runners ``a`` and ``b`` on ``output``, as a fraction of its scale."""
        if self.rtol is not None:
            return self.rtol
        return sum(self.budget(r, output) for r in (a, b))

    def budget(self, runner: str, output: str) -> float:
        p = self.precision[runner]
        if p == "float32":
            return FP32_REL / 2  # two fp32 runners together: FP32_REL
        return HALF_ULPS * EPS[p] * math.sqrt(output_depth(output, self.num_layers))

    def describe(self) -> str:
        if self.rtol is not None:
            return f"|a - b| <= {self.atol:g} + {self.rtol:g} x max|hf| per output (--rtol)"
        half = sorted({p for p in self.precision.values() if p != "float32"})
        text = f"|a - b| <= {self.atol:g} + (budget a + budget b) x max|hf| per output; fp32 budget {FP32_REL / 2:g}"
        for p in half:
            text += f", {p} budget {HALF_ULPS:g} x eps {EPS[p]:.3g} x sqrt(depth)"
        return text


@dataclass
class Row:
    pair: tuple  # (reference runner, runner)
    feed: int
    output: str
    err: float  # max abs error over the output (nan: a NaN somewhere)
    allowed: float
    rel: float  # allowed = atol + rel x scale
    scale: float  # max |hf output| in this feed
    problem: str = ""  # missing output, shape mismatch

    @property
    def ok(self) -> bool:
        return not self.problem and self.err <= self.allowed  # NaN compares False: a NaN fails

    @property
    def ratio(self) -> float:
        if self.problem or not math.isfinite(self.err):
            return math.inf
        return self.err / self.allowed if self.allowed else (0.0 if self.err == 0 else math.inf)


def _max_abs(x) -> float:
    return float(np.max(np.abs(x))) if x.size else 0.0


def compare(results, pairs, rule: Rule, scale_runner: str = "hf") -> list[Row]:
    """Rows for every pair ``(a, b)`` of runner names, feed and output ``a`` gives. ``results``: Polygraphy's
    ``RunResults`` (or ``[(name, [outputs per feed])]``)."""
    by_name = {name: iters for name, iters in results}
    rows = []
    for a, b in pairs:
        for f, (ra, rb) in enumerate(zip(by_name[a], by_name[b])):
            scales = by_name.get(scale_runner, by_name[a])[f]
            for key in ra.keys():
                x = np.asarray(ra[key], np.float64)
                scale = _max_abs(np.asarray(scales[key], np.float64)) if key in scales else _max_abs(x)
                rel = rule.relative(a, b, key)
                row = Row((a, b), f, key, math.nan, rule.atol + rel * scale, rel, scale)
                if key not in rb:
                    row.problem = f"{b} gives no {key}"
                else:
                    y = np.asarray(rb[key], np.float64)
                    if x.shape != y.shape:
                        row.problem = f"shape {y.shape} != {x.shape}"
                    else:
                        row.err = _max_abs(x - y)
                rows.append(row)
    return rows


def _line(row: Row, name: str) -> str:
    pair = f"{row.pair[1]} vs {row.pair[0]}"
    feed = FEED_NAMES[row.feed] if row.feed < len(FEED_NAMES) else f"feed {row.feed}"
    status = "PASS" if row.ok else "FAIL"
    if row.problem:
        return f"  {status}  {pair:22} {feed:8} {name:28} {row.problem}"
    return (f"  {status}  {pair:22} {feed:8} {name:28} err {row.err:9.3e}  allowed {row.allowed:9.3e}"
            f"  = {row.rel:.2e} x max|hf| {row.scale:.3g}")


def report(rows: list[Row], verbose: bool = False) -> list[str]:
    """The report's lines. Short (default): per pair and feed, one row for the logits and one for each cache kind
    (its output with the least margin, ``(worst of N)``), and every failing output on its own row. ``verbose``:
    every output."""
    if verbose:
        return [_line(r, r.output) for r in rows]
    groups: dict = {}
    for r in rows:
        groups.setdefault((r.pair, r.feed, output_group(r.output)), []).append(r)
    lines = []
    for members in groups.values():
        failing = [r for r in members if not r.ok]
        if failing:
            lines += [_line(r, r.output) for r in failing]
            continue
        worst = max(members, key=lambda r: r.ratio)
        name = worst.output if len(members) == 1 else f"{worst.output} (worst of {len(members)})"
        lines.append(_line(worst, name))
    return lines
