"""``python -m export.build``: HF checkpoint -> (quantized) weights -> ONNX (plugin + reference) -> kernels -> engine.

With no ``--checkpoint`` it first writes the built-in tiny LLaMA (seeded, random) to a temp dir, so the whole path runs
on a fresh machine. Everything goes to a temp dir beside OUT that is renamed to OUT at the end: a failed build leaves an
existing OUT as it was. Steps that cannot run here (the AOT kernels under Triton's interpreter, the engine without
TensorRT) are skipped with the reason, and the summary at the end lists what was produced and what was skipped.
``--from-onnx OUT`` builds only the engine of an existing OUT (on the machine that has TensorRT).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

MODELS = ("llama",)
QUANTS = ("none", "int8", "int4")
DTYPES = ("auto", "float16", "bfloat16", "float32")
# The built-in tiny model: every dim a multiple of 128 so int4 works at the default group size; head_dim 32.
TINY_BUILD = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=2, vocab_size=320, max_position_embeddings=512)


class BuildError(RuntimeError):
    """A build cannot proceed; the message says what to do."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m export.build", description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=MODELS, default="llama", help="model family (default: llama)")
    p.add_argument("--quant", choices=QUANTS, default="none", help="weight-only quantization of the linear layers")
    p.add_argument("--checkpoint", type=Path, help="local HF model directory (default: build the built-in tiny LLaMA)")
    p.add_argument("--out", type=Path, help="output directory (default: ./build/<model>-<quant>)")
    p.add_argument("--sm", type=int, help="target compute capability for the AOT kernels, e.g. 90 (default: this "
                   "machine's GPU, else 90)")
    p.add_argument("--dtype", choices=DTYPES, default="auto", help="activation/weight dtype (default: the "
                   "checkpoint's; the GPU kernels need float16 or bfloat16)")
    p.add_argument("--group-size", type=int, default=128, help="int4 group size along in_features (32, 64, 128)")
    p.add_argument("--block-size", type=int, default=16, help="KV-cache block size in tokens (power of two <= 128)")
    p.add_argument("--max-num-tokens", type=int, default=2048, help="most tokens in one step (prefill chunk)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="most sequences in one step (decode batch)")
    p.add_argument("--max-seq-len", type=int, help="longest sequence (default: min(max_position_embeddings, 8192))")
    p.add_argument("--num-blocks", type=int, help="largest KV-cache pool in blocks the engine accepts "
                   "(default: max-num-seqs full sequences)")
    p.add_argument("--seed", type=int, default=0, help="seed of the built-in tiny model")
    p.add_argument("--timing-cache", type=Path, help="TensorRT timing cache file (default: ~/.cache/tritrt/...)")
    p.add_argument("--no-engine", action="store_true", help="skip the TensorRT engine even if TensorRT is present")
    p.add_argument("--from-onnx", type=Path, metavar="OUT", help="only build model.engine for an existing OUT")
    args = p.parse_args(argv)
    if args.group_size not in (32, 64, 128):
        p.error(f"--group-size {args.group_size}: choose 32, 64 or 128")
    if args.block_size < 1 or args.block_size > 128 or args.block_size & (args.block_size - 1):
        p.error(f"--block-size {args.block_size}: choose a power of two in 1..128")
    for name in ("max_num_tokens", "max_num_seqs", "max_seq_len", "num_blocks"):
        v = getattr(args, name)
        if v is not None and v < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def default_sm() -> tuple[int, str]:
    import torch

    from kernels._utils import device_sm

    if torch.cuda.is_available():
        return device_sm(), "this machine's GPU"
    return 90, "no GPU here: H100 default"


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _limits(args, config) -> dict:
    max_seq_len = args.max_seq_len or min(config.max_position_embeddings, 8192)
    if max_seq_len > config.max_position_embeddings:
        raise BuildError(f"--max-seq-len {max_seq_len} exceeds the model's max_position_embeddings "
                         f"{config.max_position_embeddings}")
    per_seq = -(-max_seq_len // args.block_size)
    return dict(max_seq_len=max_seq_len, max_num_tokens=max(args.max_num_tokens, args.max_num_seqs),
                max_num_seqs=args.max_num_seqs, max_blocks_per_seq=per_seq,
                num_blocks=args.num_blocks or args.max_num_seqs * per_seq + 1)


def _export_onnx(model, tmp: Path, args, log) -> list[str]:
    try:
        from .onnx_export import export_onnx
    except ImportError as e:
        return [f"ONNX export skipped: export.onnx_export is not available ({e})"]
    for flavour in ("plugin", "reference"):
        path = tmp / f"model.{flavour}.onnx"
        t0 = time.perf_counter()
        export_onnx(model, model.config, path, flavour, block_size=args.block_size, dtype=model.dtype,
                    quant=model.quant, group_size=model.group_size if model.quant == "int4" else None)
        log(f"  {path.name} ({time.perf_counter() - t0:.1f} s)")
    return []


def _aot_kernels(tmp: Path, sm: int, log) -> list[str]:
    from kernels.aot.compile import interpreter_enabled

    if interpreter_enabled():
        return ["AOT kernels skipped: TRITON_INTERPRET=1 is set (AOT needs Triton's compiler; unset it)"]
    try:
        from kernels.aot.__main__ import build as aot_build
    except ImportError as e:
        return [f"AOT kernels skipped: kernels.aot is not available ({e})"]
    try:
        manifest = aot_build(sm, tmp / "kernels", log=lambda m: None)
    except SystemExit as e:  # kernels.aot reports bad input (e.g. an unsupported --sm) as its CLI would
        raise BuildError(str(e)) from None
    log(f"  kernels/manifest.json ({len(manifest['kernels'])} kernels, sm_{sm})")
    return []


def _engine(work_dir: Path, build: dict, args, log, out: Path) -> list[str]:
    from .engine import TensorRTNotFound, build_engine, default_timing_cache

    if args.no_engine:
        return ["engine skipped: --no-engine"]
    try:
        build_engine(work_dir / "model.plugin.onnx", work_dir / "model.engine", build,
                     timing_cache=args.timing_cache or default_timing_cache(), log=log, out_dir=out)
    except TensorRTNotFound as e:
        return [f"engine skipped: {e}"]
    return []


def _replace_dir(tmp: Path, out: Path) -> None:
    """Move ``tmp`` to ``out``; an existing ``out`` is removed only once the new one is in place."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    try:
        os.replace(tmp, out)
    except OSError:
        if old is not None:
            os.replace(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def run_build(args, log=print) -> tuple[Path, list[str]]:
    """Build OUT; returns (OUT, skipped-step notes). Raises CheckpointError / BuildError / ValueError on bad input."""
    import torch

    from .checkpoint import load_checkpoint, make_tiny_llama
    from .model import LlamaModel
    from .quantize import save_weights

    out = (args.out or Path("build") / f"{args.model}-{args.quant}").resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    skipped: list[str] = []
    try:
        ckpt_dir = args.checkpoint
        if ckpt_dir is None:
            ckpt_dir = make_tiny_llama(tmp / "_tiny_checkpoint", seed=args.seed, **TINY_BUILD)
            log(f"no --checkpoint: built-in tiny LLaMA (seed {args.seed})")
        ckpt = load_checkpoint(ckpt_dir)
        dtype_name = ckpt.config.torch_dtype if args.dtype == "auto" else args.dtype
        if dtype_name not in ("float16", "bfloat16", "float32"):
            raise BuildError(f"checkpoint dtype '{dtype_name}' is not supported; pass --dtype float16 or bfloat16")
        t0 = time.perf_counter()
        model = LlamaModel.from_checkpoint(ckpt_dir, quant=args.quant, dtype=getattr(torch, dtype_name),
                                           group_size=args.group_size)
        if ckpt.quantization_config and model.quant != args.quant:
            log(f"note: {ckpt.quantization_config.get('quant_method')} checkpoint: its own {model.quant} "
                f"(group {model.group_size}) weights are used; --quant {args.quant} ignored")
        log(f"loaded {ckpt_dir} ({ckpt.config.num_layers} layers, hidden {ckpt.config.hidden_size}, quant "
            f"{model.quant}, {dtype_name}) in {time.perf_counter() - t0:.1f} s")
        sm, sm_why = (args.sm, "--sm") if args.sm else default_sm()
        build = dict(tritrt_version=1, model=args.model, quant=model.quant,
                     group_size=model.group_size if model.quant == "int4" else None, dtype=dtype_name,
                     block_size=args.block_size, sm=sm, **_limits(args, ckpt.config), config=ckpt.config.to_dict(),
                     source=str(Path(ckpt_dir).resolve()) if args.checkpoint else f"built-in tiny (seed {args.seed})")
        # HF files first: config.json and the tokenizer, as the runtime and the verifier read them.
        hf_config = dict(ckpt.hf_config)
        hf_config.pop("quantization_config", None)  # OUT's weights are ours, in weights.safetensors
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
        for f in ckpt.tokenizer_files:
            shutil.copy2(f, tmp / f.name)
        save_weights(model.weights, tmp / "weights.safetensors")
        skipped += _export_onnx(model, tmp, args, log)
        skipped += _aot_kernels(tmp, sm, log)
        shutil.rmtree(tmp / "_tiny_checkpoint", ignore_errors=True)
        build["sm_source"] = sm_why
        if any(s.startswith("ONNX") for s in skipped):
            skipped.append("engine skipped: no ONNX to build it from")
        else:
            skipped += _engine(tmp, build, args, log, out)
        # Top-level files, and the kernels by their manifest (which lists every PTX/cubin).
        build["files"] = sorted([p.name for p in tmp.iterdir() if p.is_file()] + ["build.json"] +
                                (["kernels/manifest.json"] if (tmp / "kernels" / "manifest.json").exists() else []))
        build["skipped"] = skipped
        (tmp / "build.json").write_text(json.dumps(build, indent=2))
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out, skipped


def engine_only(out: Path, args, log=print) -> list[str]:
    """``--from-onnx OUT``: build OUT/model.engine from OUT/model.plugin.onnx and OUT/build.json."""
    if not (out / "build.json").exists() or not (out / "model.plugin.onnx").exists():
        raise BuildError(f"{out} lacks build.json or model.plugin.onnx; run `python -m export.build --out {out}` first")
    build = json.loads((out / "build.json").read_text())
    return _engine(out, build, args, log, out)


def summarize(out: Path, skipped: list[str]) -> str:
    lines = [f"OUT: {out}"]
    files = sorted(p for p in out.rglob("*") if p.is_file())
    kernels = [p for p in files if p.parent.name == "kernels"]
    for p in files:
        if p not in kernels:
            lines.append(f"  {p.relative_to(out)!s:32s} {_human(p.stat().st_size):>10s}")
    if kernels:
        lines.append(f"  {'kernels/ (' + str(len(kernels)) + ' files)':32s} "
                     f"{_human(sum(p.stat().st_size for p in kernels)):>10s}")
    lines += ["skipped:"] + [f"  - {s}" for s in skipped] if skipped else ["skipped: nothing"]
    return "\n".join(lines)


def main(argv=None) -> int:
    from .checkpoint import CheckpointError

    args = parse_args(argv)
    try:
        if args.from_onnx:
            out, skipped = args.from_onnx, engine_only(args.from_onnx, args)
        else:
            out, skipped = run_build(args)
    except (CheckpointError, BuildError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(summarize(out, skipped))
    return 0


if __name__ == "__main__":
    sys.exit(main())
