"""The generation loop: tokenize, schedule, run a backend step, sample, stream, stop.

``Generator(backend, tokenizer).generate(prompts, SamplingParams(...), on_token=...)`` returns one
``GenerationResult`` per prompt (token ids, text, why it stopped). Any backend with the ``Backend`` interface
(``export.runtime.backends``) runs it: the torch model or the TensorRT engine.

Pipelined decode (backends with ``supports_device_tokens``, greedy requests): a decode step's tokens stay on the
device as the next step's input ids, and that next step is launched before the host reads them, so the host's work
between two steps (reading tokens, stop checks, scheduling, the graph launch) overlaps the GPU's instead of leaving
it idle. The host learns each token one step later; a sequence that stops meanwhile has computed one discarded
token. Only a steady decode is pipelined: a step whose batch would change (a request to admit, a sequence at its
last token, too few free KV blocks, a sequence that just stopped) first reads the tokens in flight, as before.
"""

from __future__ import annotations

import numbers
import re
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Sequence as Seq

import torch

from .blocks import BlockManager
from .sampling import NO_TOKEN, SamplingParams, flag_unusable, make_generator, sample
from .scheduler import Scheduler, Sequence


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int]  # generated tokens (a stop token that ended generation is included, as HF does)
    text: str | None  # decoded generated text without special tokens (None without a tokenizer)
    # "stop" or "length"; "error" where the model gave logits no token can be chosen from (a NaN, +inf: see
    # sampling.NO_TOKEN); None while the request runs (``Generator.result`` mid-way)
    finish_reason: str | None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache (at the last admission), not prefilled


@dataclass
class GenerationStats:
    """Tokens and wall time by kind of step: a step that feeds any prompt tokens counts as prefill, its decode rows
    (sequences decoding alongside a prompt's chunk) included; decode counts the steps of decode rows only."""

    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    time_to_first_token_s: float | None = None
    steps: int = 0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s else 0.0


# on_token(request_index, token_id, text_delta): text_delta is "" without a tokenizer; token_id is NO_TOKEN in the
# last call of a request that ended in "error" (see Generator._stream).
TokenCallback = Callable[[int, int, str], None]

MAX_NUM_BATCHED_TOKENS = 8192  # a step's default token budget (a long prompt is prefilled in chunks of it)
_PENDING = -1  # an output token still on the device (pipelined decode): replaced when the host reads it


@dataclass
class _InFlight:
    """A pipelined decode step: launched, its greedy tokens on their way to the host."""

    seqs: list[Sequence]
    index: list[int]  # where each sequence's token goes in its output_ids (a _PENDING placeholder until read)
    tokens: torch.Tensor  # [S] int64 on the backend's device: the next step's input ids
    host: torch.Tensor  # [S] int64 on the host (pinned on CUDA), filled asynchronously
    ready: object  # torch.cuda.Event recorded after the copy (None on CPU)
    aligned: bool = True  # the scheduler's running list is still `seqs`, in order (nothing stopped since)


# Prompt tokens decoded before the output, for the output's first word to keep its leading space; a few, so that a
# merge or normalisation at the start of the context cannot reach the boundary.
PROMPT_CONTEXT = 6
BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


@dataclass
class _Stream:
    """Incremental detokenization of one request: emit only the text that the new token added, decoding a window of
    the tokens rather than the whole output at every token (which cost O(length) a token: at thousands of tokens,
    milliseconds a token, more than a small model's decode step). ``toks`` is the prompt's last ``PROMPT_CONTEXT``
    tokens (the first ``ctx``) and the output's; the window ``toks[prefix:]`` starts at the tokens emitted last, whose
    text (``toks[prefix:read]``) is cut from the window's, so a leading space the decoder strips from the window's
    first token is stripped from both."""

    text: str = ""  # emitted so far
    toks: list[int] = field(default_factory=list)
    ctx: int = 0
    prefix: int = 0
    read: int = 0


class Generator:
    """Generation over one backend. ``generate`` runs prompts to completion; ``add_request`` + ``step`` let new
    requests join a running batch between steps (what a server loop does)."""

    def __init__(self, backend, tokenizer=None, max_num_seqs: int = 32,
                 max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS,
                 pipeline: bool | None = None, prefix_caching: bool = True):
        """``pipeline``: pipelined greedy decode (see the module docstring); default: when the backend supports
        device-side input ids (the torch backend on CUDA). ``prefix_caching``: a prompt that starts with full KV
        blocks an earlier request computed (a shared system prompt, the turns of a chat) reuses them instead of
        prefilling them again (``export.runtime.blocks``)."""
        self.backend = backend
        self.pipeline = bool(getattr(backend, "supports_device_tokens", False)) if pipeline is None else pipeline
        self._inflight: _InFlight | None = None
        self._pinned: list = []  # two pinned token buffers, used in turn by consecutive in-flight steps
        self._decode_clock = 0.0  # when the last pipelined decode step was read (or the first one launched)
        self.tokenizer = tokenizer
        # token id -> whether a byte or special token (_joins_byte_run); the special ones known from the start
        self._run_tokens: dict[int, bool] = {} if tokenizer is None else dict.fromkeys(tokenizer.all_special_ids, True)
        # A backend with fixed limits (an engine's optimization profile) caps what one step may hold.
        max_num_seqs = min(max_num_seqs, getattr(backend, "max_num_seqs", None) or max_num_seqs)
        max_num_batched_tokens = min(max_num_batched_tokens,
                                     getattr(backend, "max_num_tokens", None) or max_num_batched_tokens)
        self.blocks = BlockManager(backend.num_blocks, backend.block_size)
        self.scheduler = Scheduler(self.blocks, max_num_seqs, max_num_batched_tokens, backend.max_model_len,
                                   prefix_caching)
        self.stats = GenerationStats()
        self._eos = self._eos_ids()
        self._next_id = 0
        self._streams: dict[int, _Stream] = {}
        self._seqs: dict[int, Sequence] = {}
        self._t_start: float | None = None

    def _eos_ids(self) -> set[int]:
        ids = set(getattr(self.backend, "eos_token_ids", ()) or ())
        for src in (self.tokenizer, getattr(self.backend, "config", None)):
            eos = getattr(src, "eos_token_id", None)
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, (list, tuple)):
                ids.update(int(e) for e in eos)
        return ids

    def encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids or Generator(backend, tokenizer)")
            return list(self.tokenizer.encode(prompt))
        return [int(t) for t in prompt]

    def add_request(self, prompt, params: SamplingParams | None = None) -> int:
        """Queue one prompt (text or token ids); it joins at the next ``step``. Returns its request id."""
        params = params or SamplingParams()
        ids = self.encode(prompt)
        vocab = self.backend.vocab_size
        if ids and (min(ids) < 0 or max(ids) >= vocab):  # two C-level scans (8k ids: 0.2 ms, 0.4 as a genexpr)
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {vocab})")
        gen = None if params.greedy else make_generator(params.seed, self.backend.device)
        seq = Sequence(req_id=self._next_id, prompt_ids=ids, params=params, generator=gen)
        self.scheduler.add(seq)  # refuses requests that can never fit, before any state changes
        self._next_id += 1
        self._seqs[seq.req_id] = seq
        self._streams[seq.req_id] = _Stream()
        return seq.req_id

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    def step(self, on_token: TokenCallback | None = None) -> list[tuple[int, int]]:
        """Run one model step; return ``(request_id, token)`` for every sequence whose token the host learnt (with
        pipelined decode, the tokens of the step before)."""
        stats = self.stats
        if self._t_start is None:
            self._t_start = time.perf_counter()
        writer = getattr(self.backend, "cache_writer", None)
        if writer is None or writer() is not self:
            # Another Generator on this backend wrote its KV cache since this one's last step: the blocks this one
            # registered for prefix caching may hold other tokens now. (Generators may take turns on a backend; two
            # with requests running at once would overwrite each other's blocks, prefix caching or not.) A weak
            # reference: the backend does not keep a finished Generator alive.
            self.blocks.forget_cached()
            self.backend.cache_writer = weakref.ref(self)
        inflight = self._inflight
        if inflight is not None:
            # Launch the next decode step on the device-side tokens first (when the batch stays the same), then read
            # the tokens in flight while it runs.
            self._inflight = self._launch(self.scheduler.schedule(), inflight.tokens) if self._can_speculate(
                inflight) else None
            return self._resolve(inflight, on_token)
        step = self.scheduler.schedule()
        if step is None:
            return []
        if self.pipeline and not step.is_prefill and all(s.params.greedy for s in step.seqs):
            self._decode_clock = time.perf_counter()
            self._inflight = self._launch(step, None)
            return []
        t0 = time.perf_counter()
        logits = self.backend.forward(step.batch)
        # Only sequences whose chunk ended at their last token sample (and advance their RNG); sample() brings the
        # tokens to the host, a device sync, so the wall time below covers the step's GPU work.
        samples = step.samples
        rows = [i for i, s in enumerate(samples) if s]
        sampling = [step.seqs[i] for i in rows]
        tokens = sample(logits[rows] if len(rows) < len(samples) else logits,
                        [s.params for s in sampling], [s.generator for s in sampling]) if rows else []
        dt = time.perf_counter() - t0
        stats.steps += 1
        if step.is_prefill:
            stats.prefill_tokens += int(step.batch.input_ids.shape[0])
            stats.prefill_s += dt
            if stats.time_to_first_token_s is None and len(tokens) > tokens.count(NO_TOKEN):
                stats.time_to_first_token_s = time.perf_counter() - self._t_start
        else:
            stats.decode_tokens += len(tokens) - tokens.count(NO_TOKEN)  # a row that ended in "error" made none
            stats.decode_s += dt
        for seq, n in zip(step.seqs, step.num_tokens):
            seq.num_cached += n
        taken = [(seq, tok, self._take(seq, len(seq.output_ids), tok)) for seq, tok in zip(sampling, tokens)]
        self._stream(taken, on_token)
        return [(seq.req_id, tok) for seq, tok in zip(sampling, tokens) if tok != NO_TOKEN]

    def _take(self, seq: Sequence, k: int, tok: int) -> bool:
        """``tok`` is output ``k`` of ``seq`` (appended, or in place of its placeholder); finish the sequence at a stop
        token or its last token (dropping any placeholder after ``k``), or with "error" at ``NO_TOKEN`` (unusable
        logits: no token is added). Returns whether it finished."""
        if tok == NO_TOKEN:
            del seq.output_ids[k:]
            self.scheduler.finish(seq, "error")
            return True
        if k == len(seq.output_ids):
            seq.output_ids.append(tok)
        else:
            seq.output_ids[k] = tok
        stop = tok in seq.params.stop_token_ids or (not seq.params.ignore_eos and tok in self._eos)
        if not stop and k + 1 < seq.params.max_new_tokens:
            return False
        del seq.output_ids[k + 1:]  # the placeholder of a step launched after this one (pipelined decode)
        self.scheduler.finish(seq, "stop" if stop else "length")
        return True

    def _stream(self, taken: list[tuple[Sequence, int, bool]], on_token) -> None:
        """``on_token`` for each (sequence, token, whether it was the last) of a step, once the step's bookkeeping is
        done for every sequence: a callback that raises leaves no sequence half-updated. A request that ended in
        "error" gets one last call with token ``NO_TOKEN`` and the text its stream held back (a byte run not yet
        ended; often ""), so that a stream learns how its request ended and its deltas still add up to the result's
        text."""
        if on_token is None:
            return
        for seq, tok, last in taken:
            stream = self._streams.get(seq.req_id)
            if stream is None:  # aborted by an earlier callback of this step
                continue
            if tok != NO_TOKEN:
                on_token(seq.req_id, tok, self._text_delta(stream, seq, tok, last))
            else:
                held = self._final_delta(stream, seq) if self.tokenizer is not None and stream.toks else ""
                on_token(seq.req_id, NO_TOKEN, held)

    # -- pipelined decode ------------------------------------------------------------------------------------------
    def _can_speculate(self, inflight: _InFlight) -> bool:
        """Whether the next step is exactly the in-flight one's sequences decoding one more token: nothing stopped,
        no sequence is at its last token, the new tokens' KV slots are free (so nothing is preempted), and no waiting
        request can be admitted (the batch is at max_num_seqs, or the head request's blocks are not free: a server
        at capacity keeps pipelining)."""
        sch = self.scheduler
        if not inflight.aligned or sch.running != inflight.seqs:
            return False
        if any(k + 1 >= s.params.max_new_tokens for s, k in zip(inflight.seqs, inflight.index)):
            return False
        need = sum(self.blocks.blocks_needed(s.req_id, 1) for s in inflight.seqs)
        return need <= self.blocks.num_free_blocks and not sch.can_admit(reserved=need)

    def _launch(self, step, input_ids) -> _InFlight:
        """Run a decode ``step`` (``input_ids``: the previous step's tokens on the device, or None for the batch's
        own) and start its greedy tokens' way to the host, without waiting for them."""
        logits = self.backend.forward(step.batch, input_ids=input_ids) if input_ids is not None else \
            self.backend.forward(step.batch)
        tokens = torch.argmax(logits, dim=-1)  # the same argmax as sample()'s greedy rows: the next step's input
        flagged = flag_unusable(logits, tokens)  # what the host reads: NO_TOKEN where the logits were unusable
        ready = None
        host = flagged
        if tokens.is_cuda:
            if not self._pinned:
                n = self.scheduler.max_num_seqs
                self._pinned = [torch.empty(n, dtype=torch.int64, pin_memory=True) for _ in range(2)]
            self._pinned.reverse()  # the other buffer than the in-flight step's (read before it is reused)
            host = self._pinned[0][:tokens.shape[0]]
            host.copy_(flagged, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        index = []
        for seq, n in zip(step.seqs, step.num_tokens):
            seq.num_cached += n
            index.append(len(seq.output_ids))
            seq.output_ids.append(_PENDING)
        self.stats.steps += 1
        return _InFlight(list(step.seqs), index, tokens, host, ready)

    def _resolve(self, inflight: _InFlight, on_token) -> list[tuple[int, int]]:
        """Read an in-flight step's tokens (waiting for them) and do what a synchronous step does after sampling."""
        if inflight.ready is not None:
            inflight.ready.synchronize()
        tokens = inflight.host.tolist()
        now = time.perf_counter()
        self.stats.decode_s += now - self._decode_clock
        self._decode_clock = now
        out, taken = [], []
        for seq, k, tok in zip(inflight.seqs, inflight.index, tokens):
            if seq.finish_reason is not None:
                continue  # stopped at the step before (or aborted): this token was computed ahead and is dropped
            if tok != NO_TOKEN:
                self.stats.decode_tokens += 1
                out.append((seq.req_id, tok))
            taken.append((seq, tok, self._take(seq, k, tok)))
            if taken[-1][2] and self._inflight is not None:
                self._inflight.aligned = False
        self._stream(taken, on_token)
        return out

    def abort(self, req_id: int) -> None:
        """Stop request ``req_id`` now (a server whose client went away): its KV blocks are freed and its
        bookkeeping dropped (``result`` no longer knows it); a token of it still in flight is discarded. (GPU run of
        the pipelined path after this: ``benchmarks/results/dev-logs/h200/gpu_runtime_ad306b6.log``.)"""
        seq = self._seqs.pop(req_id)
        del self._streams[req_id]
        if seq.finish_reason is None:
            self.scheduler.abort(seq)
        if self._inflight is not None and all(s.finish_reason is not None for s in self._inflight.seqs):
            self._inflight = None  # nothing of it is wanted (its writes precede any later step on the stream)

    def result(self, req_id: int) -> GenerationResult:
        """Request ``req_id`` as far as the host knows it: between steps (a server loop), its tokens so far, without
        a pipelined step's token still on the device; ``finish_reason`` None while it runs. A server loop calls
        ``abort(req_id)`` once it has read a finished request's result: that drops its bookkeeping, which is otherwise
        kept (``generate`` drops its own requests')."""
        s = self._seqs[req_id]
        ids = list(s.output_ids)
        if _PENDING in ids:
            del ids[ids.index(_PENDING):]
        return GenerationResult(s.prompt_ids, ids, self._decode(s.prompt_ids, ids), s.finish_reason,
                                s.num_preemptions, s.num_prefix_cached)

    def generate(self, prompts: Seq, params: SamplingParams | Seq[SamplingParams] | None = None,
                 on_token: TokenCallback | None = None) -> list[GenerationResult]:
        """Generate for every prompt (text or token ids), batched; ``params`` one for all or one per prompt.

        ``on_token(i, token_id, text_delta)`` streams with ``i`` the prompt's index in ``prompts``. Requests queued
        with ``add_request`` before the call run to completion with it (their tokens are not streamed to ``on_token``;
        read them with ``result``).
        """
        if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], numbers.Integral)) or \
                getattr(prompts, "ndim", None) == 1:  # one prompt: text, or ids (a list, a 1-D tensor or array)
            prompts = [prompts]
        params = params or SamplingParams()
        per_req = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per_req) != len(prompts):
            raise ValueError(f"{len(per_req)} SamplingParams for {len(prompts)} prompts; give one or one per prompt")
        encoded = [self.encode(p) for p in prompts]
        ids: list[int] = []
        try:
            for e, p in zip(encoded, per_req):
                ids.append(self.add_request(e, p))
        except ValueError:  # one bad prompt refuses the whole call: withdraw the ones already queued
            for r in ids:
                self.scheduler.waiting.remove(self._seqs.pop(r))
                del self._streams[r]
            raise
        index = {r: i for i, r in enumerate(ids)}
        self.stats, self._t_start = GenerationStats(), None
        cb = None if on_token is None else (lambda r, t, d: on_token(index[r], t, d) if r in index else None)
        try:
            while self.has_unfinished():
                self.step(cb)
        except BaseException:  # a backend error, a callback that raised, Ctrl-C: leave nothing of this call behind
            for r in ids:
                self.abort(r)
            raise
        self.blocks.check_invariants()
        assert self.blocks.num_free_blocks == self.blocks.num_blocks, "KV blocks leaked after generation"
        results = [self.result(r) for r in ids]
        for r in ids:  # generate() hands its results back: keep no bookkeeping for them
            del self._seqs[r], self._streams[r]
        return results

    def _text(self, ids: list[int]) -> str:
        """The text of ``ids``: special tokens skipped, and no clean-up of spaces (clean_up_tokenization_spaces, which
        Llama-3's tokenizer config sets, turns ' .' into '.': it would rewrite text the stream already sent, and it is
        no part of the tokens' text)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _decode(self, prompt_ids: list[int], ids: list[int]) -> str | None:
        """The text of output ``ids``, decoded after the prompt's last ``PROMPT_CONTEXT`` tokens and cut after them:
        a SentencePiece decoder drops the leading space of the first token it decodes, which the output's first word
        must keep ("Once upon a" + " the", not "the"). Decoded alone where the context's text is not a prefix (a
        byte run across the boundary)."""
        if self.tokenizer is None:
            return None
        ctx = list(prompt_ids[-PROMPT_CONTEXT:])
        before = self._text(ctx)
        text = self._text(ctx + list(ids))
        return text[len(before):] if text.startswith(before) else self._text(ids)

    def _joins_byte_run(self, tok: int) -> bool:
        """Whether ``tok`` is a byte-fallback token (``<0xE2>``: SentencePiece's for bytes outside its vocabulary) or a
        special token, which the decode skips, so that the bytes on either side of it decode as one run."""
        if tok not in self._run_tokens:
            self._run_tokens[tok] = bool(BYTE_TOKEN.fullmatch(str(self.tokenizer.convert_ids_to_tokens(tok))))
        return self._run_tokens[tok]

    def _final_delta(self, stream: _Stream, seq: Sequence) -> str:
        """What ends the stream of a request whose tokens are all in ``stream.toks``."""
        # The result's text is the whole output decoded once (_decode); what the stream has not sent of it ends the
        # stream, so the deltas add up to it.
        text = self._decode(seq.prompt_ids, stream.toks[stream.ctx:])
        # (Text sent is never sent again: where the whole decode disagrees with what was streamed, the stream ends as
        # it is and the result holds the whole decode.)
        delta = text[len(stream.text):] if text.startswith(stream.text) else ""
        stream.text = text
        return delta

    def _text_delta(self, stream: _Stream, seq: Sequence, tok: int, last: bool = False) -> str:
        """The text ``tok`` adds to its request's stream; ``last``: the request's final token, after which the deltas
        add up to the result's text."""
        if self.tokenizer is None:
            return ""
        if not stream.toks:
            stream.toks = list(seq.prompt_ids[-PROMPT_CONTEXT:])
            stream.ctx = stream.read = len(stream.toks)
        stream.toks.append(tok)
        if not last and self._joins_byte_run(tok):
            # A byte-fallback decoder decodes a run of byte tokens as a whole, and an invalid run (a stray lead byte)
            # turns every byte of it into U+FFFD, rewriting a character already complete: the run's text is final
            # only once a token that is not a byte ends it.
            return ""
        if last:
            return self._final_delta(stream, seq)
        before = self._text(stream.toks[stream.prefix:stream.read])
        text = self._text(stream.toks[stream.prefix:])
        # A token that ends mid-character decodes to U+FFFD until the next token completes it: hold it back (the
        # window grows until a token completes it, or the last token sends it). So does a window whose earlier text
        # the new token rewrote.
        if text.endswith("\ufffd") or not text.startswith(before):
            return ""
        delta = text[len(before):]
        if not delta:
            # Nothing new (a special token skipped): the window keeps its start, so that the next token is decoded
            # after the text it follows (a window starting at a skipped token would strip the next word's space).
            return ""
        stream.prefix, stream.read = stream.read, len(stream.toks)
        stream.text += delta
        return delta
