"""A seeded random tiny LLaMA-family checkpoint and a locally trained tokenizer, for tests and a first-run build.

``make_tiny_llama(dir)`` writes what a Hugging Face model directory holds (config.json, safetensors weights,
tokenizer.json / tokenizer_config.json) with no download: the model is a random ``transformers`` model made from a
fixed seed, the tokenizer a byte-level BPE trained on a few built-in sentences. transformers is used only here (and
for reference logits in tests); ``export.checkpoint`` reads the files back without it.
"""

from __future__ import annotations

from pathlib import Path

import torch

# Small but with every LLaMA feature that matters: GQA (4 q heads over 2 kv heads), two layers, untied lm_head.
TINY_DEFAULTS = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                     tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps the key value cache in fixed size blocks.",
    "TensorRT engines run plugins whose kernels are written in Triton.",
    "Once upon a time there was a tiny llama that learned to count: one, two, three, four, five.",
    "def forward(self, x): return self.norm(x + self.attn(x))",
]


def make_tokenizer(path, vocab_size: int = 320):
    """Train a byte-level BPE tokenizer (at most ``vocab_size`` tokens, ids 0-2 = <unk>, <s>, </s>) and save it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    special = ["<unk>", "<s>", "</s>"]
    if vocab_size < len(alphabet) + len(special):
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level tokenizer (>= 259)")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(path))
    return fast


def tiny_config(**overrides) -> dict:
    """The HF config fields of a tiny checkpoint: ``TINY_DEFAULTS`` under ``overrides`` (what ``make_tiny_llama``
    writes to config.json, ``model_type`` aside)."""
    return {**TINY_DEFAULTS, **overrides}


def make_tiny_llama(path, seed: int = 0, model_type: str = "llama", max_shard_size=None, **overrides) -> Path:
    """Write a random tiny checkpoint to ``path`` and return it.

    ``overrides`` are HF config fields (e.g. ``tie_word_embeddings=True``, ``rope_scaling={...llama3...}``,
    ``num_hidden_layers=1``); ``model_type`` "llama", "qwen2" (q/k/v biases) or "qwen3" (q/k norms; pass ``head_dim``
    to untie it from hidden / heads); ``max_shard_size`` (e.g. "40KB")
    writes several shards plus ``model.safetensors.index.json``.
    """
    import transformers

    from .checkpoint import HF_CLASSES  # here: export.checkpoint imports this module

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    fields = tiny_config(**overrides)
    if model_type not in HF_CLASSES:
        raise ValueError(f"make_tiny_llama makes {', '.join(map(repr, HF_CLASSES))} checkpoints, not '{model_type}'")
    config_cls, model_cls = HF_CLASSES[model_type]
    cfg = getattr(transformers, config_cls)(**fields)
    cls = getattr(transformers, model_cls)
    # Seed, and fork the RNG so that making a fixture does not perturb the random stream of the caller's test.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(cfg).to(torch.float32).eval()
        # HF initialises norms to 1 and biases to 0; random values make the test see a wrong mapping of those too.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
                elif name.endswith(".bias"):
                    p.copy_(0.1 * torch.randn_like(p))
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), safe_serialization=True, **kw)
    make_tokenizer(path, vocab_size=fields["vocab_size"])
    return path
