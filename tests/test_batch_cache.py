"""Batched generation with policy caches: every row of a batch is the same prompt generated alone.

mlx-lm's BatchGenerator merges per-sequence caches (PolicyCache.merge -> BatchPolicyCache),
pads prompts, filters finished rows and extends the batch with late arrivals; each row must
still produce the greedy tokens and log-probabilities of a single generation.
"""

import mlx.core as mx
import pytest
from helpers import tiny_gemma3, tiny_llama
from mlx_lm.generate import BatchGenerator, batch_generate, generate_step

from kvpolicy_core import KVCacheBuilder, PolicyCache, attach, detach
from kvpolicy_core.cache.batch import BatchPolicyCache

# cam's default merge (mass) keeps per-slot attention log-weights: its batched rows give the attention
# additive masks (test_log_weight_rows_are_batched pins that it does); mass_blend keeps none
SHIPPED = [
    "h2o",
    "cam",
    "cam:merge=mass_blend",
    "random",
    "streamingllm",
    "tova",
    "cam:merge=mean,gate=false",
    "cam:merge=sim_weighted",
    "cam:merge=paper",
    "h2o:signal=proxy",  # gated merges: per-row random draws
    "h2o:signal=observed",
    "h2o:layers=unbounded",  # sliding layers keep mlx-lm's RotatingKVCache, batched by mlx-lm
    "cam:after=2,min_sim=-1",
]  # merges begin at each row's own offset 16 (rows cross it at different steps)
LENGTHS = (5, 23, 14)  # one under the budget, two over it
MAX_TOKENS = (12, 4, 12)  # the second row finishes early (filter)


def prompts():
    return [mx.random.randint(0, 97, (n,), key=mx.random.key(100 + n)).tolist() for n in LENGTHS]


def single(model, prompt, max_tokens, prefill_step_size):
    out = list(
        zip(
            range(max_tokens),
            generate_step(mx.array(prompt), model, max_tokens=max_tokens, prefill_step_size=prefill_step_size),
        )
    )
    return [t for _, (t, _) in out], [lp for _, (_, lp) in out]


def batched(model, ps, max_tokens, prefill_step_size, join_late_after=3):
    """All but the last prompt start together; the last joins after a few decode steps (extend)."""
    gen = BatchGenerator(model, stop_tokens=None, prefill_step_size=prefill_step_size)
    uids = gen.insert(ps[:-1], list(max_tokens[:-1]))
    got, steps = {u: ([], []) for u in uids}, 0
    while responses := gen.next_generated():
        steps += 1
        for r in responses:
            got[r.uid][0].append(r.token)
            got[r.uid][1].append(r.logprobs)
        if steps == join_late_after:
            (late,) = gen.insert([ps[-1]], [max_tokens[-1]])
            uids.append(late)
            got[late] = ([], [])
    gen.close()
    return [got[u] for u in uids]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request):
    m = tiny_llama(seed=1) if request.param == "llama" else tiny_gemma3(window=6, seed=2)
    yield m
    detach(m)


@pytest.mark.parametrize(
    "method, prefill_step_size", [(m, 2048) for m in SHIPPED] + [(m, 7) for m in ("h2o", "cam", "tova")]
)
def test_each_row_equals_its_prompt_alone(model, method, prefill_step_size):
    """Prompts of 5, 23 and 14 tokens (budget 8): the 4-token row finishes early (filter), the
    14-token row joins after 3 decode steps (extend); prefill in one chunk or chunks of 7."""
    config = f"{method}{',' if ':' in method else ':'}budget=8,n_sink=2"
    attach(model, config)
    try:
        ps = prompts()
        alone = [single(model, p, m, prefill_step_size) for p, m in zip(ps, MAX_TOKENS)]
        rows = batched(model, ps, MAX_TOKENS, prefill_step_size)
    finally:
        detach(model)
    for i, ((tokens, logprobs), (want_tokens, want_logprobs)) in enumerate(zip(rows, alone)):
        assert tokens == want_tokens, f"row {i} (prompt of {LENGTHS[i]} tokens)"
        for step, (a, b) in enumerate(zip(logprobs, want_logprobs)):
            assert mx.allclose(a, b, atol=1e-4, rtol=1e-4), f"row {i} step {step}: logprobs differ"
    # the budget mattered: the longest row alone differs from a full cache
    full_tokens, full_logprobs = single(model, ps[1], MAX_TOKENS[1], prefill_step_size)
    assert not all(mx.allclose(a, b, atol=1e-4) for a, b in zip(alone[1][1], full_logprobs))


def test_batch_generate_matches_single_generation_and_leaves_given_caches_alone():
    model = tiny_llama(seed=3)
    attach(model, "cam:budget=8,n_sink=2")
    try:
        ps = prompts()
        alone = [single(model, p, 6, 2048)[0] for p in ps]

        class Tok:  # batch_generate only needs eos ids and decode
            eos_token_ids = []

            @staticmethod
            def decode(ids):
                return " ".join(map(str, ids))

        out = batch_generate(model, Tok, ps, max_tokens=6, return_token_ids=True)
        assert out.token_ids == alone
        # prompt caches given to batch_generate are copied, not updated in place (mlx-lm's contract)
        given = [model.make_cache() for _ in ps]
        for c, p in zip(given, ps):
            model(mx.array(p)[None, :-1], cache=c)
        before = [(c[0].offset, c[0].tokens_kept) for c in given]
        out2 = batch_generate(
            model, Tok, [p[-1:] for p in ps], prompt_caches=given, max_tokens=6, return_token_ids=True
        )
        assert [(c[0].offset, c[0].tokens_kept) for c in given] == before
        assert out2.token_ids == alone
    finally:
        detach(model)


def test_protocol_filter_extend_extract_and_padding_never_kept():
    model = tiny_llama(seed=4)
    caches = [KVCacheBuilder.for_model(model, "h2o:budget=6,n_sink=1") for _ in range(3)]
    detach(model)  # the proxy signal needs no attention hook; leave none installed behind
    batch = [PolicyCache.merge([c[i] for c in caches]) for i in range(len(model.layers))]
    assert all(isinstance(b, BatchPolicyCache) and len(b) == 3 for b in batch)
    # right-padded prompt of lengths 2, 9, 4: row b sees only its real tokens
    lengths = [2, 9, 4]
    tokens = mx.array([[1] * n + [0] * (9 - n) for n in lengths])
    for b in batch:
        b.prepare(lengths=lengths, right_padding=[9 - n for n in lengths])
    model(tokens, cache=batch)
    for b in batch:
        b.finalize()
        assert [r.offset for r in b.rows] == lengths
        assert [r.tokens_kept for r in b.rows] == [2, 9, 4]  # the prompts held for their cut
        assert b.offset.tolist() == lengths
    # extract gives an independent single-sequence cache
    row = batch[0].extract(1)
    assert isinstance(row, PolicyCache) and row.offset == 9 and row.keys.shape[0] == 1
    model(mx.array([[5], [6], [7]]), cache=batch)
    assert row.offset == 9 and batch[0].rows[1].offset == 10
    # filter keeps rows in the order given; extend appends
    for b in batch:
        b.filter([2, 0])
    assert [r.offset for r in batch[0].rows] == [5, 3]
    other = [PolicyCache.merge([c[i] for c in caches[:1]]) for i in range(len(model.layers))]
    for b, o in zip(batch, other):
        b.extend(o)
    assert len(batch[0]) == 3 and batch[0].rows[2].offset == 0
    assert batch[0].nbytes == sum(r.nbytes for r in batch[0].rows)


def test_rows_must_be_single_sequence_policy_caches():
    with pytest.raises(Exception, match="expected a PolicyCache"):
        BatchPolicyCache([object()])
    c = PolicyCache("h2o:budget=4,n_sink=1")
    c.update_and_fetch(mx.zeros((2, 1, 3, 4)), mx.zeros((2, 1, 3, 4)))
    with pytest.raises(Exception, match="one sequence"):
        BatchPolicyCache([c])


def test_log_weight_rows_are_batched():
    """The cam rows of the equivalence test above really carry log-weights (additive row masks)."""
    assert PolicyCache("cam:budget=8,n_sink=2").uses_log_weights
    for m in ("mass_blend", "mean,gate=false"):
        assert not PolicyCache(f"cam:merge={m},budget=8,n_sink=2").uses_log_weights


def test_merged_rows_keep_the_attention_hook_their_caches_hold():
    """The caches that need the hook own it: a batch merged from them keeps it installed
    after the original caches are gone, and its rows still observe the model's attention."""
    import gc
    import weakref

    model = tiny_llama(seed=5)
    caches = [KVCacheBuilder.for_model(model, "h2o:budget=6,n_sink=1,signal=observed") for _ in range(2)]
    hooks = [c[0].attention_hook for c in caches]  # one install per build, shared by its layers
    assert all(h is not None and h.active for h in hooks)
    batch = [PolicyCache.merge([c[i] for c in caches]) for i in range(len(model.layers))]
    assert all([r.attention_hook for r in b.rows] == hooks for b in batch)  # copies share, not copy, it
    hooks = [weakref.ref(h) for h in hooks]  # the test must not hold the installs itself
    del caches
    gc.collect()
    assert all(h() is not None and h().active for h in hooks)  # the rows hold them
    model(mx.array([[1, 2, 3, 4, 5, 6, 7, 8], [8, 7, 6, 5, 4, 3, 2, 1]]), cache=batch)
    row = batch[0].rows[0]
    row.settle()  # the end-of-prompt cut
    assert row.tokens_kept == 6 and float(row.scores[..., : row.n].sum()) > 0  # observed attention scored
    del batch, row
    gc.collect()
    assert all(h() is None for h in hooks)  # the last holders gone: the installs are undone


def test_decode_steps_of_rows_at_their_budget_run_stacked_with_each_rows_counters(monkeypatch):
    """Once every row is at its budget the rows take decode steps as one stacked step (batch_rows.py);
    each row still ends with exactly its own state: slots, offset and its own merge/gate counters."""
    from kvpolicy_core.cache import batch_rows

    stacked_steps = []
    step = batch_rows.StackedRows.update_and_fetch
    monkeypatch.setattr(
        batch_rows.StackedRows,
        "update_and_fetch",
        lambda self, k, v: stacked_steps.append(len(self)) or step(self, k, v),
    )
    model = tiny_gemma3(window=6, seed=7)
    attach(model, "cam:budget=8,n_sink=2,merge=paper")  # gated: row b draws with its own key
    try:
        ps = prompts()
        alone = []
        for p in ps:
            caches = model.make_cache()
            tokens = [
                t for (t, _), _ in zip(generate_step(mx.array(p), model, max_tokens=10, prompt_cache=caches), range(10))
            ]
            alone.append((tokens, caches))
        gen = BatchGenerator(model, stop_tokens=None)
        uids = gen.insert(ps, [10] * len(ps))
        got = {u: [] for u in uids}
        final = {}
        while responses := gen.next_generated():
            for r in responses:
                got[r.uid].append(r.token)
                if r.finish_reason is not None:
                    final[r.uid] = r.prompt_cache
        gen.close()
    finally:
        detach(model)
    assert stacked_steps and set(stacked_steps) == {3}  # all three rows, stacked
    for u, (tokens, caches) in zip(uids, alone):
        assert got[u] == tokens
        for mine, theirs in zip(final[u], caches):
            if isinstance(theirs, PolicyCache):
                assert mine.offset == theirs.offset and mine.stats() == theirs.stats()
                for a, b in zip(mine.state[:4], theirs.state[:4]):
                    assert mx.allclose(a, b, atol=1e-4, rtol=1e-4), "row state differs from its prompt alone"
    assert sum(c.stats()["gate_draws"] for c in alone[1][1] if isinstance(c, PolicyCache)) > 0


def test_stacked_rows_answer_the_contract_without_unstacking():
    """A stacked batch (every row at its budget) answers offset and masks itself; reading the rows splits it."""
    model = tiny_llama(seed=8)
    caches = [KVCacheBuilder.for_model(model, "h2o:budget=6,n_sink=1") for _ in range(2)]
    batch = [PolicyCache.merge([c[i] for c in caches]) for i in range(len(model.layers))]
    model(mx.array([[1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 8, 7, 6, 5, 4, 3, 2, 1]]), cache=batch)
    for t in range(2):
        model(mx.array([[t + 1], [t + 2]]), cache=batch)
    b = batch[0]
    assert b._stacked is not None and b.offset.tolist() == [11, 11]
    assert b.make_mask(1) is None and b.make_mask(1, return_array=True).shape == (2, 1, 1, 7)
    assert b._stacked is not None  # still stacked
    assert [r.offset for r in b.rows] == [11, 11] and [r.tokens_kept for r in b.rows] == [6, 6]
    assert b._stacked is None  # split back into its rows
    detach(model)


def test_a_stacked_row_at_its_window_evicts_what_it_evicts_alone():
    """A row whose offset equals its layer's window has window-dead slots (position <= offset - window: the next
    query no longer reaches position 0, a sink included); stacked with a row past its window it evicts the same."""
    import copy

    from kvpolicy_core.cache.batch_rows import StackedRows, can_stack

    def row(n, seed):  # a prompt of n - 1 tokens, then one decode step: offset n, budget + 1 slots
        c = PolicyCache("h2o:budget=4,n_sink=1,signal=proxy", window=6)
        kv = mx.random.normal((1, 2, n, 8), key=mx.random.key(seed))
        for s in (slice(0, n - 1), slice(n - 1, n)):
            c.update_and_fetch(kv[:, :, s], kv[:, :, s])
            c._attended = c._observed = True
        return c

    rows = [row(6, 1), row(9, 3)]  # offsets 6 (= the window) and 9
    assert can_stack(rows) and [r.offset for r in rows] == [6, 9]
    alone = [copy.deepcopy(r) for r in rows]
    stacked = StackedRows(rows)
    kv = mx.random.normal((2, 2, 1, 8), key=mx.random.key(9))
    stacked.update_and_fetch(kv, kv)
    for b, (mine, theirs) in enumerate(zip(stacked.split(), alone)):
        theirs.update_and_fetch(kv[b : b + 1], kv[b : b + 1])
        assert mine.positions[..., : mine.n].tolist() == theirs.positions[..., : theirs.n].tolist(), f"row {b}"
