"""The tokenizer files of a GGUF import: ``tokenizer.json`` and its configs, from the ``tokenizer.ggml.*`` metadata.

Byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``: SmolLM, Llama 3, StarCoder) are rebuilt here with
the ``tokenizers`` library: the file holds the vocabulary (already spelled in GPT-2's byte alphabet), the merges and
which tokens are control tokens; how text is split before the merges is named by ``tokenizer.ggml.pre`` and mapped
below to the pre-tokenizer the original ``tokenizer.json`` had. SentencePiece vocabularies (``"llama"``: Llama 2,
TinyLlama, Mistral) go through ``transformers``' own GGUF tokenizer converter (``AutoTokenizer.from_pretrained(...,
gguf_file=...)``), which reads the local file only.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

# llama.cpp's token types (gguf.TokenType): 3 = CONTROL (special, e.g. <|im_end|>), 4 = USER_DEFINED (added, whole).
_CONTROL, _USER_DEFINED = 3, 4
# Llama 3's split pattern (its tokenizer.json's pre_tokenizer regex).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2_PRE = ("default", "gpt-2", "gpt2")
_DIGITS_PRE = ("smollm", "starcoder", "refact")  # GPT-2's split after cutting every digit alone
_LLAMA3_PRE = ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3")


def _pre_tokenizer(pre: str | None):
    """(pre_tokenizer, ignore_merges, note) for a ``tokenizer.ggml.pre`` name."""
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre is None or pre in _GPT2_PRE:
        return byte_level, False, None
    if pre in _DIGITS_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]), False, None
    if pre in _LLAMA3_PRE:
        split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False)
        no_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)
        return pre_tokenizers.Sequence([split, no_regex]), True, None
    note = (f"tokenizer.ggml.pre '{pre}' is not known to tritrt; text is split with GPT-2's pattern, which may "
            f"tokenize some text (digits, whitespace runs) differently from the original tokenizer")
    log.warning(note)
    return byte_level, False, note


def byte_level_bpe(meta: dict):
    """A ``tokenizers.Tokenizer`` for a ``gpt2``-model GGUF vocabulary. Returns (tokenizer, note or None)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    pre, ignore_merges, note = _pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos_id is not None:
        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, int(bos_id))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok, note


def sentencepiece_via_transformers(gguf_path: Path):
    """``transformers``' GGUF converter for SentencePiece vocabularies (it reads only the local file)."""
    from .gguf import GGUFError

    try:
        from transformers import AutoTokenizer

        fast = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True)
    except Exception as e:  # transformers raises several types here; all mean "cannot build it"
        raise GGUFError(f"{gguf_path.name}: transformers could not build its SentencePiece tokenizer ({e}); "
                        f"{NO_TOKENIZER_HINT}") from e
    return fast.backend_tokenizer, None


TOKENIZER_MODELS = ("gpt2", "llama")  # tokenizer.ggml.model values we build a tokenizer.json for
NO_TOKENIZER_HINT = ("build from the model's Hugging Face checkpoint instead (--checkpoint DIR: its safetensors and "
                     "tokenizer.json)")


def check_tokenizer(meta: dict, where: str) -> None:
    """Refuse a GGUF whose tokenizer model we cannot convert (before any weight is dequantized)."""
    from .gguf import GGUFError

    model = meta.get("tokenizer.ggml.model")
    if model is not None and model not in TOKENIZER_MODELS:
        raise GGUFError(f"{where}: tokenizer model '{model}' is not supported ({', '.join(TOKENIZER_MODELS)}); "
                        f"{NO_TOKENIZER_HINT}")


def write_tokenizer(meta: dict, dest: Path, gguf_path: Path, model_max_length: int) -> dict:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json and generation_config.json to ``dest``;
    returns what was built (for gguf_source.json)."""

    model = meta.get("tokenizer.ggml.model")
    if model is None:
        log.warning("%s holds no tokenizer; the converted checkpoint has none", gguf_path.name)
        return {"model": None, "note": "the GGUF holds no tokenizer"}
    if model == "gpt2":
        tok, note = byte_level_bpe(meta)
    elif model == "llama":
        tok, note = sentencepiece_via_transformers(gguf_path)
    else:
        check_tokenizer(meta, gguf_path.name)
    tok.save(str(dest / "tokenizer.json"))
    tokens = meta["tokenizer.ggml.tokens"]
    special = {}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        idx = meta.get(f"tokenizer.ggml.{key}_token_id")
        if idx is not None and 0 <= int(idx) < len(tokens):
            special[name] = tokens[int(idx)]
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special,
              "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", model == "llama")),
              "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
              "clean_up_tokenization_spaces": False, "model_max_length": model_max_length}
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    (dest / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (dest / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    gen = {k: int(meta[f"tokenizer.ggml.{g}_token_id"]) for k, g in
           (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding"))
           if f"tokenizer.ggml.{g}_token_id" in meta}
    (dest / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return {"model": model, "pre": meta.get("tokenizer.ggml.pre"), "note": note}
