"""export.model: the LLaMA forward on torch.ops.tritrt (CPU: the ops' fp32 references) against transformers' logits.

Prefill of two sequences of different lengths, then a decode step and a chunked-prefill step, each compared with HF's
logits for the whole sequence so far; the KV cache blocks are scattered (a shuffled block table) so paging is real.
Tolerance: everything runs in fp32 on both sides; the only differences are summation order and the attention
formulation (fp32 rounding, ~1e-7 relative per op over 2 layers), so 1e-4 relative to the largest logit is ~100x margin
and still far below any wiring error (a wrong head, position or block changes logits by O(1)).
"""

import pytest
import torch

from export.model import LlamaModel, make_batch
from tests.helpers import describe_error

REL_TOL = 1e-4
BLOCK_SIZE = 4  # sequences of 7 and 13 tokens are not block multiples; blocks get crossed mid-sequence


def _hf(path, weights=None):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return model


@torch.no_grad()
def _hf_logits(hf, ids):
    return hf(ids[None]).logits[0]


def _assert_rel(got, want, what):
    assert torch.isfinite(got).all(), what + ": non-finite " + describe_error(got, want)
    rel = float((got - want).abs().max() / want.abs().max())
    assert rel < REL_TOL, f"{what}: rel err {rel:.2e} >= {REL_TOL}: " + describe_error(got, want)


def _scatter_blocks(batch, perm):
    """The same batch with block ids renamed through ``perm`` (so each sequence's blocks are not contiguous)."""
    bs = BLOCK_SIZE
    batch.block_table = perm[batch.block_table.long()].to(torch.int32)
    slots = batch.slot_mapping.long()
    batch.slot_mapping = (perm[slots // bs] * bs + slots % bs).to(torch.int32)
    return batch


def _run_steps(model, hf, vocab, steps, gen):
    """Run ``steps`` (list of per-sequence new-token counts) on two sequences; after each, compare all new tokens'
    logits with HF's on the full sequence so far."""
    num_seqs, blocks_per_seq = 2, 8
    num_blocks = num_seqs * blocks_per_seq
    perm = torch.randperm(num_blocks, generator=gen)
    kv = model.allocate_kv_cache(num_blocks, BLOCK_SIZE, "cpu", torch.float32)
    for k, v in kv:  # poison: any read of a slot not yet written gives NaN logits
        k.fill_(float("nan")), v.fill_(float("nan"))
    full = [torch.randint(0, vocab, (sum(s[i] for s in steps),), generator=gen) for i in range(num_seqs)]
    done = [0] * num_seqs
    for step, new in enumerate(steps):
        ids = torch.cat([full[i][done[i]:done[i] + new[i]] for i in range(num_seqs)])
        batch = _scatter_blocks(make_batch(new, cached_lens=done, block_size=BLOCK_SIZE, input_ids=ids,
                                           blocks_per_seq=blocks_per_seq), perm)
        all_logits = model(batch, kv, all_logits=True)
        last = model(_copy(batch), [(k.clone(), v.clone()) for k, v in kv])  # cache already holds this step's K/V
        assert all_logits.shape == (sum(new), vocab) and last.shape == (num_seqs, vocab)
        offs = batch.cu_seqlens_q.tolist()
        for i in range(num_seqs):
            want = _hf_logits(hf, full[i][: done[i] + new[i]])[done[i]:]
            _assert_rel(all_logits[offs[i]:offs[i + 1]], want, f"step {step} seq {i} (all tokens)")
            _assert_rel(last[i], want[-1], f"step {step} seq {i} (last token)")
        done = [d + n for d, n in zip(done, new)]


def _copy(batch):
    return batch.to("cpu")


@pytest.mark.parametrize("variant", ["llama", "tied", "llama3", "qwen2", "qwen3", "bias"])
def test_prefill_decode_chunked_vs_hf(tiny_dirs, variant):
    path = tiny_dirs(variant)
    model = LlamaModel.from_checkpoint(path)
    hf = _hf(path)
    gen = torch.Generator().manual_seed(1)
    # prefill 7 / 13 tokens, decode one each, chunked prefill (5 more for seq 0 while seq 1 decodes)
    _run_steps(model, hf, model.config.vocab_size, [[7, 13], [1, 1], [5, 1]], gen)


@pytest.mark.parametrize("variant, quant, group_size, fused", [("llama", "int8", 128, False),
                                                                ("llama", "int4", 32, False),
                                                                ("odd_dims", "int4", 128, False),
                                                                ("llama", "int8", 128, True),
                                                                ("odd_dims", "int4", 128, True)])
def test_quantized_model_vs_hf_with_dequantized_weights(tiny_dirs, variant, quant, group_size, fused):
    """The quantized model equals HF running the dequantized weights: quantization error is not counted. odd_dims
    (hidden 320, intermediate 608) at the default group size mixes group sizes 64 and 32 (``group_sizes``). ``fused``:
    after ``fuse_swiglu_`` (gate/up as column pairs, SwiGLU applied by the GEMM op; on the CPU its fp32 reference)."""
    import kernels.quant as kq

    tiny_llama_dir = tiny_dirs(variant)
    model = LlamaModel.from_checkpoint(tiny_llama_dir, quant=quant, group_size=group_size)
    if variant == "odd_dims":
        assert model.group_sizes == {"layers.*.wqkv": 64, "layers.*.wo": 64, "layers.*.w13": 64, "layers.*.w2": 32}
    c = model.config
    for name in ("layers.0.wqkv", "layers.1.w2"):
        assert isinstance(model.weights[name], kq.QuantizedWeight) and model.weights[name].bits == int(quant[3:])
    assert isinstance(model.weights["embed"], torch.Tensor) and isinstance(model.weights["lm_head"], torch.Tensor)
    hf = _hf(tiny_llama_dir)
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            wqkv = kq.dequantize(model.weights[f"layers.{i}.wqkv"])
            q, k, v = wqkv.split([c.q_size, c.kv_size, c.kv_size])
            gate, up = kq.dequantize(model.weights[f"layers.{i}.w13"]).split([c.intermediate_size] * 2)
            for mod, w in ((layer.self_attn.q_proj, q), (layer.self_attn.k_proj, k), (layer.self_attn.v_proj, v),
                           (layer.self_attn.o_proj, kq.dequantize(model.weights[f"layers.{i}.wo"])),
                           (layer.mlp.gate_proj, gate), (layer.mlp.up_proj, up),
                           (layer.mlp.down_proj, kq.dequantize(model.weights[f"layers.{i}.w2"]))):
                assert not torch.equal(mod.weight, w)  # quantization did change the weight: the test can fail
                mod.weight.copy_(w)
    if fused:
        assert model.fuse_swiglu_() is model and model.swiglu_fused
        assert not any(k.endswith(".w13") for k in model.weights)
    gen = torch.Generator().manual_seed(2)
    _run_steps(model, hf, c.vocab_size, [[7, 13], [1, 1]], gen)


def test_fuse_swiglu_is_for_running_only(tiny_llama_dir, tmp_path):
    """A fused model runs (for_cpu() gives back the [gate | up] weights exactly); it cannot be saved or exported, and
    nothing is written when that is refused. Plain (unquantized) gate/up weights are left alone."""
    from export.onnx_export import export_onnx
    from export.quantize import save_weights

    model = LlamaModel.from_checkpoint(tiny_llama_dir, quant="int4", group_size=32)
    want = model.for_cpu().weights
    assert not model.swiglu_fused
    model.fuse_swiglu_().fuse_swiglu_()  # a second call finds nothing left to fuse
    assert model.swiglu_fused and "layers.1.w13_pairs" in model.weights and "layers.1.w13" not in model.weights
    got = model.for_cpu().weights
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(ValueError, match="fuse_swiglu_"):
        save_weights(model.weights, tmp_path / "w.safetensors")
    with pytest.raises(ValueError, match="fuse_swiglu_"):
        export_onnx(model, path=tmp_path / "model.onnx")
    assert list(tmp_path.iterdir()) == []
    plain = LlamaModel.from_checkpoint(tiny_llama_dir)
    assert not plain.fuse_swiglu_().swiglu_fused and "layers.0.w13" in plain.weights


def test_allocate_kv_cache_shape(tiny_llama_dir):
    model = LlamaModel.from_checkpoint(tiny_llama_dir)
    kv = model.allocate_kv_cache(5, 3, "cpu", torch.float16)
    c = model.config
    assert len(kv) == c.num_layers
    assert all(t.shape == (5, 3, c.num_kv_heads, c.head_dim) and t.dtype == torch.float16 for pair in kv for t in pair)


def test_bad_inputs(tiny_llama_dir):
    from export.checkpoint import load_checkpoint

    ckpt = load_checkpoint(tiny_llama_dir)
    with pytest.raises(ValueError, match="quant must be one of"):
        LlamaModel(ckpt.config, ckpt.state_dict, quant="fp8")
    weights = dict(ckpt.state_dict)
    del weights["layers.1.w13"]
    with pytest.raises(ValueError, match="lack 1 tensor"):
        LlamaModel(ckpt.config, weights)
    model = LlamaModel(ckpt.config, ckpt.state_dict)
    with pytest.raises(ValueError, match="kv_cache has 1 layers"):
        model(make_batch([3]), model.allocate_kv_cache(2, 4)[:1])
    with pytest.raises(ValueError, match="blocks_per_seq=1 cannot hold"):
        make_batch([9], block_size=4, blocks_per_seq=1)


# --- GPU: the Triton kernels in half precision ---------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("variant, quant, group_size, fused", [("qwen2", "none", 128, False),
                                                                ("llama", "int8", 128, False),
                                                                ("llama", "int4", 32, False),
                                                                ("qwen3", "none", 128, False),
                                                                ("qwen3", "int4", 32, False),
                                                                ("llama", "int8", 128, True),
                                                                ("llama", "int4", 32, True)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_half_model_vs_hf(tiny_dirs, variant, quant, group_size, fused, dtype):
    """Our kernels in fp16/bf16 on CUDA vs HF in fp32 on the same (dequantized) weights, over prefill, decode and
    chunked prefill (``fused``: after ``fuse_swiglu_``, SwiGLU in the gate/up GEMMs). Bound: 3x HF's own error when it
    runs in the same half dtype, + 1e-2 abs (logits are O(1)): fused kernels round at different points than eager
    PyTorch, which is of the same size as HF's own rounding error; a wiring error (head, position, block) moves logits
    by O(1)."""
    import kernels.quant as kq
    from tests.helpers import assert_close_to_ref

    path = tiny_dirs(variant)
    model = LlamaModel.from_checkpoint(path, quant=quant, group_size=group_size, dtype=dtype, device="cuda")
    c = model.config
    hf32 = _hf(path).cuda()
    if quant != "none":  # HF runs the weights our model runs: quantization error is not counted
        with torch.no_grad():
            for i, layer in enumerate(hf32.model.layers):
                q, k, v = kq.dequantize(model.weights[f"layers.{i}.wqkv"]).float().split(
                    [c.q_size, c.kv_size, c.kv_size])
                gate, up = kq.dequantize(model.weights[f"layers.{i}.w13"]).float().split([c.intermediate_size] * 2)
                layer.self_attn.q_proj.weight.copy_(q), layer.self_attn.k_proj.weight.copy_(k)
                layer.self_attn.v_proj.weight.copy_(v), layer.mlp.gate_proj.weight.copy_(gate)
                layer.mlp.up_proj.weight.copy_(up)
                layer.self_attn.o_proj.weight.copy_(kq.dequantize(model.weights[f"layers.{i}.wo"]).float())
                layer.mlp.down_proj.weight.copy_(kq.dequantize(model.weights[f"layers.{i}.w2"]).float())
    if fused:
        model.fuse_swiglu_()
    hf_half = type(hf32)(hf32.config).to(device="cuda", dtype=dtype).eval()
    hf_half.load_state_dict(hf32.state_dict())
    gen = torch.Generator().manual_seed(3)
    steps, block_size, blocks_per_seq = [[37, 123], [1, 1], [17, 1]], 16, 12
    full = [torch.randint(0, c.vocab_size, (sum(s[i] for s in steps),), generator=gen) for i in range(2)]
    kv = model.allocate_kv_cache(2 * blocks_per_seq, block_size, "cuda", dtype)
    done = [0, 0]
    for step, new in enumerate(steps):
        ids = torch.cat([full[i][done[i]:done[i] + new[i]] for i in range(2)])
        batch = make_batch(new, cached_lens=done, block_size=block_size, input_ids=ids, blocks_per_seq=blocks_per_seq,
                           device="cuda")
        got = model(batch, kv).float()
        with torch.no_grad():
            for i in range(2):
                seq = full[i][: done[i] + new[i]][None].cuda()
                want = hf32(seq).logits[0, -1]
                base = hf_half(seq).logits[0, -1].float()
                assert_close_to_ref(got[i], want, baseline=base, factor=3.0, atol=1e-2)
        done = [d + n for d, n in zip(done, new)]


@pytest.mark.gpu
@pytest.mark.parametrize("quant, group_size", [("none", 128), ("int8", 128), ("int4", 32)])
def test_gpu_decode_graph_pdl_equals_plain_launches(tiny_dirs, monkeypatch, quant, group_size):
    """A decode step captured in a CUDA graph with programmatic dependent launches (kernels._launch) gives bit for
    bit the logits of the same step with plain stream-ordered launches. A kernel that read or wrote before its
    griddepcontrol wait would race with the kernel before it; the kernels are deterministic, so equality is exact."""
    from kernels._launch import PDL_ENV, pdl_enabled

    model = LlamaModel.from_checkpoint(tiny_dirs("llama"), quant=quant, group_size=group_size, dtype=torch.float16,
                                       device="cuda")
    c = model.config
    gen = torch.Generator().manual_seed(5)
    prompt = make_batch([37, 20], block_size=16, input_ids=torch.randint(0, c.vocab_size, (57,), generator=gen),
                        blocks_per_seq=6, device="cuda")
    step = make_batch([1, 1], cached_lens=[37, 20], block_size=16, blocks_per_seq=6, device="cuda",
                      input_ids=torch.randint(0, c.vocab_size, (2,), generator=gen))
    kv0 = model.allocate_kv_cache(12, 16, "cuda", torch.float16)
    model(prompt, kv0)
    logits = {}
    for pdl in ("1", "0"):
        monkeypatch.setenv(PDL_ENV, pdl)
        kv = [(k.clone(), v.clone()) for k, v in kv0]
        model(step, [(k.clone(), v.clone()) for k, v in kv])  # warm: compiles outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(step, kv)
        graph.replay()
        torch.cuda.synchronize()
        logits[pdl] = out.clone()
        if pdl == "1":
            assert pdl_enabled() == (torch.cuda.get_device_capability()[0] >= 9)
    assert torch.equal(logits["1"], logits["0"]), describe_error(logits["1"], logits["0"])
