"""Greedy generation of the tiny LLaMA (and Qwen3) through the runtime (torch backend, paged cache, batched prompts of
different lengths) equals Hugging Face ``generate`` token for token; the CLI prints what the API generates."""

import dataclasses
import subprocess
import sys

import pytest
import torch

from export.runtime import Generator, SamplingParams
from export.runtime.backends import TorchBackend
from export.runtime.tokenizer import load_tokenizer

PROMPTS = ["The quick brown", "Paged attention keeps the key value cache in", "x", "def forward(self, x): return"]
# Tied argmax: where our token differs from HF's, HF's own fp32 logits must rank the two within this margin, i.e.
# the step is a near-tie that any fp32 reordering of sums may flip (fp32 logits of the tiny model carry ~1e-6
# absolute error; 1e-4 leaves room, yet a real bug, which moves logits by O(0.1), cannot hide under it).
TIE_MARGIN = 1e-4


@pytest.fixture(scope="module")
def hf_model(tiny_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()


def hf_greedy(hf_model, prompt_ids: list[int], max_new: int, eos: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    out = hf_model.generate(ids, max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    return out[0, len(prompt_ids):].tolist()


def assert_same_tokens(hf_model, prompt_ids, ours, want):
    """Equal token for token, except that a first divergence at an exact near-tie ends the comparison there."""
    for j, (a, b) in enumerate(zip(ours, want)):
        if a != b:
            with torch.no_grad():
                logits = hf_model(torch.tensor([prompt_ids + want[:j]])).logits[0, -1]
            margin = float(logits[b] - logits[a])
            assert margin < TIE_MARGIN, f"token {j}: ours {a}, HF {b}, HF logit margin {margin:.3e} (not a tie)"
            return
    assert len(ours) == len(want), f"ours {len(ours)} tokens, HF {len(want)}"


# (24 blocks of 2 tokens cannot hold all four sequences at once: the scheduler queues and preempts; a budget of 5
# tokens chunks the longer prompts, and the sequences that decode meanwhile share those steps.)
@pytest.mark.parametrize("num_blocks,block_size,pipeline,budget", [(None, 4, False, 8192), (24, 2, False, 8192),
                                                                   (None, 4, True, 8192), (None, 4, False, 5)])
def test_greedy_batched_equals_hf_generate(tiny_dir, hf_model, num_blocks, block_size, pipeline, budget):
    from export.model import LlamaModel

    tok = load_tokenizer(tiny_dir)
    model = LlamaModel.from_checkpoint(tiny_dir, dtype=torch.float32)
    backend = TorchBackend(model, num_blocks=num_blocks, block_size=block_size)
    # pipelined: the model on device-side ids
    gen = Generator(backend, tok, max_num_seqs=4, max_num_batched_tokens=budget, pipeline=pipeline)
    mixed = []  # steps that feed prompt tokens and decode rows together
    schedule = gen.scheduler.schedule
    def spy():
        step = schedule()
        if step is not None and step.is_prefill:
            mixed.append(any(n == 1 and s.output_ids for s, n in zip(step.seqs, step.num_tokens)))
        return step
    gen.scheduler.schedule = spy
    max_new = 16
    res = gen.generate(PROMPTS, SamplingParams(max_new_tokens=max_new))
    assert gen.stats.steps < len(PROMPTS) * max_new, "prompts were not batched"
    for p, r in zip(PROMPTS, res):
        ids = tok.encode(p)
        assert r.prompt_ids == ids
        want = hf_greedy(hf_model, ids, max_new, tok.eos_token_id)
        assert_same_tokens(hf_model, ids, r.token_ids, want)
        assert r.text == tok.decode(r.token_ids, skip_special_tokens=True)
    if num_blocks == 24:
        assert any(r.num_preemptions for r in res), "the small cache should have forced a preemption"
    if budget == 5:
        assert any(mixed), "the small budget should mix prompt chunks and decode rows in a step"


def test_prefix_cached_chat_turn_equals_hf_generate(tiny_dir, hf_model):
    """A chat's next turn (the first prompt, its output and a reply) starts from the first request's KV blocks in
    the prefix cache, prefills only the rest, and still generates HF's tokens."""
    from export.model import LlamaModel

    tok = load_tokenizer(tiny_dir)
    gen = Generator(TorchBackend(LlamaModel.from_checkpoint(tiny_dir, dtype=torch.float32), block_size=4), tok)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    first = tok.encode(PROMPTS[1])
    out = gen.generate([first], params)[0].token_ids
    turn = first + out + tok.encode(PROMPTS[0])[1:]  # the reply without its BOS
    r = gen.generate([turn], SamplingParams(max_new_tokens=16))[0]
    # every full block of the first request but its last token's (never fed: its K/V was not computed)
    assert r.num_cached_tokens == (len(first) + len(out) - 1) // 4 * 4 > 0
    assert gen.stats.prefill_tokens == len(turn) - r.num_cached_tokens
    assert_same_tokens(hf_model, turn, r.token_ids, hf_greedy(hf_model, turn, 16, tok.eos_token_id))


def test_greedy_qwen3_equals_hf_generate(tiny_dirs):
    """Qwen3 (q/k norms per head, head_dim 32 != hidden / heads) through the same loop: transformers'
    Qwen3ForCausalLM generates the same tokens."""
    import transformers

    from export.model import LlamaModel

    path = tiny_dirs("qwen3", seed=3)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    tok = load_tokenizer(path)
    model = LlamaModel.from_checkpoint(path, dtype=torch.float32)
    assert model.config.qk_norm and model.config.q_size != model.config.hidden_size
    res = Generator(TorchBackend(model, block_size=4), tok, max_num_seqs=4).generate(
        PROMPTS, SamplingParams(max_new_tokens=16))
    for p, r in zip(PROMPTS, res):
        ids = tok.encode(p)
        assert_same_tokens(hf, ids, r.token_ids, hf_greedy(hf, ids, 16, tok.eos_token_id))


def test_seeded_sampling_is_reproducible_through_the_loop(tiny_dir):
    from export.model import LlamaModel

    model = LlamaModel.from_checkpoint(tiny_dir, dtype=torch.float32)
    backend = TorchBackend(model, block_size=4)
    params = SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True)
    a = Generator(backend).generate([[5, 6, 7], [9]], params)
    b = Generator(backend).generate([[5, 6, 7], [9]], params)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    # the seed is used at all (an ignored temperature or seed, i.e. greedy, would pass the lines above)
    others = [Generator(backend).generate([[5, 6, 7]], dataclasses.replace(params, seed=s))[0].token_ids
              for s in (12, 13, 14)]
    assert any(o != a[0].token_ids for o in others)


def test_cli_prints_generated_text(tiny_dir, tmp_path, capsys):
    from export.model import LlamaModel

    # The CLI reads a build output dir; the torch backend needs only config, weights and tokenizer from it.
    out = _torch_output_dir(tiny_dir, tmp_path / "out")
    model = LlamaModel.from_output_dir(out)
    want = Generator(TorchBackend(model, block_size=16), load_tokenizer(out)).generate(
        ["The quick brown"], SamplingParams(max_new_tokens=6))[0].text
    cmd = [sys.executable, "-m", "export.run", str(out), "--prompt", "The quick brown", "--max-new-tokens", "6"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert want in proc.stdout and "tok/s" in proc.stdout
    from export.run import main

    assert main([str(tmp_path / "nope"), "--prompt", "x"]) == 2
    assert "python -m export.build" in capsys.readouterr().err
    assert main([str(out), "--prompt", "x", "--backend", "trt"]) == 2  # no engine in OUT (and no TensorRT here)
    assert "model.engine is missing" in capsys.readouterr().err
    assert main([str(out), "--prompt", "x", "--top-p", "0"]) == 2
    assert "top_p" in capsys.readouterr().err
    assert main([str(out), "--prompt", "x", "--temperature", "nan"]) == 2
    err = capsys.readouterr().err
    assert "temperature must be a finite number" in err and err.count("\n") == 1


def test_cli_seed_gives_each_prompt_its_own_stream(tiny_dir, tmp_path, capsys):
    """One --seed for a batch: the i-th prompt samples with seed + i (identical prompts sampled identically before),
    so the first prompt of a batch samples as it does alone with the same --seed."""
    from export.run import main

    out = _torch_output_dir(tiny_dir, tmp_path / "out")
    common = ["--temperature", "1", "--seed", "3", "--max-new-tokens", "8", "--ignore-eos", "--device", "cpu"]

    def ids(*prompts):
        assert main([str(out), *[a for p in prompts for a in ("--prompt-ids", p)], *common]) == 0
        return [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("ids: ")]

    batch = ids("5,6,7", "5,6,7")
    assert len(batch) == 2 and batch[0] != batch[1]
    assert ids("5,6,7") == batch[:1]
    # sampling settings at the default --temperature 0 (greedy) run, saying they do nothing
    assert main([str(out), "--prompt-ids", "5,6,7", "--top-k", "5", "--max-new-tokens", "2", "--device", "cpu"]) == 0
    assert "warning: --top-k, --top-p and --seed apply to sampling" in capsys.readouterr().err


def _torch_output_dir(tiny_dir, out):
    """What ``export.build`` writes that the torch backend reads, without building ONNX (not this test's subject)."""
    import json
    import shutil

    from export.checkpoint import load_checkpoint
    from export.quantize import save_weights

    out.mkdir(parents=True)
    for f in tiny_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("config.json", "special_tokens_map.json",
                                                        "generation_config.json"):
            shutil.copy(f, out / f.name)
    ckpt = load_checkpoint(tiny_dir)
    save_weights({k: v for k, v in ckpt.state_dict.items()}, out / "weights.safetensors")
    (out / "build.json").write_text(json.dumps({"quant": "none", "group_size": 128, "block_size": 16,
                                                "config": ckpt.config.to_dict()}))
    return out
