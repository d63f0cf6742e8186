"""export.quantize: which weights get quantized, that the result dequantizes to within the quantization step, and
that weights.safetensors round-trips a quantized state dict exactly (tied lm_head stored once)."""

import pytest
import torch

import kernels.quant as kq
from export.checkpoint import load_checkpoint
from export.quantize import (dequantize_state_dict, is_quantizable, load_weights, quantize_state_dict, save_weights,
                             weights_nbytes)

LINEARS = ("wqkv", "wo", "w13", "w2")


@pytest.fixture(scope="module")
def state(tiny_dirs):
    return load_checkpoint(tiny_dirs("tied")).state_dict


@pytest.mark.parametrize("quant, bits, group", [("int8", 8, 128), ("int4", 4, 32)])
def test_only_linear_weights_are_quantized(state, quant, bits, group):
    q = quantize_state_dict(state, quant, group_size=group)
    assert set(q) == set(state)
    for name, v in q.items():
        if name.startswith("layers.") and name.split(".")[-1] in LINEARS:
            assert isinstance(v, kq.QuantizedWeight) and v.bits == bits, name
            assert (v.out_features, v.in_features) == tuple(state[name].shape)
            assert v.dtype == state[name].dtype  # scales in the activation dtype (fp32 here)
            if bits == 4:
                assert v.group_size == group
        else:
            assert v is state[name], name  # embed, lm_head, norms untouched (not even copied)
    assert q["lm_head"] is q["embed"]


@pytest.mark.parametrize("quant, group", [("int8", 128), ("int4", 32)])
def test_dequantized_within_one_step(state, quant, group):
    """|w - dequant(q(w))| <= step / 2 (+ fp32 rounding): step = max|w_row| / 127 for int8, (max - min) / 15 per group
    for int4. A bound from the format itself, so a wrong scale, zero point or layout fails it."""
    q = quantize_state_dict(state, quant, group_size=group)
    d = dequantize_state_dict(q)
    for name in ("layers.0.wqkv", "layers.1.w2"):
        w = state[name].float()
        if quant == "int8":
            step = w.abs().amax(dim=1, keepdim=True) / 127
        else:
            wg = w.reshape(w.shape[0], -1, group)
            step = ((wg.amax(-1) - wg.amin(-1)) / 15).repeat_interleave(group, dim=1)
        err = (d[name].float() - w).abs()
        assert bool((err <= step / 2 * (1 + 1e-3) + 1e-7).all()), f"{name}: max err/step {float((err / step).max())}"
        assert not torch.equal(d[name], state[name])


def test_is_quantizable():
    assert is_quantizable("layers.3.wqkv") and is_quantizable("layers.0.w2")
    assert not any(is_quantizable(n) for n in ("embed", "lm_head", "norm", "layers.0.attn_norm", "layers.0.bqkv"))


def test_bad_modes(state):
    with pytest.raises(ValueError, match="'int8' or 'int4'"):
        quantize_state_dict(state, "fp8")
    with pytest.raises(ValueError, match="layers.0.wqkv: .*in_features=64"):
        quantize_state_dict(state, "int4", group_size=128)  # hidden 64 is not a multiple of 128


@pytest.mark.parametrize("quant", ["none", "int8", "int4"])
def test_weights_file_round_trip(state, tmp_path, quant):
    q = state if quant == "none" else quantize_state_dict(state, quant, group_size=32)
    path = tmp_path / "weights.safetensors"
    save_weights(q, path)
    back = load_weights(path)
    assert set(back) == set(q)
    assert back["lm_head"] is back["embed"]  # tied: stored once, shared again on load
    for name, v in q.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(back[name], v), name
        else:
            b = back[name]
            assert isinstance(b, kq.QuantizedWeight)
            assert (b.bits, b.group_size, b.in_features, b.out_features) == \
                (v.bits, v.group_size, v.in_features, v.out_features)
            for f in ("qweight", "scales", "zeros", "perm"):
                x, y = getattr(b, f), getattr(v, f)
                assert (x is None and y is None) or torch.equal(x, y), f"{name}.{f}"


def test_quantized_weights_are_smaller(state):
    sizes = {q: weights_nbytes(state if q == "none" else quantize_state_dict(state, q, group_size=32))
             for q in ("none", "int8", "int4")}
    assert sizes["int4"] < sizes["int8"] < sizes["none"]
