"""Continuous batching: waiting/running queues, chunked prefill, preemption by recompute.

One rule drives every sequence: each step it is fed ``tokens[num_computed:]`` (up to the
step's token budget; while others decode, prompt tokens are capped lower), and when that
reaches the end of its tokens the step samples one more. A decode is the one-token case; a prefill, a later chunk of one, and the recompute
after a preemption are the longer cases. Running sequences are served first (so every
running request decodes every step); waiting ones are admitted while blocks, slots and
budget last. When a running sequence needs a block and none is free, the most recently
admitted sequence is preempted (blocks released, recomputed later).
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from gpu.cache.kv_cache import BlockManager, PrefixHit
from gpu.runtime.disk_prefix import DiskPrefix
from gpu.runtime.engine_config import EngineConfig
from gpu.runtime.speculation import Drafts, Speculation
from wire.options import RequestOptions
from wire.reasoning_budget import BudgetState
from wire.sampling import SamplingParams

__all__ = ["Scheduler", "Sequence", "speculates"]


@dataclass(slots=True, eq=False)
class Sequence:
    """One sampled sequence (a request with n > 1 has n of them after its prefill)."""

    rid: int
    tokens: list[int]  # prompt + output so far
    prompt_len: int
    params: SamplingParams
    options: RequestOptions
    generator: torch.Generator | None = None
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # of the published full blocks
    num_computed: int = 0  # tokens whose KV is in the cache
    cached_tokens: int = 0
    num_retractions: int = 0
    started: bool = False  # its first STEP entry was sent
    forks: int = 0  # siblings to fork off at the first sampled token (n - 1)
    prefix_limit: int = 1 << 62  # prompt tokens the prefix cache may supply
    stop_window: int = 0  # tokens of output to decode when checking stop strings
    stop_patterns: tuple[re.Pattern[str], ...] = ()  # stop_regex, compiled
    prompt_logprobs: list[Any] = field(default_factory=list)  # rows gathered during prefill
    pooled: Any = None  # embed, mean pooling: the sum of the final hidden rows so far
    matcher: Any = None  # the grammar's llguidance matcher (gpu/runtime/grammar.py), if constrained
    grammar_done: bool = False  # the matcher accepts nothing more: the sample ends
    grammar_error: str | None = None  # the matcher refused a sampled token (a bug)
    grammar_info: dict[str, Any] = field(default_factory=dict)  # compile time, cache hit
    eog_ids: tuple[int, ...] = ()  # the model's end-of-generation ids (masked by min_new_tokens)
    # Overlapped steps (``Engine``): the last token is a placeholder for the one the step
    # in flight sampled at this index; its real value is known when that step resolves.
    future: int | None = None
    # The request's thinking budget (``wire/reasoning_budget.py``): the end it forces.
    budget: BudgetState | None = None
    # What the sampler asks of every row each step, read from ``params`` once.
    greedy: bool = field(init=False)
    plain: bool = field(init=False)  # no bias, penalty or EOG mask changes its logits
    # greedy and plain, no logprobs or hidden states: its token is its logits' argmax
    # alone when it has no grammar (``Engine._finish_step``'s one pass over the batch)
    argmax_only: bool = field(init=False)
    max_len: int = field(init=False)  # len(tokens) when max_new_tokens is reached
    # A started quiet row's ids that end it (``gpu/runtime/step_books.py``, set by the engine).
    ends: frozenset[int] | None = None
    # Speculative decoding (``gpu/runtime/speculation.py``): its n-gram index and record,
    # made at its first decode when it may speculate, and this step's draft tokens.
    drafts: Drafts | None = None
    draft: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.greedy = self.params.greedy
        self.plain = not self.params.adjusts_logits
        self.max_len = self.prompt_len + self.params.max_new_tokens
        o = self.options
        self.argmax_only = (
            self.greedy and self.plain and not o.return_logprob and not o.return_hidden_states
        )

    @property
    def prompt(self) -> list[int]:
        return self.tokens[: self.prompt_len]

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len


def speculates(seq: Sequence) -> bool:
    """Whether a started sequence may speculate: no reasoning budget forces its tokens,
    it asks no hidden states and it is not an embedding (penalties, masks and grammars
    read each checked row's output as its decode row would: ``draft_rows``,
    ``draft_matchers``)."""
    o = seq.options
    return seq.budget is None and not o.return_hidden_states and o.embed is None


class Scheduler:
    def __init__(
        self, blocks: BlockManager, config: EngineConfig, disk: DiskPrefix | None = None
    ) -> None:
        """``config``: the engine's, of which the scheduler reads its bounds (max_running,
        step_tokens, mixed_prefill_tokens: while any sequence decodes, the prompt tokens
        a step takes stop there, a chunk sharing its step with every decode)."""
        self.blocks = blocks
        self.config = config
        self.disk = disk  # the prefix cache's disk tier (--prefix-cache-dir), if any
        spec = config.speculation
        self.spec: Speculation | None = spec if spec.on else None  # --speculative
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # The next step's KV copies (src block, dst block, rows), in the order they were
        # decided: the runner makes them just before the model runs (``StepInput.copies``).
        self._copies: list[tuple[int, int, int]] = []

    def copy_rows(self, src: int, dst: int, n: int) -> None:
        """Copy block ``src``'s first ``n`` KV rows into ``dst`` before the next step
        (copy-on-write: a prefix hit inside a block, a fork's partial last block). KV
        changes only as a step runs, so a copy made then reads what it reads now."""
        self._copies.append((src, dst, n))

    def take_copies(self) -> list[tuple[int, int, int]]:
        """The copies decided since the last step, in order (the step about to run's)."""
        copies, self._copies = self._copies, []
        return copies

    def take_loads(self) -> list[tuple[int, Tensor, Tensor]]:
        """The blocks read back from disk since the last step (``DiskPrefix``), whose
        rows the runner writes before the copies and the model."""
        return self.disk.take_loads() if self.disk is not None else []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def live(self) -> list[Sequence]:
        return [*self.running, *self.waiting]

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The step's batch: (sequence, new tokens); single-token entries first.

        Per running row this is the worker's hottest Python (every decode of every step):
        a decode whose next token fits its last block takes the first branch, with no
        call; the rest (a new block, a prompt chunk, a preemption) the general one."""
        budget = self.config.step_tokens
        decoding = any(len(s.tokens) - s.num_computed == 1 for s in self.running)
        prefill = min(budget, self.config.mixed_prefill_tokens) if decoding else budget
        batch: list[tuple[Sequence, int]] = []
        bs = self.blocks.block_size
        preempted = 0
        chunks = False
        spec = self.spec
        # draft rows this step may add: a step of many decodes gains nothing from them,
        # and prompt work (a running prompt's chunk, a request this step may admit) fills
        # its rows; a request kept waiting by --max-running waits for the running to end
        room = spec.step_rows - len(self.running) if spec is not None else 0
        if room > 0 and (
            (self.waiting and len(self.running) < self.config.max_running)
            or any(len(s.tokens) - s.num_computed > 1 for s in self.running)
        ):
            room = 0
        for seq in list(self.running):
            c = seq.num_computed
            left = len(seq.tokens) - c
            if room > 0 and left == 1 and (n := self._speculate(seq, spec, min(budget, room + 1))):
                batch.append((seq, n))
                budget -= n
                room -= n - 1
                chunks = True
                continue
            if left == 1 and c < len(seq.block_table) * bs:
                batch.append((seq, 1))  # a decode within its last block
                budget -= 1
                continue
            if preempted and seq not in self.running:
                continue  # preempted while an earlier one made room
            n = 1 if left == 1 else min(left, max(min(budget, prefill), 1))
            before = len(self.running)
            if not self._reserve_running(seq, n):
                preempted += 1
                continue
            preempted += before - len(self.running)
            batch.append((seq, n))
            budget -= n
            if left > 1:
                prefill -= n
                chunks = True
        while (
            self.waiting
            and min(budget, prefill) > 0
            and len(self.running) < self.config.max_running
        ):
            seq = self.waiting[0]
            n = self._admit(seq, min(budget, prefill))
            if not n:
                break
            self.waiting.popleft()
            self.running.append(seq)
            batch.append((seq, n))
            budget -= n
            prefill -= n
            chunks = chunks or n > 1
        if chunks:
            batch.sort(key=lambda e: e[1] > 1)
        return batch

    def _speculate(self, seq: Sequence, spec: Speculation | None, budget: int) -> int:
        """A decode's rows with its draft (``gpu/runtime/speculation.py``): 1 + the draft's
        tokens, their blocks held; 0 when it proposes nothing (or they do not fit without
        preempting anyone: the decode then goes on alone)."""
        if seq.future is not None:  # its last token is still on the device (--overlap)
            return 0
        drafts = seq.drafts
        if drafts is None:
            if spec is None or not seq.started or not speculates(seq):
                return 0
            drafts = seq.drafts = Drafts(spec)
        most = min(seq.max_len - len(seq.tokens) - 1, budget - 1)
        if self.spec is not None and self.spec.mode == "draft":  # the draft model fills it
            if seq.matcher is not None:  # (its proposals are not held to a grammar)
                return 0
            draft = [0] * drafts.length(most)  # before the step is laid out (Drafter.fill)
        else:
            draft = drafts.propose(seq.tokens, most)
            if draft and seq.matcher is not None:  # no token the grammar refuses
                draft = draft[: seq.matcher.validate_tokens(draft)]
        if not draft:
            return 0
        n = 1 + len(draft)
        need = self._blocks_needed(seq, n)
        if need > self.blocks.num_free:
            return 0
        if need:
            seq.block_table += self.blocks.allocate(need)
        seq.draft = draft
        return n

    def accepted(self, seq: Sequence, n: int) -> None:
        """``n`` of ``seq``'s draft tokens were accepted (now its tokens): the KV the
        step wrote for them is its own, past that is written over later."""
        seq.draft = []
        if n:
            self.computed([(seq, n)])

    def _blocks_needed(self, seq: Sequence, n: int) -> int:
        bs = self.blocks.block_size
        return max(0, -(-(seq.num_computed + n) // bs) - len(seq.block_table))

    def _reserve_running(self, seq: Sequence, n: int) -> bool:
        while self._blocks_needed(seq, n) > self.blocks.num_free:
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        seq.block_table += self.blocks.allocate(self._blocks_needed(seq, n))
        return True

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Hold the cached prefix and the first chunk's blocks; 0 when they do not fit."""
        if seq.num_computed == 0 and not seq.block_table:
            self._reuse_prefix(seq)
        n = min(len(seq.tokens) - seq.num_computed, budget)
        if self._blocks_needed(seq, n) > self.blocks.num_free:
            self._drop_blocks(seq)
            return 0
        seq.block_table += self.blocks.allocate(self._blocks_needed(seq, n))
        return n

    def _reuse_prefix(self, seq: Sequence) -> None:
        """Start from the longest cached prefix, to the token. At least one token is
        left to compute: the logits of the last one give the next token."""
        bs = self.blocks.block_size
        limit = min(len(seq.tokens) - 1, seq.prefix_limit)
        hit = self.blocks.match_prefix(seq.tokens, limit)
        seq.block_table, seq.block_hashes = hit.blocks, hit.hashes
        # Where the blocks in memory stop, the disk's may go on (whole blocks only).
        if self.disk is not None and self.disk.extend(
            self.blocks, seq.tokens, hit.blocks, hit.hashes, limit
        ):
            if hit.partial is not None:
                self.blocks.release([hit.partial])
            hit = PrefixHit(hit.blocks, hit.hashes)
        seq.num_computed = len(hit.blocks) * bs
        if hit.partial is not None:
            if self.blocks.num_free:
                (own,) = self.blocks.allocate(1)
                self.copy_rows(hit.partial, own, hit.partial_len)
                seq.block_table.append(own)
                seq.num_computed += hit.partial_len
            self.blocks.release([hit.partial])
        if not seq.started:
            seq.cached_tokens = seq.num_computed

    def _drop_blocks(self, seq: Sequence) -> None:
        """Release its blocks; the computed head of a partly filled last block is
        published first, so a later request (or its own recompute) can copy it."""
        bs, j = self.blocks.block_size, seq.num_computed // self.blocks.block_size
        if seq.num_computed % bs and len(seq.block_table) > j and len(seq.block_hashes) == j:
            parent = seq.block_hashes[-1] if j else None
            head = seq.tokens[j * bs : seq.num_computed]
            self.blocks.publish_partial(seq.block_table[j], parent, head)
        self.blocks.release(seq.block_table)
        seq.block_table, seq.block_hashes, seq.num_computed = [], [], 0

    def preempt(self, seq: Sequence) -> None:
        """Release everything; the sequence is recomputed from its tokens when readmitted."""
        self.running.remove(seq)
        self._drop_blocks(seq)
        seq.num_retractions += 1
        if not seq.started:
            seq.prompt_logprobs.clear()  # gathered again by the recompute
            seq.pooled = None
        self.waiting.appendleft(seq)

    def computed(self, batch: list[tuple[Sequence, int]]) -> None:
        """The step wrote each row's ``n`` more tokens of KV: publish the blocks that
        became full. Every full block below ``num_computed`` is published already (those
        from the prefix cache or a parent come with their hashes), so one fills only where
        a row crosses a block's end: the test reads no list (at batch 256, a list read
        per row, cold after the model, cost ~0.05 ms)."""
        bs = self.blocks.block_size
        for seq, n in batch:
            c = seq.num_computed
            seq.num_computed = c + n
            if c % bs + n >= bs:
                self._publish(seq)

    def _publish(self, seq: Sequence) -> None:
        bs = self.blocks.block_size
        while (len(seq.block_hashes) + 1) * bs <= seq.num_computed:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            h = self.blocks.register(seq.block_table[i], parent, seq.tokens[i * bs : (i + 1) * bs])
            seq.block_hashes.append(h)

    def remove(self, seq: Sequence) -> None:
        """Finish or abort: free its blocks now, wherever it is queued."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._drop_blocks(seq)

    def check(self) -> list[str]:
        return self.blocks.check(s.block_table for s in self.live())
