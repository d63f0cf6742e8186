"""Weight-only quantization of a model's linear layers, GPTQ/AWQ repacking, and (de)serialising the result.

``quantize_state_dict`` applies ``kernels.quant.quantize_int8`` (per output channel, symmetric) or ``quantize_int4``
(group-wise, asymmetric) to the linear weights of an internal-name state dict: ``wqkv``, ``wo``, ``w13``, ``w2`` of
every layer. The int4 group size is chosen per weight (``choose_group_size``): the largest of 128, 64, 32 that is at
most the requested one and divides the weight's in_features, so that models whose hidden or intermediate size is not
a multiple of 128 (SmolLM2's 576, 1536) build with the defaults; ``group_size_map`` says what was chosen.
Embeddings and norms stay in floating point (the embedding is a gather); so does ``lm_head`` unless asked
(``quantize_lm_head``: round-to-nearest int8 per channel or int4 group-wise, as AutoRound's ``--quant_lm_head`` and
vLLM's GPTQ ``lm_head`` option offer: the fp16 head is 1 GB of a Llama-3-8B decode step's reads, 11% of the int4 step
on the H200; a head tied to the embedding is quantized as a copy and the embedding kept).
GPTQ/AWQ checkpoints are not re-quantized: ``import_quantized`` repacks their tensors with ``kernels.quant``'s
importers. ``save_weights`` / ``load_weights`` write the result as one safetensors file so the runtime can load a
build output without the original checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from . import QUANT_MODES

LINEAR_SUFFIXES = (".wqkv", ".wo", ".w13", ".w2")


def is_quantizable(name: str) -> bool:
    return name.startswith("layers.") and name.endswith(LINEAR_SUFFIXES)


def choose_group_size(in_features: int, max_group_size: int = 128, name: str = "weight",
                      option: str = "--quant") -> int:
    """The int4 group size of a weight with ``in_features`` inputs: the largest of ``INT4_GROUP_SIZES`` (32, 64, 128)
    that is at most ``max_group_size`` and divides ``in_features``.

    Smaller groups cost a little more memory (one fp16 scale and one zero point per group: 0.38 bits per weight at 64
    instead of 0.19 at 128) and quantize more finely. A K that no supported size divides (not a multiple of 32) is an
    error rather than a padded layout: padding K would need the kernels and the plugin to read a weight wider than x;
    the error suggests the other modes of ``option``, the build option that asked for int4.
    """
    from kernels.quant import INT4_GROUP_SIZES

    if max_group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"group_size={max_group_size} is not supported: use one of {INT4_GROUP_SIZES}")
    for g in sorted(INT4_GROUP_SIZES, reverse=True):
        if g <= max_group_size and in_features % g == 0:
            return g
    raise ValueError(f"{name}: in_features={in_features} is not a multiple of {min(INT4_GROUP_SIZES)}, the smallest "
                     f"int4 group size, so this model cannot be quantized to int4; use {option} int8 (per channel: "
                     f"in_features a multiple of 16) or {option} none")


def quantize_state_dict(state: dict, quant: str, group_size: int = 128) -> dict:
    """A copy of ``state`` with every linear weight quantized to ``quant`` ("int8" or "int4"). For int4,
    ``group_size`` is the largest group size a weight may get (``choose_group_size`` picks each weight's)."""
    from kernels import quant as kq

    if quant not in ("int8", "int4"):
        raise ValueError(f"quant must be 'int8' or 'int4', got {quant!r}")
    out = dict(state)
    for name, w in state.items():
        if not is_quantizable(name) or not isinstance(w, torch.Tensor):
            continue
        # Scales in the weight's dtype: the activations run in that dtype and the GEMM wants them to match.
        g = choose_group_size(w.shape[-1], group_size, name) if quant == "int4" else None
        try:
            if quant == "int8":
                out[name] = kq.quantize_int8(w, scale_dtype=w.dtype)
            else:
                out[name] = kq.quantize_int4(w, group_size=g, symmetric=False, scale_dtype=w.dtype)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from e
    return out


def quantize_lm_head(state: dict, quant: str, group_size: int = 128) -> dict:
    """A copy of ``state`` whose ``lm_head`` (or, tied, a copy of ``embed``) is quantized to ``quant`` ("int8" per
    output channel, "int4" group-wise with the largest group of at most ``group_size`` dividing the hidden size,
    asymmetric, round to nearest: the head sees no calibration); "none" returns ``state`` unchanged."""
    from kernels import quant as kq

    if quant not in QUANT_MODES:
        raise ValueError(f"lm_head quant must be one of {QUANT_MODES}, got {quant!r}")
    if quant == "none":
        return state
    w = state.get("lm_head", state.get("embed"))
    if not isinstance(w, torch.Tensor):
        raise ValueError(f"lm_head is already quantized ({type(w).__name__}); quantize it once")
    out = dict(state)
    if quant == "int8":
        out["lm_head"] = kq.quantize_int8(w, scale_dtype=w.dtype)
    else:
        g = choose_group_size(w.shape[-1], group_size, "lm_head", "--lm-head-quant")
        out["lm_head"] = kq.quantize_int4(w, group_size=g, symmetric=False, scale_dtype=w.dtype)
    return out


def group_size_map(weights: dict) -> dict:
    """The int4 group size of each linear projection, compactly: ``{"layers.*.wqkv": 64, ...}`` when every layer has
    the same one for that projection, else one entry per layer (``"layers.3.w2": 32``); other int4 weights (an
    lm_head) under their own name. Empty when no weight is int4. For build.json and the build summary."""
    per_proj: dict = {}
    for name, w in weights.items():
        if getattr(w, "bits", None) != 4:
            continue
        layer, _, proj = name.partition(".")[2].partition(".") if name.startswith("layers.") else ("", "", name)
        per_proj.setdefault(proj, {})[layer] = int(w.group_size)
    out = {}
    for proj, by_layer in per_proj.items():
        if "" in by_layer:  # not a per-layer weight
            out[proj] = by_layer[""]
        elif len(set(by_layer.values())) == 1:
            out[f"layers.*.{proj}"] = next(iter(by_layer.values()))
        else:
            out.update({f"layers.{i}.{proj}": g for i, g in sorted(by_layer.items(), key=lambda kv: int(kv[0]))})
    return out


def dequantize_state_dict(state: dict) -> dict:
    """Float weights from a (partly) quantized state dict: what the quantized model computes, for references."""
    from kernels import quant as kq

    return {k: (v if isinstance(v, torch.Tensor) else kq.dequantize(v)) for k, v in state.items()}


# --- GPTQ / AWQ ---------------------------------------------------------------------------------------------------
def import_quantized(ckpt, device="cpu"):
    """Repack a GPTQ/AWQ checkpoint's ``quantized_parts`` into ``QuantizedWeight``s (``kernels.quant_import``).

    Returns ``(weights, "int4", group_size)``: the internal linear weights (and q|k|v biases) and the checkpoint's group
    size. Projections that we fuse (q|k|v, gate|up) are imported one by one and concatenated along the output features,
    which moves no value (``concat_output``).
    """
    from kernels import quant_import as qi

    qcfg = ckpt.quantization_config or {}
    method = qcfg.get("quant_method")
    bits = int(qcfg.get("bits", qcfg.get("w_bit", 4)))
    group_size = int(qcfg.get("group_size", qcfg.get("q_group_size", 128)))
    if bits != 4:
        raise ValueError(f"{method} checkpoint with bits={bits}: only 4-bit GPTQ/AWQ is supported; for 8 bit, use the "
                         f"original fp16/bf16 checkpoint with --quant int8")
    if group_size <= 0:
        raise ValueError(f"{method} checkpoint with group_size {group_size} (one group per row) is not supported; "
                         f"use a group-wise quantized checkpoint (e.g. group_size 128)")
    if method == "gptq":
        # v1 checkpoints (AutoGPTQ, most of the Hub) store zero - 1; "gptq_v2" (GPTQModel) stores the zero itself.
        offset = 0 if qcfg.get("checkpoint_format", "gptq") == "gptq_v2" else 1
        importer = lambda p: qi.import_gptq(p["qweight"], p["qzeros"], p["scales"], p.get("g_idx"),  # noqa: E731
                                            group_size=group_size, zero_offset=offset)
    elif method == "awq":
        version = str(qcfg.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version '{version}' is not supported; use an AWQ checkpoint in GEMM format")
        importer = lambda p: qi.import_awq(p["qweight"], p["qzeros"], p["scales"], group_size=group_size)  # noqa: E731
    else:
        raise ValueError(f"quant_method {method!r} is not supported (gptq, awq)")
    # the build's float dtype (load_checkpoint cast the float tensors to it): the scales and biases take it too, as
    # the kernels want the activations' dtype (a GPTQ checkpoint's fp16 scales in a bf16 build failed at its first op)
    dtype = ckpt.state_dict["embed"].dtype
    weights = {}
    for name, parts in ckpt.quantized_parts.items():
        qws = [importer({k: v.to(device) for k, v in p.items()}) for p in parts]
        qw = qws[0] if len(qws) == 1 else concat_output(qws, name)
        weights[name] = dataclasses.replace(qw, scales=qw.scales.to(dtype))
        if name.endswith(".wqkv") and all("bias" in p for p in parts):
            weights[name[: -len("wqkv")] + "bqkv"] = torch.cat([p["bias"].to(device, dtype) for p in parts])
        if name.endswith(".wo") and "bias" in parts[0]:
            weights[name[: -len("wo")] + "bo"] = parts[0]["bias"].to(device, dtype)
    return weights, "int4", group_size


def concat_output(qws: list, name: str = "weight"):
    """One ``QuantizedWeight`` whose output features are those of ``qws`` in order (the q|k|v or gate|up fusion).

    The packed layout is K-major (``qweight [K // 8, N]``, ``scales`` / ``zeros`` ``[K // G, N]``), so fusing along N
    is a concatenation of columns. All parts must share in_features, group size and input permutation (GPTQ act
    order): they read the same activations.
    """
    first = qws[0]
    for q in qws[1:]:
        if (q.bits, q.in_features, q.group_size, q.dtype) != (first.bits, first.in_features, first.group_size,
                                                              first.dtype):
            raise ValueError(f"{name}: cannot fuse projections with different bits/in_features/group size/dtype")
        if (q.perm is None) != (first.perm is None) or (q.perm is not None and not torch.equal(q.perm, first.perm)):
            raise ValueError(f"{name}: the fused projections (q|k|v or gate|up) have different GPTQ act-order "
                             f"permutations (g_idx), which one fused GEMM cannot serve; re-quantize with "
                             f"desc_act=False or static_groups=True")
    cat = lambda f: None if getattr(first, f) is None else torch.cat([getattr(q, f) for q in qws], dim=1)  # noqa: E731
    return dataclasses.replace(first, qweight=cat("qweight"), scales=cat("scales"), zeros=cat("zeros"),
                               out_features=sum(q.out_features for q in qws))


# --- (de)serialisation --------------------------------------------------------------------------------------------
_TIED = "tied_lm_head"


def save_weights(state: dict, path) -> None:
    """Write a (quantized) internal state dict to one safetensors file; a ``QuantizedWeight`` is stored as its tensor
    fields (``name::field``) plus its other fields as JSON in the file's metadata. A tied ``lm_head`` is stored once."""
    from safetensors.torch import save_file

    from .decoder import check_unfused

    check_unfused(state, f"save_weights({path})")
    tensors, meta = {}, {}
    tied = "lm_head" in state and state["lm_head"] is state.get("embed")
    for name, v in state.items():
        if name == "lm_head" and tied:
            continue
        if isinstance(v, torch.Tensor):
            tensors[name] = v.detach().contiguous().cpu()
            continue
        if not dataclasses.is_dataclass(v):
            raise TypeError(f"{name}: cannot serialise {type(v).__name__} (expected a tensor or QuantizedWeight)")
        scalars = {}
        for f in dataclasses.fields(v):
            x = getattr(v, f.name)
            if isinstance(x, torch.Tensor):
                tensors[f"{name}::{f.name}"] = x.detach().contiguous().cpu()
            else:
                scalars[f.name] = x
        meta[name] = json.dumps({"type": type(v).__name__, "fields": scalars})
    meta[_TIED] = json.dumps(tied)
    save_file(tensors, str(path), metadata=meta)


def load_weights(path, device="cpu") -> dict:
    """Inverse of ``save_weights``. A truncated or corrupt file (an OUT copied in part, a disk that filled up) is a
    ``CheckpointError`` that names it, not safetensors' own exception."""
    from safetensors import SafetensorError, safe_open

    from .checkpoint import CheckpointError

    state, fields = {}, {}
    try:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            meta = f.metadata() or {}
            for key in f.keys():
                if "::" in key:
                    name, field = key.split("::", 1)
                    fields.setdefault(name, {})[field] = f.get_tensor(key)
                else:
                    state[key] = f.get_tensor(key)
    except SafetensorError as e:
        raise CheckpointError(f"cannot read {path} ({e}); the file is truncated or corrupt: rebuild its OUT with "
                              f"`python -m export.build --out {Path(path).parent} ...`") from e
    if fields:
        from kernels import quant as kq

        for name, tensors in fields.items():
            info = json.loads(meta[name])
            if tensors.get("zeros") is not None and tensors["zeros"].dtype == torch.uint8:
                tensors["zeros"] = tensors["zeros"].view(torch.int8)  # written before zeros became int8: same bytes
            state[name] = getattr(kq, info["type"])(**tensors, **info["fields"])
    if json.loads(meta.get(_TIED, "false")):
        state["lm_head"] = state["embed"]
    return state

