"""``python -m export.run OUT --prompt "..."``: generate text from a build output directory and print it.

``--backend torch`` (default) runs ``LlamaModel`` on our kernels (CUDA graphs on a GPU; the ops' torch references on
CPU, so the tiny model runs anywhere); ``--backend trt`` runs ``OUT/model.engine`` (needs TensorRT >= 10.9 and a GPU).
The generated text is printed per prompt (streamed for a single prompt), then prefill and decode tokens/s.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m export.run", description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="output directory of `python -m export.build`")
    p.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for a batch")
    p.add_argument("--backend", choices=("torch", "trt"), default="torch")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    p.add_argument("--device", default=None, help="torch backend: cuda or cpu (default: cuda when available)")
    p.add_argument("--num-blocks", type=int, default=None, help="KV-cache blocks (default: from free memory)")
    p.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default: build.json, else 16)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="torch backend: run decode eagerly")
    return p.parse_args(argv)


def _build_json(out: Path) -> dict:
    f = out / "build.json"
    return json.loads(f.read_text()) if f.is_file() else {}


def make_backend(args):
    out = args.out
    if not out.is_dir():
        raise FileNotFoundError(f"{out} is not a directory; build one with `python -m export.build CHECKPOINT {out}`")
    build = _build_json(out)
    block_size = args.block_size or int(build.get("block_size", 16))
    if args.backend == "trt":
        from export.runtime.trt_backend import TrtBackend

        return TrtBackend(out, num_blocks=args.num_blocks)
    import torch

    from export.model import LlamaModel
    from export.runtime.backends import TorchBackend
    from export.runtime.tokenizer import eos_token_ids

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = LlamaModel.from_output_dir(out, device=device)
    backend = TorchBackend(model, num_blocks=args.num_blocks, block_size=block_size,
                           max_model_len=build.get("max_seq_len"), cuda_graphs=False if args.no_cuda_graphs else None)
    backend.eos_token_ids = eos_token_ids(out)
    return backend


def main(argv=None) -> int:
    args = parse_args(argv)
    from export.runtime import Generator, SamplingParams
    from export.runtime.tokenizer import load_tokenizer

    try:
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)
        backend = make_backend(args)
        tokenizer = load_tokenizer(args.out)
    except (FileNotFoundError, ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    gen = Generator(backend, tokenizer, max_num_seqs=max(1, len(args.prompt)))
    stream = len(args.prompt) == 1
    if stream:
        print(args.prompt[0], end="", flush=True)
    results = gen.generate(args.prompt, params,
                           on_token=(lambda i, t, d: print(d, end="", flush=True)) if stream else None)
    if stream:
        print()
    else:
        for prompt, r in zip(args.prompt, results):
            print(f"--- {prompt!r}\n{prompt}{r.text}")
    s = gen.stats
    n_out = sum(len(r.token_ids) for r in results)
    print(f"[{args.backend} on {backend.device}] {n_out} tokens; prefill {s.prefill_tokens} tok in "
          f"{s.prefill_s * 1e3:.1f} ms ({s.prefill_tokens_per_s:.1f} tok/s); decode {s.decode_tokens} tok at "
          f"{s.decode_tokens_per_s:.1f} tok/s; first token after {1e3 * (s.time_to_first_token_s or 0):.1f} ms",
          file=sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
