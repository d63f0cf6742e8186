"""Tiny checkpoints (random, seeded, made with transformers) shared by the export tests; made once per session."""

import pytest

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}

# name -> make_tiny_llama overrides; each a feature the loader and model must get right.
VARIANTS = {
    "llama": {},
    "tied": {"tie_word_embeddings": True},
    "llama3": {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0},
    "sharded": {"max_shard_size": "40KB"},
    "qwen2": {"model_type": "qwen2"},
}


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """Lazily made checkpoint dirs: ``tiny_dirs("tied")``."""
    from export.checkpoint import make_tiny_llama

    made = {}

    def get(name="llama"):
        if name not in made:
            made[name] = make_tiny_llama(tmp_path_factory.mktemp(f"tiny_{name}"), seed=0, **VARIANTS[name])
        return made[name]

    return get


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_dirs):
    return tiny_dirs("llama")
