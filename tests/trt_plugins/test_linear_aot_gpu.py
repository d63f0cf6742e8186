"""GPU tier: every CUDA kernel variant the GEMM plugins can select (``linear_variants.plugin_cases`` on this GPU:
Llama-3-8B and SmolLM2-135M projections and small odd ones, fp16, group sizes 32/64/128, every tactic, without and
with SwiGLU in the epilogue; and the W4A16 GEMV's K split over a cluster of 3, on Llama-2-13B's down), run the way
the engine runs it -- its plugin entry compiled ahead of time (cubin, and the PTX TensorRT embeds), launched through
the CUDA driver with the plugin's argument list and grid (``trt_plugins.aot.run_aot``) -- at odd M around its tactic:

- equals, bitwise, the same variant through its torch launcher (the plugin entry runs the same kernel body);
- is as close to the fp32 reference (dequantized weights) as the torch op at that M, within 2x its error plus one
  fp16 rounding step;
- writes every output (outputs poisoned with NaN before the call).

~256 nvcc builds on a cold cache (H100, SwiGLU variants included): ``python -m tests.trt_plugins.linear_variants``
compiles them in parallel first.
"""

import pytest
import torch

from tests.helpers import assert_close_to_ref, poisoned
from tests.trt_plugins.linear_variants import (FILL_SHAPES, HEAD_SHAPES, ODD_SHAPES, SHAPES, make_inputs, plugin_cases,
                                              reference, routed_op, same_variant)
from trt_plugins.aot import run_aot, target_card

pytestmark = pytest.mark.gpu


def _cases():
    if not torch.cuda.is_available():
        return []  # collected on the CPU too; the gpu marker skips the tests there
    from kernels._utils import device_sm

    from kernels.gemm.w4a16.gemv_mma import SPLITS

    card = target_card(device_sm())
    routes = [(c, c.specialise(c.m_hint, card).cuda.route) for c in plugin_cases(card, FILL_SHAPES)]
    fill = [c for c, (kind, plan) in routes  # only the fill split's GEMV builds of that shape
            if kind == "w4_gemv_mma" and dict(plan).get("ksplit", 1) not in SPLITS]
    return plugin_cases(card, ODD_SHAPES + SHAPES + HEAD_SHAPES) + fill  # heads last: the builds only they pick


CASES = _cases()


def _ms(m_hint):
    """Odd token counts around the tactic, and decode's M = 1; tactic 1 also at M = 17, past the 8 rows the GEMVs take
    in one launch (their plugin entries walk row tiles over grid z)."""
    return sorted({1, max(1, m_hint - 1), m_hint, m_hint + 1, 2 * m_hint + 3} | ({17} if m_hint == 1 else set()))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_plugin_cuda_variant_aot_equals_torch_and_reference(case):
    from kernels._utils import device_sm

    card = target_card(device_sm())
    for m in _ms(case.m_hint):
        sp = case.specialise(m, card)
        assert sp.cuda is not None
        ins, w = make_inputs(case, m)
        ref = reference(case, ins, w)
        jit = same_variant(case, sp, ins)
        op = routed_op(case, ins)
        for use_ptx in (False, True):
            out = poisoned((m, case.n_out), torch.float16, "cuda")
            (aot,) = run_aot(case.op, ins, case.attrs, outputs=[out], use_ptx=use_ptx)
            torch.cuda.synchronize()
            where = f"{case.id} M={m} {'ptx' if use_ptx else 'cubin'} {sp.cuda.route[0]}"
            assert not torch.isnan(aot).any(), f"{where}: {int(torch.isnan(aot).sum())} outputs not written"
            if not torch.equal(aot, jit):
                diff = (aot.float() - jit.float()).abs()
                idx = tuple(int(i) for i in divmod(int(diff.argmax()), case.n_out))
                raise AssertionError(f"{where}: AOT != the same variant through its torch launcher: max |diff| "
                                     f"{float(diff.max()):.3e} at {idx}")
            assert_close_to_ref(aot, ref, baseline=op, factor=2.0,
                                atol=torch.finfo(torch.float16).eps * float(ref.abs().max()))


def test_every_cuda_kernel_is_covered():
    """Not vacuous: on an H100/H200 the cases include every CUDA kernel a plugin can select."""
    if not CASES:
        pytest.skip("no CUDA variants on this GPU")
    from kernels._utils import device_sm

    card = target_card(device_sm())
    kinds = {c.specialise(c.m_hint, card).cuda.route[0] for c in CASES}
    want = {"w4_gemv_mma", "w8_gemv_mma"} | ({"w4_gemm_wgmma", "w8_gemm_wgmma"} if card.sm == 90 else set())
    assert want <= kinds, kinds
