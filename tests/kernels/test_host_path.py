"""The launchers' host path (CPU): what an eager call asks of torch and of the plan search once, not per call."""

import torch

from kernels import _utils
from kernels.gemm.cuda import cached_plan


def test_cached_plan_searches_once_and_hands_out_copies():
    calls = []

    @cached_plan
    def plan(M, N, warps=None):
        """The docstring stays."""
        calls.append((M, N, warps))
        return dict(warps=warps or 4, grid=(N // 32, 1))

    a = plan(16, 4096)
    a["warps"] = 99  # a caller editing its plan does not edit the next caller's
    b = plan(16, 4096)
    assert b == dict(warps=4, grid=(128, 1)) and b is not a
    assert plan(16, 4096, warps=8)["warps"] == 8
    assert calls == [(16, 4096, None), (16, 4096, 8)]
    assert plan.__doc__ == "The docstring stays."


def test_device_sm_queries_each_device_once(monkeypatch):
    asked = []

    def capability(index):
        asked.append(index)
        return (9, 0) if index == 0 else (8, 9)

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    _utils._sm_of_index.cache_clear()
    try:
        assert [_utils.device_sm(), _utils.device_sm("cuda"), _utils.device_sm(torch.device("cuda:0"))] == [90] * 3
        assert _utils.device_sm("cuda:1") == 89 and _utils.device_sm(1) == 89
        assert asked == [0, 1]
    finally:
        _utils._sm_of_index.cache_clear()  # no fake capability left for later tests
