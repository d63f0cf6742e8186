"""Write a small GGUF file from a tiny HF checkpoint (``tiny_dirs``), as llama.cpp's converter lays it out.

Tensors get llama.cpp's names, the q/k rows its RoPE order (``export.gguf.permute_rope_rows``), the matrices the
requested ggml type (quantized with ``gguf.quants``; norms stay F32, as llama.cpp keeps 1-D tensors), and the
tokenizer its ``tokenizer.ggml.*`` metadata (byte-level BPE: ``gpt2`` model). Test-only: it writes what the importer
must read, nothing more.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf: str) -> str:
    if hf in _TO_GGUF:
        return _TO_GGUF[hf]
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{_LAYER[rest]}"


def gguf_ready_tensor(hf: str, w: torch.Tensor, cfg: dict) -> torch.Tensor:
    """The HF tensor as llama.cpp stores it (q/k rows permuted), float32."""
    from export.gguf import permute_rope_rows

    w = w.float()
    if hf.endswith("q_proj.weight"):
        w = permute_rope_rows(w, cfg["num_attention_heads"])
    elif hf.endswith("k_proj.weight"):
        w = permute_rope_rows(w, cfg["num_key_value_heads"])
    return w


def write_gguf(hf_dir, path, matrix_type: str = "F32", arch: str = "llama", tokenizer: str | None = "gpt2",
               overrides: dict | None = None) -> Path:
    """Write ``hf_dir`` as a GGUF at ``path``; ``matrix_type`` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, or any ggml type
    name: types gguf.quants cannot make are written as zero bytes) for the 2-D tensors; ``tokenizer`` "gpt2" (the
    checkpoint's byte-level BPE), "llama" (a made-up SentencePiece vocabulary of the same size) or None."""
    import gguf
    from safetensors.torch import load_file

    hf_dir, path = Path(hf_dir), Path(path)
    cfg = json.loads((hf_dir / "config.json").read_text())
    state = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    qtype = gguf.GGMLQuantizationType[matrix_type]
    w = gguf.GGUFWriter(str(path), arch)
    heads = cfg["num_attention_heads"]
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    # transformers 5 keeps rope_theta inside rope_parameters; older configs at the top level
    w.add_rope_freq_base(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    w.add_rope_dimension_count(cfg["hidden_size"] // heads)
    for key, value in (overrides or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):  # as llama.cpp writes float keys (rope.scaling.factor): float32
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    if tokenizer == "gpt2":
        _add_tokenizer(w, hf_dir)
    elif tokenizer == "llama":
        _add_spm_tokenizer(w, cfg["vocab_size"])
    for hf, t in state.items():
        if cfg.get("tie_word_embeddings") and hf == "lm_head.weight":
            continue
        arr = gguf_ready_tensor(hf, t, cfg).numpy()
        if arr.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gguf_name(hf), arr.astype(np.float32))
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(gguf_name(hf), arr.astype(np.float16))
        else:
            try:
                data = gguf.quants.quantize(arr, qtype)
            except NotImplementedError:
                data = np.zeros(gguf.quants.quant_shape_to_byte_shape(arr.shape, qtype), dtype=np.uint8)
            w.add_tensor(gguf_name(hf), data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add_tokenizer(w, hf_dir: Path) -> None:
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tok.get("added_tokens", []) if a.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab["<s>"])
    w.add_eos_token_id(vocab["</s>"])
    w.add_unk_token_id(vocab["<unk>"])
    w.add_add_bos_token(False)


# SentencePiece pieces after the 3 specials, 256 byte tokens, "\u2581" and a-z: each splits into two earlier pieces.
SPM_PIECES = ["\u2581t", "he", "\u2581the", "in", "er", "an", "re", "on", "at", "en", "nd", "ti", "es", "or", "te",
              "of", "ed", "is", "it", "al", "ar", "st", "to", "nt", "ng", "se", "ha", "as", "ou", "io", "le", "ve",
              "co", "me"]


def _add_spm_tokenizer(w, vocab_size: int) -> None:
    """A Llama-2-style SentencePiece vocabulary (llama.cpp's ``llama`` tokenizer model: pieces with scores, byte
    fallback tokens, no merges), padded or cut to ``vocab_size``."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["\u2581"]
    tokens += [chr(c) for c in range(ord("a"), ord("z") + 1)] + SPM_PIECES
    tokens = (tokens + [f"<extra_{i}>" for i in range(vocab_size)])[:vocab_size]
    types = [2, 3, 3] + [6] * 256 + [1] * (vocab_size - 259)  # UNKNOWN, CONTROL, BYTE, NORMAL
    scores = [0.0] * 259 + [-float(i) for i in range(vocab_size - 259)]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
