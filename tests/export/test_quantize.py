"""export.quantize: which weights get quantized, that the result dequantizes to within the quantization step, and
that weights.safetensors round-trips a quantized state dict exactly (tied lm_head stored once)."""

import pytest
import torch

import kernels.quant as kq
from export.checkpoint import load_checkpoint
from export.quantize import dequantize_state_dict, is_quantizable, load_weights, quantize_state_dict, save_weights

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
    with pytest.raises(ValueError, match="group_size=48 is not supported"):
        quantize_state_dict(state, "int4", group_size=48)


@pytest.mark.parametrize("k, largest, want", [
    (4096, 128, 128), (1536, 128, 128), (576, 128, 64), (320, 128, 64), (704, 128, 64), (608, 128, 32),
    (160, 128, 32), (96, 128, 32), (4096, 64, 64), (4096, 32, 32), (576, 32, 32), (32, 128, 32)])
def test_group_size_is_the_largest_that_divides(k, largest, want):
    """Per weight: the largest of 128, 64, 32 that is at most the requested (largest) one and divides K."""
    from export.quantize import choose_group_size

    assert choose_group_size(k, largest) == want


@pytest.mark.parametrize("k", [100, 8, 48, 1000])
def test_group_size_when_none_divides(k):
    """K not a multiple of 32: no int4 layout fits; the error names the weight, its K and what to do instead."""
    from export.quantize import choose_group_size

    with pytest.raises(ValueError, match=rf"layers.3.w2: in_features={k} is not a multiple of 32.*--quant int8"):
        choose_group_size(k, 128, "layers.3.w2")
    with pytest.raises(ValueError, match=r"lm_head: .*use --lm-head-quant int8 .* or --lm-head-quant none"):
        choose_group_size(k, 128, "lm_head", "--lm-head-quant")


def test_default_group_size_per_weight(state):
    """The tiny model (hidden 64, intermediate 160) at the default group size: 64 where K = 64, 32 where K = 160;
    each weight dequantizes within its own groups' step."""
    from export.quantize import group_size_map

    q = quantize_state_dict(state, "int4")  # group_size 128 at most
    assert {n: q[f"layers.0.{n}"].group_size for n in LINEARS} == {"wqkv": 64, "wo": 64, "w13": 64, "w2": 32}
    assert group_size_map(q) == {"layers.*.wqkv": 64, "layers.*.wo": 64, "layers.*.w13": 64, "layers.*.w2": 32}
    assert group_size_map(quantize_state_dict(state, "int8")) == {} and group_size_map(state) == {}
    d = dequantize_state_dict(q)
    for name in ("layers.1.wqkv", "layers.1.w2"):
        g, w = q[name].group_size, state[name].float()
        wg = w.reshape(w.shape[0], -1, g)
        step = ((wg.amax(-1) - wg.amin(-1)) / 15).repeat_interleave(g, dim=1)
        assert bool(((d[name].float() - w).abs() <= step / 2 * (1 + 1e-3) + 1e-7).all()), name


def test_group_size_map_lists_layers_that_differ():
    """Collapsed to ``layers.*.proj`` only when every layer agrees (an import may mix them); a quantized lm_head is
    listed under its own name."""
    from export.quantize import group_size_map

    def qw(g):
        return kq.QuantizedWeight(4, None, None, None, g, 128, 8)

    weights = {"layers.0.wqkv": qw(128), "layers.1.wqkv": qw(128), "layers.10.w2": qw(32), "layers.2.w2": qw(64),
               "lm_head": qw(64), "layers.0.wo": kq.QuantizedWeight(8, None, None, None, 128, 128, 8),
               "embed": torch.zeros(1)}
    assert group_size_map(weights) == {"layers.*.wqkv": 128, "layers.2.w2": 64, "layers.10.w2": 32, "lm_head": 64}
    assert list(group_size_map(weights))[1:3] == ["layers.2.w2", "layers.10.w2"]  # in layer order


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


def test_quantized_weights_are_smaller(state, tmp_path):
    # The size a build reports: weights.safetensors on disk (scales, zero points and metadata included).
    sizes = {}
    for q in ("none", "int8", "int4"):
        save_weights(state if q == "none" else quantize_state_dict(state, q, group_size=32), tmp_path / f"{q}.st")
        sizes[q] = (tmp_path / f"{q}.st").stat().st_size
    assert sizes["int4"] < sizes["int8"] < sizes["none"], sizes


# --- GPTQ / AWQ checkpoints: repacked, never re-quantized --------------------------------------------------------
GROUP = 32
PROJ = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
        "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# Projections that read the same activations share one act-order permutation (they are fused into one GEMM).
INPUT_GROUP = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o", "gate_proj": "gu", "up_proj": "gu",
               "down_proj": "down"}


def _pack_cols(q, order=tuple(range(8))):
    """int [R, C] in 0..15 -> int32 [R, C // 8], nibble i of column block c = column 8c + order[i]."""
    r, c = q.shape
    q = q.to(torch.int64).reshape(r, c // 8, 8)
    out = torch.zeros(r, c // 8, dtype=torch.int64)
    for i, col in enumerate(order):
        out |= q[:, :, col] << (4 * i)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def _quantize_like_gptq(w, perm):
    """Asymmetric int4 over groups of inputs given by ``perm`` (act order): (q [K, N] in original order, scales,
    zeros [K // G, N], g_idx [K], the dequantized weight [N, K] the checkpoint stands for)."""
    qw = kq.quantize_int4(w[:, perm], group_size=GROUP, scale_dtype=w.dtype)
    q = torch.empty(w.shape[1], w.shape[0], dtype=torch.int32)
    q[perm] = kq.unpack_int4(qw.qweight)
    deq = torch.empty_like(w)
    deq[:, perm] = kq.dequantize(qw)
    g_idx = torch.empty(w.shape[1], dtype=torch.int32)
    g_idx[perm] = torch.arange(w.shape[1], dtype=torch.int32) // GROUP
    return q, qw.scales, qw.zeros.to(torch.int32), g_idx, deq


def _make_quantized_checkpoint(src, dst, method, act_order=False, same_perm=True, bits=4):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    gen = torch.Generator().manual_seed(5)
    perms, dequantized = {}, {}
    for name in [n for n in tensors if n.rsplit(".", 2)[-2] in PROJ and n.endswith(".weight")]:
        prefix, proj = name[: -len(".weight")], name.rsplit(".", 2)[-2]
        w = tensors.pop(name)
        key = (name.split(".")[2], INPUT_GROUP[proj] if same_perm else proj)
        if key not in perms:
            perms[key] = torch.randperm(w.shape[1], generator=gen) if act_order else torch.arange(w.shape[1])
        q, scales, zeros, g_idx, dequantized[name] = _quantize_like_gptq(w, perms[key])
        if method == "gptq":
            tensors.update({prefix + ".qweight": kq.pack_int4(q), prefix + ".qzeros": _pack_cols(zeros - 1),
                            prefix + ".scales": scales, prefix + ".g_idx": g_idx})
        else:
            order = (0, 2, 4, 6, 1, 3, 5, 7)
            tensors.update({prefix + ".qweight": _pack_cols(q, order), prefix + ".qzeros": _pack_cols(zeros, order),
                            prefix + ".scales": scales})
    save_file(tensors, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = ({"quant_method": "gptq", "bits": bits, "group_size": GROUP, "desc_act": act_order,
                                   "sym": False, "checkpoint_format": "gptq"} if method == "gptq" else
                                  {"quant_method": "awq", "bits": bits, "group_size": GROUP, "version": "gemm",
                                   "zero_point": True})
    (dst / "config.json").write_text(json.dumps(cfg))
    return dequantized


@pytest.mark.parametrize("method, act_order", [("gptq", False), ("gptq", True), ("awq", False)])
def test_gptq_awq_import_is_exact(tiny_dirs, tmp_path, method, act_order):
    """Imported (and fused) weights dequantize bit-exactly to what the checkpoint encodes, and the model on them gives
    the logits of the float model on those dequantized weights (fp32 everywhere: differences are fp32 summation
    order only, ~1e-7; 1e-5 relative leaves 100x margin while a wrong nibble order or zero offset is ~1e-2)."""
    from export.model import LlamaModel, make_batch

    src = tiny_dirs("llama")
    deq = _make_quantized_checkpoint(src, tmp_path / "q", method, act_order)
    model = LlamaModel.from_checkpoint(tmp_path / "q")
    assert model.quant == "int4" and model.group_size == GROUP
    c = model.config
    ref_state = dict(load_checkpoint(src).state_dict)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        for name, parts in (("wqkv", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
                            ("wo", ["self_attn.o_proj"]), ("w13", ["mlp.gate_proj", "mlp.up_proj"]),
                            ("w2", ["mlp.down_proj"])):
            qw = model.weights[f"layers.{i}.{name}"]
            assert isinstance(qw, kq.QuantizedWeight) and (qw.perm is not None) == act_order
            want = torch.cat([deq[p + part + ".weight"] for part in parts])
            assert torch.equal(kq.dequantize(qw), want), f"layers.{i}.{name}"
            ref_state[f"layers.{i}.{name}"] = want
    ref = LlamaModel(c, ref_state)
    ids = torch.randint(0, c.vocab_size, (11,))
    batch = make_batch([4, 7], block_size=4, input_ids=ids)
    got, want = model(batch, model.allocate_kv_cache(8, 4)), ref(batch, ref.allocate_kv_cache(8, 4))
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_imported_scales_take_the_build_dtype(tiny_dirs, tmp_path, method):
    """GPTQ / AWQ checkpoints store fp16 scales whatever their model's dtype: a bf16 (or fp32) build casts them to
    its dtype, as the kernels take the activations' (the fp16 scales failed the first linear of a bf16 build)."""
    from safetensors.torch import load_file, save_file

    from export.model import LlamaModel, make_batch

    _make_quantized_checkpoint(tiny_dirs("llama"), tmp_path / "q", method)
    f = tmp_path / "q" / "model.safetensors"
    tensors = load_file(str(f))
    save_file({k: v.half() if k.endswith(".scales") else v for k, v in tensors.items()}, str(f))
    for dtype in (torch.bfloat16, torch.float32):
        model = LlamaModel.from_checkpoint(tmp_path / "q", dtype=dtype)
        qws = [w for w in model.weights.values() if isinstance(w, kq.QuantizedWeight)]
        assert qws and {w.scales.dtype for w in qws} == {dtype}
        batch = make_batch([3], block_size=4, input_ids=torch.tensor([5, 6, 7]))
        assert model(batch, model.allocate_kv_cache(2, 4)).dtype == dtype


def test_gptq_act_order_must_match_across_fused_projections(tiny_dirs, tmp_path):
    from export.model import LlamaModel

    _make_quantized_checkpoint(tiny_dirs("llama"), tmp_path / "q", "gptq", act_order=True, same_perm=False)
    with pytest.raises(ValueError, match="different GPTQ act-order permutations"):
        LlamaModel.from_checkpoint(tmp_path / "q")


def test_gptq_8bit_is_refused(tiny_dirs, tmp_path):
    from export.model import LlamaModel

    _make_quantized_checkpoint(tiny_dirs("llama"), tmp_path / "q", "gptq", bits=8)
    with pytest.raises(ValueError, match="only 4-bit GPTQ/AWQ"):
        LlamaModel.from_checkpoint(tmp_path / "q")


@pytest.mark.parametrize("quant, bits", [("int8", 8), ("int4", 4)])
def test_lm_head_quantized_on_request(state, quant, bits):
    """``quantize_lm_head``: the (tied) head becomes its own quantized copy of the embedding, within one step of it;
    the embedding and every other weight are the same objects; "none" changes nothing."""
    from export.quantize import quantize_lm_head

    assert quantize_lm_head(state, "none") is state
    q = quantize_lm_head(state, quant, group_size=32)
    head = q["lm_head"]
    assert isinstance(head, kq.QuantizedWeight) and head.bits == bits
    assert (head.out_features, head.in_features) == tuple(state["embed"].shape)
    assert all(q[n] is state[n] for n in state if n != "lm_head")
    w, d = state["embed"].float(), kq.dequantize(head, torch.float32)
    if bits == 8:
        step = w.abs().amax(dim=1, keepdim=True) / 127
    else:
        assert head.group_size == 32
        wg = w.reshape(w.shape[0], -1, 32)
        step = ((wg.amax(-1) - wg.amin(-1)) / 15).repeat_interleave(32, dim=1)
    assert bool(((d - w).abs() <= step / 2 * (1 + 1e-3) + 1e-7).all())
    assert not torch.equal(d, w)  # rounded: not the embedding itself


def test_lm_head_quant_bad_input(state):
    from export.quantize import quantize_lm_head

    with pytest.raises(ValueError, match="lm_head quant must be one of"):
        quantize_lm_head(state, "fp8")
    with pytest.raises(ValueError, match="already quantized"):
        quantize_lm_head(quantize_lm_head(state, "int8"), "int4")


def test_quantized_lm_head_file_round_trip(state, tmp_path):
    """A quantized head of a tied checkpoint is saved as its own weight: it loads back quantized, not tied."""
    from export.quantize import quantize_lm_head

    q = quantize_lm_head(quantize_state_dict(state, "int4", group_size=32), "int8")
    save_weights(q, tmp_path / "w.safetensors")
    back = load_weights(tmp_path / "w.safetensors")
    assert back["lm_head"] is not back["embed"] and torch.equal(back["embed"], state["embed"])
    assert isinstance(back["lm_head"], kq.QuantizedWeight) and back["lm_head"].bits == 8
    assert torch.equal(back["lm_head"].qweight, q["lm_head"].qweight)
    assert torch.equal(back["lm_head"].scales, q["lm_head"].scales)
