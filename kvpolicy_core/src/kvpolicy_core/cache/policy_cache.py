"""The per-layer policy cache: runs any scorer/selector/disposition under mlx-lm's cache contract.

Three units do the work: the slot store (:mod:`.slots`: buffers, positions, the one decode write,
compaction), the policy step (:mod:`.step`: score, select, dispose, checked) and
persistence/diagnostics (:mod:`.state`, :mod:`.diagnostics`). This class is
the loop that ties them to mlx-lm. ``update_and_fetch(k, v)`` with S new tokens:

1. *Settle*: if the previous call left ``n > budget`` slots, ``E >= n - budget`` losers are
   chosen (the selector's count: the overflow, or more for whole chunks; window-dead slots first,
   then the selector's, from the scores accumulated so far), the disposition updates survivors,
   and the losers are removed. Decode (``S == 1``, ``E == 1``) writes the new token straight into
   the loser's slot; otherwise survivors are compacted in temporal order. With
   ``when="prompt_end"`` a prompt chunk (``S > 1``) settles nothing: the cache holds the prompt
   as mlx-lm's ``KVCache`` would, and the first decode step (``S == 1``; mlx-lm feeds the
   prompt's last token so) cuts it once, scored with the prompt's last queries in view.
2. *Append* the S new tokens (positions ``offset .. offset+S-1``, score 0).
3. *Score*: ``scorer.on_append`` (and, for observed signals, from the attention hook: the
   model's own attention weights through :meth:`PolicyCache.attend`, computed once with the
   output, or ``on_attention`` before mlx-lm's kernel for scorers without ``on_attention_weights``).
4. Return everything this step attends to: ``n - E + S`` slots.

``offset`` is the number of tokens seen: mlx-lm rotates queries with it, so RoPE stays
exact after evictions without any re-rotation.

*Runs.* Consecutive prompt chunks (updates of ``S > 1`` tokens) with no eviction between them
form one run; the scorer gets a dict (``CacheView.run``) that the cache carries across the
run's chunks, so a scorer can score the run as one chunk (the observation window does: a
prompt fed as 3 + 54 tokens, e.g. after mlx-lm's server reused a stored prefix, is scored
as the 57 tokens in one chunk). An eviction, a single-token update and ``trim`` end the run; the
next chunk starts a new one with an empty dict. A saved ``state`` carries the run in progress.

*Attention hook.* A cache that needs it (observed signal, log-weights, sliding window) holds the
install (``attention_hook``) and restores it with its state (:mod:`.state`); a step that needs
the hook is refused, before anything changes, when the install was removed or a restored cache has none.
"""

from __future__ import annotations

import copy
from typing import Optional, Tuple

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

from ..attention.bias import with_log_weights
from ..attention.blocks import HELD_BLOCK_FLOOR, by_query_blocks, query_block
from ..attention.weights import attend_once, attention_with_weights, quantized_attention_with_weights
from ..attention.window import outside_window, window_mask
from ..config.policy import Policy, build_policy
from ..errors import KVPolicyError, ModelError
from ..parts.attention_scorer import causal_allowed
from ..parts.base import DEMAND_NORMS, CacheView
from ..runtime.sharding import check_head_shard
from . import undo
from .batch import BatchPolicyCache, register_with_mlx_lm
from .diagnostics import CacheDiagnostics
from .layer_group import prompt_statistic, record
from .restore_checks import check_restored
from .slots import FIELDS, QuantizedRows, RowState, SlotStore, Token, storage_for
from .state import from_state, load_state, meta_json, state_of
from .step import PolicyStep


def _slot(name: str) -> property:
    return property(lambda self: getattr(self._slots, name), lambda self, v: setattr(self._slots, name, v))


class PolicyCache(CacheDiagnostics):
    """An mlx-lm compatible KV cache holding at most ``budget`` tokens under a policy.

    Args:
        policy: a :class:`~kvpolicy_core.config.policy.Policy`, or any config form (parsed once here).
        layer: the layer index (decorrelates random draws between layers).
        window: the sliding window of the layer, or None for global attention. Tokens
            outside the window of every future query are evicted first and masked out.
        head_shard: ``(rank, size)`` of the tensor-parallel group that splits this layer's KV
            heads evenly (mlx-lm's ``model.shard``): this cache holds global heads
            ``rank * H .. rank * H + H - 1`` of ``size * H``; ``(0, 1)`` when unsharded.
            Random draws are keyed by global head, so they do not depend on the split.
    """

    step = 256
    keys, values, positions, scores, n = (_slot(f) for f in FIELDS)
    kvpolicy_attention = "single"  #: the attention hook calls :meth:`attend` for this cache
    hook_missing = None  #: why a restored cache has no hook it needs (it refuses its next update), or None
    _undo = None  #: the last update's undo record (:mod:`.undo`), or None
    _verify_next = False  #: a trim came last: the next short multi-token update is a verify step
    #: the last step's attention called the hook and the install this cache holds (if any) is live: set by the
    #: hook's call (:meth:`before_attention`, :meth:`attend`), cleared by the update, a new install, its removal
    #: (:meth:`hook_removed`) and :meth:`set_row_state`. While it holds, every check of :meth:`_check_observation`
    #: passes, so an update reads this one flag for the hook
    _observed = False
    _hook = None
    #: the last update was decode's (not a prompt chunk) and nothing changed the cache since: no held prompt to cut,
    #: no run of prompt chunks open, the rows in the kept storage. A one-token update then takes decode's route
    #: without reading the hold and run state; anything else that sets the state (:meth:`set_row_state`,
    #: :meth:`_use_rows`, :meth:`trim`, unpickling) clears it
    _decoding = False
    _trims = False  #: asked is_trimmable() while empty (speculative decoding does): short prompt chunks keep a record

    def __init__(
        self, policy, layer: int = 0, window: Optional[int] = None, head_shard: Tuple[int, int] = (0, 1)
    ) -> None:
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"window must be None or an int >= 1 (got {window!r})")
        self.head_shard = check_head_shard(head_shard)
        self.policy: Policy = policy if isinstance(policy, Policy) else build_policy(policy)
        self.budget, self.layer, self.window = self.policy.budget, layer, window
        self._step = PolicyStep(self.policy, layer)
        needs = self._step.needs  # what the parts need of the cache (kvpolicy_core.parts.base.policy_needs)
        #: the policy keeps per-slot attention log-weights (added to the logits by the hook)
        self.uses_log_weights = needs.log_weights
        cfg = self.policy.config
        rows = storage_for(cfg.kv_bits, cfg.kv_group_size, cfg.kv_dtype and getattr(mx, cfg.kv_dtype))
        self._slots = SlotStore(
            self.step, track_log_weights=self.uses_log_weights, track_key_norms=needs.key_norms, rows=rows
        )
        if rows.bits is not None:  # mlx-lm's attention takes its quantized path for a cache that has ``bits``
            self.bits, self.group_size = rows.bits, rows.group_size  # (instance attributes: only such a cache has them)
        self._counters = {k: mx.array(0, dtype=mx.int32) for k in self._step.counter_names()}
        self.offset = 0  # tokens seen = absolute position of the next token
        self._attended, self._last_S, self._updates = True, 0, 0
        self._run: dict = {}  # the scorer's state for the current run of prompt chunks (CacheView.run)
        self._run_open = False  # the last update was a chunk (S > 1) and nothing was evicted since
        self.attention_hook = None  # the attention hook install this cache keeps alive, if it needs one
        self.hook_missing = None
        #: some log-weight may be nonzero (a checked update changed one, a shipped disposition evicted at a decode
        #: step: whether it merged is decided on the device, or restored state carries them); until then the
        #: attention needs no bias (all zero: the same attention bit for bit) and skips building it
        self._lw_used = False
        #: the scorer takes the model's attention weights (``on_attention_weights``): one pass gives both
        self._weights_once = needs.attention_weights
        #: every step needs the attention hook (observed signal or log-weights; a window only past its length)
        self.hook_every_step = needs.attention or self.uses_log_weights
        #: ``when="prompt_end"``: prompt chunks are held whole and cut at the first decode step (or settle())
        self.holds_prompt = self.policy.config.policy.when == "prompt_end"
        #: the :class:`~.layer_group.LayerGroup` linking the caches of a data-driven allocation, or None
        self.group = None
        #: how a held prompt past the budget is stored (``hold_bits``: :meth:`_hold_rows_for`), or None
        self.hold_rows = self._hold_rows_for(rows) if self.holds_prompt else None
        self._kept_rows = rows  #: how the kept rows are stored (the config's storage)

    # ------------------------------------------------------------------ mlx-lm contract
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Tuple[mx.array, mx.array]:
        """keys [B, H, S, D], values [B, H, S, Dv] -> all keys/values this step attends to."""
        sl = self._slots
        sl.check_input(keys, values, self.layer)
        self._last_S = S = keys.shape[2]
        if not self._observed:  # else every hook check passes
            self._check_observation()
        decoding = S == 1 and self._decoding  # past the prompt: no held prompt to cut, no run open, kept storage
        steps = 1 < S <= undo.UNDO_TOKENS and self._verify_next  # decode steps at once (a verify step), not a chunk
        chunk = S > 1 and not steps  # a prompt chunk
        saved, record, rows = self.row_state(), None, self.storage
        try:
            if decoding:
                cut, n_evict, self._run = False, self._n_evict(1), {}
            else:
                cut = self.holds_prompt and self._run_open and not chunk  # this eviction cuts a held prompt at its end
                self._cut_budget(S)
                n_evict = self._n_evict(S)
                if not (self._run_open and chunk):
                    self._run = {}
                elif n_evict == 0:
                    self._run = dict(self._run)
                else:  # an eviction inside a held prompt (its hold, a window) ends the run, not the prompt's statistic
                    self._run = prompt_statistic(self._run)
            if n_evict == 1 and S == 1 and not cut:  # decode: the loser's slot takes the new token (one write)
                losers, update = self._evicted(self._step.decode(self._view(0), self.offset))
                self._slots.write(Token(keys, values, self.offset), losers, update, compiled=self.n == sl.capacity)
            else:
                if n_evict > 0:
                    self._evict(n_evict, cut=cut, steps=steps)
                self._hold_storage(keys, values, chunk)
                record = undo.start(self, S, steps, keys)
                self._slots.append(keys, values, self.offset, self.budget + 1)
            if not (decoding or chunk) and self.storage is not self._kept_rows:  # (a restored hold cut in place)
                self._use_rows(self._kept_rows)
            self._run_open = chunk  # a prompt chunk: a run (re)starts or goes on; held for its cut
            self.offset += S
            if steps and self._step.appends:  # token by token, as S decode steps (:mod:`.undo`)
                self.scores = undo.append_rows(self, record, keys)
            elif self._step.appends:  # else the scorer's on_append returns the scores as they are (observed signals)
                new_positions = mx.arange(self.offset - S, self.offset, dtype=mx.int32)
                self.scores = self._step.on_append(self._view(S, self._run), keys, new_positions)
            self._attended = self._observed = False
        except BaseException:
            self._use_rows(rows, encode=False)
            self.set_row_state(saved)
            raise
        self._undo, self._verify_next, self._decoding = record, False, not chunk
        self._bound_graph()
        return self._slots.valid()

    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False):
        """The mask for N new tokens attending to ``min(n, budget) + N`` slots.

        Global layers need only causality among the new tokens (every retained token is in
        the past). Sliding-window masks depend on each layer's retained positions, so the
        attention hook rebuilds them per layer (:meth:`before_attention`).
        """
        if N == 1 and not return_array:
            return None
        if return_array or window_size is not None:
            return causal_allowed(N, self.fetched(N))
        return "causal"

    def is_trimmable(self) -> bool:
        """Whether :meth:`trim` can take back tokens exactly: the newest tokens of the last update of 2 to
        :data:`~.undo.UNDO_TOKENS` tokens (a verify step of speculative decoding; a short prompt chunk of a cache
        asked this while empty), any tokens while nothing was ever evicted and the scorer's scores are per token
        (``Needs(trim_exact=True)``), or none of an empty cache. A trim beyond what it can take back raises
        :class:`~kvpolicy_core.errors.KVPolicyError`.

        mlx-lm asks this before it trims and skips the trim of a cache that says no. Its speculative decoding asks
        first of the empty caches (which say yes, and from then on keep a record of their short prompt chunks too:
        the first verify step carries the prompt's last token and is one); its prompt cache reuses a cache that says
        no only as a prefix (a stored cache's last update is a long prompt chunk or a decode step: no record).
        """
        if self.offset == 0:
            self._trims = True
            return True
        return self._exact_trim() or undo.trimmable(self) > 0

    def _exact_trim(self) -> bool:
        """Nothing was ever evicted and the scores are per token: a trim of any length is exact."""
        return self.n == self.offset and self.n <= self.budget and self._step.needs.trim_exact

    def trim(self, n: int) -> int:
        """Drop the newest ``min(n, tokens)`` tokens, exactly: slots, positions and scores are those of a cache
        whose last update brought only its first ``S - n`` tokens (:mod:`.undo`), or, while nothing was evicted
        and the scores are per token, of a cache that never saw them. Returns the number dropped. Every trim
        (``n = 0`` too) makes the next update of 2 to :data:`~.undo.UNDO_TOKENS` tokens a verify step (decode steps
        at once) and ends a held prompt.

        Raises :class:`~kvpolicy_core.errors.KVPolicyError` (nothing changed) for ``n`` beyond what the cache can
        take back, rather than leaving stale scores behind.
        """
        if n < 0:
            raise ValueError(f"layer {self.layer}: trim(n) needs n >= 0 (got {n})")
        n = min(self.n, n)
        if n > 0:
            can = undo.trimmable(self)
            if n <= can:
                undo.take_back(self, n)
            elif self._exact_trim():
                self.n -= n
                self.offset -= n
                self._run, self._run_open, self._undo = {}, False, None
                self.scores = self.scores[..., : self.n]
                if self._slots.log_weights is not None:
                    self._slots.log_weights = self._slots.log_weights[..., : self.n]
            else:
                raise undo.refuse(self, n, can)
        self._verify_next, self._decoding = True, False
        return n

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> "PolicyCache":
        """mlx-lm's ``kv_bits`` hook (``generate_step`` calls it on every cache once ``quantized_kv_start`` tokens
        are in): from now on this cache stores its kept rows quantized (:class:`~.storage.QuantizedRows`: the rows
        held are quantized once, new rows as they come), under the same policy. Returns the cache itself; a cache
        already quantized so is left as it is, one quantized otherwise is refused (ValueError)."""
        kept = self._kept_rows
        if kept.bits is not None:
            if (kept.bits, kept.group_size) != (bits, group_size):
                raise ValueError(
                    f"layer {self.layer}: this cache stores kv_bits={kept.bits}, kv_group_size={kept.group_size}"
                    f"; mlx-lm asks for kv_bits={bits}, kv_group_size={group_size}: give one of them"
                )
            return self
        rows = QuantizedRows(bits, group_size)
        if self.keys is not None:
            for d in self._slots.dims:
                rows.check_head_dim(d, self.layer)
        self._kept_rows, self.hold_rows = rows, None  # a held prompt is stored at kv_bits too
        self._use_rows(rows)
        return self

    def _hold_rows_for(self, rows):
        """The storage of a held prompt past the budget: ``hold_bits`` quantized rows (group 64, or 32 where 64
        does not divide the head dim, checked when the rows come) for full-precision kept rows; None (held as
        kept) without ``hold_bits`` or with quantized kept rows (``kv_bits``: held so already)."""
        bits = self.policy.config.policy.hold_bits
        return None if bits is None or rows.bits is not None else QuantizedRows(bits, 64)

    def _hold_storage(self, keys: mx.array, values: mx.array, chunk: bool) -> None:
        """Before S new tokens are appended: a prompt chunk (``chunk``) that takes a held prompt past the budget
        (``n + S > budget``) switches it to :attr:`hold_rows` until its cut (the rows held so far encoded once); a
        decode step (or a verify step's decode steps: the cut is done) puts the kept rows back in the kept
        storage, decoded row for row.

        A held row ``x`` reads ``dequantize(quantize(x))`` for the prompt's remaining chunks, the cut's scoring
        and, kept, ever after (mlx-lm's ``quantized_kv_start`` does the same to every row); a prompt within the
        budget is never re-encoded, so it is held exactly."""
        S = keys.shape[2]
        if not chunk:
            self._use_rows(self._kept_rows)
        elif self.hold_rows is not None and self.storage is not self.hold_rows and self.n + S > self.budget:
            dims = (keys.shape[-1], values.shape[-1])
            g = next((g for g in (self.hold_rows.group_size, 32) if all(d % g == 0 for d in dims)), None)
            if g is None:  # this head dim cannot be quantized so: held in full precision
                self.hold_rows = None
                return
            if g != self.hold_rows.group_size:
                self.hold_rows = QuantizedRows(self.hold_rows.bits, g)
            self._use_rows(self.hold_rows)

    def hold_as_kept(self) -> None:
        """Hold a prompt as the kept rows are stored (no ``hold_bits``) from now on: a batch's rows share one
        storage (:class:`~.batch.BatchPolicyCache`), so they hold their prompts so."""
        self.hold_rows = None
        self._use_rows(self._kept_rows)

    def _use_rows(self, rows, encode: bool = True) -> None:
        """Store this cache's rows as ``rows`` from now on (the rows held re-encoded, unless ``encode=False``:
        a rollback restores buffers already so encoded); mlx-lm's attention takes its quantized path while the
        cache has ``bits``."""
        sl = self._slots
        if rows is sl.rows:
            return
        self._decoding = False
        if encode and sl.keys is not None:
            keys, values = sl.decoded(sl.n)
            dtypes = sl.dtypes
            sl.rows = rows
            sl.keys, sl.values = rows.encode(keys), rows.encode(values)
            sl.dtypes = dtypes
        else:
            sl.rows = rows
        if rows.bits is None:
            self.__dict__.pop("bits", None)
            self.__dict__.pop("group_size", None)
        else:
            self.bits, self.group_size = rows.bits, rows.group_size

    def size(self) -> int:
        return self.tokens_kept

    def empty(self) -> bool:
        return self.keys is None

    @classmethod
    def merge(cls, caches):
        """mlx-lm's batching entry point: single-sequence caches -> one BatchPolicyCache (copies)."""
        return BatchPolicyCache.merge(caches)

    def retained(self):
        """(keys, values, positions, scores) of the retained tokens in temporal order."""
        self.settle()
        return None if self.keys is None else self._slots.in_temporal_order()

    def retained_log_weights(self) -> Optional[mx.array]:
        """Attention log-weights [B, H, n] of the retained tokens in :meth:`retained`'s order, or None."""
        self.settle()
        if self._slots.log_weights is None:
            return None
        order = mx.argsort(self.positions[..., : self.n], axis=-1)
        return mx.take_along_axis(self._slots.log_weights, order, axis=-1)

    def settle(self) -> None:
        """Apply a pending eviction now (after a step), so at most ``budget`` tokens remain (a held prompt,
        ``when="prompt_end"``, is cut here as at its first decode step)."""
        self._cut_budget(1)
        n_evict = self._n_evict(1)
        if n_evict > 0:
            saved, rows = self.row_state(), self.storage
            try:
                self._evict(n_evict, cut=self.holds_prompt and self._run_open)
                self._use_rows(self._kept_rows)
            except BaseException:
                self._use_rows(rows, encode=False)
                self.set_row_state(saved)
                raise

    @property
    def storage(self):
        """How this cache stores its rows (:class:`~.slots.Rows`)."""
        return self._slots.rows

    @property
    def log_weights(self) -> Optional[mx.array]:
        """Per-slot attention log-weights [B, H, n] float32 (slot order), or None when not used."""
        return self._slots.log_weights

    # ------------------------------------------------------------------ persistence (functions in .state)
    @property
    def state(self):
        """(keys, values, positions, scores, meta JSON[, log_weights][, run]), settled: :func:`.state.state_of`."""
        return state_of(self)

    @state.setter
    def state(self, v) -> None:
        load_state(self, v)

    @property
    def meta_state(self):
        return (meta_json(self),)

    @classmethod
    def from_state(cls, state, meta_state=None, *, model=None):
        """A cache rebuilt from ``state`` (config, hook and all): :func:`.state.from_state`."""
        return from_state(cls, state, meta_state, model=model)

    @property
    def needs_hook(self) -> bool:
        """Whether this cache's attention must go through kvpolicy's hook: an observed signal, attention
        log-weights, a sliding window or a data-driven allocation (it measures the attention output)."""
        return self.window is not None or self._step.needs.attention or self.uses_log_weights or self.group is not None

    def __deepcopy__(self, memo):
        """A faithful copy (no restore checks): the same attention-hook install, the policy's parts shared when
        ``memo`` says so (:func:`~kvpolicy_core.cache.batch.copy_row`)."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        if new._hook is not None:
            new._hook.hold(new)
        if new.group is not None:
            new.group.join(new)
        return new

    def __setstate__(self, d: dict) -> None:
        """Unpickling: the attention hook re-installs through its handle (:class:`~kvpolicy_core.attention.hook.
        AttentionHook`); the slots are checked like every restored state, and key norms recomputed."""
        d.setdefault("hold_rows", None)  # (pickled before hold_bits)
        if "attention_hook" in d:  # (pickled before the hook was a property)
            d["_hook"] = d.pop("attention_hook")
        if isinstance(d.get("_slots"), SlotStore):
            d.setdefault("_kept_rows", d["_slots"].rows)
        self.__dict__.update(d)
        if not isinstance(d.get("_slots"), SlotStore) or not isinstance(d.get("offset"), int):
            raise KVPolicyError("unpickled PolicyCache: not a PolicyCache's pickled state")
        self._slots.key_norms, self._decoding, self._observed = None, False, False
        if self._hook is not None:
            self._hook.hold(self)
        if self.group is not None:
            self.group.join(self)
        check_restored(
            self._slots, self.offset, self.budget, settled=False, where=f"PolicyCache state (layer {self.layer})"
        )

    # ------------------------------------------------------------------ attention hook
    @property
    def attention_hook(self):
        """The attention hook install this cache keeps alive (an :class:`~kvpolicy_core.attention.hook.
        AttentionHook`), or None."""
        return self._hook

    @attention_hook.setter
    def attention_hook(self, hook) -> None:
        self._hook, self._observed = hook, False
        if hook is not None:
            hook.hold(self)

    def hook_removed(self) -> None:
        """The install this cache holds was removed: the next update checks the hook again (and refuses a step
        that needs it)."""
        self._observed = False

    def before_attention(self, queries: mx.array, scale: float, mask):
        """Called by the attention hook with the real queries [B, Hq, S, D]; returns the mask to use.

        Sliding-window layers get a mask built from this layer's own positions:
        query at position p may attend to key at position q iff ``p - W < q <= p``. A policy with
        log-weights gets them added to the logits (:func:`~kvpolicy_core.attention.bias.with_log_weights`).
        """
        mask = self._attention_mask(queries, mask)
        rec = self._undo
        if self._step.needs.attention and rec is not None and rec.steps:  # a verify step: token by token (.undo)
            self.scores = undo.attention_rows(self, rec, queries=queries, scale=scale, mask=mask)
            self._bound_graph()
        elif self._step.needs.attention:
            undo.observe_chunk(rec, queries, scale, mask)
            run = dict(self._run)  # adopted only if the scorer succeeds
            self.scores = self._step.on_attention(self._view(queries.shape[2], run), queries, scale, mask)
            self._run = run
            self._bound_graph()
        self._attended, hook = True, self._hook
        self._observed = hook is None or hook.active
        return mask

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask, fused):
        """The attention hook's entry: the attention output [B, Hq, S, Dv] of this step.

        ``fused(queries, keys, values, cache, scale, mask)`` is mlx-lm's attention. A scorer that can
        take the model's weights (``on_attention_weights``: the shipped observed scorers) gets them from
        the one pass that computes the output (:func:`~kvpolicy_core.attention.weights.attention_with_weights`, on CPU
        bit-identical to the fused kernel) where that is faster (:func:`~kvpolicy_core.attention.weights.attend_once`);
        otherwise this is :meth:`before_attention` then ``fused``. So is a prompt chunk whose scores read only
        some of its query rows (the observation window's last W of S > W, ``rows_observed``): the scorer's own
        pass over those rows costs W/S of the kernel's, and where the output is never read (the last layer of a
        prefill chunk: mlx-lm evaluates only the caches' state) the kernel is not run at all, as for mlx-lm's caches.
        """
        B, Hq, S, _ = queries.shape
        rows = getattr(self.policy.scorer, "rows_observed", None)
        L = (keys[0] if isinstance(keys, tuple) else keys).shape[2]
        held = self.hold_rows is not None and self.storage is self.hold_rows
        held_bytes = None  # a prompt chunk over quantized rows: the bytes the layer holds bound its blocks' logits
        if S > 1 and (held or self.storage.bits is not None):
            held_bytes = sum(a.nbytes for _, a in tree_flatten([keys, values]))
        if held:  # a held prompt (hold_bits): this chunk attends its rows decoded, dequantize(quantize(x)) (.decoded)
            keys, values = self.decoded_rows(keys), self.decoded_rows(values)
        elif self.storage.bits is not None:  # quantized rows: mlx-lm's quantized attention, masks grouped per KV head
            once = self._weights_once and (rows is None or rows(S) >= S)
            mask = self._attention_mask(queries, mask) if once else self.before_attention(queries, scale, mask)
            gs, bits = self.group_size, self.bits
            block = None if once else query_block(S, L, Hq, B, held=held_bytes)
            if block:  # a prompt chunk whose weights no scorer reads: by blocks of query rows (.attention.blocks)
                out = by_query_blocks(
                    lambda q, m: quantized_attention_with_weights(q, keys, values, scale, m, gs, bits)[0],
                    queries,
                    mask,
                    L,
                    block,
                )
                return self.after_attention(out, values)
            out, weights = quantized_attention_with_weights(queries, keys, values, scale, mask, gs, bits)
            if once:
                self._observe(queries, weights, scale, mask)
            return self.after_attention(out, values)
        if not (self._weights_once and attend_once(S) and (rows is None or rows(S) >= S)):
            mask = self.before_attention(queries, scale, mask)
            block = query_block(S, L, Hq, B, held=max(held_bytes, HELD_BLOCK_FLOOR)) if held else None
            if block:  # decoded rows: mlx-lm's kernel by blocks of query rows, its [S, L] logits not the peak
                out = by_query_blocks(lambda q, m: fused(q, keys, values, None, scale, m), queries, mask, L, block)
            else:
                out = fused(queries, keys, values, None if held else self, scale, mask)
            return self.after_attention(out, values)
        mask = self._attention_mask(queries, mask)
        out, weights = attention_with_weights(  # grouped once evicted: before, mlx-lm's kernel's numbers exactly
            queries,
            keys,
            values,
            scale,
            mask,
            compiled=self.n == self._slots.capacity,
            grouped=self.offset > self.n,
        )
        self._observe(queries, weights, scale, mask)
        return self.after_attention(out, values)

    def decoded_rows(self, rows) -> mx.array:
        """Held quantized rows ``(packed, scales, biases)`` [B, H, L, *] decoded: [B, H, L, D] in the scales' dtype.

        mlx-lm's fused kernel over the decoded rows is faster than its ``quantized_matmul`` attention on CPU
        (``quantized_matmul`` has no BLAS path); the decoded copy is one layer's rows at a time, freed after the
        chunk."""
        return mx.dequantize(*rows, group_size=self.group_size, bits=self.bits)

    def _observe(self, queries: mx.array, weights: mx.array, scale: float = None, mask=None) -> None:
        """The scorer takes this step's attention ``weights`` [B, H, G, S, L] (``on_attention_weights``)."""
        rec = self._undo
        if rec is not None and rec.steps:  # a verify step: token by token (.undo)
            self.scores = undo.attention_rows(self, rec, weights=weights)
        else:
            undo.observe_chunk(rec, queries, scale, mask)
            run = dict(self._run)  # adopted only if the scorer succeeds (as in before_attention)
            self.scores = self._step.on_attention_weights(self._view(queries.shape[2], run), weights)
            self._run = run
        self._bound_graph()
        self._attended, hook = True, self._hook
        self._observed = hook is None or hook.active

    def after_attention(self, out: mx.array, values: mx.array) -> mx.array:
        """``out`` [B, Hq, S, Dv], this step's attention output (the hook's); a prompt chunk's is measured for a
        data-driven allocation into the run's state (:func:`~.layer_group.record`; ``values``' last S slots are
        the chunk's own)."""
        S = out.shape[2]
        if self.group is not None and S > 1:
            new = tree_map(lambda x: x[:, :, -S:], values)  # quantized rows (a tuple) are decoded
            new = self.storage.decode(new, out.dtype) if isinstance(new, tuple) else new
            self._run = record(self._run, out, new)
            self.group.stale()
        return out

    # ------------------------------------------------------------------ internals
    def _attention_mask(self, queries: mx.array, mask):
        """The mask this layer's attention uses: its own sliding window, plus the slots' log-weights. mlx-lm builds
        one mask per kind of layer from the first such layer's cache (:meth:`make_mask`); where this layer holds
        another number of slots (per-layer budgets: an allocation, a compress-once file) its causal mask is rebuilt
        for its own ``n``."""
        if self.window is not None and self.offset > self.window:
            mask = window_mask(self.positions[..., : self.n], self.offset, self._last_S, self.window, queries.shape[1])
        elif isinstance(mask, mx.array) and mask.shape[-1] != self.n:
            mask = causal_allowed(queries.shape[2], self.n)
        if self.uses_log_weights and self._lw_used:
            mask = with_log_weights(mask, self._slots.log_weights[..., : self.n], queries)
        return mask

    def _view(self, n_new: int, run: Optional[dict] = None) -> CacheView:
        """The parts' view (``offset``: tokens seen, read by the parts as int32 [B, 1, 1]); its first read of
        ``key_norms`` makes the store keep them, when it does not yet."""
        sl = self._slots
        view = sl.view(self.offset, n_new, self._window_dead() if n_new == 0 else None, self.head_shard, run)
        if sl.key_norms is None:  # on_key_norms(view, sl.norms_read), set here: no parts code on decode's route
            view.__dict__[DEMAND_NORMS] = sl.norms_read
        return view

    def _cut_budget(self, S: int) -> None:
        """Before a held prompt's cut (the next update is one token), take the budget a data-driven allocation gives
        this layer at the end of the prompt (its policy with that budget: the selector's protection follows it)."""
        if (S != 1 and not undo.is_steps(self, S)) or self.group is None or not (self.holds_prompt and self._run_open):
            return
        budget = self.group.budget_for(self.layer, self.budget)
        if budget != self.budget:
            self.policy = self.group.policy_for(self.policy.config, budget)
            self.budget, self._step = budget, PolicyStep(self.policy, self.layer)

    def fetched(self, S: int) -> int:
        """How many slots the next update of ``S`` tokens returns (what its attention reads): ``n - E + S``."""
        self._cut_budget(S)  # a batch plans its rows' updates first: with the budget the cut will take
        return self.n - self._n_evict(S) + S

    def _n_evict(self, S: int) -> int:
        """How many of the ``n`` slots the next update of ``S`` tokens evicts before appending them: ``E = max(E_p,
        E_w)``.

        ``E_p``, the policy's: the selector's count (:meth:`~.step.PolicyStep.n_evict`: at least the overflow,
        whole chunks for some) for the overflow ``over = n - budget``, or for a prompt chunk (``S > 1``) under
        ``when="prompt_end"``, ``over = min(n - budget, n + S - hold)`` with ``hold`` the config's
        :meth:`~kvpolicy_core.config.policy_config.PolicyConfig.hold_tokens`: the prompt is held while it fits
        the hold (without one, always) and cut to ``budget`` at its end; 0 when ``over <= 0``.

        ``E_w``, a sliding-window layer's (window ``w``), for a chunk: ``n - (w - 1)``. The next query (position
        ``offset``) reaches positions ``> offset - w`` only, at most ``w - 1`` of the slots, so at least ``n - (w - 1)``
        slots are window-dead, and the step evicts those first: the layer drops nothing a query can see and holds at
        most ``w - 1 + S`` slots through a prompt, as mlx-lm's ``RotatingKVCache`` does, in every schedule."""
        n, over = self.n, self.n - self.budget
        if S > 1 and self.holds_prompt and not undo.is_steps(self, S):  # a prompt chunk (not a verify step)
            hold = self.policy.config.policy.hold_tokens()
            over = 0 if hold is None else min(over, n + S - hold)
        E = self._step.n_evict(over, n) if over > 0 else 0
        if S > 1 and self.window is not None and n >= self.window:
            E = max(E, min(n - 1, n - self.window + 1))
        return E

    def _window_dead(self) -> Optional[mx.array]:
        """bool [B, H, n]: slots outside the sliding window of every future query, or None (no window yet)."""
        if self.window is None or self.offset < self.window:
            return None
        pos = self.positions
        return outside_window(pos if pos.shape[-1] == self.n else pos[..., : self.n], self.offset, self.window)

    def _evicted(self, evicted):
        """Book an eviction (:meth:`~.step.PolicyStep.evict`'s losers, update and counters): the counters add up;
        returns (losers, update) for the caller to write. (A decode write's run is empty already; :meth:`_evict`
        ends the run of prompt chunks.)"""
        losers, update, counts = evicted
        if update is not None:
            self._lw_used = self._lw_used or update.d_log_weights is not None
        if counts:
            zero = mx.array(0, dtype=mx.int32)
            self._counters = {**self._counters, **{k: self._counters.get(k, zero) + v for k, v in counts.items()}}
        return losers, update

    def _evict(self, n_evict: int, cut: bool = False, steps: bool = False) -> None:
        """Evict ``n_evict`` slots outside decode's one-for-one write (a prompt chunk over its hold or window, the
        cut, a verify step's overflow, :meth:`settle`): the update added, the survivors compacted in temporal
        order."""
        losers, update = self._evicted(self._step.evict(self._view(0), n_evict, self.offset, cut, steps))
        # the eviction ends the run of prompt chunks (a cut also its statistic)
        self._run, self._run_open = prompt_statistic(self._run) if self._run and not cut else {}, False
        if update is not None:
            self._slots.add(update)
        self._slots.compact(losers)

    def _check_observation(self) -> None:
        """Refuse (before anything changes) a step that needs the attention hook when the hook cannot run: the
        install this cache holds was removed, a restored cache has none, or the last step did not call it.
        :meth:`update_and_fetch` calls it only when :attr:`_observed` does not hold: otherwise each check below
        passes (a decode step reads that one flag, not the four here)."""
        windowed = self.window is not None and self.offset > self.window
        hook = self.attention_hook
        if hook is not None and not hook.active:
            self._step.check_hook((hook,), windowed or self.hook_every_step)
        if self.hook_missing is not None and not self._attended:
            raise ModelError(f"layer {self.layer}: this cache needs kvpolicy's attention hook, but {self.hook_missing}")
        self._step.check_observed(windowed, self._attended or self.offset == 0)

    # ------------------------------------------------------------------ the row's state as a value
    @property
    def policy_step(self) -> PolicyStep:
        """This layer's :class:`~.step.PolicyStep` (the one eviction route; stacked rows share their first row's)."""
        return self._step

    def row_state(self) -> RowState:
        """This cache's state as a value (:class:`~.slots.RowState`): :meth:`set_row_state` of it puts the cache
        back exactly as it is now. Every update is functional (MLX arrays are values), so references are a complete
        snapshot; a step that raises is rolled back through it (all-or-nothing)."""
        sl = self._slots
        return RowState(
            sl.snapshot(),
            self.offset,
            self._counters,
            self._attended,
            self._run,
            self._run_open,
            self._lw_used,
            self._last_S,
            self._updates,
            sl.track_key_norms,
        )

    def set_row_state(self, state: RowState) -> None:
        """Take ``state`` (a :meth:`row_state`, or one derived from it with :func:`dataclasses.replace`). The undo
        record of the last update is dropped (it describes the state replaced)."""
        self._undo, self._decoding, self._observed = None, False, False
        self._slots.restore(state.slots)
        self._slots.track_key_norms = state.track_key_norms
        self.offset, self._counters, self._attended = state.offset, dict(state.counters), state.attended
        self._run, self._run_open, self._lw_used = dict(state.run), state.run_open, state.lw_used
        self._last_S, self._updates = state.last_S, state.updates

    def _bound_graph(self) -> None:
        """Keep the lazy graph of scores and counters bounded over long runs.

        Over budget at decode, the next eviction (hence the model's output) depends on the scores, so they
        are evaluated with the output; below it, and through a prompt chunk (a held prompt's scores and the run's
        state feed no output until the cut: left lazy, each chunk's graph would keep its attention rows alive,
        growing by ``layers * W * L`` floats a chunk), asynchronously. Counters: every 256 updates.
        Key norms (kept for CaM's cosine search): after every chunk, asynchronously; ``state``, which
        mlx-lm evaluates after each prefill chunk, does not hold them, and their lazy graph would keep
        every earlier chunk's keys alive (memory growing by a chunk's keys per chunk of a long prompt).
        """
        self._updates += 1
        if self._last_S > 1:
            mx.async_eval([self.scores, self._run])
        elif self.n <= self.budget:
            mx.async_eval(self.scores)
        if self._last_S > 1 and self._slots.key_norms is not None:
            mx.async_eval(self._slots.key_norms)
        if self._updates % 256 == 0 and self._counters:
            mx.async_eval(list(self._counters.values()))


BatchPolicyCache.row_class = PolicyCache
register_with_mlx_lm(PolicyCache)
