"""The compiled pass behind the ``attention`` statistics group (C, `kernels.c`'s
``block_scores``, loaded by `native`): one walk over a block of
queries' logits that applies SPEC 10.1's scale, softcap, mask and sinks, takes the softmax, and
adds up every per-query score `head_importance` reports, with no ``(n_queries, n_keys)``
temporaries beyond the weights themselves.

`block_scores` takes the raw products ``q . k`` of a block (BLAS, float32) and overwrites them
with each row's unnormalized softmax numerators ``e_j = exp(x_j - m)`` (float32, exactly 0 where
masked; the weights are ``e_j * INVERSE``, so that the caller normalizes its ``(n, dim)``
products instead of dividing ``(n, n_keys)`` weights) and fills ``rows`` ``(n_queries,
ROW_FIELDS)`` float64 per query:

- ``SINK``, ``LOCAL``: the weight on key positions ``< sinks`` and on visible keys less than
  ``local`` positions back that are not sinks (the two never overlap);
- ``ENTROPY`` (nats) from the identity ``log w_j = (x_j - m) - log T`` (``x`` the logit, ``m``
  the row's maximum, ``T`` the softmax denominator): no logarithm per key;
- ``VISIBLE``: how many keys the query sees; ``DISTANCE``: ``sum w_j (p - j)``;
- ``TOP``: the column of the largest weight (the first one on ties; 0 when every weight is 0);
- ``KEPT``: the sum of the weights a streaming head keeps (key positions ``< sinks`` or less
  than ``stream_window`` back); ``SINK_SHARE``: the share of the layer's own sink
  (``exp(sink - m) / T``, 0 without sinks): a streaming head keeps it too;
- ``INVERSE``: ``1 / T`` (``T`` rounded to float32, as the attention kernels divide by it).

The keys must be in position order (as caches hold them), so that what a query sees is at most
two column ranges found by binary search, and every masked sum is a sum over ranges. The
arithmetic per key is float32 as the attention kernels compute it, in loops over those ranges
that the compiler vectorizes: the logits' maximum (on the raw products: ``scale > 0`` keeps the order),
the search for its first column, and the exponentials (`exp_nonpositive`: Cephes ``expf``, range
reduction by ln 2 and a degree-6 polynomial, within 1 ulp) of
``products * scale - m`` with their sums. Those sums are float32 within each `CHUNK` of keys (at
the float32 vector width) and float64 across chunks; the distance sums ``p - j`` directly (key
positions from the first key's, in float32: exact below 2**24 positions of span), not ``p T -
sum e_j j``, which cancels. It agrees with `kvformat.attention.weights` to float32 rounding,
which the tests hold it to; the largest weight is taken as the largest logit (they differ only
where two weights round to one float32). The passes assume finite logits: the caller sends blocks
whose keys are out of order, or whose logits could overflow or hold a NaN or inf, down the numpy
path. Where the C library is not built (`AVAILABLE` false, or ``KVSNAP_KERNEL=numpy``) only the
numpy path runs. Measured in `python -m benchmarks.needle` and `python -m benchmarks.attention_group_bench`.
"""

from __future__ import annotations

import os

from . import native

SELECTED = os.environ.get("KVSNAP_KERNEL", "compiled")
AVAILABLE = SELECTED != "numpy" and native.AVAILABLE

SINK, LOCAL, ENTROPY, VISIBLE, DISTANCE, TOP, KEPT, SINK_SHARE, INVERSE = range(9)
ROW_FIELDS = 9
CHUNK = 512  # keys per float32 partial sum (its rounding grows with it), and per search step

block_scores = native.block_scores
exp_nonpositive = native.exp_nonpositive
