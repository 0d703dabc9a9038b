"""The engine: requests in, token events out, one batched model step at a time.

`Engine.step()` reads top to bottom: the speculator offers guesses, the scheduler plans the step
(a `StepPlan`: decodes, verifications, prefill chunks), the model runner runs its one packed
forward over the paged KV cache, and `_update` hands each sequence its logits rows (sample,
verify, score the prompt) and turns the results into events. An embedding request
(`SamplingParams.pooling`, engine.pooling) is prefilled like any prompt and pooled from the same
forward's final hidden states; its last chunk ends it with one event carrying its vector. With
LoRA slots (`lora`, `model.lora.batched`), a request naming an adapter (`SamplingParams.lora`)
has its rows updated by that adapter in the same batch as everyone else's (`engine.adapters`).
It is synchronous and single-threaded; `engine.async_engine` drives it from a thread.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import torch
from gptserve.engine.adapters import NOT_FOUND, AdapterError, AdapterSlots, LoadedAdapter
from gptserve.engine.block_manager import BlockManager
from gptserve.engine.errors import RequestError
from gptserve.engine.grammar import (
    ConstraintViolation,
    allocate_bitmask,
    bitmask_to_bool,
    fill_bitmask,
)
from gptserve.engine.limits import EngineLimits, RequestLimits
from gptserve.engine.proposers import make_speculator
from gptserve.engine.runner import ModelRunner
from gptserve.engine.sampler import SampleOutput, SampleRow, SamplingParams, prompt_logprobs, sample
from gptserve.engine.scheduler import TENANT_STEP_PREFILL, Scheduler
from gptserve.engine.sequence import (
    GRAMMAR_ERROR,
    SEQUENCE_ERROR,
    Sequence,
    TokenEvent,
    TokenLogprob,
)
from gptserve.engine.step_plan import ScheduledSeq, StepKind, StepPlan
from gptserve.engine.verify import verify
from gptserve.kernels.paged_kv import KVPools, cache_dtype
from gptserve.model.gpt import GPT
from gptserve.model.lora.batched import LoraBank
from gptserve.model.tokenizers import Tokenizer

log = logging.getLogger(__name__)
# what the requests of a failed step are told; the exception itself goes to the log only, since
# it may speak of other requests
STEP_FAILED = "the engine failed while running this request's batch; the server log has details"


@dataclass
class EngineConfig:
    max_num_seqs: int = 32  # sequences decoding together
    max_batch_tokens: int = 512  # tokens per step (prefill chunk size bound)
    # with API keys, a step's prompt chunks cost at most this many tokens at a prompt's start,
    # fewer deep into it (engine.scheduler); 0: no bound but max_batch_tokens
    tenant_step_tokens: int = TENANT_STEP_PREFILL
    kv_block_size: int = 16  # tokens per KV cache block (page)
    # None: kv_cache_tokens (None: max_num_seqs full contexts) within kv_cache_bytes
    num_blocks: int | None = None
    kv_cache_bytes: int = 2 << 30
    kv_cache_tokens: int | None = None
    prefix_caching: bool = True  # reuse the KV blocks of prompt prefixes seen before
    speculative: str | None = None  # "ngram" (prompt lookup) or "draft" (needs a draft model)
    num_speculative_tokens: int = 4  # guesses per sequence and step
    speculative_max_batch: int = 4  # no guesses while more sequences decode
    # a sequence's logits independent of its batch on a CPU in bfloat16 too (the attention's
    # part; load the model with `load_for_inference(..., batch_invariant=True)` for the rest)
    batch_invariant: bool = False
    # the KV cache's dtype; None: the model's. float16 or bfloat16 under a float32 model halves
    # the cache's bytes (twice the tokens in kv_cache_bytes, half the decode attention's reads)
    # at the cost of rounding each cached key and value; any other dtype than the model's is a
    # ValueError (`kernels.paged_kv.cache_dtype`)
    kv_cache_dtype: torch.dtype | None = None


@dataclass
class _Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    forked: bool = False
    prompt_lp: list[TokenLogprob | None] = field(default_factory=list)
    prompt_lp_sent: bool = False
    pooled: torch.Tensor | None = None  # an embedding's: the sum (mean) or last state so far
    adapter: LoadedAdapter | None = None  # its LoRA adapter, held until it ends


class Engine:
    """Continuous batching over one model and its paged KV cache; `step()` runs one batch.

    The Engine runs the model as it is given (it only switches it to eval mode). On a CPU, give it
    a model passed through `model.cpu.optimize_for_cpu` for fast decoding, as the CLIs do.
    `lora`: the model's LoRA slots (`model.lora.batched.install_lora`), whose adapters `adapters` names.
    """

    def __init__(
        self, model: GPT, tokenizer: Tokenizer, config: EngineConfig | None = None,
        draft_model: GPT | None = None, lora: LoraBank | None = None,
    ) -> None:  # fmt: skip
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = config = config or EngineConfig()
        mc = model.config
        self.max_len = mc.context_length
        param = next(model.parameters())
        floats = (p.dtype for p in model.parameters() if p.is_floating_point())
        kv_dtype = cache_dtype(next(floats, param.dtype), config.kv_cache_dtype)
        num_blocks = config.num_blocks
        if num_blocks is None:
            per_block = KVPools.bytes_per_block(
                mc.n_layer, mc.kv_heads, mc.head_dim, config.kv_block_size, kv_dtype
            )
            tokens = config.kv_cache_tokens or config.max_num_seqs * self.max_len
            full = -(-tokens // config.kv_block_size)
            num_blocks = max(1, min(full, config.kv_cache_bytes // per_block))
        # the pools' memory and attention are the runner's; which block holds what, the
        # scheduler's (engine.block_manager)
        self.pools = KVPools.for_model(
            model, num_blocks, config.kv_block_size, dtype=kv_dtype,
            batch_invariant=config.batch_invariant,
        )  # fmt: skip
        windows = mc.layer_windows()
        self.blocks = BlockManager(
            num_blocks, config.kv_block_size, self.pools.device,
            prefix_caching=config.prefix_caching,
            window=max(windows) if None not in windows else None,  # all windowed: release
        )  # fmt: skip
        self.scheduler = Scheduler(
            self.blocks, config.max_num_seqs, config.max_batch_tokens, config.tenant_step_tokens
        )
        self.runner = ModelRunner(self.model, self.pools, lora)
        self.adapters = None if lora is None else AdapterSlots(lora)
        if draft_model is not None and draft_model.config.tokenizer != model.config.tokenizer:
            raise ValueError("the draft model must use the model's tokenizer")
        self.speculator = make_speculator(
            config.speculative, draft_model, config.num_speculative_tokens,
            config.speculative_max_batch, config.max_num_seqs, config.kv_block_size,
        )  # fmt: skip
        self.eos = tokenizer.eot_token
        # every id that ends a generation: the tokenizer's EOS and generation_config.json's ids
        self.end_tokens = frozenset(tokenizer.eos_token_ids)
        self.device = param.device
        self._requests: dict[str, _Request] = {}
        self._seq_ids = itertools.count()
        self.num_failed_steps = 0
        self.num_preemptions = 0  # sequences requeued for lack of KV blocks (server /metrics)

    # ---- requests -------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, *,
        admitted: bool = False,
    ) -> None:  # fmt: skip
        """Queue a request; raises RequestError if it can never run. admitted: the caller has
        run `RequestLimits.admit` on it already (the server does), so it is not checked again."""
        if request_id in self._requests:
            raise RequestError(f"duplicate request id {request_id!r}")
        if not admitted:
            RequestLimits(self.limits).admit([prompt_ids], params)
        seqs = [
            Sequence(next(self._seq_ids), request_id, i, prompt_ids, params, self.tokenizer)
            for i in range(params.n)
        ]
        adapter = None
        if params.lora is not None:
            if self.adapters is None:
                raise AdapterError("this engine serves no LoRA adapters", "model", NOT_FOUND)
            adapter = self.adapters.acquire(params.lora)
            for seq in seqs:  # its rows use the adapter's slot; its blocks are keyed by its load
                seq.lora_slot, seq.prefix_salt = adapter.slot, (params.cache_salt, adapter.uid)
        self._requests[request_id] = _Request(
            request_id, list(prompt_ids), params, seqs, adapter=adapter
        )
        self.scheduler.add(seqs[0])

    @property
    def limits(self) -> EngineLimits:
        """What this engine can take: context, vocabulary, KV pool (fixed once built)."""
        return EngineLimits(
            max_model_len=self.max_len,
            vocab_size=self.model.config.vocab_size,
            kv_block_size=self.config.kv_block_size,
            kv_cache_blocks=self.blocks.num_blocks,
        )

    def abort(self, request_id: str) -> bool:
        """Drop a request and free its blocks at once; False if it is unknown or finished."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        self._release_adapter(req)
        for seq in req.seqs:
            self.scheduler.remove(seq)
            if self.speculator is not None:
                self.speculator.forget(seq)
        return True

    def finish(self, request_id: str, index: int) -> list[TokenEvent]:
        """End completion `index` of a request now, as a stop string would: the caller has all
        it needs of it (the server, an answer that repeated a tool call). Its blocks are freed
        and its last event (finish reason "stop", no tokens) returned; its siblings go on. []
        when it has ended already, or has not generated a token yet (before the fork of n
        completions, ending one would strand the others)."""
        req = self._requests.get(request_id)
        if req is None or not 0 <= index < len(req.seqs):
            return []
        seq = req.seqs[index]
        if seq.finished or seq.num_generated == 0:
            return []
        seq.finish_reason = "stop"
        event = self._event(req, seq, [], "", [], "stop")
        self._retire(req, seq)
        return [event]

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def num_waiting_of(self, tenant: str | None) -> int:
        """Sequences of `tenant` (SamplingParams.tenant) waiting for admission."""
        # tuple(): a snapshot, taken while the engine thread may add and admit
        return sum(1 for s in tuple(self.scheduler.waiting) if s.params.tenant == tenant)

    @property
    def num_waiting(self) -> int:
        # list(): other threads read this while the engine thread adds and retires requests
        return len(self.scheduler.waiting) + sum(
            len(r.seqs) - 1 for r in list(self._requests.values()) if not r.forked
        )

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.blocks.num_free_blocks / self.blocks.num_blocks

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[TokenEvent]:
        """Run one batched forward and return the events it produced."""
        start = time.perf_counter()
        plan = self.scheduler.schedule(self._propose())
        if plan.preempted:  # counted for the server's /metrics, and logged
            self.num_preemptions += len(plan.preempted)
            log.info(
                "preempted %d sequence(s) for lack of KV cache blocks: %s",
                len(plan.preempted), ", ".join(f"{s.request_id}/{s.index}" for s in plan.preempted),
            )  # fmt: skip
        if not plan.scheduled:
            return self._fail(
                list(self.scheduler.running),
                "the request does not fit the KV cache",
                SEQUENCE_ERROR,
            )
        try:
            step = self.blocks.prepare([(s.seq.seq_id, s.num_tokens) for s in plan.scheduled])
            # (len(plan.logits_positions), V), and (len(plan.hidden_positions), C) or None
            logits, hidden = self.runner.run_step(plan, step)
            events = self._update(plan, logits, hidden)
            self.scheduler.record_step(time.perf_counter() - start)  # paces tenants' turns
            return events
        except Exception as exc:  # a failed step fails only its own requests
            self.num_failed_steps += 1
            log.exception("engine step failed: %s", exc)
            return self._fail([s.seq for s in plan.scheduled], STEP_FAILED)

    def _propose(self) -> dict[int, list[int]]:
        """Guesses for decoding sequences to verify this step, {seq_id: tokens}, if speculating."""
        if self.speculator is None:
            return {}
        try:
            return self.speculator.propose(self.scheduler.running, self.max_len)
        except Exception:  # a proposer fault costs the guesses, never the engine
            log.exception("speculative proposal failed")
            return {}

    def _update(
        self, plan: StepPlan, logits: torch.Tensor, hidden: torch.Tensor | None = None
    ) -> list[TokenEvent]:
        """Apply the step's logits (len(plan.logits_positions), V) to its sequences: verify
        guesses, score prompts, count the new tokens as cached, draw the next tokens; pool
        embeddings from hidden (len(plan.hidden_positions), C) and end those done."""
        events: list[TokenEvent] = []
        to_sample: list[tuple[Sequence, int]] = []  # (sequence, logits row)
        for part in plan.scheduled:
            seq = part.seq
            req = self._requests.get(seq.request_id)
            if req is None:  # failed earlier in this loop
                continue
            if part.kind is StepKind.VERIFY:
                try:
                    events.append(self._verify(req, part, logits[part.rows]))
                except Exception as exc:  # its detokenizer or stop strings: this request alone
                    log.exception(  # the server maps engine_request_id to the request's id
                        "request %s failed in verification", req.request_id,
                        extra={"engine_request_id": req.request_id},
                    )  # fmt: skip
                    message = f"generation failed: {exc}"
                    events.extend(self._fail_request(req, message, SEQUENCE_ERROR))
                continue
            if req.params.pooling is not None:
                events.extend(self._pool(req, part, hidden))
                continue
            if part.scores_prompt:
                self._score_prompt(req, seq.num_cached, logits[part.rows])
            seq.num_cached += part.num_tokens
            self.blocks.register_full_blocks(seq.seq_id, seq.token_ids, seq.prefix_salt)
            if not part.samples:
                continue
            if req.params.max_tokens == 0:
                events.extend(self._finish_unsampled(req))
                continue
            to_sample.append((seq, part.last_row))
            if not req.forked and seq.index == 0:
                req.forked = True
                to_sample.extend((child, part.last_row) for child in self._fork(req))
        if to_sample:
            events.extend(self._sample(to_sample, logits))
        return events

    def _pool(
        self, req: _Request, part: ScheduledSeq, hidden: torch.Tensor | None
    ) -> list[TokenEvent]:
        """An embedding's chunk: add its rows to the pooled state; after its last chunk, its one
        event with the vector, and it ends (its blocks freed at once)."""
        seq, pooling = part.seq, req.params.pooling
        rows = None if hidden is None else hidden[part.hidden_rows].float()
        if seq.num_cached == 0:  # its first chunk (again, after a preemption): start over
            req.pooled = None
        if rows is not None and len(rows):
            if pooling.mode == "mean":
                total = rows.sum(0)
                req.pooled = total if req.pooled is None else req.pooled + total
            else:
                req.pooled = rows[-1]
        seq.num_cached += part.num_tokens
        self.blocks.register_full_blocks(seq.seq_id, seq.token_ids, seq.prefix_salt)
        if not part.pools:
            return []
        if req.pooled is None:
            raise RuntimeError("an embedding ended without its hidden states")
        vector = pooling.finish(req.pooled, len(req.prompt_ids))
        seq.finish_reason = "stop"
        event = self._event(req, seq, [], "", [], "stop")
        event.embedding = vector
        self._retire(req, seq)
        return [event]

    def _score_prompt(self, req: _Request, start: int, logits: torch.Tensor) -> None:
        """Record logprobs of prompt tokens start+1 .. predicted by logits (n, V)."""
        if start == 0:
            req.prompt_lp = [None]
        n = min(len(logits), len(req.prompt_ids) - 1 - start)
        if n > 0:
            nxt = torch.tensor(req.prompt_ids[start + 1 : start + 1 + n], device=logits.device)
            chosen, top_ids, top_lp = prompt_logprobs(logits[:n], nxt, req.params.prompt_logprobs)
            for tok, lp, ids, lps in zip(nxt.tolist(), chosen, top_ids, top_lp):
                req.prompt_lp.append(TokenLogprob(tok, lp, list(zip(ids, lps))))

    def _fork(self, req: _Request) -> list[Sequence]:
        """After the shared prefill, the other n - 1 completions share its blocks (copied on write)."""
        parent = req.seqs[0]
        children = []
        for child in req.seqs[1:]:
            self.blocks.fork(parent.seq_id, child.seq_id)
            child.num_cached = parent.num_cached
            self.scheduler.add_running(child)
            children.append(child)
        return children

    def _sample(self, work: list[tuple[Sequence, int]], logits: torch.Tensor) -> list[TokenEvent]:
        """Draw each sequence's next token from its logits row and hand it the token. A failure
        that belongs to one sequence (its grammar, sampler row, detokenizer or stop strings)
        ends that sequence's request alone; the others take their tokens."""
        rows = [
            SampleRow(s.params, s.token_ids[: s.num_prompt], s.output_ids, s.generator,
                      None if s.constraint else self.eos)  # a grammar decides when it may end
            for s, _ in work
        ]  # fmt: skip
        allowed = None
        failed: dict[int, tuple[str, str]] = {}  # work index -> (message, error code)
        if any(s.constraint for s, _ in work):  # structured output: a mask row per sequence
            bitmask = allocate_bitmask(len(work), logits.shape[-1])
            fill_bitmask([s.constraint for s, _ in work], bitmask)
            allowed = bitmask_to_bool(bitmask, logits.shape[-1])
            for i, (s, _) in enumerate(work):
                if s.constraint is not None and (why := s.constraint.error) is not None:
                    failed[i] = (why, GRAMMAR_ERROR)
        picked = [r for _, r in work]
        if picked != list(range(len(logits))):  # a decode step samples every row, in order
            logits = logits[torch.tensor(picked, device=logits.device)]
        out = self._sample_rows(logits, rows, allowed, failed)
        events = []
        for i, (seq, _) in enumerate(work):
            req = self._requests.get(seq.request_id)
            if req is None:  # a sibling completion failed earlier in this loop
                continue
            if i in failed:
                events.extend(self._fail_request(req, *failed[i]))
                continue
            token = out.tokens[i]
            try:
                text = seq.append(token, self.end_tokens, self.max_len)
            except ConstraintViolation as exc:
                events.extend(self._fail_request(req, str(exc), GRAMMAR_ERROR))
                continue
            except Exception as exc:  # detokenizer, stop strings: this request's own fault
                log.exception(
                    "request %s failed on token %d", req.request_id, token,
                    extra={"engine_request_id": req.request_id},
                )  # fmt: skip
                events.extend(self._fail_request(req, f"generation failed: {exc}", SEQUENCE_ERROR))
                continue
            lps = []
            if seq.params.logprobs is not None:
                top = list(zip(out.top_ids[i], out.top_logprobs[i]))
                lps = [TokenLogprob(token, out.logprobs[i], top)]
            events.append(self._event(req, seq, [token], text, lps, seq.finish_reason))
            if seq.finished:
                self._retire(req, seq)
        return events

    def _sample_rows(
        self,
        logits: torch.Tensor,
        rows: list[SampleRow],
        allowed: torch.Tensor | None,
        failed: dict[int, tuple[str, str]],
    ) -> SampleOutput:
        """`sample` over the batch; if it raises, row by row, so that the rows that fail alone
        are marked in `failed` and the others keep their draws (each row is drawn as it would
        be alone, so their tokens are the same)."""
        try:
            return sample(logits, rows, allowed)
        except Exception:
            log.exception("sampling the batch failed; sampling its rows one by one")
        out = SampleOutput([], [], [], [])
        for i, row in enumerate(rows):
            try:
                one = sample(
                    logits[i : i + 1], [row], None if allowed is None else allowed[i : i + 1]
                )
            except Exception as exc:
                failed[i] = (f"sampling failed: {exc}", SEQUENCE_ERROR)
                one = SampleOutput([self.eos], [float("nan")], [[]], [[]])
            out.tokens += one.tokens
            out.logprobs += one.logprobs
            out.top_ids += one.top_ids
            out.top_logprobs += one.top_logprobs
        return out

    def _verify(self, req: _Request, part: ScheduledSeq, logits: torch.Tensor) -> TokenEvent:
        """Keep the guesses the model agrees with, plus a token of its own (logits (1 + k, V))."""
        seq = part.seq
        row = SampleRow(seq.params, seq.token_ids[: seq.num_prompt], seq.output_ids,
                        seq.generator, self.eos)  # fmt: skip
        out = verify(logits, row, part.guesses)
        self.speculator.record(seq, len(part.guesses), out.num_accepted)
        settled = seq.num_cached + 1 + out.num_accepted  # the last token and the accepted guesses
        self.blocks.truncate(seq.seq_id, settled)
        seq.num_cached = settled
        text, lps, emitted = "", [], []
        for i, token in enumerate(out.tokens):
            if seq.finished:  # a stop or the length limit came before the last token
                break
            emitted.append(token)
            text += seq.append(token, self.end_tokens, self.max_len)
            if seq.params.logprobs is not None:
                top = list(zip(out.top_ids[i], out.top_logprobs[i]))
                lps.append(TokenLogprob(token, out.logprobs[i], top))
        self.blocks.register_full_blocks(seq.seq_id, seq.token_ids, seq.prefix_salt)
        event = self._event(req, seq, emitted, text, lps, seq.finish_reason)
        if seq.finished:
            self._retire(req, seq)
        return event

    def _finish_unsampled(self, req: _Request) -> list[TokenEvent]:
        """max_tokens 0 (prompt scoring): every completion ends after the prefill."""
        events = []
        for seq in req.seqs:
            seq.finish_reason = "length"
            events.append(self._event(req, seq, [], "", [], "length"))
            self._retire(req, seq)
        return events

    def _event(
        self,
        req: _Request,
        seq: Sequence,
        token_ids: list[int],
        text: str,
        lps: list[TokenLogprob],
        finish: str | None,
        error: str | None = None,
    ) -> TokenEvent:
        event = TokenEvent(
            req.request_id, seq.index, token_ids, text, lps, finish, error,
            num_prompt_tokens=len(req.prompt_ids), num_generated=seq.num_generated,
            num_cached_tokens=req.seqs[0].num_prefix_hit,
            text_offsets=seq.text_offsets[len(seq.text_offsets) - len(token_ids) :],
            stop_reason=seq.stop_reason if finish is not None else None,
            scheduled_at=req.seqs[0].scheduled_at,
        )  # fmt: skip
        if req.params.prompt_logprobs is not None and not req.prompt_lp_sent and seq.index == 0:
            event.prompt_logprobs = req.prompt_lp
            req.prompt_lp_sent = True
        return event

    def _retire(self, req: _Request, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        if self.speculator is not None:
            self.speculator.forget(seq)
        if all(s.finished for s in req.seqs) and self._requests.pop(req.request_id, None):
            self._release_adapter(req)

    def _release_adapter(self, req: _Request) -> None:
        """A request has ended: its adapter's slot may empty (if it was unloaded meanwhile)."""
        if req.adapter is not None:
            self.adapters.release(req.adapter)
            req.adapter = None

    def _fail(
        self, seqs: list[Sequence], message: str, code: str | None = None
    ) -> list[TokenEvent]:
        """End every request that has a sequence in seqs with an error event per completion."""
        events = []
        for rid in dict.fromkeys(s.request_id for s in seqs):
            req = self._requests.get(rid)
            if req is not None:
                events.extend(self._fail_request(req, message, code))
        return events

    def _fail_request(self, req: _Request, message: str, code: str | None) -> list[TokenEvent]:
        """End one request: an error event for each of its unfinished completions."""
        events = []
        for seq in req.seqs:
            if not seq.finished:
                event = self._event(req, seq, [], "", [], None, error=message)
                event.error_code = code
                events.append(event)
        self.abort(req.request_id)
        return events
