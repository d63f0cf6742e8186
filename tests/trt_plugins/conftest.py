"""AOT tests write their artifacts (and generated plugin entry modules) to a per-session cache, never to ~/.cache."""

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _aot_cache_dir(tmp_path_factory):
    old = os.environ.get("TRITRT_AOT_CACHE")
    os.environ["TRITRT_AOT_CACHE"] = str(tmp_path_factory.mktemp("aot_cache"))
    yield
    if old is None:
        os.environ.pop("TRITRT_AOT_CACHE", None)
    else:
        os.environ["TRITRT_AOT_CACHE"] = old
