"""``LaunchConfig.launch``'s programmatic-dependent-launch choice, with the device faked (no GPU needed)."""

import pytest
import torch

import kernels._launch as L


class _Kernel:
    """Records the keyword arguments of ``kernel[grid](...)``."""

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.grid, self.args, self.kwargs = grid, args, kwargs
        return run


@pytest.fixture
def fake_gpu(monkeypatch):
    def use(sm):
        monkeypatch.setattr(L, "interpreting", lambda: False)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(L, "_sm", lambda device: sm)
    return use


@pytest.mark.parametrize("sm, env, pdl", [(90, None, True), (90, "0", False), (89, None, False)])
def test_pdl_kernel_launch(fake_gpu, monkeypatch, sm, env, pdl):
    fake_gpu(sm)
    if env is None:
        monkeypatch.delenv(L.PDL_ENV, raising=False)
    else:
        monkeypatch.setenv(L.PDL_ENV, env)
    k = _Kernel()
    cfg = L.LaunchConfig(k, (3,), dict(BLOCK=64, PDL=False), num_warps=2, num_stages=1)
    cfg.launch(1, 2)
    assert k.grid == (3,) and k.args == (1, 2)
    assert k.kwargs == dict(BLOCK=64, PDL=pdl, num_warps=2, num_stages=1, **({"launch_pdl": True} if pdl else {}))
    assert cfg.constexprs["PDL"] is False  # the config (AOT / plugin view) is left as it was


def test_kernel_without_pdl_constexpr_is_launched_plainly(fake_gpu, monkeypatch):
    fake_gpu(90)
    monkeypatch.delenv(L.PDL_ENV, raising=False)
    k = _Kernel()
    L.LaunchConfig(k, (1,), dict(BLOCK=64)).launch()
    assert k.kwargs == dict(BLOCK=64, num_warps=4, num_stages=3)
