"""The mutations ``tools/mutations.py`` runs: each a small bug put into the product, and
the tests that must fail on it.

``origin`` says where the mutation comes from: the 18 planted bugs of issue 54 (its
points 1-7 the ones the suite missed then, ``caught`` the twelve it caught), its fixes
(points 8-11), and each fault protection's named regression test (``protection``, the
list ``docs/faults.md`` documents). Edits are exact texts that must occur once in their
file: when the code moves, move the mutation with it (the runner reports it STALE).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MUTATIONS", "Edit", "Mutation"]


@dataclass(frozen=True, slots=True)
class Edit:
    path: str
    old: str
    new: str


@dataclass(frozen=True, slots=True)
class Mutation:
    name: str
    origin: str
    what: str
    edits: tuple[Edit, ...]
    tests: tuple[str, ...]  # pytest arguments: files, node ids


def _m(name: str, origin: str, what: str, tests: tuple[str, ...], *edits: Edit) -> Mutation:
    return Mutation(name, origin, what, edits, tests)


FAULTS = "tests/test_fault_regressions.py"
REQUESTS = "tests/test_request_regressions.py"

# Issue 54's planted bugs the suite missed then (points 1-7), each held now.
MISSED_THEN = (
    _m("detok_hold_back_short", "issue 54, point 1",
       "the stream's hold-back for a stop string is one character short",
       ("tests/test_detok.py",),
       Edit("lifecycle/core/detok.py",
            "end = min(end, len(raw) - held_back(raw, (stop,)))",
            "end = min(end, len(raw) - held_back(raw, (stop,)) + 1)")),
    _m("no_abort_on_close", "issue 54, point 2",
       "a call that closes (client gone, failure, drain cut) sends the worker no ABORT",
       ("tests/test_dsim.py::test_seeds_hold_every_invariant",),
       Edit("lifecycle/core/call_state.py",
            "            if run.sub is not None and self.client is not None:\n"
            "                self.client.abort(run.sub, forget=True, message=detail or cause.value)\n",
            "            pass\n")),
    _m("gemma2_final_softcap", "issue 54, point 4",
       "Gemma 2's final logit soft cap 1.25 times too large on the served (quantized CPU) path",
       ("tests/test_families.py",),
       Edit("gpu/model/decoder.py", "logits = native.softcap(logits, cap)",
            "logits = native.softcap(logits, cap * 1.25)")),
    _m("llama3_rope_blend", "issue 54, point 5",
       "Llama 3's RoPE blend between the wavelength limits divides by (high + low)",
       ("tests/test_hf_folder.py",),
       Edit("modelfile/hf_config.py", "smooth = (old / wavelen - low) / (high - low)",
            "smooth = (old / wavelen - low) / (high + low)")),
    _m("push_without_readiness", "issue 54, point 6",
       "the stream push polls output without asking whether the socket takes it now",
       ("tests/test_stream_push.py",),
       Edit("lifecycle/api/native.py",
            "if not gate.ready_now() or call.end_pending() or _client_write_planned():",
            "if call.end_pending() or _client_write_planned():")),
    _m("x_scale_everywhere", "issue 54, point 7",
       "x's int8 scale computed as amax * (1/127) in every build (all builds still agree)",
       ("tests/test_qlinear.py",),
       Edit("gpu/kernels/csrc/quant_linear.c", "float d = _mm_cvtss_f32(m4) / 127.0f, id",
            "float d = _mm_cvtss_f32(m4) * (1.0f / 127.0f), id"),
       Edit("gpu/kernels/csrc/quant_linear.c", "float d = amax / 127.0f, id",
            "float d = amax * (1.0f / 127.0f), id")),
)  # fmt: skip

# Issue 54's planted bugs the suite caught then, of the kinds it named.
CAUGHT_THEN = (
    _m("kv_blocks_of_running_leak", "issue 54, caught",
       "a running sequence's KV blocks are not freed when it finishes or is aborted",
       ("tests/test_engine.py",),
       Edit("gpu/runtime/scheduler.py",
            "        if seq in self.running:\n            self.running.remove(seq)\n"
            "        elif seq in self.waiting:",
            "        if seq in self.running:\n            self.running.remove(seq)\n"
            "            return\n        elif seq in self.waiting:")),
    _m("cached_block_never_evictable", "issue 54, caught",
       "a prefix-cached block whose last holder lets go is lost, neither free nor evictable",
       ("tests/test_engine.py", "tests/test_prefix_cache.py"),
       Edit("gpu/cache/blocks.py",
            "                if self._tokens[b] is not None:\n                    self._cached[b] = None\n",
            "                if self._tokens[b] is not None:\n                    pass\n")),
    _m("utf8_split_at_chunk", "issue 54, caught",
       "the byte-level stream decoder releases an incomplete UTF-8 character as U+FFFD",
       ("tests/test_tokenizer.py", "tests/test_tokenizer_spm.py", "tests/test_llamacpp_vocab.py"),
       Edit("modelfile/byte_decode.py",
            "return self._start(self._decoder.decode(self._decoding.piece(token_id)))",
            "return self._start(self._decoder.decode(self._decoding.piece(token_id), final=True))")),
    _m("drain_drops_new_request", "issue 54, caught",
       "a request arriving while the server drains is dropped unanswered, not refused 503",
       ("tests/test_transport_drain.py",),
       Edit("transport/http11.py",
            "                keep_alive = await writer.refuse_draining(item, self.server.retry_after)\n",
            "                return\n")),
    _m("round_half_away_portable", "issue 54, caught",
       "the portable kernel rounds x half away from zero (the SIMD builds: half to even)",
       ("tests/test_qlinear.py",),
       Edit("gpu/kernels/csrc/quant_linear.c", "int q = (int)nearbyintf(v[i] * id);",
            "int q = (int)roundf(v[i] * id);")),
    _m("template_autoescape", "issue 54, caught",
       "chat templates render with HTML autoescape (transformers' environment has none)",
       ("tests/test_chat_templates_real.py", "tests/test_chat.py"),
       Edit("modelfile/chat.py", "trim_blocks=True, lstrip_blocks=True, extensions=",
            "trim_blocks=True, lstrip_blocks=True, autoescape=True, extensions=")),
    _m("template_tojson_ascii", "issue 54, caught",
       "the templates' tojson escapes non-ASCII (transformers' writes it as it is)",
       ("tests/test_chat_templates_real.py", "tests/test_chat.py"),
       Edit("modelfile/chat.py", "    ensure_ascii: bool = False,\n    indent: int | None = None,",
            "    ensure_ascii: bool = True,\n    indent: int | None = None,")),
    _m("stop_token_ids_ignored", "issue 54, caught",
       "a request's stop_token_ids do not end it",
       ("tests/test_worker_engine.py", "tests/test_engine.py"),
       Edit("gpu/runtime/step_books.py",
            "if tok in p.stop_token_ids or (not p.ignore_eos and tok in eog_ids):",
            "if not p.ignore_eos and tok in eog_ids:")),
    _m("reasoning_end_tag_leaks", "issue 54, caught",
       "the reasoning splitter streams the first characters of a split end tag as reasoning",
       ("tests/test_reasoning.py",),
       Edit("lifecycle/chat/reasoning.py", "        keep = held_back(buf, (fmt.end,))\n",
            "        keep = 0\n")),
    _m("hermes_close_tag_left_in_content", "issue 54, caught",
       "the qwen25 (hermes) reader stops one character short of </tool_call>: a '>' reaches "
       "the content",
       ("tests/test_tool_formats.py", "tests/test_tool_streaming.py", "tests/test_tools.py"),
       Edit("lifecycle/chat/formats/json_calls.py",
            "used = end + len(TOOL_CALL_CLOSE) if end >= 0 else len(buf)",
            "used = end + len(TOOL_CALL_CLOSE) - 1 if end >= 0 else len(buf)")),
    _m("xml_arguments_untyped", "issue 56, point 2",
       "qwen3_coder / glm45 arguments stay strings whatever the tool's schema says",
       ("tests/test_tool_formats.py", "tests/test_tool_streaming.py"),
       Edit("lifecycle/chat/formats/xml_calls.py",
            "    kinds = _types(schema)\n    if \"string\" in kinds:",
            "    kinds = _types(schema)\n    if True:")),
    _m("top_p_drops_the_crossing_token", "issue 54, caught",
       "top-p drops the token whose probability crosses top_p (a top_p below the first "
       "token's probability drops every token)",
       ("tests/test_worker_sampling.py",),
       Edit("gpu/runtime/sampling.py", "drop = (sorted_p.cumsum(dim=-1) - sorted_p) > top_p[:, None]",
            "drop = sorted_p.cumsum(dim=-1) > top_p[:, None]")),
)  # fmt: skip

# The fixes of issue 54, points 8-11.
FIXES = (
    _m("nan_logits_sampled", "issue 54, point 8",
       "a row of NaN logits is sampled as token 0 instead of failing its request",
       ("tests/test_worker_sampling.py", "tests/test_worker_fault_points.py"),
       Edit("gpu/runtime/sampling.py",
            "torch.from_numpy(a[np.arange(len(idx)), idx] < np.inf)",
            "torch.from_numpy(np.ones(len(idx), dtype=bool))")),
    _m("slow_reader_is_stalled", "issue 54, point 9",
       "the send deadline counts a write's whole length, not the time without progress",
       ("tests/test_slow_reader.py",),
       Edit("transport/channel.py", "            if 0 <= left < self.send_left:",
            "            if False:")),
    _m("deadline_waits_for_the_write", "issue 54, point 10",
       "the frontend's deadline watch does not end a call whose owner is blocked in a write",
       ("tests/test_deadline_blocked_write.py",),
       Edit("lifecycle/core/call.py",
            "        self._expired = True\n        self.interrupt(Cause.DEADLINE, self._deadline_message())\n"
            "        return True\n",
            "        return False\n")),
    _m("unknown_field_names_unbounded", "issue 54, point 11",
       "every distinct unknown field name gets its own counter and warning",
       ("tests/test_unknown_fields_bound.py",),
       Edit("lifecycle/core/fields.py", "if self._named < NAMES_KEPT and len(name) <= NAME_CHARS:",
            "if len(name) <= NAME_CHARS:")),
)  # fmt: skip

_LOST_DISPATCH = Edit(
    "lifecycle/link/worker_client.py",
    "        lost = [rid for rid in reply.missing if rid in self._held]\n",
    "        lost: list[int] = []\n",
)

# Features since (each new feature adds the mutations its tests must catch).
FEATURES = (
    _m(
        "frontends_drain_in_turn",
        "issue 53, point 6",
        "--frontends N: a signal to the launcher drains one frontend, the next once it ended",
        ("tests/test_signals.py::test_every_signal_drains_every_frontend_at_once",),
        Edit(
            "lifecycle/frontends.py",
            "    for child in frontends:\n        child.signal(CHILD_DRAIN)\n",
            "    for child in frontends:\n        child.signal(CHILD_DRAIN)\n"
            "        while child.proc is not None and child.proc.poll() is None:\n"
            "            time.sleep(0.05)\n",
        ),
    ),
    _m(
        "thinking_budget_one_late",
        "issue 56, point 4",
        "the thinking budget forces the reasoning's end one token after the budget",
        ("tests/test_reasoning_budget.py", "tests/test_worker_reasoning_budget.py"),
        Edit(
            "wire/reasoning_budget.py",
            "        elif self._count >= b.tokens:\n",
            "        elif self._count > b.tokens:\n",
        ),
    ),
    _m(
        "anthropic_stop_sequence_unnamed",
        "issue 56, point 1",
        "a /v1/messages reply that ended on a stop sequence reports end_turn",
        ("tests/test_anthropic_params.py", "tests/test_api_anthropic.py"),
        Edit(
            "lifecycle/api/anthropic.py",
            "    if isinstance(matched, str) and matched in stops:\n",
            "    if False:\n",
        ),
    ),
    _m(
        "spec_accepts_one_too_many",
        "issue 59, point 1",
        "speculative decoding keeps the row after a draft's first mismatch",
        ("tests/test_speculative.py",),
        Edit(
            "gpu/runtime/speculation.py",
            "        drop.update(range(first + a + 1, first + len(draft) + 1))\n",
            "        drop.update(range(first + a + 2, first + len(draft) + 1))\n",
        ),
    ),
    _m(
        "spec_generator_not_rewound",
        "issue 59, point 1",
        "a sampled speculating row's generator keeps the draws of the rows dropped",
        ("tests/test_speculative.py",),
        Edit(
            "gpu/runtime/engine.py",
            "                rewind(saved[0], saved[1], a + 1, vocab, torch.float32)\n",
            "                pass\n",
        ),
    ),
    _m(
        "spec_rows_read_the_output_unchecked",
        "issue 59, point 1",
        "a speculating row's penalties read the output without the draft before it",
        ("tests/test_speculative.py",),
        Edit(
            "gpu/runtime/speculation.py",
            "    if all(seq.plain for _, seq, _ in drafts):\n",
            "    if True:\n",
        ),
    ),
    _m(
        "spec_grammar_row_masks",
        "issue 59, point 1",
        "a speculating row's grammar mask is the matcher's before the draft",
        ("tests/test_speculative.py",),
        Edit(
            "gpu/runtime/grammar.py",
            "    if not any(s.matcher is not None for _, s, _ in drafts):\n",
            "    if True:\n",
        ),
    ),
    _m(
        "spec_draft_kv_not_mirrored",
        "issue 59, point 1",
        "the draft model's cache misses the served model's steps (its proposals go stale)",
        ("tests/test_speculative_draft.py",),
        Edit(
            "gpu/runtime/engine.py",
            "            self.drafter.mirror(step)\n",
            "            pass\n",
        ),
    ),
    _m(
        "spec_draft_mirror_cuts_prompts",
        "issue 59, point 1",
        "the draft model's mirror runs only the last row of every chunk, prompt chunks too",
        ("tests/test_speculative_draft.py",),
        Edit(
            "gpu/runtime/drafter.py",
            "        if id(c.block_table) in checks:\n",
            "        if True:\n",
        ),
    ),
    _m(
        "spec_drafts_beside_prompt_work",
        "issue 59, point 1",
        "a step with a prompt chunk or a request waiting still proposes drafts",
        ("tests/test_speculative.py",),
        Edit(
            "gpu/runtime/scheduler.py",
            "        if room > 0 and (\n            (self.waiting and",
            "        if room < 0 and (\n            (self.waiting and",
        ),
    ),
    _m(
        "spec_queue_past_max_running_stops_drafts",
        "issue 59, point 1",
        "a request that --max-running keeps waiting stops the running ones' drafts",
        ("tests/test_speculative.py",),
        Edit(
            "gpu/runtime/scheduler.py",
            "(self.waiting and len(self.running) < self.config.max_running)\n            or",
            "self.waiting\n            or",
        ),
    ),
    _m(
        "spec_draft_published",
        "issue 59, point 1",
        "a speculating row's draft KV is counted computed before it was checked",
        ("tests/test_speculative.py", "tests/test_speculative_draft.py"),
        Edit(
            "gpu/runtime/engine.py",
            "            batch = [(s, 1 if s.draft else n) for s, n in batch]\n",
            "            pass\n",
        ),
    ),
    _m(
        "packed_fifth_bit_dropped",
        "issue 59, one stream",
        "q_pack leaves out the Q5 types' fifth bits",
        ("tests/test_qlinear.py",),
        Edit(
            "gpu/kernels/csrc/quant_linear.c",
            "                        if (bits == 5) q[256 + at] |=",
            "                        if (bits == 55) q[256 + at] |=",
        ),
    ),
    _m(
        "packed_zero_half_sum",
        "issue 59, one stream",
        "a packed block's zero point comes off with x's first half-block sum only",
        ("tests/test_qlinear.py",),
        Edit(
            "gpu/kernels/csrc/quant_linear.c",
            "if (z) dot = QV_SUBI(dot, QV_SET1I(z * (sx[0] + sx[1])));",
            "if (z) dot = QV_SUBI(dot, QV_SET1I(z * sx[0]));",
        ),
    ),
    _m(
        "packed_never",
        "issue 59, one stream",
        "the loader keeps the file's layout where the build packs (slower, the same bits)",
        ("tests/test_gguf_loader.py",),
        Edit(
            "gpu/model/quant.py",
            "        return self if wp is None else QuantWeight(wp, self.qtype, self.k, self.shape[0])",
            "        return self",
        ),
    ),
    _m(
        "kv_query_unrotated",
        "issue 59, q8_0 KV",
        "attention over a q8_0 / q4_0 cache scores the query as it is against the rotated keys",
        ("tests/test_kv_rows.py",),
        Edit(
            "gpu/kernels/csrc/paged_attention.c",
            "            if (rotated) { /* H q / G against the stored H k */",
            "            if (0) { /* H q / G against the stored H k */",
        ),
    ),
    _m(
        "kv_store_unrotated",
        "issue 59, q8_0 KV",
        "the q8_0 / q4_0 writer quantizes the row without rotating it first",
        ("tests/test_kv_rows.py",),
        Edit(
            "gpu/kernels/csrc/paged_attention.c",
            "        kv_rotate(tmp, 1, hd, 1.0f);\n",
            "",
        ),
    ),
    _m(
        "attention_v_unfused",
        "issue 59, speculation's checks",
        "the vector attention's last keys' dot products multiply and add in two roundings",
        ("tests/test_determinism.py",),
        Edit(
            "gpu/kernels/csrc/paged_attention.c",
            "                    a = _mm256_fmadd_ps(_mm256_loadu_ps(qj + d), _mm256_loadu_ps(k + d), a);",
            "                    a = _mm256_add_ps(a, _mm256_mul_ps(_mm256_loadu_ps(qj + d), _mm256_loadu_ps(k + d)));",
        ),
    ),
    _m(
        "arena_torch_empty",
        "issue 59, one stream",
        "the loader packs every matrix into torch.empty's memory, wherever the heap has room",
        ("tests/test_weight_arena.py",),
        Edit(
            "gpu/kernels/arena.py",
            "    return WeightArena() if huge_pages_advisable() else TorchArena()",
            "    return TorchArena()",
        ),
    ),
    _m(
        "arena_not_advised",
        "issue 59, one stream",
        "the arena's chunks are never advised for huge pages (4 KiB pages where THP is madvise)",
        ("tests/test_weight_arena.py",),
        Edit(
            "gpu/kernels/arena.py",
            "    m.madvise(mmap.MADV_HUGEPAGE, start, size)\n",
            "",
        ),
    ),
)

# Each fault protection's named regression test (docs/faults.md, "Named regression tests").
PROTECTIONS = (
    _m("protection_zombie_decode", "protection",
       "a disconnected client's request decodes on (no ABORT on close)",
       (f"{FAULTS}::test_zombie_decode_after_disconnect",),
       Edit("lifecycle/core/call_state.py",
            "            if run.sub is not None and self.client is not None:\n"
            "                self.client.abort(run.sub, forget=True, message=detail or cause.value)\n",
            "            pass\n")),
    _m("protection_abort_is_per_request", "protection",
       "/abort_request stops every live call, not the one named",
       (f"{FAULTS}::test_abort_does_not_kill_other_clients_decode",),
       Edit("lifecycle/core/live_calls.py", "        call.abort(message, rec.id)\n",
            "        for other in self.calls():\n            other.abort(message)  # process-global stop\n")),
    _m("protection_abort_during_handoff", "protection",
       "an abort during the handoff to the worker leaks its KV blocks",
       (f"{FAULTS}::test_kv_not_leaked_on_abort_during_handoff",),
       Edit("lifecycle/link/worker_client.py", "            self._abort_lane.extend(live)\n",
            "            pass\n")),
    _m("protection_unfittable_prompt", "protection",
       "a prompt the KV cache can never hold waits forever",
       (f"{FAULTS}::test_unfittable_prompt_refused_not_hung",),
       Edit("lifecycle/testing/scripted_worker.py", "            if need > c.kv_blocks:",
            "            if False:")),
    _m("protection_hung_engine_health", "protection",
       "/health stays 200 while the engine is hung",
       (f"{FAULTS}::test_health_503_while_engine_hung",),
       Edit("lifecycle/link/supervisor.py", "        limit_ns = int(cfg.hung_timeout * 1e9)\n",
            "        limit_ns = 10**15\n")),
    _m("protection_lost_dispatch", "protection",
       "a submission lost on the way to the worker is never noticed (the AUDIT ignores it)",
       (f"{FAULTS}::test_lost_dispatch_is_hung_even_while_stats_are_polled",),
       _LOST_DISPATCH),
    _m("protection_lost_dispatch_alone", "protection",
       "the same: the lost request alone must end, the others stream on",
       (f"{REQUESTS}::test_lost_dispatch_ends_alone_while_others_stream",),
       _LOST_DISPATCH),
    _m("protection_truncated_stream", "protection",
       "a native stream that fails ends without its error event",
       (f"{FAULTS}::test_truncated_stream_never_ends_with_done",),
       Edit("lifecycle/api/native.py",
            "            cause, message = err\n            yield orjson.dumps(cause.body(message))\n"
            "        yield b\"[DONE]\"\n\n    # -- health",
            "            pass\n        yield b\"[DONE]\"\n\n    # -- health")),
    _m("protection_malformed_logprob", "protection",
       "a malformed per-token field from the worker raises in the frontend's reader",
       (f"{FAULTS}::test_malformed_logprob_field_does_not_kill_scheduler",),
       Edit("lifecycle/core/call_state.py",
            "                except (ValueError, TypeError, KeyError, IndexError) as exc:\n",
            "                except ZeroDivisionError as exc:\n")),
    _m("protection_long_prefill", "protection",
       "a long chunked prefill (no tokens yet) looks hung to the watchdog",
       (f"{REQUESTS}::test_long_prefill_is_not_hung",),
       Edit("lifecycle/testing/scripted_worker.py", "        if not entries and not advanced:\n",
            "        if not entries:\n")),
    _m("protection_abort_while_tokenizing", "protection",
       "an abort that arrives while the prompt is tokenized is lost",
       (f"{REQUESTS}::test_abort_during_tokenization_is_honoured",),
       Edit("lifecycle/core/call_state.py",
            '                run.ended = run.ended or {"type": Finish.ABORT, "message": message}\n',
            "                pass\n")),
    _m("protection_lagging_reader", "protection",
       "a reader lagging behind a failed stream loses the tokens before the error",
       (f"{REQUESTS}::test_lagging_reader_gets_every_token_before_the_error",),
       Edit("lifecycle/core/call.py",
            "if sample.failure is None or len(sample.ids) > sample.sent_ids]",
            "if sample.failure is None]")),
    _m("protection_split_submit", "protection",
       "a request bigger than one frame is a fatal link error instead of its own frame",
       (f"{REQUESTS}::test_a_request_bigger_than_a_frame_is_split_not_fatal",),
       Edit("lifecycle/link/worker_client.py",
            "            if batch and size + sub.entry_bytes > SUBMIT_ENTRY_LIMIT:\n",
            "            if False:\n")),
    _m("protection_one_abort_message", "protection",
       "an aborted request reports the worker's words, not the reason it was aborted for",
       (f"{REQUESTS}::test_one_abort_message_in_every_state",),
       Edit("lifecycle/link/worker_client.py",
            '                    reason["message"] = sub.abort_message  # ours, not the worker\'s words\n',
            "                    pass\n")),
    _m("protection_burst_queue_bound", "protection",
       "the admission queue takes a burst without bound",
       (f"{FAULTS}::test_burst_queue_bounded",),
       Edit("lifecycle/core/fsm.py", "        rec.fire(Event.ADMIT, queue)\n",
            "        queue.capacity = 10**9\n        rec.fire(Event.ADMIT, queue)\n")),
)  # fmt: skip

MUTATIONS: tuple[Mutation, ...] = MISSED_THEN + CAUGHT_THEN + FIXES + FEATURES + PROTECTIONS
assert len({m.name for m in MUTATIONS}) == len(MUTATIONS), "mutation names are unique"
