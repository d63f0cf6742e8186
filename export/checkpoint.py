"""Load a local Hugging Face LLaMA-family checkpoint into our config and internal weight names.

Reads ``config.json`` and the safetensors shards lazily (``safe_open``: one tensor at a time, no transformers) and maps
HF names to the gpt-fast style names the model runs on (``layers.{i}.wqkv`` = q|k|v rows, ``layers.{i}.w13`` = gate|up
rows, see ``internal_names``). Llama 2/3/3.1 (GQA, llama3 rope scaling, tied or untied embeddings), TinyLlama, Mistral
without a sliding window, Qwen2 (qkv bias) and Qwen3 (per-head q/k RMSNorm, its own head_dim) share this layout; what
the forward does with it is ``export.decoder``. Anything else is refused with a ``CheckpointError``
that says what to do. GPTQ/AWQ checkpoints keep their packed tensors per projection (``Checkpoint.quantized_parts``) for
``export.quantize`` to repack. ``make_tiny_llama`` (in ``export.tiny``) is re-exported here.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch

from .tiny import make_tiny_llama  # noqa: F401  (re-exported: the fixture writer beside the reader)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# model_type -> (transformers config class, model class): the HF model each type is checked against (tiny fixtures,
# baselines); transformers is imported only by those users
HF_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
              "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}
# chat_template.jinja: where transformers saves a tokenizer's chat template (no longer in tokenizer_config.json)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "generation_config.json", "chat_template.jinja")
# Packed tensors of one GPTQ/AWQ linear (g_idx only in GPTQ act-order checkpoints).
QUANT_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx", "bias")


class CheckpointError(ValueError):
    """The checkpoint directory cannot be used; the message says what is wrong and what to do."""


@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict]  # HF dict with "rope_type" (e.g. llama3), None for plain RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2); o_proj too where the flag says so (Llama)
    torch_dtype: str  # the checkpoint's dtype name, e.g. "bfloat16"
    model_type: str = "llama"
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3); weights layers.{i}.q_norm / k_norm

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_build(cls, build: dict, out) -> "LlamaConfig":
        """The config of an ``export.build`` OUT: the one build.json records, else OUT's config.json."""
        if "config" in build:
            return cls(**build["config"])
        return cls.from_hf(json.loads((Path(out) / "config.json").read_text()))

    @classmethod
    def from_hf(cls, hf: dict, where: str = "config.json") -> "LlamaConfig":
        """Our config from an HF ``config.json`` dict; refuses architectures the model cannot run."""
        check_supported(hf, where)
        try:
            num_heads = int(hf["num_attention_heads"])
            hidden = int(hf["hidden_size"])
            sizes = {k: int(hf[k]) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                              "num_attention_heads")}
            sizes.update({k: int(hf[k]) for k in ("num_key_value_heads", "head_dim") if hf.get(k)})  # 0: unset
            bad = [f"{k}={v}" for k, v in sizes.items() if v < 1]
            if bad:  # else a ZeroDivisionError here, or a traceback deep in the ONNX export
                raise CheckpointError(f"{where}: {', '.join(bad)}; every size must be >= 1: the config is damaged, "
                                      f"re-download or fix it")
            head_dim = int(hf.get("head_dim") or hidden // num_heads)
            theta, scaling = _rope(hf)
            model_type = hf["model_type"]
            return cls(
                vocab_size=int(hf["vocab_size"]), hidden_size=hidden, intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]), num_heads=num_heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or num_heads), head_dim=head_dim,
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
                max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                # Qwen2's q/k/v always have a bias and its config has no flag for it.
                attention_bias=bool(hf.get("attention_bias", False)) or model_type == "qwen2",
                torch_dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "float32"), model_type=model_type,
                qk_norm=model_type == "qwen3")
        except CheckpointError:  # already says what is wrong (a ValueError too: not "a field of the wrong type")
            raise
        except KeyError as e:
            raise CheckpointError(f"{where} lacks the field {e}; is this a complete Hugging Face LLaMA config?") from e
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{where} has a field of the wrong type ({e})") from e


def _rope(hf: dict) -> tuple[float, Optional[dict]]:
    """(rope_theta, scaling dict or None): transformers >= 5 nests both in ``rope_parameters``; older configs use
    ``rope_theta`` and ``rope_scaling``. A config with both takes ``rope_scaling``'s type, as transformers does
    (``rope_scaling or rope_parameters``), and its theta from wherever it is."""
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta",
                                                                                hf.get("rope_theta", 10000.0))))
    if "type" in params and "rope_type" not in params:  # pre-4.45 spelling
        params["rope_type"] = params.pop("type")
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        return theta, None
    if rope_type not in ("llama3", "linear"):
        raise CheckpointError(f"rope scaling '{rope_type}' is not supported (supported: none, llama3, linear)")
    return theta, params


def check_supported(hf: dict, where: str = "config.json") -> None:
    """Raise ``CheckpointError`` for architectures whose forward differs from LLaMA's."""
    model_type = hf.get("model_type")
    archs = hf.get("architectures") or []
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"{where}: model_type '{model_type}' ({', '.join(archs) or 'no architectures'}) is not supported; "
            f"tritrt builds LLaMA-family decoders: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if any(k in hf for k in ("num_local_experts", "num_experts", "n_routed_experts")):
        raise CheckpointError(f"{where}: mixture-of-experts models are not supported (dense LLaMA-family only)")
    sliding = hf.get("sliding_window")
    uses_sliding = hf.get("use_sliding_window", model_type == "mistral")
    if sliding is not None and uses_sliding:
        raise CheckpointError(
            f"{where}: sliding-window attention (sliding_window={sliding}) is not supported; use a checkpoint "
            f"without it (e.g. Mistral v0.2+, whose config sets sliding_window to null)")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{where}: hidden_act '{act}' is not supported (the MLP kernel is SwiGLU)")
    if hf.get("mlp_bias"):
        raise CheckpointError(f"{where}: MLP biases (mlp_bias=true) are not supported")


@dataclass
class Checkpoint:
    path: Path
    config: LlamaConfig
    hf_config: dict  # config.json as read
    state_dict: dict[str, torch.Tensor]  # internal names; quantized linears absent (see quantized_parts)
    tokenizer_files: list[Path] = field(default_factory=list)
    quantization_config: Optional[dict] = None  # HF quantization_config (GPTQ/AWQ) or None
    # GPTQ/AWQ: internal linear name -> one dict per HF projection in concatenation order (q, k, v / gate, up), each
    # {"qweight", "qzeros", "scales", ["g_idx"], ["bias"]}; export.quantize repacks them.
    quantized_parts: dict[str, list[dict[str, torch.Tensor]]] = field(default_factory=dict)


def internal_names(config: LlamaConfig) -> dict[str, list[str]]:
    """THE HF -> internal map: internal name -> the HF tensors concatenated (along rows) to make it."""
    m = {"embed": ["model.embed_tokens.weight"], "norm": ["model.norm.weight"], "lm_head": ["lm_head.weight"]}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        m[f"layers.{i}.attn_norm"] = [p + "input_layernorm.weight"]
        m[f"layers.{i}.wqkv"] = [p + f"self_attn.{x}_proj.weight" for x in "qkv"]
        if config.attention_bias:
            m[f"layers.{i}.bqkv"] = [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        if config.attention_bias and config.model_type != "qwen2":  # Llama / Qwen3's flag biases o_proj too
            m[f"layers.{i}.bo"] = [p + "self_attn.o_proj.bias"]
        if config.qk_norm:
            m[f"layers.{i}.q_norm"] = [p + "self_attn.q_norm.weight"]
            m[f"layers.{i}.k_norm"] = [p + "self_attn.k_norm.weight"]
        m[f"layers.{i}.wo"] = [p + "self_attn.o_proj.weight"]
        m[f"layers.{i}.mlp_norm"] = [p + "post_attention_layernorm.weight"]
        m[f"layers.{i}.w13"] = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
        m[f"layers.{i}.w2"] = [p + "mlp.down_proj.weight"]
    return m


def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every HF tensor the map reads (unquantized layout: [out_features, in_features])."""
    c = config
    h, i_, v = c.hidden_size, c.intermediate_size, c.vocab_size
    per_proj = {"q_proj": (c.q_size, h), "k_proj": (c.kv_size, h), "v_proj": (c.kv_size, h),
                "o_proj": (h, c.q_size), "gate_proj": (i_, h), "up_proj": (i_, h), "down_proj": (h, i_)}
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for names in internal_names(c).values():
        for n in names:
            if n in shapes:
                continue
            leaf = n.split(".")[-2]
            if n.endswith("layernorm.weight"):
                shapes[n] = (h,)
            elif n.endswith(("q_norm.weight", "k_norm.weight")):
                shapes[n] = (c.head_dim,)
            elif n.endswith(".bias"):
                shapes[n] = (per_proj[leaf][0],)
            else:
                shapes[n] = per_proj[leaf]
    return shapes


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError for a binary file
        raise CheckpointError(f"{path} is not valid JSON ({e}); re-download or fix the file") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds a JSON {type(data).__name__}, not an object; re-download or fix the file")
    return data


def _weight_files(path: Path) -> dict[str, Path]:
    """tensor name -> shard file, from ``model.safetensors.index.json`` or by listing the shards."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no 'weight_map'; re-download the checkpoint")
        missing = sorted({f for f in weight_map.values() if not (path / f).exists()})
        if missing:
            raise CheckpointError(f"{index} names shard(s) that are missing: {', '.join(missing)}; download them")
        return {name: path / f for name, f in weight_map.items()}
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        extra = " (found PyTorch .bin weights: convert them to safetensors first)" if list(path.glob("*.bin")) else ""
        raise CheckpointError(f"no *.safetensors weights in {path}{extra}")
    names = {}
    for shard in shards:
        with _open_shard(shard) as f:
            names.update({k: shard for k in f.keys()})
    return names


def _open_shard(shard: Path):
    """``safe_open`` of one shard; a truncated or corrupt file (safetensors checks the header and that the data covers
    every tensor) is a ``CheckpointError``."""
    from safetensors import safe_open

    try:
        with open(shard, "rb"):  # an unreadable file is not a corrupt one: say which
            pass
    except OSError as e:
        raise CheckpointError(f"cannot read {shard} ({e.strerror}); make it readable by this user") from e
    try:
        return safe_open(str(shard), framework="pt")
    except Exception as e:  # safetensors raises its own error types (SafetensorError, OSError) for corrupt files
        raise CheckpointError(f"cannot read {shard} ({e}); the file is truncated or corrupt: re-download it") from e


_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def _check_layer_count(names, config: LlamaConfig, path: Path) -> None:
    """Weights of layers past ``num_hidden_layers`` mean that config.json does not describe these weights (a wrong or
    edited config): the model would be built from its first layers only, silently. Refused."""
    extra = sorted({int(m.group(1)) for m in map(_LAYER_INDEX.match, names) if m} - set(range(config.num_layers)))
    if extra:
        raise CheckpointError(f"the weights in {path} have layer(s) {', '.join(map(str, extra[:5]))}"
                              f"{' ...' if len(extra) > 5 else ''} but config.json says num_hidden_layers="
                              f"{config.num_layers}; the config does not match the weights: fix or re-download it")


def check_weight_files(path, config: Optional[LlamaConfig] = None) -> None:
    """Open the header of every weight shard of the checkpoint ``path``, and each tokenizer file it has: a missing,
    unreadable, truncated or corrupt shard, or an unreadable tokenizer file, is a ``CheckpointError`` before any
    tensor is read (headers only, cheap even for a large model). With ``config``: weights of more layers than it
    has are one too."""
    files = _weight_files(Path(path))
    for shard in sorted(set(files.values())):
        with _open_shard(shard):
            pass
    if config is not None:
        _check_layer_count(files, config, Path(path))
    for name in TOKENIZER_FILES:
        f = Path(path) / name
        try:
            if f.is_file():
                with open(f, "rb"):
                    pass
        except OSError as e:
            raise CheckpointError(f"cannot read {f} ({e.strerror}); make it readable by this user") from e


class _LazyTensors:
    """Opens each shard once and reads tensors on demand (``safe_open`` maps the file; nothing else is read)."""

    def __init__(self, files: dict[str, Path]):
        self.files, self._open = files, {}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str) -> torch.Tensor:
        shard = self.files[name]
        if shard not in self._open:
            self._open[shard] = _open_shard(shard)
        try:
            return self._open[shard].get_tensor(name)
        except Exception as e:  # e.g. a shard truncated after it was opened
            raise CheckpointError(f"cannot read tensor '{name}' from {shard} ({e}); re-download it") from e


def read_hf_config(path) -> dict:
    """``config.json`` of the checkpoint directory ``path``, with a message that says what to pass instead when
    ``path`` is a file, missing or not a model directory."""
    path = Path(path)
    if path.is_file():
        raise CheckpointError(f"checkpoint {path} is a file; pass the directory that holds it: --checkpoint "
                              f"{path.parent}")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist; pass a local Hugging Face model directory "
                              "(config.json + *.safetensors) or .gguf file, or omit --checkpoint to build the default "
                              "model")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} has no config.json; is it a Hugging Face model directory?")
    try:
        return _read_json(path / "config.json")
    except OSError as e:
        raise CheckpointError(f"cannot read {path / 'config.json'} ({e.strerror})") from e


def load_checkpoint(path, dtype: Optional[torch.dtype] = None) -> Checkpoint:
    """Load ``path`` (an HF model directory) into a ``Checkpoint`` with internal names, casting floats to ``dtype``."""
    path = Path(path)
    hf = read_hf_config(path)
    config = LlamaConfig.from_hf(hf, str(path / "config.json"))
    qcfg = hf.get("quantization_config")
    quant_method = (qcfg or {}).get("quant_method")
    if qcfg is not None and quant_method not in ("gptq", "awq"):
        raise CheckpointError(f"quantization_config.quant_method '{quant_method}' is not supported (gptq, awq)")
    tensors = _LazyTensors(_weight_files(path))
    _check_layer_count(tensors.files, config, path)
    shapes = expected_shapes(config)

    def read(hf_name: str) -> torch.Tensor:
        if hf_name not in tensors:
            raise CheckpointError(f"tensor '{hf_name}' is missing from the weights in {path}; the checkpoint is "
                                  f"incomplete or does not match config.json")
        t = tensors.get(hf_name)
        if tuple(t.shape) != shapes[hf_name]:
            raise CheckpointError(f"tensor '{hf_name}' has shape {tuple(t.shape)} but config.json implies "
                                  f"{shapes[hf_name]}; the weights do not match the config")
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t

    state, parts = {}, {}
    for name, hf_names in internal_names(config).items():
        if name == "lm_head" and "lm_head.weight" not in tensors and config.tie_word_embeddings:
            state[name] = state["embed"]  # tied: the very same tensor, stored once
            continue
        module_names = [n.rsplit(".", 1)[0] for n in hf_names]
        if qcfg is not None and name.startswith("layers.") and all(m + ".qweight" in tensors for m in module_names):
            parts[name] = [{s: tensors.get(f"{m}.{s}") for s in QUANT_SUFFIXES if f"{m}.{s}" in tensors}
                           for m in module_names]
            continue
        if qcfg is not None and name.startswith("layers.") and name.endswith((".bqkv", ".bo")) and \
                all(n.rsplit(".", 1)[0] + ".qweight" in tensors for n in hf_names):
            continue  # the biases ride along with the quantized parts
        ts = [read(n) for n in hf_names]
        state[name] = ts[0] if len(ts) == 1 else torch.cat(ts, dim=0)
    tok = [path / f for f in TOKENIZER_FILES if (path / f).exists()]
    return Checkpoint(path=path, config=config, hf_config=hf, state_dict=state, tokenizer_files=tok,
                      quantization_config=qcfg, quantized_parts=parts)


def eos_token_ids(path) -> tuple[int, ...]:
    """Stop token ids from generation_config.json, else config.json (an int or a list there); () if none."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        f = Path(path) / name
        if not f.is_file():
            continue
        eos = json.loads(f.read_text()).get("eos_token_id")
        if eos is None:
            continue
        ids += [int(e) for e in (eos if isinstance(eos, list) else [eos])]
        break
    return tuple(dict.fromkeys(ids))
