"""One seeded tiny LLaMA checkpoint (with its tokenizer) shared by the runtime tests: making it costs seconds."""

import pytest


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    from export.checkpoint import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny"), seed=3)
