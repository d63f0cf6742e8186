"""The tokenizer of a model or build output directory, from local files only (never a download).

``load_tokenizer(dir)`` returns a ``transformers`` fast tokenizer built from ``tokenizer.json`` (+
``tokenizer_config.json``); ``eos_token_ids(dir)`` (``export.checkpoint``'s) reads the stop tokens the model was trained
with from ``generation_config.json`` / ``config.json`` (Llama-3 lists several).
"""

from __future__ import annotations

from pathlib import Path

from ..checkpoint import eos_token_ids  # noqa: F401  (the stop tokens a directory names; public here too)


def load_tokenizer(path):
    """The fast tokenizer saved in ``path``; a clear error when the files are missing."""
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{path} has no tokenizer.json; copy the checkpoint's tokenizer files there "
                                "(python -m export.build does this), or give token ids instead of text "
                                "(python -m export.run --prompt-ids 1,2,3)")
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError as e:  # pragma: no cover - transformers is part of the 'export' extra
        raise ImportError("reading tokenizer.json needs transformers: pip install 'tritrt[export]'") from e
    return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
