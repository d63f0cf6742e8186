"""The ``hf`` runner of ``export.verify``: transformers' own model (fp32) on OUT's weights, of the class OUT's
config.json names (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, ...; see ``load_hf_model``).

It gives, per feed, the logits of each sequence's last token and the K/V caches in the graph's paged layout and
names (``k_cache_out_i``, ``v_cache_out_i``): HF runs each sequence's full tokens with its own cache (post-RoPE keys,
``[1, kv_heads, seq, head_dim]`` per layer), and token ``p`` of sequence ``s`` goes to block ``block_table[s][p //
block_size]``, slot ``p % block_size``. Every slot no sequence holds stays 0, as in the graphs (their caches start at
0 and only sequences' slots are written; block 0 is never used).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch


class VerifyError(RuntimeError):
    """OUT cannot be verified (missing or unreadable files); the message says what to do."""


def hf_state_dict(weights: dict, config) -> dict:
    """HF tensor names from our internal weights, dequantized, as contiguous fp32 tensors (on the weights' device).

    A quantized weight is dequantized exactly, ``(q - z) * s`` in fp32, which is what our GEMM kernels multiply by
    (they never round the weight to 16 bits; see ``kernels.quant.dequantize``): the HF model is then the exact model
    the build describes, and each half runner's deviation from it is that runner's own rounding. One weight at a time,
    so that the peak is the fp32 model plus one weight.
    """
    from kernels.quant import dequantize

    from .runtime.hf_baseline import hf_state_dict as hf_views

    fp32, seen = {}, {}
    for name, w in weights.items():
        if id(w) not in seen:  # tied embeddings: lm_head is the embed tensor itself, one fp32 copy
            seen[id(w)] = w.float() if isinstance(w, torch.Tensor) else dequantize(w, torch.float32)
        fp32[name] = seen[id(w)]
    return {k: v.contiguous() for k, v in hf_views(fp32, config).items()}


def load_hf_model(out: Path, config, device: str = "cpu"):
    """transformers' model (fp32) on ``device`` from OUT's config.json and weights.safetensors: AutoModelForCausalLM
    picks the class of its ``model_type`` (qwen3: Qwen3ForCausalLM, with its per-head q/k norms).

    The model is made on the meta device and given our fp32 tensors (``assign``): no random initialisation, and on
    cuda the weights are read straight to the GPU and dequantized there, never as an fp32 copy in host memory.
    """
    import transformers

    from .quantize import load_weights

    hf_config = transformers.AutoConfig.from_pretrained(str(out))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    sd = hf_state_dict(load_weights(out / "weights.safetensors", device=device), config)
    if config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    del sd
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise VerifyError(f"weights.safetensors does not fill the HF model: missing {missing[:3]}, unexpected "
                          f"{unexpected[:3]}; rebuild OUT")
    if config.tie_word_embeddings:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    # Buffers computed at construction (RoPE's inverse frequencies, fp32 in HF) were made on meta: make them again.
    rotary = model.model.rotary_emb
    with torch.device(device):
        model.model.rotary_emb = type(rotary)(config=hf_config)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise VerifyError(f"the HF model has tensors that weights.safetensors does not give: {left[:3]}; rebuild OUT")
    return model.to(torch.float32).eval()  # a no-op on the fp32 weights; any other float buffer to fp32 as before


def make_hf_runner(out, config, sequences, feeds, device: str = "cpu", log=print, preloaded: dict | None = None):
    """The ``hf`` runner; its model is ``preloaded.pop("hf")`` when given there, else loaded on activation.

    ``sequences[i]``: each sequence's full tokens at feed ``i`` of ``feeds`` (``export.verify.make_feeds``), whose
    ``block_table`` and cache shape place the caches. (Polygraphy hands a runner only the inputs its metadata names,
    none here: the runner reads the feeds by step.)"""
    from collections import OrderedDict

    from polygraphy.backend.base import BaseRunner

    from .onnx_reference_runner import fp32_matmul, release_gpu_cache

    class HfRunner(BaseRunner):
        """The HF model on each sequence's full tokens; one entry of ``sequences`` per feed, in order. The fp32 model
        exists only while this runner is active (the other runners do not hold it in memory)."""

        def __init__(self):
            super().__init__(name="hf", prefix="hf-runner")

        def activate_impl(self):
            self._step = 0
            self.model = (preloaded or {}).pop("hf", None)
            if self.model is None:
                start = time.perf_counter()
                self.model = load_hf_model(out, config, device)
                log(f"export.verify: fp32 HF model loaded on {device} in {time.perf_counter() - start:.1f} s")

        def get_input_metadata_impl(self):
            from polygraphy.common import TensorMetadata

            return TensorMetadata()  # see make_hf_runner: reads its feed by step

        def infer_impl(self, feed_dict):
            seqs, feed = sequences[self._step], feeds[self._step]
            self._step += 1
            start = time.perf_counter()
            with torch.no_grad(), fp32_matmul():
                runs = [self.model(torch.as_tensor(s, dtype=torch.long, device=device)[None], use_cache=True)
                        for s in seqs]
                logits = torch.stack([r.logits[0, -1] for r in runs]).float().cpu().numpy()
                caches = paged_caches([hf_layer_caches(output_cache(r)) for r in runs], feed["block_table"],
                                      feed["k_cache_0"].shape)
            self.inference_time = time.perf_counter() - start
            return OrderedDict(logits=logits, **caches)

        def deactivate_impl(self):
            del self.model
            release_gpu_cache(device)

    return HfRunner()


def output_cache(output):
    """The KV cache object of an HF model output: ``output.cache`` in transformers >= 5 (where ``past_key_values``
    still works but logs a deprecation warning on every run), ``output.past_key_values`` before."""
    return output["cache"] if "cache" in output.keys() else output.past_key_values


def hf_layer_caches(past_key_values) -> list:
    """``[(k, v), ...]`` per layer, each ``[1, kv_heads, seq, head_dim]`` (keys after RoPE), from HF's cache object.

    transformers >= 4.56 keeps them as ``cache.layers[i].keys/.values``; older versions as ``key_cache``/``value_cache``
    lists or (legacy) a tuple of pairs.
    """
    if hasattr(past_key_values, "layers"):
        return [(layer.keys, layer.values) for layer in past_key_values.layers]
    if hasattr(past_key_values, "key_cache"):
        return list(zip(past_key_values.key_cache, past_key_values.value_cache))
    return [(k, v) for k, v in past_key_values]


def paged_caches(per_seq: list, block_table, cache_shape) -> dict:
    """The graph's ``k_cache_out_i``/``v_cache_out_i`` (fp32 numpy, ``cache_shape`` = ``[num_blocks, block_size,
    kv_heads, head_dim]``) from each sequence's HF caches (``per_seq[s][layer] = (k, v)``, ``[1, kv_heads, seq,
    head_dim]``): token ``p`` of sequence ``s`` at block ``block_table[s][p // block_size]``, slot ``p % block_size``;
    slots no sequence holds are 0 (as the graphs leave them)."""
    num_blocks, block_size = int(cache_shape[0]), int(cache_shape[1])
    table = np.asarray(block_table)
    out = {}
    for layer in range(len(per_seq[0])):
        for which, name in ((0, "k"), (1, "v")):
            cache = np.zeros(tuple(cache_shape), np.float32)
            for s, layers in enumerate(per_seq):
                t = layers[layer][which][0].float().cpu().numpy()  # [kv_heads, seq, head_dim]
                if t.shape[0] != cache_shape[2] or t.shape[2] != cache_shape[3]:
                    raise VerifyError(f"HF's layer-{layer} cache is {tuple(t.shape)} per sequence, the graph's "
                                      f"{tuple(cache_shape)}: config.json and the graphs disagree; rebuild OUT")
                pos = np.arange(t.shape[1])
                blocks = table[s, pos // block_size]
                if blocks.max(initial=0) >= num_blocks:
                    raise VerifyError(f"block_table names block {blocks.max()} of {num_blocks}")
                cache[blocks, pos % block_size] = t.transpose(1, 0, 2)  # [seq, kv_heads, head_dim]
            out[f"{name}_cache_out_{layer}"] = cache
    return out
