"""The facts the planner and the runtime must agree on: head-dim tile widths, dtype tables, how to read
TRITON_INTERPRET, and the allocation rule of every output (the layout contract).

The runtime owns them since it runs them on every call; the planner (Plan.widths, the plan's dtype
names), the tests' dtype table and api's reading of TRITON_INTERPRET import them from here.
"""

import os

import torch

# q, k and v's dtypes, by the names the plan keys its tiles with.
_DTYPES = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}
# q, k and v's dtypes by the plan's name of the tiles their kernels run: an FP8 call (float8_e4m3fn) runs on
# the bf16 plan's, whose shared memory its one-byte tiles need half of.
_PLAN_DTYPES = {**_DTYPES, torch.float8_e4m3fn: "bf16"}
# The torch dtype of each dtype an input may declare.
_INPUT_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16,
                 "i32": torch.int32, "i64": torch.int64, "bool": torch.bool}


def _interpreting():
    """Whether TRITON_INTERPRET asks Triton for its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


# Host arithmetic in plain Python: triton.cdiv and triton.next_power_of_2 are ConstexprFunctions,
# ~5 us a call on the host, and a call used a dozen of them.
def _cdiv(a, b):
    return -(-a // b)


def _next_power_of_2(n):
    return 1 << (n - 1).bit_length()


_MIN_BLOCK = 16  # tl.dot needs every dimension >= 16


def _pad(n):
    return max(_MIN_BLOCK, _next_power_of_2(n))


def _empty_in_layout(t, last, dtype=None):
    """An empty tensor of t's shape but with last dim `last`, whose dims lie in memory in t's order
    (outermost first by stride; ties keep their order), densely.

    The layout contract of every family, and of the operators' fake implementations, which call this
    same function: O follows q's layout, dQ, dK and dV follow q's, k's and v's. So a model's
    transposed (B, N, H, D) projections get O and their gradients back as (B, N, H, D) memory, which
    the output projection and the projections' backward read with no copy; and what torch.compile is
    told of an output's strides is what the kernels write."""
    shape = (*t.shape[:-1], last)
    if t.is_contiguous():  # the dims' own order; a quarter of the general path's host time
        return torch.empty(shape, dtype=dtype or t.dtype, device=t.device)
    n = t.dim()
    # Largest stride first; sorted is stable with reverse=True too. q, k, v have a unit-stride last dim.
    order = sorted(range(n - 1), key=t.stride().__getitem__, reverse=True)
    dense = torch.empty([shape[d] for d in order] + [last], dtype=dtype or t.dtype, device=t.device)
    return dense.permute(*[order.index(d) for d in range(n - 1)], n - 1)


def _tile_widths(D, DV, floor):
    """Tile widths of head dims D and DV: each rounded up to a power of two >= 16, and when either is
    not a power of two (its loads are masked), both at least `floor`."""
    d, dv = _pad(D), _pad(DV)
    if (d, dv) != (D, DV):
        d, dv = max(d, floor), max(dv, floor)
    return d, dv


def _packed_view(t):
    """A packed (TOTAL, heads, D) tensor as the (1, heads, TOTAL, D) view the portable kernels read."""
    return t.unsqueeze(0).transpose(1, 2)


def _unpacked(t):
    """_packed_view's inverse: (1, heads, TOTAL, D) back to (TOTAL, heads, D)."""
    return t.squeeze(0).transpose(0, 1)


def _token_sequences(cu_seqlens, total):
    """(sequence, tokens): which sequence of a packed call each of its `total` tokens belongs to, and the
    tokens' indices, both (total,) int64, made on the device without a sync (searchsorted; repeat_interleave
    would read the lengths on the host). Sequences of length 0 hold no token."""
    tokens = torch.arange(total, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].long(), tokens, right=True), tokens
