"""``python -m export.eval OUT [OUT ...] --against CHECKPOINT``: how much a build's quantization costs in quality.

For each build OUT (``python -m export.build`` output, run by our ``LlamaModel.from_output_dir`` on ``--device`` as
the runtime runs it there: on CUDA with SwiGLU in the quantized gate/up GEMMs' epilogue, ``swiglu_fused``) and
the unquantized CHECKPOINT (an HF directory or a ``.gguf``), on an English text that ships with tritrt
(``export.data``, >= 20k tokens): perplexity of each, next-token top-1 agreement of the build with the reference, and
the mean KL(reference || build) over every scored position. The reference is by default our own ``LlamaModel`` with
no quantization in float32 (so the numbers measure quantization and the build's dtype, not a second implementation);
``--reference hf`` uses ``transformers``' ``LlamaForCausalLM`` in float32 instead (the default on CUDA, where our
kernels run 16-bit only). The text is cut into windows of ``--window`` tokens, each evaluated from an empty cache;
the first token of a window is context only. The reference's logits are computed once per window and shared by
every OUT.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.aot.files import holds_json_with, write_atomic

from .outdir import make_output_hint


class EvalError(ValueError):
    """Bad input to the evaluation; the message says what to do."""


# --- the two sides ------------------------------------------------------------------------------------------------
class OurModel:
    """``LlamaModel`` over packed windows and a paged KV cache sized for one batch of windows (reused per call)."""

    def __init__(self, model, name: str, block_size: int = 16):
        self.model, self.name, self.block_size = model, name, block_size
        self.config = model.config
        self._cache, self._cache_blocks = None, 0

    def logits(self, windows: list[torch.Tensor]) -> torch.Tensor:
        """fp32 logits ``[sum(len(w)), vocab]`` of every position of every window."""
        from .model import make_batch

        lens = [int(w.numel()) for w in windows]
        batch = make_batch(lens, block_size=self.block_size, device=self.model.device,
                           input_ids=torch.cat(windows))
        need = int(batch.block_table.numel())
        if need > self._cache_blocks:  # one cache, grown to the largest batch; stale K/V past seq_lens is never read
            self._cache = self.model.allocate_kv_cache(need, self.block_size)
            self._cache_blocks = need
        with torch.inference_mode():
            return self.model.forward(batch, self._cache, all_logits=True).float()


class HFModel:
    """``transformers``' LlamaForCausalLM in float32 over a batch of equal-length windows."""

    def __init__(self, path, device):
        try:
            from transformers import AutoModelForCausalLM
        except ImportError as e:  # pragma: no cover - part of the export extra
            raise EvalError("--reference hf needs transformers: pip install 'tritrt[export]'") from e
        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device).eval()
        self.device, self.name = device, f"{path} (transformers, float32)"

    def logits(self, windows: list[torch.Tensor]) -> torch.Tensor:
        out = []
        with torch.inference_mode():
            for w in windows:  # the windows may differ in length (the last one)
                out.append(self.model(input_ids=w[None].to(self.device)).logits[0].float())
        return torch.cat(out)


# --- metrics ------------------------------------------------------------------------------------------------------
@dataclass
class Scores:
    """Sums over scored positions; ``summary()`` turns them into the reported numbers."""

    name: str
    quant: str = "none"
    group_size: int | None = None
    lm_head_quant: str = "none"
    dtype: str = "float32"
    swiglu_fused: bool = False
    tokens: int = 0
    nll: float = 0.0
    top1_agree: int = 0
    kl: float = 0.0
    kl_max: float = 0.0
    seconds: float = 0.0

    def add(self, logits: torch.Tensor, targets: torch.Tensor, ref_logp: torch.Tensor | None = None):
        logp = torch.log_softmax(logits, dim=-1)
        self.tokens += int(targets.numel())
        self.nll += float(-logp.gather(1, targets[:, None]).sum())
        if ref_logp is not None:
            self.top1_agree += int((logp.argmax(-1) == ref_logp.argmax(-1)).sum())
            kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)
            self.kl += float(kl.sum())
            self.kl_max = max(self.kl_max, float(kl.nan_to_num(nan=math.inf).max()))  # max() would skip a NaN
        return logp

    def summary(self, ref: Scores | None = None) -> dict:
        ppl = math.exp(self.nll / max(self.tokens, 1))
        d = {"name": self.name, "quant": self.quant, "group_size": self.group_size,
             "lm_head_quant": self.lm_head_quant, "dtype": self.dtype,
             "swiglu_fused": self.swiglu_fused, "tokens": self.tokens, "perplexity": ppl, "seconds": self.seconds}
        if ref is not None:
            ref_ppl = math.exp(ref.nll / max(ref.tokens, 1))
            d.update(perplexity_change=ppl / ref_ppl - 1.0, top1_agreement=self.top1_agree / max(self.tokens, 1),
                     kl_mean=self.kl / max(self.tokens, 1), kl_max=self.kl_max)
        return d


def windows_of(ids: list[int], window: int, bos: int | None = None) -> list[torch.Tensor]:
    """Non-overlapping windows of ``window`` tokens (a BOS first when the tokenizer adds one; the last window may be
    shorter, and one of fewer than 2 tokens is dropped: it predicts nothing)."""
    step = window - (bos is not None)
    out = []
    for i in range(0, len(ids), step):
        chunk = ([bos] if bos is not None else []) + ids[i:i + step]
        if len(chunk) >= 2:
            out.append(torch.tensor(chunk, dtype=torch.int64))
    return out


def evaluate(builds: list, reference, windows: list[torch.Tensor], batch_windows: int = 1, log=None,
             infos: list[dict] | None = None) -> dict:
    """Score ``builds`` (objects with ``.logits(windows)``) against ``reference`` on ``windows``.

    Returns ``{"reference": summary, "builds": [summary, ...]}``; a build's summary has perplexity, its change
    against the reference, top-1 agreement and mean / max KL(reference || build) per scored token."""
    infos = infos or [{} for _ in builds]
    ref = Scores(name=reference.name)
    scores = [Scores(name=b.name, **info) for b, info in zip(builds, infos)]
    t_start = time.perf_counter()
    for start in range(0, len(windows), batch_windows):
        group = windows[start:start + batch_windows]
        # Position j predicts token j + 1 of its window; the last position of each window predicts nothing.
        keep = torch.cat([torch.arange(len(w) - 1) + sum(len(x) for x in group[:i]) for i, w in enumerate(group)])
        targets = torch.cat([w[1:] for w in group])
        t0 = time.perf_counter()
        ref_logits = reference.logits(group)
        ref.seconds += time.perf_counter() - t0
        ref_logp = ref.add(ref_logits.cpu()[keep], targets)
        del ref_logits
        for b, s in zip(builds, scores):
            t0 = time.perf_counter()
            logits = b.logits(group)
            s.seconds += time.perf_counter() - t0
            s.add(logits.cpu()[keep], targets, ref_logp)
        if log and (start // batch_windows) % 10 == 9:
            done = start + len(group)
            log(f"  {done}/{len(windows)} windows ({time.perf_counter() - t_start:.0f} s)")
    return {"reference": ref.summary(), "builds": [s.summary(ref) for s in scores]}


# --- CLI ----------------------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    from .cli import ArgumentParser  # one-line errors, exit code 2, as the other export CLIs

    p = ArgumentParser(prog="python -m export.eval", description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="+", type=Path, help="build output directories (python -m export.build --out)")
    p.add_argument("--against", type=Path, required=True, metavar="CHECKPOINT",
                   help="the unquantized model: an HF checkpoint directory or a .gguf file")
    p.add_argument("--text", default="alice", help="a shipped text (alice, as-you-like-it) or a UTF-8 file path "
                   "(default: alice, 39k SmolLM2 tokens)")
    p.add_argument("--window", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--max-tokens", type=int, help="evaluate only the first N tokens of the text")
    p.add_argument("--batch", type=int, default=1, help="windows per forward (default 1)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--reference", choices=("auto", "ours", "hf"), default="auto",
                   help="what runs CHECKPOINT: our LlamaModel (fp32) or transformers (fp32); auto: ours on CPU, "
                   "hf on CUDA")
    p.add_argument("--json", type=Path, help="also write the results as JSON to this file (new, or an earlier "
                   "export.eval result, which is replaced)")
    args = p.parse_args(argv)
    if args.window < 2:
        p.error("--window must be >= 2")
    if args.batch < 1:
        p.error("--batch must be >= 1")
    if args.max_tokens is not None and args.max_tokens < 2:
        p.error("--max-tokens must be >= 2")
    return args


def load_text(spec: str) -> tuple[str, str]:
    """(text, description) of ``--text``: a shipped text's name or a file."""
    from .data import TEXTS, read_text

    if spec in TEXTS:
        return read_text(spec), f"{TEXTS[spec][0]} ({TEXTS[spec][1]})"
    path = Path(spec)
    if not path.is_file():
        raise EvalError(f"--text {spec}: neither a shipped text ({', '.join(TEXTS)}) nor a file")
    try:
        return path.read_text(encoding="utf-8"), str(path)
    except UnicodeDecodeError as e:
        raise EvalError(f"--text {spec}: not UTF-8 text ({e.reason} at byte {e.start}); pass a UTF-8 file") from None
    except OSError as e:
        raise EvalError(f"--text {spec}: cannot be read ({e.strerror}); make it readable") from None


def tokenize(tokenizer, text: str) -> tuple[list[int], int | None]:
    """The text's token ids without special tokens, and the BOS id when the tokenizer adds one."""
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]  # (no "longer than the model" warning)
    probe, bare = tokenizer("a")["input_ids"], tokenizer("a", add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and len(probe) > len(bare) and probe[0] == bos
    return ids, (bos if adds_bos else None)


def _check_device(device: str) -> torch.device:
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise EvalError(f"--device {device}: not a device; choose cpu or cuda (or cuda:N)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise EvalError(f"--device {device}: no CUDA device here; use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise EvalError(f"--device {device}: choose cpu or cuda")
    return dev


def run(args, log=print) -> dict:
    from .checkpoint import CheckpointError
    from .gguf import checkpoint_dir
    from .model import LlamaModel
    from .runtime.backends import runtime_fuses_swiglu
    from .runtime.tokenizer import load_tokenizer

    device = _check_device(args.device)
    for out in args.out:
        if not (out / "build.json").is_file() or not (out / "weights.safetensors").is_file():
            raise EvalError(f"{out} is not a build output (no build.json / weights.safetensors); "
                            f"{make_output_hint(out)}")
        if not holds_json_with(out / "build.json", ()):
            raise EvalError(f"{out}/build.json is not a JSON object (damaged?); {make_output_hint(out)}")
    ckpt = checkpoint_dir(args.against, log_fn=log)
    if not Path(ckpt).is_dir():
        raise EvalError(f"--against {args.against}: no such checkpoint directory or .gguf file")
    try:
        tokenizer = load_tokenizer(args.out[0])
    except FileNotFoundError as e:
        raise EvalError(str(e)) from None
    text, text_desc = load_text(args.text)
    ids, bos = tokenize(tokenizer, text)
    if args.max_tokens:
        ids = ids[:args.max_tokens]
    windows = windows_of(ids, args.window, bos)
    if not windows:
        raise EvalError(f"--text gives {len(ids)} tokens, too few to score; use a longer text")
    kind = args.reference if args.reference != "auto" else ("hf" if device.type == "cuda" else "ours")
    if kind == "ours" and device.type == "cuda":
        raise EvalError("--reference ours runs float32, which our CUDA kernels do not (float16/bfloat16 only); use "
                        "--reference hf on CUDA (the default there), or --device cpu")
    try:
        if kind == "ours":
            reference = OurModel(LlamaModel.from_checkpoint(ckpt, quant="none", dtype=torch.float32, device=device),
                                 f"{args.against} (our LlamaModel, float32)")
        else:
            reference = HFModel(ckpt, device)
    except CheckpointError as e:
        raise EvalError(str(e)) from None
    ref_vocab = reference.model.config.vocab_size
    builds, infos = [], []
    for out in args.out:
        build = json.loads((out / "build.json").read_text())
        model = LlamaModel.from_output_dir(out, device=device)
        if runtime_fuses_swiglu(device):  # scored as the runtime runs it: SwiGLU in the gate/up GEMMs' epilogue
            model.fuse_swiglu_()
        if device.type == "cpu" and model.dtype == torch.float32:
            # Quantized weights dequantized once (exact in fp32, the values the kernels use) instead of at every
            # call of the CPU reference GEMM: the same numbers, faster.
            model = model.for_cpu()
        if model.config.vocab_size != ref_vocab:
            raise EvalError(f"{out} has vocab {model.config.vocab_size} but {args.against} has {ref_vocab}: the "
                            f"build was not made from this checkpoint")
        longest = model.config.max_position_embeddings
        if args.window > longest:  # past the RoPE table: an IndexError on the CPU, silently zeroed q / k on CUDA
            raise EvalError(f"--window {args.window} is longer than {out}'s model takes ({longest} positions); pass "
                            f"--window {longest} or less")
        builds.append(OurModel(model, str(out)))
        infos.append({"quant": build.get("quant", "none"), "group_size": build.get("group_size"),
                      "lm_head_quant": build.get("lm_head_quant", "none"),
                      "dtype": build.get("dtype", str(model.dtype).removeprefix("torch.")),
                      "swiglu_fused": model.swiglu_fused})
    scored = sum(len(w) - 1 for w in windows)
    log(f"text: {text_desc}: {len(ids)} tokens in {len(windows)} windows of <= {args.window} ({scored} scored); "
        f"device {device}")
    log(f"reference: {reference.name}")
    result = evaluate(builds, reference, windows, args.batch, log=log, infos=infos)
    result.update(text=text_desc, text_tokens=len(ids), windows=len(windows), window=args.window, device=str(device),
                  reference_kind=kind, against=str(args.against))
    return result


def format_table(result: dict) -> str:
    ref = result["reference"]
    rows = [("build", "quant", "group", "dtype", "ppl", "d_ppl", "top-1", "KL mean", "KL max", "s"),
            ("(reference)", "none", "-", "float32", f"{ref['perplexity']:.3f}", "-", "-", "-", "-",
             f"{ref['seconds']:.0f}")]
    for b in result["builds"]:
        head = b.get("lm_head_quant", "none")
        quant = b["quant"] if head == "none" else f"{b['quant']}, head {head}"
        rows.append((b["name"], quant, str(b["group_size"] or "-"), b["dtype"], f"{b['perplexity']:.3f}",
                     f"{100 * b['perplexity_change']:+.2f}%", f"{b['top1_agreement']:.4f}", f"{b['kl_mean']:.3g}",
                     f"{b['kl_max']:.3g}", f"{b['seconds']:.0f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in rows)


def check_json_path(path: Path) -> None:
    """``--json``: a new file, or one an earlier ``export.eval`` wrote (a JSON object with ``reference`` and
    ``builds``), which this run replaces; anything else is refused before the evaluation starts, never overwritten."""
    if os.path.lexists(path) and not holds_json_with(path, ("reference", "builds")):
        raise EvalError(f"--json {path}: exists and is not an earlier export.eval result, so it is not overwritten; "
                        f"pass a new file name")
    parent = path.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise EvalError(f"--json {path}: {parent} is not a directory this user can write to; create it or pass "
                        f"another path")


def os_error_message(e: OSError) -> str:
    """What failed, on which path, and what to do: the GGUF-cache hint only where the path is in the cache (or on the
    way to it: a cache directory that cannot be created), which ``--against`` a .gguf writes; everything else
    export.eval only reads."""
    from .gguf import cache_root

    if not e.filename:
        return f"{e.strerror or e}"
    what = f"{e.strerror or e}: {e.filename}"
    failed, cache = Path(os.fsdecode(e.filename)).resolve(), cache_root().resolve()
    if failed.is_relative_to(cache) or cache.is_relative_to(failed):
        return f"{what}; free space or make it writable (the GGUF cache is $TRITRT_CACHE, default ~/.cache/tritrt)"
    if e.errno in (errno.EACCES, errno.EPERM):
        return f"{what}; make it readable by this user"
    return what


def main(argv=None) -> int:
    from .checkpoint import CheckpointError

    args = parse_args(argv)
    try:
        if args.json:
            check_json_path(args.json)
        result = run(args, log=lambda m: print(m, flush=True))  # progress shows up in a redirected log too
    except (EvalError, CheckpointError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the GGUF cache ($TRITRT_CACHE) cannot be written, a file of OUT cannot be read, ...
        print(f"error: {os_error_message(e)}", file=sys.stderr)
        return 2
    print(format_table(result))
    if args.json:
        try:
            write_atomic(args.json, json.dumps(result, indent=2).encode())
        except OSError as e:
            print(f"error: --json {args.json}: not written ({e.strerror}); the table above is the result",
                  file=sys.stderr)
            return 2
    broken = [s["name"] for s in [result["reference"], *result["builds"]]
              if not all(math.isfinite(s.get(k, 0.0)) for k in ("perplexity", "kl_mean"))]
    if broken:  # a NaN / inf logit somewhere: the numbers above measure nothing
        print(f"error: non-finite scores (NaN or inf logits) for {', '.join(broken)}: the model is broken, not "
              f"merely worse; check it with `python -m export.verify OUT`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
