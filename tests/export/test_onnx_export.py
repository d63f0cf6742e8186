"""ONNX export, both flavours: ORT on the reference flavour == transformers; the plugin flavour on the CPU reference
ops == ORT (logits and the written caches), for none / int8 / int4 weights; graph contract and bad input.

Tolerances: the tiny models are fp32 end to end, so every path differs only in fp32 summation order. Observed max abs
error on logits of magnitude ~0.5 is ~2e-7 (a few ulps); we allow rel 1e-4 of the logits' max (the brief's bound,
~100x the observed error) while a real defect (wrong weight, mask, cache slot, rope table) moves logits by >= 1e-3.
"""

import numpy as np
import onnx
import pytest
import torch

from tests.helpers import assert_close_to_ref

REL = 1e-4  # see the module docstring
BLOCK = 4  # small blocks so that the 7-token sequence spans two blocks, one partly filled


def _ort(path):
    from export.verify import ort_session

    return ort_session(path)  # QDQ fusions off: see its docstring


def _run(sess, feed):
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feed)))


def _weights(ckpt, quant, group_size=32):
    from export.quantize import quantize_state_dict

    w = dict(ckpt.state_dict)
    w.setdefault("lm_head", w["embed"])
    # group 32 (by default): every weight of the tiny model (K 64 and 160) gets the same group size
    return w if quant == "none" else quantize_state_dict(w, quant, group_size=group_size)


def _hf_logits(ckpt_dir, config, weights, sequences):
    """transformers' logits of each sequence's last token, with the (dequantized) weights the export used."""
    import transformers

    from export.verify import hf_state_dict

    model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt_dir)).to(torch.float32).eval()
    sd = hf_state_dict(weights, config)
    if config.tie_word_embeddings:
        sd.pop("lm_head.weight")
    model.load_state_dict(sd, strict=False)
    with torch.no_grad():
        return np.stack([model(torch.as_tensor(s)[None]).logits[0, -1].numpy() for s in sequences])


def _assert_rel(actual, expected, rel=REL):
    a, e = torch.from_numpy(np.asarray(actual, np.float32)), torch.from_numpy(np.asarray(expected, np.float32))
    assert_close_to_ref(a, e, atol=rel * float(e.abs().max()))


@pytest.fixture(scope="module")
def exported(tiny_dirs, tmp_path_factory):
    """``get(variant, quant)`` -> (ckpt, weights, {flavour: path}), exported once per module."""
    from export.checkpoint import load_checkpoint
    from export.onnx_export import export_onnx

    made = {}

    def get(variant="llama", quant="none", group_size=32):
        if (variant, quant, group_size) not in made:
            ckpt = load_checkpoint(tiny_dirs(variant))
            w = _weights(ckpt, quant, group_size)
            out = tmp_path_factory.mktemp(f"onnx_{variant}_{quant}")
            gs = group_size if quant == "int4" else None
            paths = {f: export_onnx(w, ckpt.config, out / f"model.{f}.onnx", f, block_size=BLOCK, quant=quant,
                                    group_size=gs) for f in ("plugin", "reference")}
            made[variant, quant, group_size] = (ckpt, w, paths)
        return made[variant, quant, group_size]

    return get


@pytest.mark.parametrize("variant,quant,group_size", [
    ("llama", "none", None), ("tied", "none", None), ("llama3", "none", None), ("qwen2", "none", None),
    ("llama", "int8", None), ("llama", "int4", 32), ("qwen2", "int4", 32),
    ("qwen3", "none", None), ("qwen3", "int4", 32),  # q/k norms per head (RmsNorm on [T * H, D]); head_dim 32
    ("odd_dims", "int4", 128),  # group sizes chosen per weight: 64 (K = 320) and 32 (K = 608)
])
def test_flavours_match_hf_and_each_other(exported, tiny_dirs, variant, quant, group_size):
    """Prefill of 2 sequences (7 and 1 new tokens) on fresh caches, then a decode step on the written caches."""
    from export.onnx_reference_runner import make_evaluator
    from export.verify import make_feeds

    ckpt, w, paths = exported(variant, quant, group_size or 32)
    sess = _ort(paths["reference"])
    feeds, sequences = make_feeds(ckpt.config, BLOCK, lens=(7, 1), seed=1, prefill_runner=lambda f: _run(sess, f))
    plugin = make_evaluator(paths["plugin"])
    for feed, seqs in zip(feeds, sequences):
        ref = _run(sess, feed)
        _assert_rel(ref["logits"], _hf_logits(tiny_dirs(variant), ckpt.config, w, seqs))
        got = dict(zip(plugin.output_names, plugin.run(None, feed)))
        assert set(got) == set(ref)
        for name in ref:
            _assert_rel(got[name], ref[name])


def test_graph_contract(exported):
    """Dynamic dims and I/O names as documented, plugin nodes as the specs say, external data beside the model."""
    from export.onnx_ops import plugin_contract
    from trt_plugins.specs import SPECS

    ckpt, _, paths = exported("llama", "int4")
    c = ckpt.config
    for flavour, path in paths.items():
        model = onnx.load(path, load_external_data=False)
        onnx.checker.check_model(path)  # path form: checks a model with external data without loading it
        dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
        assert dims["input_ids"] == ["num_tokens"] and dims["block_table"] == ["num_seqs", "max_blocks"]
        assert dims["k_cache_1"] == ["num_blocks", BLOCK, c.num_kv_heads, c.head_dim]
        outs = [o.name for o in model.graph.output]
        assert outs[0] == "logits" and f"v_cache_out_{c.num_layers - 1}" in outs
        big = [t for t in model.graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL]
        assert not big, f"initializers stored inline: {[t.name for t in big][:3]}"
        plugin_nodes = [n for n in model.graph.node if n.domain == "tritrt"]
        if flavour == "reference":
            assert not plugin_nodes and all(n.domain == "" for n in model.graph.node)
            continue
        kinds = {n.op_type for n in plugin_nodes}
        # quantized gate/up: SwiGLU in the GEMM plugin's epilogue (no SwiGLU node), on the layer's (gate, up) pairs
        assert kinds == {"RmsNorm", "FusedAddRmsNorm", "QkvRopeWriteKvCache", "PagedAttention", "W4A16Linear"}
        # RoPE and the cache write read q, k and v in place from the qkv output: no Split to copy them apart
        assert not [n for n in model.graph.node if n.op_type == "Split"]
        fused = {n.name: {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}["swiglu"]
                 for n in plugin_nodes if n.op_type == "W4A16Linear"}
        want = {f"{i}.w13_pairs" for i in range(c.num_layers)}
        assert {k.split("layers.")[-1] for k, v in fused.items() if v} == want
        for n in plugin_nodes:
            in_names, attr_names, n_out = plugin_contract(n.op_type)
            assert len(n.input) == len(in_names) and len(n.output) == n_out, n.op_type
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
            # what TensorRT's ONNX parser needs to pick our AOT plugin: tritrt::<op_type>, version 1, aot
            assert attrs.pop("plugin_namespace") == b"tritrt" and attrs.pop("aot") == 1, n.op_type
            assert attrs.pop("plugin_version") == SPECS[n.op_type].version.encode(), n.op_type
            # every spec attribute is on the node: TensorRT's Python plugins cannot fill in defaults
            assert set(attrs) == set(attr_names), (n.op_type, sorted(attrs), attr_names)
        # the cache write's outputs are the graph's cache outputs (aliased in place by the engine)
        writes = [n for n in plugin_nodes if n.op_type == "QkvRopeWriteKvCache"]
        assert [list(n.output)[1:] for n in writes] == [[f"k_cache_out_{i}", f"v_cache_out_{i}"]
                                                        for i in range(c.num_layers)]


def test_int4_group_size_per_weight_on_every_node(exported):
    """hidden 320 / intermediate 608 at the default (largest) group size 128: each weight takes the largest group size
    that divides its K, and both flavours carry each weight's own (the W4A16 node's attribute, the blocked
    DequantizeLinear's block_size); the metadata records the largest and the per-projection map."""
    import json

    ckpt, w, paths = exported("odd_dims", "int4", 128)
    want = {"wqkv": 64, "wo": 64, "w13": 64, "w2": 32}
    assert {n: w[f"layers.{i}.{n}"].group_size for i in range(2) for n in want} == want
    for flavour, path in paths.items():
        model = onnx.load(path, load_external_data=False)
        op = "W4A16Linear" if flavour == "plugin" else "DequantizeLinear"
        attr = "group_size" if flavour == "plugin" else "block_size"
        nodes = [n for n in model.graph.node if n.op_type == op]
        assert len(nodes) == 4 * ckpt.config.num_layers
        for n in nodes:
            proj = n.name.split(".")[-1].removesuffix("_dq").removesuffix("_mm").removesuffix("_pairs")
            got = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}[attr]
            assert got == want[proj], (n.name, got)
        meta = {p.key: p.value for p in model.metadata_props}
        assert meta["tritrt.group_size"] == "128"
        assert json.loads(meta["tritrt.group_sizes"]) == {f"layers.*.{n}": g for n, g in want.items()}


def test_skipped_slots_leave_cache_untouched(exported):
    """A padding token (slot -1, as a padded decode batch has) writes nothing, in both flavours."""
    from export.onnx_reference_runner import make_evaluator
    from export.verify import make_feeds

    ckpt, _, paths = exported("llama", "none")
    sess = _ort(paths["reference"])
    feeds, _ = make_feeds(ckpt.config, BLOCK, lens=(3, 2), seed=2, prefill_runner=lambda f: _run(sess, f))
    feed = dict(feeds[1])  # the decode step: one token per sequence
    feed["slot_mapping"] = np.array([feed["slot_mapping"][0], -1], np.int32)
    rng = np.random.default_rng(3)
    for k in [k for k in feed if "_cache_" in k]:  # random caches, so an unwanted write cannot go unseen
        feed[k] = rng.standard_normal(feed[k].shape).astype(np.float32)
    ref = _run(sess, feed)
    plugin = make_evaluator(paths["plugin"])
    got = dict(zip(plugin.output_names,
                   plugin.run(None, feed)))
    for layer in range(ckpt.config.num_layers):
        for kv in "kv":
            slot = int(feed["slot_mapping"][0])
            before = feed[f"{kv}_cache_{layer}"]
            for after in (ref[f"{kv}_cache_out_{layer}"], got[f"{kv}_cache_out_{layer}"]):
                changed = np.argwhere((before != after).any(axis=(2, 3)))
                assert [tuple(x) for x in changed] == [(slot // BLOCK, slot % BLOCK)]
            _assert_rel(got[f"{kv}_cache_out_{layer}"], ref[f"{kv}_cache_out_{layer}"])


def test_atomic_write_keeps_old_model_on_failure(exported, tmp_path, monkeypatch):
    from export import onnx_graph
    from export.onnx_export import export_onnx

    ckpt, w, _ = exported("llama", "none")
    path = tmp_path / "model.reference.onnx"
    export_onnx(w, ckpt.config, path, "reference", block_size=BLOCK)
    before = path.read_bytes(), (tmp_path / "model.reference.onnx.data").read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(onnx_graph.onnx, "save_model", boom)
    with pytest.raises(OSError, match="disk full"):
        export_onnx(w, ckpt.config, path, "reference", block_size=BLOCK)
    assert (path.read_bytes(), (tmp_path / "model.reference.onnx.data").read_bytes()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.reference.onnx", "model.reference.onnx.data"]


def test_bad_input_errors(exported, tmp_path):
    from export.onnx_export import export_onnx

    ckpt, w, _ = exported("llama", "none")
    c = ckpt.config
    with pytest.raises(ValueError, match="flavour must be one of"):
        export_onnx(w, c, tmp_path / "m.onnx", "tensorrt")
    with pytest.raises(KeyError, match="layers.1.w2"):
        export_onnx({k: v for k, v in w.items() if k != "layers.1.w2"}, c, tmp_path / "m.onnx", "reference")
    with pytest.raises(ValueError, match="quantize them first"):
        export_onnx(w, c, tmp_path / "m.onnx", "plugin", quant="int4")
    with pytest.raises(ValueError, match="quant must be"):
        export_onnx(w, c, tmp_path / "m.onnx", "plugin", quant="fp8")
    _, w4, _ = exported("llama", "int4")  # every weight at group 32
    with pytest.raises(ValueError, match="largest int4 group size.*layers.0.w13: 32"):
        export_onnx(w4, c, tmp_path / "m.onnx", "plugin", quant="int4", group_size=16)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        export_onnx(w, c, tmp_path / "missing" / "m.onnx", "reference")
    with pytest.raises(ValueError, match="needs its LlamaConfig"):
        export_onnx(w, None, tmp_path / "m.onnx", "reference")
    with pytest.raises(ValueError, match="block_size"):
        export_onnx(w, c, tmp_path / "m.onnx", "reference", block_size=0)
    assert list(tmp_path.iterdir()) == []  # failed exports leave no temporary files behind


def test_cpu_plugin_ops_waive_only_the_float_width():
    """fp32 graphs run the spec references on CPU, but every other spec check still rejects a malformed node."""
    from export.onnx_reference_runner import run_plugin_op

    rng = np.random.default_rng(4)
    k = rng.standard_normal((3, 2, 8)).astype(np.float32)
    cache = np.zeros((2, 4, 2, 8), np.float32)
    k_out, v_out = run_plugin_op("WriteKvCache", [k, k, cache, cache, np.array([5, -1, 0], np.int32)], {})
    np.testing.assert_array_equal(k_out[1, 1], k[0])  # slot 5 = block 1, offset 1
    np.testing.assert_array_equal(v_out[0, 0], k[2])
    assert not cache.any()  # the node's inputs are left as they were
    with pytest.raises(TypeError, match="slot_mapping"):
        run_plugin_op("WriteKvCache", [k, k, cache, cache, np.array([5, -1, 0], np.int64)], {})
    with pytest.raises(ValueError, match="weight"):
        run_plugin_op("RmsNorm", [k[:, 0], np.ones(7, np.float32)], {"eps": 1e-6})
