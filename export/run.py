"""``python -m export.run OUT --prompt "..."``: generate text from a build output directory and print it.

``--backend torch`` (default) runs ``LlamaModel`` on our kernels (CUDA graphs on a GPU; the ops' torch references on
CPU, so the tiny model runs anywhere); ``--backend trt`` runs ``OUT/model.engine`` (needs TensorRT >= 10.9 and a GPU).
The generated text is printed per prompt (streamed for a single prompt), then prefill and decode tokens/s.
``--prompt-ids 1,2,3`` gives the prompt as token ids (an OUT without a tokenizer); the generated ids are printed, and
their text too when OUT has a tokenizer. ``--chat`` sends each ``--prompt`` as a user message through the
tokenizer's chat template (an instruct model such as the default SmolLM2-135M-Instruct answers it), after
``--system TEXT`` if given, and prints the reply. Every mistake (bad option, missing OUT, a prompt longer than the
build's ``max_seq_len``, no GPU for ``--device cuda``) is one ``error:`` line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from .cli import ArgumentParser, print_error

BUILD_HINT = "python -m export.build --out {out} [--checkpoint DIR]"


def _token_ids(text: str) -> list[int]:
    """``"1,2,3"`` -> ``[1, 2, 3]`` (argparse ``type``)."""
    parts = [t.strip() for t in text.split(",")]
    if not text.strip() or not all(re.fullmatch(r"\d+", t) for t in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of token ids such as 1,2,3")
    return [int(t) for t in parts]


def parse_args(argv=None):
    p = ArgumentParser(prog="python -m export.run", description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="output directory of `python -m export.build`")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", action="append", help="prompt text; repeat for a batch")
    prompt.add_argument("--prompt-ids", action="append", type=_token_ids, metavar="IDS",
                        help="prompt as comma-separated token ids, e.g. 1,2,3 (needs no tokenizer); repeat for a batch")
    p.add_argument("--chat", action="store_true",
                   help="send each --prompt as a user message through OUT's chat template; print the reply")
    p.add_argument("--system", default=None, metavar="TEXT", help="with --chat: a system message before each prompt")
    p.add_argument("--backend", choices=("torch", "trt"), default="torch",
                   help="torch: our kernels in PyTorch; trt: OUT/model.engine")
    p.add_argument("--max-new-tokens", type=int, default=64, help="most tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: random); the i-th prompt (from 0) "
                   "samples with seed + i, so a batch's prompts do not share one random stream")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    p.add_argument("--device", default=None, help="torch backend: cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV-cache blocks (default: on a GPU from free memory; on the CPU just what the prompts and "
                        "--max-new-tokens need)")
    p.add_argument("--block-size", type=int, default=None,
                   help="torch backend: tokens per KV block, a power of two <= 128 (default: build.json's, else 16)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="torch backend: run decode eagerly")
    args = p.parse_args(argv)
    if args.system is not None and not args.chat:
        p.error("--system needs --chat (a system message is part of a chat template)")
    if args.chat and args.prompt is None:
        p.error("--chat takes --prompt text (a user message); --prompt-ids are already the model's input")
    if args.prompt is not None and any(t == "" for t in args.prompt):
        p.error("--prompt is empty; give some text, or token ids with --prompt-ids 1,2,3")
    if args.block_size is not None and not (1 <= args.block_size <= 128 and args.block_size & (args.block_size - 1)
                                            == 0):
        p.error(f"--block-size {args.block_size}: choose a power of two in 1..128")
    if args.num_blocks is not None and args.num_blocks < 1:
        p.error(f"--num-blocks {args.num_blocks}: must be >= 1")
    if args.device is not None and not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        p.error(f"--device {args.device}: choose cpu, cuda or cuda:N")
    if args.backend == "trt" and (args.device or args.block_size or args.no_cuda_graphs):
        p.error("--device, --block-size and --no-cuda-graphs are torch-backend options: the engine runs on cuda with "
                "its build's block size, as TensorRT enqueues it")
    return args


def chat_ids(tokenizer, prompt: str, system: str | None, out: Path) -> list[int]:
    """The token ids of a chat of one user message ``prompt`` (after a ``system`` message), rendered by the
    tokenizer's chat template with the assistant's turn opened; the template writes its own special tokens."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{out / 'tokenizer_config.json'} has no chat_template (not a chat model?); drop --chat and "
                         "give the text to continue")
    from jinja2.exceptions import TemplateError  # what a template's raise_exception raises (transformers needs jinja2)

    messages = ([{"role": "system", "content": system}] if system is not None else []) + \
        [{"role": "user", "content": prompt}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except TemplateError as e:  # the template's own refusal, e.g. of a system message (Gemma's, Mistral's)
        hint = "; drop --system" if system is not None else ""
        raise ValueError(f"{out}'s chat template refused the chat: {e}{hint}") from None
    return list(tokenizer.encode(text, add_special_tokens=False))


def _passive_openmp(args) -> None:
    """Let torch's OpenMP threads sleep, not spin, between parallel regions when the model may run on the CPU.

    libgomp's default keeps a thread that finished its share spinning for its partner; on a CPU shared with other jobs
    the partner is often descheduled, and the spinning thread burns the core it waits for. SmolLM2 int4, 64 tokens on
    the 2-core machine at load average 7-8: 1.8-5.5 tok/s and 0.18-0.34 CPU-s/token by default, 8.5-16.6 tok/s and
    0.06-0.08 CPU-s/token with OMP_WAIT_POLICY=PASSIVE (one thread: 9.2-16.7 tok/s). libgomp reads the variable when
    torch loads it, so this runs before the first torch import; a value the user set wins.
    """
    if args.backend == "torch" and args.device in (None, "cpu") and "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _build_json(out: Path) -> dict:
    f = out / "build.json"
    if not f.is_file():
        return {}
    try:
        build = json.loads(f.read_text())
    except (OSError, ValueError) as e:  # ValueError: JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{f} cannot be read ({e}); rebuild OUT with `{BUILD_HINT.format(out=out)}`") from None
    if not isinstance(build, dict):
        raise ValueError(f"{f} holds a JSON {type(build).__name__}, not an object (damaged?); rebuild OUT with "
                         f"`{BUILD_HINT.format(out=out)}`")
    return build


def _check_out(out: Path, args) -> None:
    """What can be checked in OUT without loading anything: it exists, and holds what the options need."""
    if not out.exists():
        raise FileNotFoundError(f"{out} does not exist; build it with `{BUILD_HINT.format(out=out)}`")
    if not out.is_dir():
        raise FileNotFoundError(f"{out} is not a directory; pass the OUT of `{BUILD_HINT.format(out='OUT')}`")
    if args.backend == "trt" and not (out / "model.engine").is_file():
        raise FileNotFoundError(f"{out / 'model.engine'} is missing; build it with `python -m export.build --from-onnx "
                                f"{out}` on a machine with TensorRT >= 10.9, or use --backend torch")
    if args.prompt is not None and not (out / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{out} has no tokenizer.json (its checkpoint had none; see 'tokenizer' in "
                                f"build.json); give the prompt as token ids: --prompt-ids 1,2,3")


def _device(requested) -> str:
    import torch

    if requested is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"--device {requested}: there is no CUDA device here (torch.cuda.is_available() is "
                             f"False); use --device cpu")
        index = int(requested.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise ValueError(f"--device {requested}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return requested


def kv_blocks_needed(prompts: list[list[int]], max_new_tokens: int, block_size: int) -> int:
    """KV-cache blocks for every prompt to run to ``max_new_tokens`` at once (no sequence waits or is preempted): each
    one's blocks, plus the spare block per running sequence the scheduler keeps free when it admits another (without
    them, prompts that fit one block each ran one at a time)."""
    from export.runtime.scheduler import blocks_for_request

    return sum(blocks_for_request(len(ids), max_new_tokens, block_size) for ids in prompts) + len(prompts)


def make_backend(args, build: dict, device: str, prompts: list[list[int]] | None = None):
    """The backend ``args`` ask for. On the CPU with no ``--num-blocks``, the KV cache holds what ``prompts`` need
    (the backend's default, 8 sequences of max_seq_len, was 3 GB of host memory for SmolLM2, allocated and zeroed
    before the first token)."""
    out = args.out
    if args.backend == "trt":
        from export.runtime.trt_backend import TrtBackend

        try:
            return TrtBackend(out, num_blocks=args.num_blocks)
        except RuntimeError as e:  # no CUDA device, or an engine TensorRT cannot load
            raise ValueError(f"{e}; or use --backend torch") from e
    from export.model import LlamaModel
    from export.runtime.backends import TorchBackend

    model = LlamaModel.from_output_dir(out, device=device)
    block_size = args.block_size or int(build.get("block_size", 16))
    num_blocks = args.num_blocks
    if device == "cpu":
        model = model.for_cpu()  # weights dequantized once, float32 math: what the CPU runs fastest
        if num_blocks is None and prompts:
            num_blocks = kv_blocks_needed(prompts, args.max_new_tokens, block_size)
    return TorchBackend(model, num_blocks=num_blocks, block_size=block_size, max_model_len=build.get("max_seq_len"),
                        cuda_graphs=False if args.no_cuda_graphs else None)


def check_prompts(prompts: list[list[int]], max_new_tokens: int, max_len, vocab_size, out: Path) -> None:
    """Refuse token ids outside the vocabulary, and a prompt that cannot fit the build's longest sequence (saying how
    many tokens do). ``max_len`` / ``vocab_size`` None: not known yet, not checked."""
    for ids in prompts:
        n = len(ids)
        if vocab_size and any(t >= vocab_size for t in ids):
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {vocab_size})")
        if max_len is None:
            continue
        if n >= max_len:
            raise ValueError(f"the prompt is {n} tokens, but {out} was built for sequences of at most {max_len} "
                             f"(max_seq_len in build.json), so at most {max_len - 1} prompt tokens fit; shorten it "
                             f"or rebuild with a larger --max-seq-len")
        if n + max_new_tokens > max_len:
            raise ValueError(f"the prompt ({n} tokens) + --max-new-tokens {max_new_tokens} exceeds {out}'s "
                             f"max_seq_len {max_len}; pass --max-new-tokens {max_len - n} or less")


def main(argv=None) -> int:
    args = parse_args(argv)
    _passive_openmp(args)
    try:
        # The cheap checks first: a mistake costs no torch import, no model load.
        _check_out(args.out, args)
        build = _build_json(args.out)
        max_len = build.get("max_seq_len") or build.get("config", {}).get("max_position_embeddings")
        vocab_size = build.get("config", {}).get("vocab_size")
        if args.prompt_ids is not None:
            check_prompts(args.prompt_ids, args.max_new_tokens, max_len, vocab_size, args.out)
        from export.runtime import Generator, SamplingParams
        from export.runtime.generator import MAX_NUM_BATCHED_TOKENS
        from export.runtime.tokenizer import load_tokenizer

        device = _device(args.device) if args.backend == "torch" else "cuda"
        tokenizer = load_tokenizer(args.out) if (args.out / "tokenizer.json").is_file() else None
        prompts = args.prompt_ids or [chat_ids(tokenizer, p, args.system, args.out) if args.chat
                                      else list(tokenizer.encode(p)) for p in args.prompt]
        params = [SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                 top_p=args.top_p, seed=None if args.seed is None else args.seed + i,
                                 ignore_eos=args.ignore_eos) for i in range(len(prompts))]
        if args.temperature == 0 and (args.top_k or args.top_p != 1.0 or args.seed is not None):  # valid, unused
            print("warning: --top-k, --top-p and --seed apply to sampling; with --temperature 0 (the default) "
                  "decoding is greedy and they are ignored", file=sys.stderr)
        if args.prompt is not None:
            check_prompts(prompts, args.max_new_tokens, max_len, vocab_size, args.out)  # before loading the model
        backend = make_backend(args, build, device, prompts)
        if backend.max_model_len != max_len:  # an engine's profile can be tighter than build.json says
            check_prompts(prompts, args.max_new_tokens, backend.max_model_len, backend.vocab_size, args.out)
        # every prompt in one batch: a budget of at least a token per sequence (a decode step's)
        gen = Generator(backend, tokenizer, max_num_seqs=max(1, len(prompts)),
                        max_num_batched_tokens=max(MAX_NUM_BATCHED_TOKENS, len(prompts)))
        stream = args.prompt is not None and len(prompts) == 1
        started = []  # the prompt is printed with the first token, after generate's checks (an error stays alone)

        def print_delta(i, tok, delta):
            if not started:
                print("" if args.chat else args.prompt[0], end="")
                started.append(True)
            print(delta, end="", flush=True)

        results = gen.generate(prompts, params, on_token=print_delta if stream else None)
    except (FileNotFoundError, ValueError, ImportError) as e:
        print_error(e)
        return 2
    except KeyboardInterrupt:
        print_error("interrupted")
        return 130
    if stream and started:
        print()
    elif args.prompt is not None:
        for prompt, r in zip(args.prompt, results):
            print(f"--- {prompt!r}\n{'' if args.chat else prompt}{r.text}")
    else:
        for ids, r in zip(prompts, results):
            print(f"--- ids {','.join(map(str, ids))}\nids: {','.join(map(str, r.token_ids))}")
            if r.text is not None:
                print(f"text: {r.text}")
    s = gen.stats
    n_out = sum(len(r.token_ids) for r in results)
    print(f"[{args.backend} on {backend.device}] {n_out} tokens; prefill {s.prefill_tokens} tok in "
          f"{s.prefill_s * 1e3:.1f} ms ({s.prefill_tokens_per_s:.1f} tok/s); decode {s.decode_tokens} tok at "
          f"{s.decode_tokens_per_s:.1f} tok/s; first token after {1e3 * (s.time_to_first_token_s or 0):.1f} ms",
          file=sys.stdout)
    failed = [i for i, r in enumerate(results) if r.finish_reason == "error"]
    if failed:  # logits no token can be chosen from (NaN / inf): the output is not the model's text
        which = "the prompt" if len(results) == 1 else f"prompt(s) {', '.join(map(str, failed))} (from 0)"
        print_error(f"generation failed for {which}: the model gave logits no token can be chosen from (NaN or inf) "
                    f"after {len(results[failed[0]].token_ids)} token(s); its weights or build are broken (check OUT "
                    f"with `python -m export.verify {args.out}`)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
