"""The step engine: SUBMIT entries in, one list of STEP entries out per scheduler step.

No I/O here: ``gpu/worker/process.py`` drives it. ``step()`` is the loop body: schedule, lay the
batch out as a ``StepInput``, run it (``gpu/runtime/runner.py``: the cache layout, graph replay
or the trunk, the LM head only on the rows that need logits), one batched sampling
pass, then per-sequence bookkeeping (stop checks, frees).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Sequence_
from time import perf_counter
from typing import Any

import torch

from gpu.cache.kv_cache import BlockManager, PagedKVCache
from gpu.cache.memory import KVPlan, MemoryFootprint
from gpu.model.loader import LoadedModel
from gpu.runtime.admission import Admission, ProtocolError, TooLong, declared_n, prefills
from gpu.runtime.disk_prefix import disk_prefix_for
from gpu.runtime.drafter import Drafter
from gpu.runtime.engine_config import EngineConfig
from gpu.runtime.forks import fork_samplers
from gpu.runtime.grammar import Grammars, draft_matchers
from gpu.runtime.overlap import InFlight, flies, fly, land, overlap_on
from gpu.runtime.runner import Followers, ModelRunner
from gpu.runtime.sampling import sample, sample_greedy
from gpu.runtime.scheduler import Scheduler, Sequence
from gpu.runtime.speculation import SpecTotals, draft_rows, rewind, verify
from gpu.runtime.step import Step, lay_out, pool
from gpu.runtime.step_books import Books, terminal
from wire import ErrorCode, Finish, StepEntry, StepStats, SubmitEntry
from wire.faults import fault_point

__all__ = ["Engine", "EngineConfig", "ProtocolError", "TooLong"]

log = logging.getLogger(__name__)

# A step's speculating sequences: (first of its sampler rows, the sequence, its draft).
Drafted = Sequence_[tuple[int, Sequence, list[int]]]


class Engine:
    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig,
        kv_plan: KVPlan | None = None,
        cache_type: Callable[..., PagedKVCache] = PagedKVCache,
        followers: Followers | None = None,
        draft: LoadedModel | None = None,
    ) -> None:
        """Every backend is chosen once, as the engine is made (the runner's: the kernels,
        the trunk, the cache, the graphs; the overlap): the loaded model is shared
        between engines and holds none of them. ``kv_plan``: how the cache was sized
        from the card's memory (None: from ``--kv-blocks`` / ``--kv-mib``);
        ``cache_type``: what makes the cache; ``followers``: the runner's (``--tp``);
        ``draft``: ``--speculative draft``'s model (``gpu/runtime/drafter.py``)."""
        self.loaded = loaded
        self.model = loaded.model
        self.mc = loaded.config
        self.config = config
        self.kv_plan = kv_plan
        self.max_context = min(self.mc.context_length, config.kv_blocks * config.block_size)
        self.runner = ModelRunner(loaded, config, self.max_context, cache_type, followers)
        self.cache = self.runner.cache
        self.drafter = None if draft is None else Drafter(draft, config, self.max_context,
                                                          self.mc.vocab_size)  # fmt: skip
        self.disk = disk_prefix_for(config.prefix_cache_dir, config.prefix_cache_disk_mib,
                                    str(loaded.path), self.cache)  # fmt: skip
        evicted = self.disk.write if self.disk is not None else None  # to disk, if a tier
        self.blocks = BlockManager(config.kv_blocks, config.block_size, evicted)
        self.scheduler = Scheduler(self.blocks, config, self.disk)
        self.seqs: dict[int, Sequence] = {}
        self.reserved: dict[int, Sequence] = {}  # rids of forks not yet made -> their parent
        self.step_no = 0
        self.step_stats = StepStats()  # every step's time, sequences and tokens
        self.spec_totals = SpecTotals()  # every speculating request's proposals
        self._footprint: MemoryFootprint | None = None
        eog = tuple(sorted(self.mc.eog_ids))
        tok = loaded.tokenizer
        self.grammars = Grammars(tok, self.mc.vocab_size, eog)
        self.admission = Admission(self.mc.vocab_size, eog, self.max_context,
                                   config.max_pending, self.grammars, self.generator)  # fmt: skip
        # The end a finished grammar reports (it is not sampled: nothing else could be).
        grammar_end = tok.eos_id if tok.eos_id is not None else eog[0]
        self.books = Books(self.seqs, self.reserved, self._end, self._fail, eog, tok.decode,
                           grammar_end)  # fmt: skip
        self.overlap = overlap_on(config.overlap, loaded.device)
        self._in_flight: InFlight | None = None  # an overlapped step's unread tokens
        # Requests the last steps failed (rid, why), for the worker to report as errors.
        self._failed: list[tuple[int, str]] = []

    @property
    def has_work(self) -> bool:
        return self._in_flight is not None or self.scheduler.has_work

    def footprint(self) -> MemoryFootprint:
        """The weights' and the KV cache's allocated bytes, their device and the cache's
        memory, whose resident part each split measures (made on first use)."""
        if self._footprint is None:
            dev = self.loaded.device
            name = dev.type if dev.type == "cpu" else str(dev)
            kv = (self.cache.k, self.cache.v)
            self._footprint = MemoryFootprint.of(self.model.weight_bytes(), kv, name)
        return self._footprint

    def holds(self, rid: int) -> bool:
        """Whether ``rid`` is live here (a sequence, or a fork not made yet)."""
        return rid in self.seqs or rid in self.reserved

    def load(self) -> dict[str, Any]:
        s = self.scheduler
        return {
            "running": len(s.running),
            "waiting": len(s.waiting),
            "kv_blocks_total": self.blocks.num_blocks,
            "kv_blocks_free": self.blocks.num_free,
            "kv_blocks_cached": self.blocks.num_cached,
            "rids": len(self.seqs) + len(self.reserved),
            **(self.disk.store.info() if self.disk is not None else {}),
            **(self.spec_totals.load() if self.config.speculation.on else {}),
        }

    # -- ingress ---------------------------------------------------------------------

    def submit(
        self, entries: Iterable[SubmitEntry]
    ) -> tuple[list[tuple[int, str, str]], list[StepEntry]]:
        """Queue valid entries; returns (REQ-ERROR tuples, immediately terminal entries)."""
        errors: list[tuple[int, str, str]] = []
        done: list[StepEntry] = []
        for e in entries:
            try:
                seq = self.admission.sequence(e, self.holds, len(self.seqs) + len(self.reserved))
            except ValueError as exc:
                if isinstance(exc, ProtocolError):
                    raise
                code = ErrorCode.TOO_LONG if isinstance(exc, TooLong) else ErrorCode.INVALID
                # Every rid the request would occupy gets its terminal entry.
                errors += [(r, code, str(exc)) for r in range(e.rid, e.rid + declared_n(e))]
                continue
            if seq.params.max_new_tokens == 0 and not prefills(seq):
                extra = {"prompt_tokens": seq.prompt_len}
                done += [
                    StepEntry(r, b"", [Finish.LENGTH, 0], extra)
                    for r in range(e.rid, e.rid + 1 + seq.forks)
                ]
                continue
            for r in range(seq.rid + 1, seq.rid + seq.forks + 1):
                self.reserved[r] = seq
            self.seqs[seq.rid] = seq
            self.scheduler.add(seq)
        return errors, done

    def _run(self, batch: list[tuple[Sequence, int]], prev: InFlight | None) -> Step:
        """The step laid out (``gpu/runtime/step.py``) and run; a fault plan may fail, delay or
        kill it here, or make its logits NaN."""
        fault = fault_point("worker.forward")
        if fault is not None:
            fault = fault.apply()  # raise, delay, stall or kill here; "nan" below
        s = self.scheduler  # the step's cache operations, made by the runner before it runs
        if self.drafter is not None and (drafting := [q for q, _ in batch if q.draft]):
            self.drafter.fill(drafting)  # their drafts, before the step is laid out
        step = lay_out(batch, prev, s.take_copies(), s.take_loads())
        out = self.runner.run(step.input)
        if self.drafter is not None:
            self.drafter.mirror(step)
        pooling = step.pooling
        pooled = (
            pool(self.model.final_norm, out.x, pooling) if pooling and out.x is not None else []
        )
        step.ran(out, pooled)
        if step.logits is not None and fault is not None and fault.action == "nan":
            step.logits = torch.full_like(step.logits, float("nan"))
        return step

    def generator(self, seed: int | None) -> torch.Generator | None:
        """The request's own generator, which only its rows draw from, a fixed amount per
        step (``gpu.runtime.sampling``): a seed's tokens do not depend on what shares the batch.
        Unseeded requests get one too, from a fresh random seed, so workers (``--dp``)
        and restarts do not repeat each other's draws."""
        g = torch.Generator(device=self.loaded.device)
        g.manual_seed(random.getrandbits(63) if seed is None else seed & ((1 << 63) - 1))
        return g

    def abort(
        self, rids: Iterable[int], message: str = "aborted by the frontend"
    ) -> list[StepEntry]:
        """End held rids now (blocks freed before the next step); unknown rids are ignored."""
        out = []
        for rid in rids:
            seq = self.seqs.pop(rid, None)
            if seq is not None:
                self.scheduler.remove(seq)
                out.append(terminal(seq, b"", [Finish.ABORT, message]))
                # Forks not yet made go with their parent: each gets its own terminal entry.
                for r in [r for r, p in self.reserved.items() if p is seq]:
                    del self.reserved[r]
                    out.append(StepEntry(r, b"", [Finish.ABORT, message], None))
            elif rid in self.reserved:
                del self.reserved[rid]
                out.append(StepEntry(rid, b"", [Finish.ABORT, message], None))
        return out

    def _end(self, seq: Sequence) -> None:
        """``seq`` ended: no longer live, its blocks released."""
        del self.seqs[seq.rid]
        self.scheduler.remove(seq)

    def _fail(self, seq: Sequence, why: str) -> None:
        """End ``seq`` (and its forks not yet made) as failed: no entry, an error the
        worker reports (``take_failed``); the rest of the step goes on."""
        log.error("request %d failed: %s", seq.rid, why)
        self._failed += [(e.rid, why) for e in self.abort([seq.rid], why)]

    def take_failed(self) -> list[tuple[int, str]]:
        """The requests the steps since the last call failed, as (rid, why)."""
        failed, self._failed = self._failed, []
        return failed

    def abort_all(self, message: str) -> list[StepEntry]:
        self._in_flight = None  # its tokens are never read: every request ends here
        return self.abort(list(self.seqs) + list(self.reserved), message)

    def check(self) -> list[str]:
        problems = self.scheduler.check()
        if not self.scheduler.has_work and (self.seqs or self.reserved):
            problems.append(f"idle but {len(self.seqs) + len(self.reserved)} rids still live")
        return problems

    def flush(self) -> tuple[bool, str]:
        n = self.blocks.flush()
        return True, f"dropped {n} cached blocks"

    # -- the step ----------------------------------------------------------------------

    def step(self) -> list[StepEntry]:
        """Schedule, run, postprocess: the STEP entries of what ended or sampled.

        Overlapped (``EngineConfig.overlap``, ``gpu/runtime/overlap.py``), a step whose samplers
        all fly leaves its tokens on the device: the next call launches the following
        step first, its rows reading them there, and only then reads them and makes their
        entries (``_resolve``). The same tokens either way (docs/worker.md). In inference
        mode: the caller's (the worker's step loop holds it), else entered here."""
        if not torch.is_inference_mode_enabled():  # entering costs ~0.05 ms at batch 256
            with torch.inference_mode():
                return self.step()
        t0 = perf_counter()
        prev, self._in_flight = self._in_flight, None
        batch = self.scheduler.schedule()
        if not batch:
            return [] if prev is None else self._resolve(prev)
        self.step_no += 1
        step = self._run(batch, prev)
        entries = [] if prev is None else self._resolve(prev)
        entries += self._settle(step, prev is not None)
        # Once per step, never per token: its time (scheduling to the STEP entries), its
        # sequences and its tokens, for STATS (wire/stats.py).
        self.step_stats.record(perf_counter() - t0, len(batch), len(step.input.ids))
        return entries

    def _settle(self, ran: Step, after_resolve: bool) -> list[StepEntry]:
        """The host's part after the model call: the KV the step wrote is the cache's (its
        full blocks published), embed and score requests end, and the samplers sample:
        at once, or left in flight when overlapped and every one is plain.
        ``after_resolve``: requests that ended as the step before resolved are gone."""
        seqs = self.seqs
        batch = ran.batch
        if after_resolve:
            batch = [(s, n) for s, n in batch if seqs.get(s.rid) is s]
        if ran.drafts:  # a speculating row's last token only: its draft's once accepted
            batch = [(s, 1 if s.draft else n) for s, n in batch]
        self.scheduler.computed(batch)
        entries = [self.books.embedded(seq, vec) for seq, vec in ran.pooled]
        logits = ran.logits
        if logits is not None:
            ran.rows.collect_prompt(logits)
        entries += [e for seq in ran.scored for e in self.books.scored(seq)]
        samplers = ran.samplers
        if logits is None or not samplers:
            return entries
        logits, hid = ran.rows.samples(logits), ran.rows.samples(ran.hidden)
        if self.overlap and hid is None and not ran.drafts and all(flies(s) for s in samplers):
            self._in_flight = fly(samplers, logits)
            return entries
        return entries + self._finish_step(samplers, logits, hid, ran.drafts)

    def _resolve(self, flight: InFlight) -> list[StepEntry]:
        """An overlapped step's tokens read at last: each sampler's placeholder becomes its
        token, and the entries are what ``_finish_step`` makes of them."""
        return self.books.entries(flight.samplers, land(flight), None, None)

    def _finish_step(
        self, samplers: list[Sequence], logits: torch.Tensor, hidden: torch.Tensor | None,
        drafts: Drafted = (),
    ) -> list[StepEntry]:  # fmt: skip
        """Sample one token for each of ``samplers`` and make their STEP entries.

        Per-row work is per-batch where it can be (issue 57): a batch whose every row is
        greedy and plain, with no grammar, forks, logprobs or hidden states (a decode
        step's usual case), takes its tokens from one argmax and no other pass over it.
        ``drafts``: the speculating sequences' rows, checked before their entries are
        made (``_speculated``)."""
        if all(s.argmax_only and s.matcher is None and not s.forks for s in samplers):
            tokens = sample_greedy(logits)
            if drafts:
                return self._speculated(samplers, tokens, None, hidden, drafts, [])
            return self.books.entries(samplers, tokens, None, hidden)
        if any(s.forks for s in samplers):
            samplers, logits, hidden = fork_samplers(self, samplers, logits, hidden)
            drafts = [(samplers.index(seq), seq, d) for _, seq, d in drafts]  # rows moved
        want_lp = any(s.options.return_logprob for s in samplers)
        allowed = self.grammars.constrain(samplers, draft_matchers(samplers, drafts))
        # a sampled speculating row's generator, as it stands before its rows' draws
        states = [(seq.generator, seq.generator.get_state()) if not seq.greedy and
                  seq.generator is not None else None for _, seq, _ in drafts]  # fmt: skip
        rows = draft_rows(samplers, drafts) if drafts else samplers
        result = sample(logits, rows, want_logprobs=want_lp, allowed=allowed)
        if drafts:
            return self._speculated(samplers, result.tokens, result.logprobs, hidden, drafts,
                                    states, logits.shape[1])  # fmt: skip
        return self.books.entries(samplers, result.tokens, result.logprobs, hidden)

    def _speculated(
        self, samplers: list[Sequence], tokens: list[int], lp: torch.Tensor | None,
        hidden: torch.Tensor | None, drafts: Drafted,
        states: list[tuple[torch.Generator, torch.Tensor] | None], vocab: int = 0,
    ) -> list[StepEntry]:  # fmt: skip
        """The entries of a step with speculating rows (``gpu/runtime/speculation.py``):
        each draft checked against the tokens sampled at its positions, the rows past
        its first mismatch dropped, the generators of sampled rows set back to where the
        rows kept leave them (``states``: each one's before the draws of ``vocab``
        values a row), and each sequence's accepted draft tokens counted as
        computed once the entries have appended them."""
        keep, accepted = verify(tokens, drafts)
        totals = self.spec_totals
        for i, ((_, seq, draft), a) in enumerate(zip(drafts, accepted, strict=True)):
            assert seq.drafts is not None
            seq.drafts.checked(len(draft), a)
            totals.draft_tokens += len(draft)
            totals.accepted_tokens += a
            totals.verify_steps += 1
            if states and (saved := states[i]) is not None and a < len(draft):
                rewind(saved[0], saved[1], a + 1, vocab, torch.float32)
        if len(keep) < len(tokens):
            samplers = [samplers[i] for i in keep]
            tokens = [tokens[i] for i in keep]
            idx = torch.tensor(keep, device=self.loaded.device)
            lp = None if lp is None else lp.index_select(0, idx)
            hidden = None if hidden is None else hidden.index_select(0, idx)
        entries = self.books.entries(samplers, tokens, lp, hidden)
        for (_, seq, _), a in zip(drafts, accepted, strict=True):
            if self.seqs.get(seq.rid) is seq:
                self.scheduler.accepted(seq, a)
            else:
                seq.draft = []
        return entries
