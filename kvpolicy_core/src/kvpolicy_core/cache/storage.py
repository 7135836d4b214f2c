"""How a layer's kept keys and values are stored: the slot store's one seam (:class:`Rows`).

A slot store (:mod:`.slots`) keeps its keys and values as *stored rows*: one row per slot along axis 2 of every
array of a ``Stored`` value, so evicting, compacting and writing a slot are the same row gathers and scatters
whatever the representation (:func:`take_rows`, :func:`put_rows`, :func:`update_rows`, :func:`first_rows`).
A storage class says only how a row is encoded and decoded:

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

from typing import Optional, Tuple, Union

import mlx.core as mx
from mlx.utils import tree_map

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
