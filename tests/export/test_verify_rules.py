"""export.verify_rules: each runner's rounding budget, the pair bounds, and the short report (worst of each output kind,
every failure on its own row); NaN, a missing output and a shape mismatch fail. Pure numpy, no model."""

import math
import re

import numpy as np
import pytest

from export.verify_rules import EPS, FP32_ATOL, FP32_REL, HALF_ULPS, Rule, compare, output_depth, report


def test_output_depth():
    assert output_depth("k_cache_out_0", 30) == 1 and output_depth("v_cache_out_29", 30) == 30
    assert output_depth("logits", 30) == 31


def test_pair_bound_is_the_sum_of_the_runners_budgets():
    rule = Rule({"hf": "float32", "onnxrt": "float16", "plugin-ref": "bfloat16"}, num_layers=3)
    assert rule.relative("hf", "hf", "logits") == pytest.approx(FP32_REL)
    half = HALF_ULPS * EPS["float16"] * math.sqrt(2)
    assert rule.relative("hf", "onnxrt", "k_cache_out_1") == pytest.approx(FP32_REL / 2 + half)
    bf16 = HALF_ULPS * 2.0**-7 * 2  # logits of 3 layers: depth 4
    assert rule.relative("onnxrt", "plugin-ref", "logits") == pytest.approx(HALF_ULPS * EPS["float16"] * 2 + bf16)
    assert Rule(rule.precision, 3, rtol=0.25).relative("onnxrt", "plugin-ref", "logits") == 0.25


def _results(**runs):
    return [(name, feeds) for name, feeds in runs.items()]


def test_rows_bounds_and_the_short_report():
    rng = np.random.default_rng(0)
    exact = {"logits": rng.standard_normal((2, 7)) * 4, "k_cache_out_0": rng.standard_normal((3, 4)),
             "k_cache_out_1": rng.standard_normal((3, 4)), "v_cache_out_0": rng.standard_normal((3, 4)),
             "v_cache_out_1": rng.standard_normal((3, 4))}
    near = {k: v + 1e-3 * np.abs(v).max() for k, v in exact.items()}  # one part in 1000 of each output's max
    off = dict(near, k_cache_out_1=near["k_cache_out_1"] + 0.5)
    rule = Rule({"hf": "float32", "plugin-ref": "float16"}, num_layers=2)
    rows = compare(_results(hf=[exact, exact], **{"plugin-ref": [near, off]}), [("hf", "plugin-ref")], rule)
    assert len(rows) == 2 * 5
    row = rows[0]
    scale = float(np.abs(exact["logits"]).max())
    assert row.scale == pytest.approx(scale) and row.err == pytest.approx(1e-3 * scale)
    assert row.allowed == pytest.approx(FP32_ATOL + (FP32_REL / 2 + HALF_ULPS * EPS["float16"] * math.sqrt(3)) * scale)
    assert [r.ok for r in rows] == [True] * 5 + [True, True, False, True, True]
    short = report(rows)
    # feed 0: logits, k (worst of 2), v (worst of 2); feed 1: logits, the failing k_cache_out_1 alone, v
    assert len(short) == 6
    assert "(worst of 2)" in short[1] and short[1].startswith("  PASS  plugin-ref vs hf")
    assert re.match(r"  FAIL  plugin-ref vs hf +decode +k_cache_out_1 +err", short[4])
    assert len(report(rows, verbose=True)) == 10


@pytest.mark.parametrize("bad", ["nan", "missing", "shape"])
def test_nan_missing_and_shape_fail(bad):
    exact = {"logits": np.ones((2, 3))}
    got = {"nan": {"logits": np.array([[1, np.nan, 1], [1, 1, 1]])}, "missing": {},
           "shape": {"logits": np.ones((3, 2))}}[bad]
    (row,) = compare(_results(hf=[exact], onnxrt=[got]), [("hf", "onnxrt")],
                     Rule({"hf": "float32", "onnxrt": "float32"}, 1))
    assert not row.ok and "FAIL" in report([row])[0]
