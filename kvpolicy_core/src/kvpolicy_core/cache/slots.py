"""The slot store of one layer: preallocated K/V buffers, positions and scores, and their edits.

Layout: ``keys`` [B, H, cap, D], ``values`` [B, H, cap, Dv], ``positions`` [B, H, cap] int32
(absolute position of each slot), ``scores`` [B, H, n] float32 and, only when the policy uses
them (``track_log_weights``), attention ``log_weights`` [B, H, n] float32 (0 for a new token);
the first ``n`` slots are valid. Once a part has read ``CacheView.key_norms`` (:meth:`SlotStore.norms_read`), or
from the start for a shipped part with the ``key_norms`` trait (``track_key_norms``):
``key_norms`` [B, H, cap] float32, the L2 norm of each slot's key, kept in step with every edit of the
keys (O(D) per written slot instead of an O(L·D) pass per step), recomputed once from the keys after
they are assigned from outside (a restore, a state load). Slots are not in temporal order after an in-place decode
write; :meth:`compact`
restores temporal order. Every edit is functional (MLX arrays are values), so a tuple of
references (:meth:`snapshot`) is a complete, cheap snapshot.

The store's one seam is its storage (:class:`Rows`). It keeps its keys and values as *stored rows*: one row per
slot along axis 2 of every array of a ``Stored`` value, so evicting, compacting and writing a slot are the same row
gathers and scatters whatever the representation (:func:`take_rows`, :func:`put_rows`, :func:`update_rows`,
:func:`first_rows`). A storage class says only how a row is encoded and decoded:

- :class:`DenseRows`: an array [B, H, L, D] in the model's dtype (``encode`` and ``decode`` are the identity),
  or in another floating dtype (``dtype``: e.g. float16 rows under a float32 model, decoded back to the model's
  dtype for attention and the parts);
- :class:`QuantizedRows`: mlx-lm's ``QuantizedKVCache`` layout, ``mx.quantize`` per token row along the head dim:
  a tuple (``wq`` uint32 [B, H, L, D * bits / 32], ``scales`` [B, H, L, D / g], ``biases`` [B, H, L, D / g]),
  with ``x ~= scales * q + biases`` per group of ``g`` elements; attention runs on mlx-lm's quantized path
  (``quantized_matmul``) and a row is decoded with ``mx.dequantize`` only where a part or a merge reads it.

Rows are independent, so evicting a row never re-quantizes another one.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, NamedTuple, Optional, Tuple, Union

import mlx.core as mx
from mlx.utils import tree_map

from ..parts.base import CacheView, MergeUpdate, key_norm, on_key_rows

#: a stored K or V buffer: an array [B, H, L, D], or a tuple of arrays [B, H, L, *] (quantized rows)
Stored = Union[mx.array, Tuple[mx.array, ...]]

#: bit widths ``mx.quantize`` takes, and the group sizes mlx-lm's quantized caches use
QUANT_BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)


def take_rows(s: Stored, idx: mx.array) -> Stored:
    """Rows ``idx`` [B, H, T] of ``s``: [B, H, T, *] for each array."""
    return tree_map(lambda x: mx.take_along_axis(x, idx[..., None], axis=2), s)


def put_rows(s: Stored, idx: mx.array, rows: Stored) -> Stored:
    """``s`` with ``rows`` [B, H, T, *] written at ``idx`` [B, H, T]."""
    return tree_map(lambda x, r: mx.put_along_axis(x, idx[..., None], r, axis=2), s, rows)


def update_rows(s: Stored, rows: Stored, at: int) -> Stored:
    """``s`` with ``rows`` [B, H, S, *] written at slots ``at .. at + S - 1``."""
    start = mx.array([0, 0, at, 0])
    return tree_map(lambda x, r: mx.slice_update(x, r, start, axes=(0, 1, 2, 3)), s, rows)


def first_rows(s: Stored, n: int) -> Stored:
    """The first ``n`` rows of ``s`` (``s`` itself when it holds exactly ``n``)."""
    return s if (s[0] if isinstance(s, tuple) else s).shape[2] == n else tree_map(lambda x: x[..., :n, :], s)


def concat_rows(a: Stored, b: Stored) -> Stored:
    return tree_map(lambda x, y: mx.concatenate([x, y], axis=2), a, b)


def leaves(s: Stored) -> Tuple[mx.array, ...]:
    return s if isinstance(s, tuple) else (s,)


def length(s: Stored) -> int:
    """Rows held (axis 2)."""
    return leaves(s)[0].shape[2]


def nbytes(s: Optional[Stored]) -> int:
    return 0 if s is None else sum(x.nbytes for x in leaves(s))


class Rows:
    """The storage interface: how rows are encoded for the buffers and decoded for attention and the parts."""

    #: bits per stored element of a quantized storage, None for floating rows
    bits: Optional[int] = None
    group_size: Optional[int] = None

    def encode(self, x: mx.array) -> Stored:
        """Rows [B, H, S, D] (the model's dtype) -> stored rows."""
        raise NotImplementedError

    def decode(self, s: Stored, dtype) -> mx.array:
        """Stored rows -> [B, H, S, D] in ``dtype`` (the model's)."""
        raise NotImplementedError

    def for_attention(self, s: Stored, dtype) -> Stored:
        """What ``update_and_fetch`` hands to attention: the stored rows themselves where attention reads them
        (the model's dtype, or quantized rows on mlx-lm's quantized path), else decoded."""
        return s

    def describe(self) -> dict:
        """The storage's parameters, as recorded in saved states."""
        return {}

    def check_head_dim(self, d: int, layer: int) -> None:
        """Raise ValueError unless rows of head dim ``d`` can be stored."""

    def model_dtypes(self, keys: Stored, values: Stored):
        """The model's (keys, values) dtypes read from stored rows, or None where they do not say."""
        return leaves(keys)[-1].dtype, leaves(values)[-1].dtype


class DenseRows(Rows):
    """Floating rows: in the model's dtype (``dtype=None``: encode and decode are the identity), or in ``dtype``."""

    def __init__(self, dtype=None) -> None:
        self._dtype = None if dtype is None else str(dtype).removeprefix("mlx.core.")  # a name: MLX dtypes do not copy

    @property
    def dtype(self):
        """The stored rows' dtype, or None for the model's own."""
        return None if self._dtype is None else getattr(mx, self._dtype)

    def model_dtypes(self, keys, values):
        return None if self._dtype is not None else (keys.dtype, values.dtype)

    def encode(self, x: mx.array) -> mx.array:
        return x if self.dtype is None or x.dtype == self.dtype else x.astype(self.dtype)

    def decode(self, s: mx.array, dtype) -> mx.array:
        return s if s.dtype == dtype else s.astype(dtype)

    def for_attention(self, s: mx.array, dtype) -> mx.array:
        return self.decode(s, dtype)

    def describe(self) -> dict:
        return {} if self._dtype is None else {"dtype": self._dtype}


class QuantizedRows(Rows):
    """Rows as mlx-lm's ``QuantizedKVCache`` stores them: ``mx.quantize(x, group_size, bits)`` per token row.

    A row of D elements is ``D / group_size`` groups; each group of ``g`` values ``x`` is stored as integers
    ``q = round((x - min x) / scale)`` in ``[0, 2**bits - 1]`` with ``scale = (max x - min x) / (2**bits - 1)``
    and ``bias = min x``, and decoded as ``scale * q + bias``."""

    def __init__(self, bits: int, group_size: int = 64) -> None:
        if bits not in QUANT_BITS:
            raise ValueError(f"kv_bits must be one of {list(QUANT_BITS)} (got {bits!r})")
        if group_size not in GROUP_SIZES:
            raise ValueError(f"kv_group_size must be one of {list(GROUP_SIZES)} (got {group_size!r})")
        self.bits, self.group_size = bits, group_size

    def encode(self, x: mx.array) -> Tuple[mx.array, mx.array, mx.array]:
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def decode(self, s, dtype) -> mx.array:
        out = mx.dequantize(*s, group_size=self.group_size, bits=self.bits)
        return out if out.dtype == dtype else out.astype(dtype)

    def describe(self) -> dict:
        return {"bits": self.bits, "group_size": self.group_size}

    def check_head_dim(self, d: int, layer: int) -> None:
        if d % self.group_size or (d * self.bits) % 32:
            raise ValueError(
                f"layer {layer}: kv_group_size={self.group_size} does not divide the head dim {d} (or {d} x "
                f"kv_bits={self.bits} is not a whole number of 32-bit words); choose a kv_group_size among "
                f"{[g for g in GROUP_SIZES if d % g == 0] or 'none: this model cannot be quantized so'}"
            )


def storage_for(bits: Optional[int] = None, group_size: Optional[int] = None, dtype=None) -> Rows:
    """The storage a config asks for: quantized rows when ``bits`` is set, else floating rows (``dtype``)."""
    return DenseRows(dtype) if bits is None else QuantizedRows(bits, group_size or 64)


_INT_MAX = 2**31 - 1
FIELDS = ("keys", "values", "positions", "scores", "n")
#: |log-weight| bound: exp(64) ~ 6e27 copies of a slot, far above any count, and finite in float16
#: logits (a non-finite or larger value from a disposition is clipped, NaN adds 0)
LOG_WEIGHT_BOUND = 64.0


class Snapshot(NamedTuple):
    """References to a store's fields (:meth:`SlotStore.snapshot`); ``None`` buffers for an empty store."""

    keys: Optional[mx.array]  #: [B, H, cap, D]
    values: Optional[mx.array]  #: [B, H, cap, Dv]
    positions: Optional[mx.array]  #: [B, H, cap] int32
    scores: Optional[mx.array]  #: [B, H, n] float32
    n: int  #: valid slots
    log_weights: Optional[mx.array] = None  #: [B, H, n] float32, when tracked


@dataclasses.dataclass(frozen=True, eq=False)
class RowState:
    """The state of one policy-cache row (its batch, for a single cache) as a value, held by reference (MLX arrays
    are values): ``PolicyCache.row_state()`` gives it and ``set_row_state`` takes it back (a step's all-or-nothing
    rollback, the stacked rows of a batch, persistence). Change a field with :func:`dataclasses.replace`;
    ``eq=False``: MLX arrays have no truth value to compare by."""

    slots: Snapshot  #: the slot store's buffers and valid count (:meth:`.slots.SlotStore.snapshot`)
    offset: int  #: tokens seen: the absolute position of the next token
    counters: Mapping[str, mx.array]  #: the parts' counters (int32 scalars), summed per layer
    attended: bool  #: the last update's attention ran through the hook (or none was needed yet)
    run: Mapping[str, Any]  #: the scorer's state of the current run of prompt chunks (``CacheView.run``)
    run_open: bool  #: the last update was a prompt chunk and nothing was evicted since
    lw_used: bool  #: some attention log-weight may be nonzero (the attention adds them from then on)
    last_S: int  #: tokens of the last update (the window mask of its attention)
    updates: int  #: updates so far (bounds the counters' lazy graph)
    track_key_norms: bool  #: the store keeps each slot's key norm (a part read them, or its trait asks)


class Token(NamedTuple):
    """Decode's new token (:meth:`SlotStore.write`)."""

    keys: mx.array  #: [B, H, 1, D]
    values: mx.array  #: [B, H, 1, Dv]
    offset: Union[int, mx.array]  #: its position: an int, or int32 [B, 1, 1] per row of stacked rows


def _nothing(like: mx.array) -> mx.array:
    """-0.0 shaped like ``like``: ``x + (-0.0)`` is ``x`` for every x (-0.0 and NaN included), where ``x + 0.0``
    turns -0.0 into 0.0. Computed, not a literal: a -0.0 constant in a compiled graph is emitted as 0.0."""
    return -mx.zeros_like(like)


def _inside(delta: mx.array, inside: mx.array) -> mx.array:
    """``delta`` [B, H, T(, D)] with -0.0 (adds nothing) where its target is outside (``inside`` [B, H, T] False)."""
    return mx.where(inside[..., None] if delta.ndim == 4 else inside, delta, _nothing(delta))


def _kept(delta: mx.array, rows: mx.array) -> mx.array:
    """``delta`` [B, H, T(, D)] in float32 (as it is added), with -0.0 (adds nothing) where it is NaN or inf but the
    buffer's element at its target (``rows`` [B, H, T(, D)], the targets' current elements) is finite."""
    d = delta if delta.dtype == mx.float32 else delta.astype(mx.float32)
    return mx.where(mx.isfinite(d) | ~mx.isfinite(rows), d, _nothing(d))


#: the largest finite value of each buffer dtype: a merged element saturates there (:func:`_stored`)
FINITE_MAX = {mx.float16: 65504.0, mx.bfloat16: 3.3895313892515355e38, mx.float32: 3.4028234663852886e38}


def _stored(total: mx.array, old: mx.array) -> mx.array:
    """Merged rows in the buffer's dtype: ``total`` [B, H, T, D] float32 (``old + sum of deltas``), where the old
    element ``old`` [B, H, T, D] (buffer dtype) is finite, clipped to the dtype's finite range (a NaN sum keeps the
    old value); a non-finite old element takes the sum as it is."""
    m = FINITE_MAX.get(old.dtype, FINITE_MAX[mx.float32])
    saturated = mx.where(mx.isnan(total), old.astype(mx.float32), mx.clip(total, -m, m))
    return mx.where(mx.isfinite(old), saturated, total).astype(old.dtype)


def _merged(rows: Rows, buffer, dtype, t: mx.array, old: mx.array, delta: mx.array):
    """``buffer`` (stored rows, :class:`Rows`) with the float32 ``delta`` [B, H, T, D] added at ``t`` [B, H, T]
    (repeats sum) in float32, stored by :func:`_stored` and encoded; and the new target rows [B, H, T, D] (``dtype``,
    decoded from what is stored). ``old``: the targets' rows [B, H, T, D] before. One target per row (decode):
    the rows alone (only they are decoded and re-encoded); more: a float32 sum over the decoded buffer, read back
    at ``t``."""
    if t.shape[-1] == 1:
        total = old.astype(mx.float32) + delta
    else:
        B, H = t.shape[:2]
        bi, hi = mx.arange(B)[:, None, None], mx.arange(H)[None, :, None]
        full = rows.decode(buffer, dtype).astype(mx.float32).at[bi, hi, t].add(delta)
        total = mx.take_along_axis(full, t[..., None], axis=2)
    new = rows.encode(_stored(total, old))
    return put_rows(buffer, t, new), rows.decode(new, dtype)


#: the store fields a decode write reads and writes, in the order its compiled call takes them
_DECODE_FIELDS = ("_keys", "_values", "positions", "scores", "log_weights", "key_norms")
_BUFFERS = _DECODE_FIELDS[:4]
_UPDATE_FIELDS = ("d_keys", "d_values", "d_scores", "d_log_weights")
_writes: dict = {}  # compiled decode writes without a choice, per (store fields, update fields)


def _write_graph(fields: Tuple[str, ...], deltas: Tuple[str, ...], rows: Rows, dtypes) -> Callable:
    """:meth:`SlotStore.write`'s ops as a function of arrays, for ``mx.compile``: ``f(keys, values, offset, losers,
    [targets], *buffers, *deltas) -> buffers`` (targets and deltas only with an update)."""

    def fn(keys, values, offset, losers, *arrays):
        n_t = bool(deltas)
        head, bufs, rest = arrays[:n_t], arrays[n_t : n_t + len(fields)], arrays[n_t + len(fields) :]
        store = SlotStore(track_log_weights="log_weights" in fields, track_key_norms="key_norms" in fields, rows=rows)
        store.dtypes = dtypes
        for f, x in zip(fields, bufs):  # _keys first: the keys setter would reset key_norms
            setattr(store, f, tuple(x) if isinstance(x, list) else x)
        if deltas:
            store.add(MergeUpdate(head[0], **dict(zip(deltas, rest))))
        store._put(losers, keys, values, offset)
        return [getattr(store, f) for f in fields]

    return fn


def _compiled_write(fields: Tuple[str, ...], deltas: Tuple[str, ...], rows: Rows, dtypes) -> Callable:
    """:func:`_write_graph` compiled, one per layout and storage (shared by every layer; MLX retraces on a new shape
    or dtype)."""
    key = (fields, deltas, type(rows), tuple(sorted(rows.describe().items())), dtypes)
    if key not in _writes:
        _writes[key] = mx.compile(_write_graph(fields, deltas, rows, dtypes))
    return _writes[key]


class SlotStore:
    """Buffers of one layer's retained tokens; knows nothing about policies."""

    def __init__(
        self, step: int = 256, track_log_weights: bool = False, track_key_norms: bool = False, rows: Rows = None
    ) -> None:
        self.step = step
        self.track_log_weights, self.track_key_norms = track_log_weights, track_key_norms
        self.rows = DenseRows() if rows is None else rows  #: how keys and values are stored (:mod:`.slots`)
        self._dtype_names = None  # (keys, values) dtype names of the model's rows (names: MLX dtypes do not copy)
        self.keys = self._values = self.positions = self.scores = self.log_weights = None
        self.n = 0

    #: (keys.shape, values.shape, keys.dtype, values.dtype) of the last input that passed check_input against
    #: the buffers: the same again passes without the field-by-field checks while the values buffer keeps its
    #: dtype and width (reset when keys are assigned from outside)
    _accepted = None

    def __getstate__(self) -> dict:
        """Copies (``copy.deepcopy`` of a cache row) leave out the accepted input (MLX dtypes do not copy)."""
        return {k: v for k, v in self.__dict__.items() if k != "_accepted"}

    @property
    def keys(self):
        """The stored keys (:mod:`.slots`: an array [B, H, cap, D] for floating rows), or None."""
        return self._keys

    @property
    def dtypes(self):
        """(keys, values) dtypes of the model's rows (what decoding gives back), from the first rows stored; None
        before, or after a load of floating rows in another dtype than the model's (the next input's are taken)."""
        if self._dtype_names is None:
            return None if self._keys is None else self.rows.model_dtypes(self._keys, self._values)
        return tuple(getattr(mx, n) for n in self._dtype_names)

    @dtypes.setter
    def dtypes(self, value) -> None:
        self._dtype_names = None if value is None else tuple(str(d).removeprefix("mlx.core.") for d in value)

    @property
    def values(self):
        """The stored values (as :attr:`keys`), or None."""
        return self._values

    @values.setter
    def values(self, value) -> None:
        """Values assigned from outside the store's edits: the next input is checked field by field against them."""
        self._values, self._accepted, self._dtype_names = value, None, None

    @property
    def capacity(self) -> int:
        return 0 if self._keys is None else length(self._keys)

    def shape(self) -> Tuple[int, int, int, int]:
        """(B, H, D, Dv) of the rows held (the keys must be set)."""
        k = leaves(self._keys)[0]
        return k.shape[0], k.shape[1], self.dims[0], self.dims[1]

    @property
    def dims(self) -> Tuple[int, int]:
        """(D, Dv), the head dims of the model's keys and values (the keys must be set)."""
        if self.rows.bits is None:
            return self._keys.shape[3], self._values.shape[3]
        return self._keys[1].shape[3] * self.rows.group_size, self._values[1].shape[3] * self.rows.group_size

    def decoded(self, n: Optional[int] = None) -> Tuple[mx.array, mx.array]:
        """(keys [B, H, n, D], values [B, H, n, Dv]) of the first ``n`` slots (all when None) in the model's dtypes."""
        n = self.capacity if n is None else n
        kd, vd = self.dtypes
        return (
            self.rows.decode(first_rows(self._keys, n), kd),
            self.rows.decode(first_rows(self._values, n), vd),
        )

    @keys.setter
    def keys(self, value: Optional[mx.array]) -> None:
        """Keys assigned from outside the store's edits: their norms are recomputed when next needed, and the
        next input is checked field by field against the new buffers."""
        self._keys, self.key_norms, self._accepted, self._dtype_names = value, None, None, None

    def _norms(self) -> Optional[mx.array]:
        """``key_norms`` [B, H, cap] when tracked (computed from the keys if unknown), else None."""
        if not self.track_key_norms or self._keys is None:
            return None
        if self.key_norms is None:
            self.key_norms = key_norm(self.decoded()[0])
        return self.key_norms

    def norms_read(self, keys: mx.array) -> mx.array:
        """A part read ``CacheView.key_norms`` of a view built without them (``keys`` [B, H, L, D], the view's):
        keep them from now on; returns the first L of them."""
        self.track_key_norms = True
        norms = self._norms()
        return norms if norms.shape[-1] == keys.shape[2] else norms[..., : keys.shape[2]]

    def snapshot(self) -> Snapshot:
        return Snapshot(self._keys, self._values, self.positions, self.scores, self.n, self.log_weights)

    def restore(self, snap: Snapshot) -> None:
        """Restore a :meth:`snapshot`, field for field."""
        self.keys, self._values, self.positions, self.scores, self.n, self.log_weights = snap

    def check_input(self, keys: mx.array, values: mx.array, layer: int) -> None:
        """Raise ValueError unless keys/values [B, H, S, D(v)] fit these buffers (same B, H, D, Dv, dtype).

        Only ``mx.array`` of a floating dtype is accepted (TypeError otherwise): mlx-lm always passes
        those, and a numpy array or integer keys would be silently converted or rounded.
        """
        if (
            self._accepted is not None
            and type(keys) is mx.array
            and type(values) is mx.array
            and (keys.shape, values.shape, keys.dtype, values.dtype) == self._accepted
        ):
            return  # the shapes and dtypes of the last accepted input (decode's steady state)
        for name, x in ("keys", keys), ("values", values):
            if not isinstance(x, mx.array):
                raise TypeError(
                    f"layer {layer}: {name} must be an mlx.core.array (got {type(x).__module__}."
                    f"{type(x).__name__}); convert with mx.array(...)"
                )
            if not mx.issubdtype(x.dtype, mx.floating):
                raise TypeError(
                    f"layer {layer}: {name} must have a floating dtype (float32, float16 or bfloat16; "
                    f"got {str(x.dtype).removeprefix('mlx.core.')})"
                )
        if keys.ndim != 4 or values.ndim != 4 or keys.shape[:3] != values.shape[:3]:
            raise ValueError(
                f"layer {layer}: keys and values must be [B, H, S, D] with equal B, H, S "
                f"(got keys {tuple(keys.shape)}, values {tuple(values.shape)})"
            )
        if keys.shape[2] == 0:
            raise ValueError(f"layer {layer}: update_and_fetch needs at least one new token (got S=0)")
        if keys.shape[3] < 1 or values.shape[3] < 1:
            raise ValueError(
                f"layer {layer}: keys and values need a head dim of at least 1 (got keys "
                f"{tuple(keys.shape)}, values {tuple(values.shape)})"
            )
        self.rows.check_head_dim(keys.shape[3], layer)
        self.rows.check_head_dim(values.shape[3], layer)
        if self._keys is not None:
            have, got = self.shape(), (keys.shape[0], keys.shape[1], keys.shape[3], values.shape[3])
            if have != got:
                raise ValueError(
                    f"layer {layer}: (batch, kv_heads, key_dim, value_dim) changed from {have} to {got}; "
                    "a cache serves one batch with fixed heads and head dims: build fresh caches"
                )
            if self.dtypes is not None and (keys.dtype, values.dtype) != self.dtypes:
                name, have, got = (
                    ("keys", self.dtypes[0], keys.dtype)
                    if keys.dtype != self.dtypes[0]
                    else ("values", self.dtypes[1], values.dtype)
                )
                raise ValueError(
                    f"layer {layer}: {name} dtype changed from {have} to {got}; "
                    "a cache keeps the dtype it was first given: build fresh caches"
                )
        self._accepted = (keys.shape, values.shape, keys.dtype, values.dtype)

    def view(
        self,
        offset,
        n_new: int,
        dead: Optional[mx.array],
        head_shard: Tuple[int, int] = (0, 1),
        run: Optional[dict] = None,
    ) -> CacheView:
        """The parts' view of the n valid slots; ``head_shard`` = (rank, size) of a tensor-parallel
        split of the KV heads: these H heads are global heads ``rank * H ..`` of ``size * H``;
        ``run``: the scorer's dict for the current run of prompt chunks (``CacheView.run``); ``offset``: tokens
        seen, an int or per row an int32 array [B, 1, 1] (``CacheView.offset`` reads either as the array)."""
        n, (rank, size) = self.n, head_shard
        H = leaves(self._keys)[0].shape[1]
        norms = self._norms()
        keys, values = self.decoded(n)
        positions = self.positions
        if n != positions.shape[-1]:  # a full buffer (decode's steady state) is viewed whole: no slice nodes
            positions = positions[..., :n]
            norms = None if norms is None else norms[..., :n]
        view = CacheView(
            keys, values, positions, self.scores, offset, n_new, dead, rank * H, size * H, self.log_weights, run, norms
        )
        if self.rows.bits is not None:  # quantized rows: a long pass may decode the keys a block at a time
            stored, kd = self._keys, self.dtypes[0]
            on_key_rows(view, lambda lo, hi: self.rows.decode(tree_map(lambda x: x[..., lo:hi, :], stored), kd))
        return view

    def valid(self):
        """(keys, values) of the n valid slots as attention reads them (:meth:`Rows.for_attention`: the
        buffers themselves when full and stored in the model's dtype; quantized rows as mlx-lm's quantized
        attention takes them)."""
        kd, vd = self.dtypes
        k, v = first_rows(self._keys, self.n), first_rows(self._values, self.n)
        return self.rows.for_attention(k, kd), self.rows.for_attention(v, vd)

    def append(self, keys: mx.array, values: mx.array, offset: int, steady: int) -> None:
        """Write S new tokens (positions ``offset .. offset+S-1``, score 0) after the n valid slots.

        Capacity grows in multiples of ``step`` up to ``steady`` slots (decode's steady state: the cache's
        budget and the one new token), or exactly to ``n + S`` for a larger chunk.
        """
        B, H, S, D = keys.shape
        need = self.n + S
        dtypes = (keys.dtype, values.dtype) if self.keys is None or self.dtypes is None else self.dtypes
        cap = self.capacity
        if need > cap:
            new_cap = min(-(-need // self.step) * self.step, steady) if need <= steady else need
            grow = new_cap - self.n
            k_new = self.rows.encode(mx.zeros((B, H, grow, D), keys.dtype))
            v_new = self.rows.encode(mx.zeros((B, H, grow, values.shape[3]), values.dtype))
            p_new = mx.zeros((B, H, grow), mx.int32)
            if self.keys is None:
                self.keys, self._values, self.positions = k_new, v_new, p_new
                self.scores = mx.zeros((B, H, 0), mx.float32)
            else:
                n = self.n
                if self.key_norms is not None:
                    self.key_norms = mx.concatenate(
                        [self.key_norms[..., :n], mx.zeros((B, H, grow), mx.float32)], axis=2
                    )
                self._keys = concat_rows(first_rows(self._keys, n), k_new)
                self._values = concat_rows(first_rows(self._values, n), v_new)
                self.positions = mx.concatenate([self.positions[..., :n], p_new], axis=2)
        self.dtypes = dtypes
        n = self.n
        at = mx.array([0, 0, n, 0])
        k_rows = self.rows.encode(keys)
        if self.key_norms is not None:
            self.key_norms = mx.slice_update(
                self.key_norms, key_norm(self.rows.decode(k_rows, keys.dtype)), at[:3], axes=(0, 1, 2)
            )
        self._keys = update_rows(self._keys, k_rows, n)
        self._values = update_rows(self._values, self.rows.encode(values), n)
        new_pos = mx.broadcast_to(mx.arange(offset, offset + S, dtype=mx.int32), (B, H, S))
        self.positions = mx.slice_update(self.positions, new_pos, at[:3], axes=(0, 1, 2))
        self.scores = mx.concatenate([self.scores[..., :n], mx.zeros((B, H, S), mx.float32)], axis=2)
        if self.track_log_weights:
            lw = mx.zeros((B, H, 0), mx.float32) if self.log_weights is None else self.log_weights[..., :n]
            self.log_weights = mx.concatenate([lw, mx.zeros((B, H, S), mx.float32)], axis=2)
        self.n = need

    def write(self, token: Token, losers: mx.array, update: Optional[MergeUpdate] = None, *, compiled=False) -> None:
        """Decode's one write: ``update`` added (:meth:`add`, its guards included), then the new ``token`` into
        the slots ``losers`` [B, H, 1]: its key, value, position ``token.offset`` and score 0 (log-weight 0, its
        key norm).

        ``compiled``: the same ops as one ``mx.compile`` call (a merge's ~25 scatters and elementwise ops, each a
        dispatch of its own when eager); a layout that cannot be traced runs them eager.
        """
        offset = token.offset if isinstance(token.offset, mx.array) else mx.array(token.offset, dtype=mx.int32)
        if compiled:
            fields = _BUFFERS
            if self.log_weights is not None or self.key_norms is not None:
                fields = tuple(f for f in _DECODE_FIELDS if getattr(self, f) is not None)
            deltas = () if update is None else tuple(f for f in _UPDATE_FIELDS if getattr(update, f) is not None)
            head = [update.targets] if deltas else []
            arrays = head + [getattr(self, f) for f in fields] + [getattr(update, f) for f in deltas]
            try:
                write = _compiled_write(fields, deltas, self.rows, self.dtypes)
                out = write(token.keys, token.values, offset, losers, *arrays)
            except (ValueError, RuntimeError, IndexError):  # MLX cannot trace it here (nothing written yet): eager
                out = None
            if out is not None:
                for f, x in zip(fields, out):
                    setattr(self, f, tuple(x) if isinstance(x, list) else x)
                return
        if update is not None:
            self.add(update)
        self._put(losers, token.keys, token.values, offset)

    def _put(self, slots: mx.array, keys: mx.array, values: mx.array, offset: mx.array) -> None:
        """The new token [B, H, 1, D(v)] (position ``offset``, an int32 array; score 0) into ``slots`` [B, H, 1]."""
        k_rows = self.rows.encode(keys)
        if self.key_norms is not None:
            norms = key_norm(self.rows.decode(k_rows, keys.dtype))
            self.key_norms = mx.put_along_axis(self.key_norms, slots, norms, axis=2)
        self._keys = put_rows(self._keys, slots, k_rows)
        self._values = put_rows(self._values, slots, self.rows.encode(values))
        self.positions = mx.put_along_axis(self.positions, slots, offset, axis=2)
        self.scores = mx.put_along_axis(self.scores, slots, mx.array(0.0, dtype=mx.float32), axis=2)
        if self.log_weights is not None:
            self.log_weights = mx.put_along_axis(self.log_weights, slots, mx.array(0.0, dtype=mx.float32), axis=2)

    def compact(self, losers: mx.array) -> None:
        """Remove the slots ``losers`` [B, H, E]; survivors move, in temporal order, to [0, n - E)."""
        n, keep_n = self.n, self.n - losers.shape[-1]
        pos = self.positions[..., :n]
        gone = mx.put_along_axis(mx.zeros(pos.shape, mx.bool_), losers, mx.array(True), axis=2)
        order = mx.argsort(mx.where(gone, _INT_MAX, pos), axis=-1)[..., :keep_n]
        if self.key_norms is not None:
            self.key_norms = mx.take_along_axis(self.key_norms[..., :n], order, axis=-1)
        self._keys, self._values = (
            take_rows(first_rows(self._keys, n), order),
            take_rows(first_rows(self._values, n), order),
        )
        self.positions = mx.take_along_axis(pos, order, axis=-1)
        self.scores = mx.take_along_axis(self.scores, order, axis=-1)
        if self.log_weights is not None:
            self.log_weights = mx.take_along_axis(self.log_weights, order, axis=-1)
        self.n = keep_n

    def add(self, u: MergeUpdate) -> None:
        """Scatter-add a disposition's deltas at ``u.targets`` [B, H, T] (duplicate targets sum; a None delta
        leaves its field as it is), guarded on the device, with no host read:

        - deltas are added in float32 and each sum stored in the buffer's dtype: an element that was finite stays
          finite, a sum past the dtype's range saturating at its largest finite value (:data:`FINITE_MAX`:
          +-65504 in float16); a delta element that is NaN or inf where the buffer's target element is finite is
          not added (a non-finite element may take any delta and any sum);
        - log-weight deltas are added with NaN as 0, and the sums clipped to +-``LOG_WEIGHT_BOUND``;
        - an update whose every delta is then 0 (no loser merged) leaves every buffer, key norms and
          log-weights included, bit for bit as it was.

        - a target outside the ``n`` valid slots (``scores`` [B, H, n]) adds nothing (MLX does not bounds-check a
          scatter).

        A prompt chunk's update and a cache's first decode updates are value-checked before they get here
        (:mod:`.step`; the guards are then the identity); later decode updates come here unchecked, and these
        guards are what protects the cache from a broken one.
        """
        B, H = self.shape()[:2]
        bi, hi = mx.arange(B)[:, None, None], mx.arange(H)[None, :, None]
        t = u.targets.astype(mx.int32)
        inside = (t >= 0) & (t < self.scores.shape[-1])  # outside the n valid slots: adds nothing (no bounds check)
        t = mx.where(inside, t, 0)
        kd, vd = self.dtypes
        old_v = None if u.d_values is None else self.rows.decode(take_rows(self._values, t), vd)
        old_k = None if u.d_keys is None else self.rows.decode(take_rows(self._keys, t), kd)
        old_s = None if u.d_scores is None else mx.take_along_axis(self.scores, t, axis=2)
        d_values, d_keys, d_scores = (
            None if d is None else _inside(_kept(d, old), inside)
            for d, old in ((u.d_values, old_v), (u.d_keys, old_k), (u.d_scores, old_s))
        )
        d_lw = getattr(u, "d_log_weights", None)
        if d_lw is not None:
            if self.log_weights is None:
                raise ValueError("MergeUpdate.d_log_weights needs a part that declares Needs(log_weights=True)")
            d_lw = mx.clip(mx.nan_to_num(d_lw.astype(mx.float32), nan=0.0), -LOG_WEIGHT_BOUND, LOG_WEIGHT_BOUND)
            d_lw = mx.where(inside, d_lw, 0.0)
        present = [d for d in (d_values, d_keys, d_scores, d_lw) if d is not None]
        changes = mx.array(False)
        for d in present:
            changes = changes | mx.any(d != 0)
        d_values, d_keys, d_scores = (
            None if d is None else mx.where(changes, d, _nothing(d)) for d in (d_values, d_keys, d_scores)
        )
        if d_values is not None:
            self._values, _ = _merged(self.rows, self._values, vd, t, old_v, d_values)
        if d_keys is not None:
            # the merged rows and their norms come from the old rows (one target per row at decode: the new keys
            # have one consumer, the next write, and MLX can update the buffer in place)
            self._keys, rows = _merged(self.rows, self._keys, kd, t, old_k, d_keys)
            if self.key_norms is not None:  # the changed rows only (duplicate targets write the same norm)
                norms = mx.where(changes, key_norm(rows), mx.take_along_axis(self.key_norms, t, axis=2))
                self.key_norms = mx.put_along_axis(self.key_norms, t, norms, axis=2)
        if d_scores is not None:
            # finite as PolicyStep.scores keeps them (a sum can overflow to inf)
            self.scores = mx.nan_to_num(self.scores.at[bi, hi, t].add(d_scores), nan=0.0)
        if d_lw is not None:
            lw = mx.clip(self.log_weights.at[bi, hi, t].add(d_lw), -LOG_WEIGHT_BOUND, LOG_WEIGHT_BOUND)
            self.log_weights = mx.where(changes, lw, self.log_weights)

    def in_temporal_order(self):
        """(keys, values, positions, scores) of the n valid slots sorted by position."""
        n = self.n
        order = mx.argsort(self.positions[..., :n], axis=-1)
        take = lambda x: mx.take_along_axis(x, order[..., None], axis=2)  # noqa: E731
        keys, values = self.decoded(n)
        return (
            take(keys),
            take(values),
            mx.take_along_axis(self.positions[..., :n], order, axis=-1),
            mx.take_along_axis(self.scores, order, axis=-1),
        )

    def bytes_per_token(self) -> int:
        if self.keys is None:
            return 0
        return (nbytes(self._keys) + nbytes(self._values)) // max(1, self.capacity)

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        lw = 0 if self.log_weights is None else self.log_weights.nbytes
        kn = 0 if self.key_norms is None else self.key_norms.nbytes
        return nbytes(self._keys) + nbytes(self._values) + self.positions.nbytes + self.scores.nbytes + lw + kn
