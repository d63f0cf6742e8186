"""Quality evaluation (export.eval) on the tiny model: a build identical to its checkpoint scores KL 0 and top-1 1.0,
an int4 build does not; the reference run by transformers agrees with ours; windows; the CLI's one-line errors; the
shipped texts are the recorded files and share no passage. The slow test runs the CLI on SmolLM2."""

import hashlib
import json
import math
import re

import pytest
import torch

from export import eval as ev
from export.data import CALIBRATION_TEXT, DATA_DIR, EVAL_TEXT, TEXTS, read_text

FAST = ["--max-tokens", "400", "--window", "96"]


def _build(checkpoint, out, quant, *extra):
    from export.build import main as build_main

    argv = ["--checkpoint", str(checkpoint), "--quant", quant, "--dtype", "float32", "--out", str(out), "--no-engine",
            *extra]
    assert build_main(argv) == 0, f"export.build {' '.join(argv)} failed"
    return out


@pytest.fixture(scope="module")
def builds(tiny_dirs, tmp_path_factory):
    ckpt = tiny_dirs("llama")
    root = tmp_path_factory.mktemp("eval_builds")
    return ckpt, _build(ckpt, root / "none", "none"), _build(ckpt, root / "int4", "int4", "--group-size", "32",
                                                                   "--int4-method", "rtn")


def _eval(capsys, *argv):
    rc = ev.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_identical_build_scores_zero_kl_and_full_agreement(builds, capsys, tmp_path):
    ckpt, none, _ = builds
    rc, out, err = _eval(capsys, none, "--against", ckpt, *FAST, "--json", tmp_path / "r.json")
    assert rc == 0, err
    r = json.loads((tmp_path / "r.json").read_text())
    b = r["builds"][0]
    assert r["reference_kind"] == "ours" and r["windows"] == 5 and b["tokens"] == 400 - 5
    assert b["top1_agreement"] == 1.0
    assert b["kl_mean"] < 1e-6 and abs(b["perplexity_change"]) < 1e-5, b
    # random weights over a 320-token vocabulary: perplexity near the vocabulary size, never below 1
    assert 100 < r["reference"]["perplexity"] < 1000
    assert "(reference)" in out and str(none) in out


def test_int4_build_costs_quality(builds, capsys, tmp_path):
    ckpt, none, int4 = builds
    rc, _, err = _eval(capsys, none, int4, "--against", ckpt, *FAST, "--batch", "2", "--json", tmp_path / "r.json")
    assert rc == 0, err
    ident, q = json.loads((tmp_path / "r.json").read_text())["builds"]
    assert q["quant"] == "int4" and q["group_size"] == 32
    assert q["kl_mean"] > 1e-4 > ident["kl_mean"]
    assert q["kl_max"] >= q["kl_mean"] and 0.5 < q["top1_agreement"] <= 1.0
    assert q["tokens"] == ident["tokens"]


def test_quantized_head_is_scored_and_labelled(builds, capsys, tmp_path):
    """A build with ``--lm-head-quant``: its head's rounding costs quality on top of the layers' (same layers, so the
    difference is the head's), and the table and the JSON say which head was scored."""
    ckpt, _, int4 = builds
    head = _build(ckpt, tmp_path / "int4_head", "int4", "--group-size", "32", "--int4-method", "rtn",
                  "--lm-head-quant", "int4")
    rc, out, err = _eval(capsys, int4, head, "--against", ckpt, *FAST, "--json", tmp_path / "r.json")
    assert rc == 0, err
    plain, q = json.loads((tmp_path / "r.json").read_text())["builds"]
    assert (plain["lm_head_quant"], q["lm_head_quant"]) == ("none", "int4")
    assert q["kl_mean"] > plain["kl_mean"] and q["tokens"] == plain["tokens"]
    assert "int4, head int4" in out


def test_build_is_scored_as_the_runtime_runs_it(builds, capsys, tmp_path, monkeypatch):
    """Where the runtime fuses SwiGLU into the quantized gate/up GEMMs (CUDA; forced here on the CPU for a float16
    build, which the CPU runs as it is), eval scores the fused model and says so; elsewhere the model as loaded."""
    import export.runtime.backends as backends

    ckpt, _, _ = builds
    fp16 = _build(ckpt, tmp_path / "int4_fp16", "int4", "--group-size", "32", "--int4-method", "rtn", "--dtype",
                  "float16")
    runs = {}
    for fused in (False, True):
        monkeypatch.setattr(backends, "runtime_fuses_swiglu", lambda device, fused=fused: fused)
        rc, _, err = _eval(capsys, fp16, "--against", ckpt, *FAST, "--json", tmp_path / f"{fused}.json")
        assert rc == 0, err
        runs[fused] = json.loads((tmp_path / f"{fused}.json").read_text())["builds"][0]
    assert runs[True]["swiglu_fused"] and not runs[False]["swiglu_fused"]
    # the same weights and activation, SwiGLU in the GEMM's epilogue instead of after it: the two differ by float16
    # roundings of the gate/up products (here 2e-6 in perplexity change), far less than int4 itself costs (1.6e-3)
    assert (abs(runs[True]["perplexity_change"] - runs[False]["perplexity_change"])
            < 0.1 * abs(runs[False]["perplexity_change"]))
    assert runs[True]["top1_agreement"] > 0.9 * runs[False]["top1_agreement"]


def test_transformers_reference_agrees_with_ours(builds):
    ckpt, none, _ = builds
    args = ev.parse_args([str(none), "--against", str(ckpt), *FAST])
    ours = ev.run(args, log=lambda m: None)
    args.reference = "hf"
    hf = ev.run(args, log=lambda m: None)
    assert hf["reference_kind"] == "hf"
    assert abs(hf["reference"]["perplexity"] / ours["reference"]["perplexity"] - 1) < 1e-4
    assert hf["builds"][0]["kl_mean"] < 1e-6


def test_windows_of():
    ids = list(range(10))
    w = ev.windows_of(ids, 4)
    assert [x.tolist() for x in w] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    w = ev.windows_of(ids, 4, bos=99)  # BOS takes one slot of each window; every text token is still seen once
    assert [x.tolist() for x in w] == [[99, 0, 1, 2], [99, 3, 4, 5], [99, 6, 7, 8], [99, 9]]
    # [8] predicts nothing
    assert [x.tolist() for x in ev.windows_of(list(range(9)), 4)] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_scores_match_a_direct_computation():
    torch.manual_seed(0)
    ref_logits, logits = torch.randn(7, 11), torch.randn(7, 11)
    targets = torch.randint(0, 11, (7,))
    ref, s = ev.Scores("ref"), ev.Scores("b")
    ref_logp = ref.add(ref_logits, targets)
    s.add(logits, targets, ref_logp)
    d = s.summary(ref)
    p, q = ref_logits.softmax(-1), logits.softmax(-1)
    kl = (p * (p.log() - q.log())).sum(-1)
    assert d["kl_mean"] == pytest.approx(float(kl.mean()), rel=1e-5)
    assert d["top1_agreement"] == pytest.approx(float((ref_logits.argmax(-1) == logits.argmax(-1)).float().mean()))
    nll = torch.nn.functional.cross_entropy(logits, targets)
    assert d["perplexity"] == pytest.approx(float(nll.exp()), rel=1e-5)


@pytest.mark.parametrize("case", ["no_out", "no_checkpoint", "no_text", "cuda", "window", "ours_on_cuda",
                                  "bad_device", "text_not_utf8", "json_dir_missing", "build_json_damaged",
                                  "window_too_long"])
def test_cli_errors_are_one_line_exit_2(builds, capsys, tmp_path, case):
    import shutil

    ckpt, none, _ = builds
    if case == "text_not_utf8":
        (tmp_path / "latin1.txt").write_bytes("caf\u00e9 au lait".encode("latin-1"))
    if case == "build_json_damaged":  # a copy of the build whose build.json was cut short
        shutil.copytree(none, tmp_path / "damaged")
        (tmp_path / "damaged" / "build.json").write_text('{"quant": "no')
    argv = {
        "no_out": [tmp_path / "missing", "--against", ckpt],
        "no_checkpoint": [none, "--against", tmp_path / "nope"],
        "no_text": [none, "--against", ckpt, "--text", tmp_path / "nope.txt"],
        "cuda": [none, "--against", ckpt, "--device", "cuda"],
        "window": [none, "--against", ckpt, "--window", "1"],
        "ours_on_cuda": [none, "--against", ckpt, "--device", "cuda", "--reference", "ours"],
        "bad_device": [none, "--against", ckpt, "--device", "gpu0"],
        "text_not_utf8": [none, "--against", ckpt, "--text", tmp_path / "latin1.txt"],
        "json_dir_missing": [none, "--against", ckpt, "--json", tmp_path / "results" / "eval.json"],
        "build_json_damaged": [tmp_path / "damaged", "--against", ckpt],
        # past the model's positions (the RoPE table): a traceback on the CPU, silently zeroed q / k on CUDA
        "window_too_long": [none, "--against", ckpt, "--window", "100000"],
    }[case]
    if case == "ours_on_cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA (on CPU --device cuda is refused first)")
    if case == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    if case == "window":
        with pytest.raises(SystemExit) as e:
            ev.main([str(a) for a in argv])
        assert e.value.code == 2
        return
    rc, out, err = _eval(capsys, *argv)
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert {"no_out": "python -m export.build", "no_checkpoint": "no such checkpoint", "no_text": "shipped text",
            "cuda": "--device cpu", "ours_on_cuda": "--reference hf", "bad_device": "choose cpu or cuda",
            "text_not_utf8": "not UTF-8", "json_dir_missing": "create it or pass another path",
            "build_json_damaged": "build.json is not a JSON object",
            "window_too_long": "--window 100000 is longer than"}[case] in lines[0]
    assert not (tmp_path / "results").exists()


def test_shipped_texts_are_the_recorded_files_and_disjoint():
    sources = (DATA_DIR / "SOURCES.md").read_text()
    for fname, _ in TEXTS.values():
        digest = hashlib.sha256((DATA_DIR / fname).read_bytes()).hexdigest()
        assert f"`{fname}`" in sources and digest in sources, f"{fname} changed; update SOURCES.md"
    ev_lines = {ln.strip() for ln in read_text(EVAL_TEXT).splitlines() if len(ln.strip()) > 40}
    cal_lines = {ln.strip() for ln in read_text(CALIBRATION_TEXT).splitlines() if len(ln.strip()) > 40}
    assert not ev_lines & cal_lines
    assert len(re.findall(r"\w+", read_text(EVAL_TEXT))) > 20000  # words; SmolLM2's tokenizer gives 39357 tokens


@pytest.mark.slow
def test_smollm2_int8_eval(tmp_path, capsys, monkeypatch):
    """The real model end to end on 1k tokens: GGUF -> build int8 -> eval against the GGUF."""
    from export.gguf import GGUFError, default_checkpoint

    try:
        gguf_file = default_checkpoint()
    except GGUFError as e:
        pytest.skip(str(e))
    monkeypatch.setenv("TRITRT_CACHE", str(tmp_path / "cache"))
    from export.gguf import checkpoint_dir

    out = _build(checkpoint_dir(gguf_file), tmp_path / "int8", "int8")
    rc, _, err = _eval(capsys, out, "--against", gguf_file, "--max-tokens", "1024", "--json", tmp_path / "r.json")
    assert rc == 0, err
    r = json.loads((tmp_path / "r.json").read_text())
    b = r["builds"][0]
    assert r["text_tokens"] == 1024 and 5 < r["reference"]["perplexity"] < 100
    assert 0 < b["kl_mean"] < 0.05 and b["top1_agreement"] > 0.9 and abs(b["perplexity_change"]) < 0.05, b


@pytest.mark.parametrize("victim", ["weights", "other_json", "directory"])
def test_json_never_overwrites_a_file_it_did_not_write(builds, capsys, tmp_path, monkeypatch, victim):
    """--json pointed at a checkpoint file, another program's JSON or a directory: refused before the evaluation
    runs (one line, exit 2), the file as it was."""
    ckpt, none, _ = builds
    path = tmp_path / {"weights": "model.safetensors", "other_json": "config.json", "directory": "d"}[victim]
    if victim == "directory":
        path.mkdir()
    else:
        path.write_bytes(b"\x00weights" if victim == "weights" else b'{"hidden_size": 64}')
    before = path.read_bytes() if path.is_file() else None
    monkeypatch.setattr(ev, "run", lambda *a, **k: pytest.fail("evaluated before refusing --json"))
    rc, out, err = _eval(capsys, none, "--against", ckpt, *FAST, "--json", path)
    assert rc == 2 and out == "" and err.startswith("error: --json ") and "not overwritten" in err
    assert (path.read_bytes() == before) if before is not None else path.is_dir()


def test_json_replaces_an_earlier_eval_result_and_leaves_no_temp_file(builds, capsys, tmp_path):
    ckpt, none, _ = builds
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"reference": {"perplexity": 1.0}, "builds": []}))
    rc, _, err = _eval(capsys, none, "--against", ckpt, *FAST, "--json", path)
    assert rc == 0, err
    assert len(json.loads(path.read_text())["builds"]) == 1 and [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_an_os_error_names_what_failed_and_blames_the_gguf_cache_only_for_the_cache(builds, capsys, tmp_path,
                                                                                     monkeypatch):
    """Every OSError was "<strerror>: <file>; free space or make it writable (the GGUF cache is $TRITRT_CACHE, ...)",
    also for an OUT file that cannot be read (EACCES, raised by the loader here: chmod does not stop root). Now: the
    file and what to do about it; the cache hint only for a path in the cache or on the way to it."""
    import errno

    from export import quantize
    from export.gguf import cache_root

    ckpt, none, _ = builds
    monkeypatch.setenv("TRITRT_CACHE", str(tmp_path / "cache"))

    def unreadable(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(quantize, "load_weights", unreadable)
    rc, out, err = _eval(capsys, none, "--against", ckpt, *FAST)
    assert rc == 2 and out == ""
    assert err.strip().splitlines() == [f"error: Permission denied: {none / 'weights.safetensors'}; make it "
                                        "readable by this user"]
    for path in (cache_root() / "m-1234" / "model.safetensors", tmp_path / "cache"):
        line = ev.os_error_message(OSError(errno.ENOSPC, "No space left on device", str(path)))
        assert line.startswith(f"No space left on device: {path}; ") and "$TRITRT_CACHE" in line, line
    assert ev.os_error_message(OSError(errno.EIO, "Input/output error")) == "Input/output error"


def test_json_that_cannot_be_written_after_the_run_says_so(builds, capsys, tmp_path, monkeypatch):
    """A --json write that fails after the evaluation (the disk filled meanwhile): one error line, exit 2, and the
    printed table is the result; no temp file left."""
    ckpt, none, _ = builds
    path = tmp_path / "r.json"

    def disk_full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ev, "write_atomic", disk_full)
    rc, out, err = _eval(capsys, none, "--against", ckpt, *FAST, "--json", path)
    assert rc == 2 and "ppl" in out and "(reference)" in out
    assert err.strip().splitlines() == [f"error: --json {path}: not written (No space left on device); the table "
                                        "above is the result"]
    assert list(tmp_path.iterdir()) == []


class _NextTokenModel:
    """Logits that put (nearly) all mass on a known next token of each window: the next one in the text, or, with
    ``shift``, another position's. Scoring it tests evaluate's alignment of logits with labels."""

    def __init__(self, text: torch.Tensor, vocab: int, shift: int = 1, name: str = "oracle"):
        self.text, self.vocab, self.shift, self.name = text, vocab, shift, name

    def logits(self, windows):
        rows = []
        for w in windows:
            start = _find(self.text, w)
            nxt = self.text[start + self.shift:start + self.shift + len(w)]
            nxt = torch.cat([nxt, nxt.new_zeros(len(w) - len(nxt))])
            rows.append(torch.nn.functional.one_hot(nxt, self.vocab).float() * 30.0)
        return torch.cat(rows)


def _find(text: torch.Tensor, w: torch.Tensor) -> int:
    return next(i for i in range(len(text) - len(w) + 1) if torch.equal(text[i:i + len(w)], w))


def test_position_j_is_scored_against_token_j_plus_1():
    """A model that knows each next token scores perplexity ~1 and one that predicts the current token scores ~e^30:
    with random weights (the CLI tests) the perplexity is near the vocabulary size whichever token is the label."""
    from export.eval import evaluate, windows_of

    gen = torch.Generator().manual_seed(0)
    text = torch.randint(0, 50, (200,), generator=gen)
    windows = windows_of(text.tolist(), 40)
    oracle = _NextTokenModel(text, 50)
    r = evaluate([_NextTokenModel(text, 50, shift=0, name="current")], oracle, windows)
    assert r["reference"]["perplexity"] < 1.001
    assert r["builds"][0]["perplexity"] > 1e10 and r["builds"][0]["top1_agreement"] < 0.1


def test_a_nan_logit_row_is_not_skipped_by_kl_max():
    """Python's max(prev, nan) keeps prev: a NaN row read kl_max 0.0 beside kl_mean nan."""
    from export.eval import Scores

    ref = torch.log_softmax(torch.randn(3, 8), -1)
    logits = torch.randn(3, 8)
    logits[1] = float("nan")
    s = Scores(name="b")
    s.add(logits, torch.tensor([1, 2, 3]), ref)
    assert math.isinf(s.kl_max) or math.isnan(s.kl_max)
