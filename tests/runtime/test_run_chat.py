"""``export.run --chat``: prompts go through the tokenizer's chat template as user messages (after ``--system``); the
reply is what the generator makes of the template's token ids; a tokenizer without a template is refused. The real
model answers a question it knows."""

import json

import pytest

from export.run import main
from tests.runtime.test_generate_hf import _torch_output_dir

# A template of our own, so that the ids it renders to can be written out independently of the tokenizer's renderer
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def chat_out(tiny_dir, tmp_path_factory):
    out = _torch_output_dir(tiny_dir, tmp_path_factory.mktemp("chat") / "out")
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return out


def test_chat_prompts_are_the_templates_user_messages(chat_out, capsys):
    from export.model import LlamaModel
    from export.runtime import Generator, SamplingParams
    from export.runtime.backends import TorchBackend
    from export.runtime.tokenizer import load_tokenizer

    rc = main([str(chat_out), "--chat", "--system", "Be brief.", "--prompt", "hello there", "--prompt", "x",
               "--max-new-tokens", "6", "--device", "cpu", "--ignore-eos"])
    printed = capsys.readouterr().out
    assert rc == 0
    tok = load_tokenizer(chat_out)
    ids = [tok.encode(f"<system>Be brief.<user>{p}<assistant>", add_special_tokens=False) for p in ("hello there", "x")]
    model = LlamaModel.from_output_dir(chat_out)
    want = Generator(TorchBackend(model, block_size=16), tok).generate(
        ids, SamplingParams(max_new_tokens=6, ignore_eos=True))
    # the reply alone after each prompt's header (the chat's text is not echoed)
    assert f"--- 'hello there'\n{want[0].text}\n--- 'x'\n{want[1].text}\n" in printed


def test_chat_needs_a_template(tiny_dir, tmp_path, capsys):
    out = _torch_output_dir(tiny_dir, tmp_path / "out")
    assert main([str(out), "--chat", "--prompt", "hi", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "has no chat_template" in err and "drop --chat" in err and err.count("\n") == 1


@pytest.mark.slow
def test_smollm2_answers_a_chat_question(tmp_path, monkeypatch, capsys):
    """SmolLM2-135M-Instruct (the real GGUF, fp32 on the CPU) through its own chat template knows France's capital:
    a template applied wrongly (no assistant turn, the text continued as plain text) gives no such answer."""
    from export.gguf import GGUFError, checkpoint_dir, default_checkpoint

    try:
        gguf_file = default_checkpoint()
    except GGUFError as e:
        pytest.skip(str(e))
    monkeypatch.setenv("TRITRT_CACHE", str(tmp_path / "cache"))
    out = _torch_output_dir(checkpoint_dir(gguf_file), tmp_path / "out")
    rc = main([str(out), "--chat", "--prompt", "What is the capital of France?", "--max-new-tokens", "24",
               "--device", "cpu"])
    printed = capsys.readouterr().out
    assert rc == 0 and "Paris" in printed.split("\n[torch")[0], printed


def test_a_template_that_refuses_the_chat_is_one_error_line(chat_out, tmp_path, capsys):
    """A template that has no place for a system message raises from inside (Gemma's and Mistral's
    ``raise_exception``): one ``error:`` line and exit code 2, not a jinja2 traceback."""
    import shutil

    out = tmp_path / "out"
    shutil.copytree(chat_out, out)
    strict = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": strict + TEMPLATE}))
    assert main([str(out), "--chat", "--system", "Be brief.", "--prompt", "hi", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "System role not supported" in err and "drop --system" in err and err.count("\n") == 1


def test_a_template_saved_beside_the_tokenizer_reaches_out(tiny_dir, tmp_path):
    """transformers saves a tokenizer's chat template to chat_template.jinja, not tokenizer_config.json: the build
    copies it with the tokenizer files, so that --chat takes such a checkpoint's OUT (it said 'has no
    chat_template')."""
    import shutil
    from types import SimpleNamespace

    from export.build import _copy_hf_files
    from export.runtime.tokenizer import load_tokenizer

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, ckpt)
    tok = load_tokenizer(ckpt)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(ckpt)
    assert (ckpt / "chat_template.jinja").is_file()  # the case: the template is not in tokenizer_config.json
    out = tmp_path / "out"
    out.mkdir()
    plan = SimpleNamespace(hf_config=None, config=SimpleNamespace(tie_word_embeddings=False))
    tokenizer_files, _ = _copy_hf_files(plan, ckpt, out)  # what export.build writes to OUT
    assert "chat_template.jinja" in tokenizer_files
    assert load_tokenizer(out).chat_template == TEMPLATE
