"""The generator's text with a SentencePiece tokenizer (Llama 2, TinyLlama, Mistral): the leading space of the output's
first word, and streamed deltas that add up to the result's text through byte-fallback runs. (The tiny test models'
byte-level BPE has neither: its decoder keeps spaces and never rewrites text it already produced.)"""

import pytest
import torch

from export.runtime import Generator, SamplingParams
from tests.runtime.test_scheduler import ToyPagedBackend

PROMPT = ["▁Once", "▁upon", "▁a"]


@pytest.fixture(scope="module")
def sp_tokenizer():
    """A SentencePiece-style tokenizer with Llama 2's decoder chain: ▁ -> space, byte fallback, strip one leading
    space. Byte tokens <0x00>..<0xFF> are ids 3..258."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in [*PROMPT, "▁the", "▁time", "x"]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


class ScriptedBackend(ToyPagedBackend):
    """Answers every sequence with the same scripted tokens: the k-th generated token is ``script[k]``."""

    vocab_size = 300  # the tokenizer's 265 and some

    def __init__(self, script, prompt_len):
        super().__init__(num_blocks=16, block_size=4)
        self.script, self.prompt_len = script, prompt_len

    def forward(self, b):
        self.cache[b.slot_mapping.long()] = b.input_ids
        logits = torch.zeros(b.num_seqs, self.vocab_size)
        for i in range(b.num_seqs):
            logits[i, self.script[int(b.seq_lens[i]) - self.prompt_len]] = 1.0
        return logits


def _run(tok, script):
    prompt = tok.convert_tokens_to_ids(PROMPT)
    assert tok.decode(prompt) == "Once upon a"
    gen = Generator(ScriptedBackend(script, len(prompt)), tok)
    deltas = []
    (r,) = gen.generate([prompt], SamplingParams(max_new_tokens=len(script), ignore_eos=True),
                        on_token=lambda i, t, d: deltas.append(d))
    return r, deltas


def test_the_first_word_keeps_its_leading_space(sp_tokenizer):
    """'Once upon a' + ' the time', not 'thetime' glued to the prompt: the output is decoded after the prompt's
    last tokens, where the decoder's strip of one leading space falls on the prompt."""
    r, deltas = _run(sp_tokenizer, sp_tokenizer.convert_tokens_to_ids(["▁the", "▁time"]))
    assert r.text == " the time" and "".join(deltas) == r.text


@pytest.mark.parametrize("pieces, text", [
    (["<0xC3>", "<0xA9>", "▁the"], "é the"),  # a complete character from two byte tokens
    (["<0xC3>", "<0xA9>", "<0xE2>", "x"], "\ufffd\ufffd\ufffdx"),  # a stray lead byte: the run turns into U+FFFD x 3
    (["▁the", "<0xC3>"], " the\ufffd"),  # ends mid-character: sent with the last token
])
def test_streamed_deltas_add_up_to_the_text_through_byte_runs(sp_tokenizer, pieces, text):
    """Llama 2's byte-fallback decoder decodes a run of byte tokens as a whole and rewrites it when a stray byte
    follows a complete character: the stream holds a run back until it ends, so it never sends 'é' and then the
    run's U+FFFDs (before, the deltas were ['', 'é', '', '\\ufffd\\ufffd\\ufffdx'])."""
    r, deltas = _run(sp_tokenizer, sp_tokenizer.convert_tokens_to_ids(pieces))
    assert r.text == text and "".join(deltas) == text


def test_streaming_decodes_a_window_not_the_whole_output(sp_tokenizer, monkeypatch):
    """Each streamed token decodes the tokens since the last text sent (and the prompt's context once), not the whole
    output so far: over 60 tokens every decode but the final one (the result's text, once) is at most the context and
    a few tokens long; the deltas still add up to the text. (Decoding everything at every token cost O(length) a
    token: O(length^2) a request.)"""
    from export.runtime.generator import PROMPT_CONTEXT

    lengths = []
    decode = type(sp_tokenizer).decode

    def counting(self, ids, *a, **k):
        lengths.append(len(ids))
        return decode(self, ids, *a, **k)

    monkeypatch.setattr(type(sp_tokenizer), "decode", counting)
    script = sp_tokenizer.convert_tokens_to_ids(["▁the", "▁time", "<0xC3>", "<0xA9>", "x"] * 12)  # 60: 16 blocks of 4
    r, deltas = _run(sp_tokenizer, script)
    assert r.text == " the timeéx" * 12 and "".join(deltas) == r.text
    long = [n for n in lengths if n > PROMPT_CONTEXT + 3]
    assert len(long) <= 2 * 2 and max(lengths) >= len(script), lengths  # the result's decodes: stream end + result()


@pytest.mark.parametrize("pieces, text", [
    (["▁the", "</s>", "▁time", "x"], " the timex"),  # ignore_eos: the next word keeps its space
    (["<0x20>", "<s>", "<0xA9>", "▁the"], "\ufffd\ufffd the"),  # the skipped token joins the bytes around it in one run
    (["<0xC3>", "<unk>", "<0xA9>", "▁a"], "é a"),
])
def test_skipped_special_tokens_mid_output_stream_as_the_text(sp_tokenizer, pieces, text):
    """A special token in the output decodes to '' (skip_special_tokens): the stream neither starts a window at it
    (the next word lost its leading space, and the end re-sent the whole text: ' the', '', 'time', ' the timex') nor
    decodes the byte run it splits in two (a space sent, then rewritten into U+FFFD by the run's decode)."""
    r, deltas = _run(sp_tokenizer, sp_tokenizer.convert_tokens_to_ids(pieces))
    assert r.text == text
    assert all(r.text.startswith("".join(deltas[:k])) for k in range(len(deltas) + 1)), deltas  # never retracted
    assert "".join(deltas) == r.text, deltas


def test_a_decode_that_rewrites_sent_text_does_not_stall_the_stream(tmp_path):
    """clean_up_tokenization_spaces (Llama-3's tokenizer_config sets it; transformers 4.x applies it to BPE, 5.x only
    when forced) rewrites ' .' to '.': a window whose sent text ends in a lone space token, followed by '.', is never
    'clean' again. The stream must keep sending (38e85d5..782adf1: nothing after ' ', every later token held and the
    window decoded whole at each one, the end sending nothing)."""
    from export.tiny import make_tokenizer

    tok = make_tokenizer(tmp_path)
    tok.clean_up_tokenization_spaces = True
    tok.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True  # transformers >= 5
    ids = tok.convert_tokens_to_ids(["H", "i", "Ġ", "."] + ["Ġ", "t", "h", "e"] * 5)
    if tok.decode(ids[:4]) != "Hi.":
        pytest.skip("this transformers does not apply clean_up_tokenization_spaces to BPE")
    prompt = tok.convert_tokens_to_ids(["H", "i"])
    gen = Generator(ScriptedBackend(ids, len(prompt)), tok)
    deltas = []
    (r,) = gen.generate([prompt], SamplingParams(max_new_tokens=len(ids), ignore_eos=True),
                        on_token=lambda i, t, d: deltas.append(d))
    assert sum(bool(d) for d in deltas[4:]) >= 10, deltas  # streaming went on after the rewrite


@pytest.mark.parametrize("pipeline", [False, True])
@pytest.mark.parametrize("pieces, text", [
    (["▁the", "<0xC3>", "<0xA9>"], " theé"),  # a complete character in a byte run the error cut short
    (["▁the", "<0xC3>"], " the\ufffd"),  # a stray lead byte
    (["▁the", "▁time"], " the time"),  # nothing held back: the last call's text is ""
])
def test_a_request_that_ends_in_an_error_streams_the_text_it_held_back(sp_tokenizer, pieces, text, pipeline):
    """Unusable logits (a NaN) after a byte run: the stream held the run back waiting for the token that ends it, which
    never comes; the result's text has the run. The stream ends in one call with token NO_TOKEN and the held-back
    text, so that the deltas add up to the result's text (before: ' the' streamed, ' theé' the result: a streaming
    client, `python -m export.run`'s single prompt, never showed the 'é' the model did generate)."""
    import dataclasses

    from export.runtime.sampling import NO_TOKEN

    script = sp_tokenizer.convert_tokens_to_ids(pieces)
    prompt = sp_tokenizer.convert_tokens_to_ids(PROMPT)

    class NaNAfterScript(ScriptedBackend):
        supports_device_tokens = pipeline

        def forward(self, b, input_ids=None):
            if input_ids is not None:
                b = dataclasses.replace(b, input_ids=input_ids)
            self.cache[b.slot_mapping.long()] = b.input_ids
            logits = torch.zeros(b.num_seqs, self.vocab_size)
            for i in range(b.num_seqs):
                k = int(b.seq_lens[i]) - self.prompt_len
                logits[i, self.script[k] if k < len(self.script) else 7] = 1.0 if k < len(self.script) else float("nan")
            return logits

    gen = Generator(NaNAfterScript(script, len(prompt)), sp_tokenizer)
    assert gen.pipeline == pipeline
    calls = []
    (r,) = gen.generate([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True),
                        on_token=lambda i, t, d: calls.append((t, d)))
    assert r.finish_reason == "error" and r.token_ids == script and r.text == text
    assert "".join(d for _, d in calls) == text, calls
    assert [t for t, _ in calls] == script + [NO_TOKEN]
    assert gen.blocks.num_free_blocks == gen.blocks.num_blocks
