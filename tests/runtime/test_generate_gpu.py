"""GPU tier: the runtime on our Triton kernels (fp16, CUDA-graph decode) generates what HF does, token for token.

The reference is greedy decoding with the HF model in fp32 on the same (for quantized models: dequantized) weights,
recomputing the whole prefix each step. Our fp16 run may leave it only at a near-tie: where the tokens first differ,
HF's fp32 logits must rank the two tokens within 4x the error that fp16 itself causes (HF in fp16 vs fp32 on the
same prefixes); anything above that is a bug, not rounding.
"""

import pytest
import torch

from export.runtime import Generator, SamplingParams
from export.runtime.backends import TorchBackend
from export.runtime.hf_baseline import hf_model

pytestmark = pytest.mark.gpu

PROMPTS = [[1, 17, 42, 99, 3], [250], [7, 7, 7, 8, 9, 10, 11, 12, 13, 200, 201, 202, 5], [60, 61]]
MAX_NEW = 40


def _fp32_weights(weights):
    from kernels.quant import dequantize

    return {k: (v.float() if isinstance(v, torch.Tensor) else dequantize(v, torch.float32)) for k, v in weights.items()}


@torch.no_grad()
def hf_greedy(hf, prompt, n):
    """Greedy tokens and the last-position logits of every step (full recompute: no cache to get wrong)."""
    ids, logits = list(prompt), []
    for _ in range(n):
        lg = hf(torch.tensor([ids], device="cuda")).logits[0, -1].float()
        logits.append(lg)
        ids.append(int(lg.argmax()))
    return ids[len(prompt):], logits


@torch.no_grad()
def fp16_error(hf32, hf16, prompt, toks):
    """Max |logit| difference HF fp16 vs HF fp32 over the reference prefixes: what fp16 costs by itself."""
    ids = torch.tensor([list(prompt) + toks], device="cuda")
    return float((hf16(ids).logits.float() - hf32(ids).logits.float()).abs().max())


def _same_random_caches(a, b):
    """The same random history in both backends' KV caches (seeded)."""
    torch.manual_seed(0)
    for (k, v), (k2, v2) in zip(a.kv_cache, b.kv_cache):
        k.normal_()
        v.normal_()
        k2.copy_(k)
        v2.copy_(v)


def check_tokens(ours, want, want_logits, tol, what):
    for j, (a, b) in enumerate(zip(ours, want)):
        if a != b:
            margin = float(want_logits[j][b] - want_logits[j][a])
            assert margin <= tol, (f"{what}: token {j} ours {a} ref {b}, ref margin {margin:.3e} > tie tolerance "
                                   f"{tol:.3e}")
            return j
    assert len(ours) == len(want), f"{what}: {len(ours)} tokens vs {len(want)}"
    return len(ours)


@pytest.mark.parametrize("variant, quant", [("llama", "none"), ("llama", "int8"), ("llama", "int4"),
                                           ("qwen3", "none"), ("qwen3", "int4")])
def test_greedy_matches_hf_fp32(tiny_dirs, variant, quant):
    from export.model import LlamaModel

    tiny_dir = tiny_dirs(variant, seed=3)  # llama: the runtime tests' tiny_dir
    model = LlamaModel.from_checkpoint(tiny_dir, dtype=torch.float16, device="cuda", quant=quant, group_size=32)
    hf32 = hf_model(_fp32_weights(model.weights), model.config)
    hf16 = hf_model({k: v.half() for k, v in _fp32_weights(model.weights).items()}, model.config)
    backend = TorchBackend(model, block_size=4)  # CUDA graphs on (default on CUDA)
    assert backend.cuda_graphs
    res = Generator(backend).generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
    exact = 0
    for p, r in zip(PROMPTS, res):
        want, want_logits = hf_greedy(hf32, p, MAX_NEW)
        tol = 4 * fp16_error(hf32, hf16, p, want)
        exact += check_tokens(r.token_ids, want, want_logits, tol, f"{variant} {quant} prompt {p[:3]}") == MAX_NEW
    # A near-tie may end one prompt's comparison early; most must match all 40 tokens or the test proves little.
    assert exact >= len(PROMPTS) - 1, f"only {exact} of {len(PROMPTS)} prompts matched all {MAX_NEW} tokens"


@pytest.mark.parametrize("quant", ["none", "int4"])
def test_mixed_steps_and_prefix_cache_match_hf_fp32(tiny_dirs, quant):
    """The scheduler's mixed steps (decode rows beside prompt chunks, with a budget of 8 tokens) and prefix-cache hits
    (a chat turn that starts with an earlier request's prompt and output; a prompt that shares a first block) on
    CUDA, graphs and pipelined decode on: the prefill kernels read the cached blocks as context, and the tokens match
    HF fp32 as in the test above."""
    from export.model import LlamaModel

    model = LlamaModel.from_checkpoint(tiny_dirs("llama", seed=3), dtype=torch.float16, device="cuda", quant=quant,
                                       group_size=32)
    hf32 = hf_model(_fp32_weights(model.weights), model.config)
    hf16 = hf_model({k: v.half() for k, v in _fp32_weights(model.weights).items()}, model.config)
    gen = Generator(TorchBackend(model, block_size=4), max_num_seqs=4, max_num_batched_tokens=8)
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    first = gen.generate(PROMPTS, params)
    turn = PROMPTS[2] + first[2].token_ids + [31, 32, 33]
    second = gen.generate([turn, PROMPTS[0] + [77]], params)
    assert [r.num_cached_tokens for r in second] == [(len(PROMPTS[2]) + MAX_NEW - 1) // 4 * 4, 4]
    exact = 0
    for p, r in zip(PROMPTS + [turn, PROMPTS[0] + [77]], first + second):
        want, want_logits = hf_greedy(hf32, p, MAX_NEW)
        tol = 4 * fp16_error(hf32, hf16, p, want)
        exact += check_tokens(r.token_ids, want, want_logits, tol, f"{quant} prompt {p[:3]}") == MAX_NEW
    assert exact >= len(PROMPTS), f"only {exact} of {len(PROMPTS) + 2} prompts matched all {MAX_NEW} tokens"


def test_cuda_graph_decode_and_prefill_equal_eager(tiny_dir):
    from export.model import LlamaModel

    model = LlamaModel.from_checkpoint(tiny_dir, dtype=torch.float16, device="cuda")
    # prefill_graph_after=1: the prompts' prefill replays a graph too (its first use captures it)
    graphs = TorchBackend(model, num_blocks=64, block_size=4, cuda_graphs=True, prefill_graph_after=1)
    eager = TorchBackend(model, num_blocks=64, block_size=4, cuda_graphs=False)
    # Different lengths make the running batch shrink 4 -> 1 through several graph buckets.
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (33, 20, 9, 2)]
    g = Generator(graphs).generate(PROMPTS, params)
    e = Generator(eager).generate(PROMPTS, params)
    decode_keys = [k for k in graphs._graphs if k[2] == 1]
    assert len(decode_keys) >= 3, f"graph buckets used: {sorted(graphs._graphs)}"
    # 21 tokens in 4 prompts (the longest 13): 32 tokens, 8 sequences, at most 16 new tokens in one
    assert (32, 8, 16, graphs._max_blocks_per_seq) in graphs._graphs, \
        f"the prefill (21 tokens, 4 prompts) has no graph: {sorted(graphs._graphs)}"
    for a, b in zip(g, e):
        # Same kernels on the same rows (padding only adds rows), so the tokens must agree; a flip would need an
        # fp16 near-tie within a GEMM's reordering error, which 64 tokens of this model do not have.
        if a.token_ids != b.token_ids:
            j = next(i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y)
            pytest.fail(f"graph and eager decode differ at token {j}: {a.token_ids[j]} vs {b.token_ids[j]}")


@pytest.mark.parametrize("quant", ["none", "int4"])
def test_cuda_graph_prefill_is_the_eager_forward_of_the_padded_batch(tiny_dir, quant):
    """A prefill replayed from its graph computes, bit for bit, what the eager model computes on the same batch padded
    to the graph's shape (the same kernels on the same inputs) and writes the same cache; a second, different batch in
    the same bucket replays correctly too (the staged inputs are reloaded, nothing of the first is left). That the
    padded batch's real rows are the unpadded batch's is the CPU test of the padding rule (test_backends.py)."""
    from export.model import LlamaModel
    from export.runtime.backends import pad_batch
    from tests.helpers import prefill_batch

    model = LlamaModel.from_checkpoint(tiny_dir, dtype=torch.float16, device="cuda", quant=quant, group_size=32)
    bs = 4
    graphs = TorchBackend(model, num_blocks=64, block_size=bs, max_model_len=64)  # prefill_graph_after=2 (default)
    eager = TorchBackend(model, num_blocks=64, block_size=bs, max_model_len=64, cuda_graphs=False)
    _same_random_caches(graphs, eager)
    a = prefill_batch([3, 9], [4, 0], bs)  # 12 tokens, 2 sequences: bucket (16, 4, 16)
    b = prefill_batch([2, 1, 2], [0, 7, 0], bs, block_offset=10)  # 5 tokens, 3 sequences: the same bucket
    c = prefill_batch([40], block_size=bs, block_offset=20)  # 40 tokens: bucket (48, 2, 48)
    runs = []
    for batch in (a, a, b, c, c):
        key = graphs._prefill_bucket(batch)
        captured = key in graphs._graphs
        got = graphs.forward(batch)
        runs.append((key, captured, key in graphs._graphs))
        padded = pad_batch(batch, key[0], key[1], graphs._max_blocks_per_seq, key[2], graphs._max_blocks_per_seq * bs)
        want = eager.forward(padded)[:batch.num_seqs]
        assert torch.equal(got, want), f"{quant}: graph prefill != eager on the padded batch, key {key}"
        for (k, v), (k2, v2) in zip(graphs.kv_cache, eager.kv_cache):
            assert torch.equal(k, k2) and torch.equal(v, v2), f"{quant}: the caches differ after key {key}"
    # eager at a bucket's first use, captured at its second (prefill_graph_after=2), replayed after
    W = graphs._max_blocks_per_seq
    assert runs == [((16, 4, 16, W), False, False), ((16, 4, 16, W), False, True), ((16, 4, 16, W), True, True),
                    ((48, 2, 48, W), False, False), ((48, 2, 48, W), False, True)], runs


def test_capture_ahead_of_time(tiny_dir):
    """capture() makes the graphs a server wants before its first request: the next prefill of a captured bucket
    replays at once (no eager first use), and asking for a bucket that is not one is refused."""
    from export.model import LlamaModel
    from export.runtime.backends import pad_batch
    from tests.helpers import prefill_batch

    model = LlamaModel.from_checkpoint(tiny_dir, dtype=torch.float16, device="cuda")
    backend = TorchBackend(model, num_blocks=64, block_size=4, max_model_len=64)
    backend.capture(batch_sizes=(1, 2), prefill_tokens=(16, 48))
    assert sorted(backend._graphs) == [(1, 1, 1, 16), (2, 2, 1, 16), (16, 2, 16, 16), (48, 2, 48, 16)]  # 64 tokens
    eager = TorchBackend(model, num_blocks=64, block_size=4, max_model_len=64, cuda_graphs=False)
    batch = prefill_batch([12])
    got = backend.forward(batch)
    assert backend._prefill_seen[(16, 2, 16, 16)] == 1  # replayed at its first use
    want = eager.forward(pad_batch(batch, 16, 2, backend._max_blocks_per_seq, 16, 64))[:1]
    assert torch.equal(got, want)  # the eager forward of the padded batch (see the test above)
    with pytest.raises(ValueError, match="not buckets"):
        backend.capture(prefill_tokens=(17,))


def test_gpu_bound_prefill_bucket_runs_padded_steps_eagerly(tiny_dir):
    """When a bucket's replay is timed slower than launching eagerly (forced here: the host cost set to 0), its padded
    steps run eagerly from then on (no more replays) and an unpadded step still replays; the outputs stay right."""
    from export.model import LlamaModel
    from export.runtime.backends import pad_batch
    from tests.helpers import prefill_batch

    model = LlamaModel.from_checkpoint(tiny_dir, dtype=torch.float16, device="cuda")
    graphs = TorchBackend(model, num_blocks=64, block_size=4, max_model_len=64, prefill_graph_after=1)
    eager = TorchBackend(model, num_blocks=64, block_size=4, max_model_len=64, cuda_graphs=False)
    padded = prefill_batch([12])  # 12 tokens: bucket (16, 2, 16), padded
    full = prefill_batch([16], block_offset=8)  # 16 tokens: the same bucket, no padding
    key = (16, 2, 16, 16)
    for _ in range(2):  # capture, then the timed second replay
        graphs.forward(padded)
    torch.cuda.synchronize()
    assert graphs._replays[key] == 2 and graphs._prefill_host_ms[key] > 0
    graphs._prefill_host_ms[key] = 0.0  # as if launching eagerly cost nothing: every replay "loses"
    for batch, replayed in ((padded, False), (full, True), (padded, False)):
        before = graphs._replays[key]
        got = graphs.forward(batch)
        assert graphs._replays[key] == before + replayed, (batch.input_ids.shape, graphs._replays)
        # bit for bit: the eager forward of the step as it ran (padded to the bucket where it replayed)
        want = eager.forward(pad_batch(batch, *key[:2], graphs._max_blocks_per_seq, key[2], 64) if replayed else batch)
        assert torch.equal(got, want[:1])
    assert graphs._replay_ms[key] > 0


def test_prefill_graphs_are_capped(tiny_dir):
    """Past ``max_prefill_graphs`` a step of a new key runs eagerly (bit for bit the eager forward) and nothing more is
    captured; decode graphs do not count; and a further capture adds no more memory than its own outputs (all
    captures warm up on one side stream: a stream per capture held a cuBLAS workspace each, ~32 MB)."""
    from export.model import LlamaModel
    from export.runtime.backends import pad_batch
    from tests.helpers import prefill_batch

    model = LlamaModel.from_checkpoint(tiny_dir, dtype=torch.float16, device="cuda")
    graphs = TorchBackend(model, num_blocks=64, block_size=4, max_model_len=64, prefill_graph_after=1,
                          max_prefill_graphs=2)
    eager = TorchBackend(model, num_blocks=64, block_size=4, max_model_len=64, cuda_graphs=False)
    graphs.capture(batch_sizes=(1, 2))
    used = []
    for n, replayed in ((16, True), (32, True), (48, False)):  # three token buckets, each unpadded
        batch = prefill_batch([n])
        got = graphs.forward(batch)
        # bit for bit the eager forward of the step as it ran (with the graph's spare sequence where it replayed)
        want = eager.forward(pad_batch(batch, n, 2, graphs._max_blocks_per_seq, n, 64) if replayed else batch)
        assert torch.equal(got, want[:1]), n
        del got, want
        torch.cuda.synchronize()
        used.append(torch.cuda.memory_allocated())
    prefill_keys = sorted(k for k in graphs._graphs if k[2] > 1)
    assert prefill_keys == [(16, 2, 16, 16), (32, 2, 32, 16)] and (2, 2, 1, 16) in graphs._graphs
    assert used[2] == used[1], "a step past the cap kept memory (captured?)"
    assert used[1] - used[0] < 2**20, f"the second capture held {(used[1] - used[0]) / 2**20:.1f} MiB"


def test_decode_graphs_by_table_width_equal_eager(tiny_dir):
    """Decode steps replay the graph of the narrowest table width that holds them (here 8, 32 and 64 tokens): a
    generation that crosses two widths uses three graphs and gives the eager run's tokens; and the logits of a
    step replayed at a narrow width equal, bit for bit, the eager forward of that step padded to it."""
    from export.model import LlamaModel
    from export.runtime.backends import pad_decode_batch
    from tests.helpers import prefill_batch

    model = LlamaModel.from_checkpoint(tiny_dir, dtype=torch.float16, device="cuda")
    kw = dict(num_blocks=64, block_size=4, max_model_len=64)
    graphs = TorchBackend(model, decode_graph_widths=(8, 32), **kw)
    eager = TorchBackend(model, cuda_graphs=False, **kw)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    g = Generator(graphs).generate([PROMPTS[0]], params)[0]  # 5 + 40 tokens: tables of 2, 8 and 12 blocks
    e = Generator(eager).generate([PROMPTS[0]], params)[0]
    assert sorted(k[3] for k in graphs._graphs if k[2] == 1) == [2, 8, 16], sorted(graphs._graphs)
    assert g.token_ids == e.token_ids
    _same_random_caches(graphs, eager)
    step = prefill_batch([1, 1], [6, 2])  # two decode tokens after 6 and 2 cached: a table of 2 blocks
    assert graphs._decode_key(step) == (2, 2, 1, 2)
    got = graphs.forward(step)
    want = eager.forward(pad_decode_batch(step, 2, 2))
    assert torch.equal(got, want)
