"""Dropout, host side: a call's dropout_p and generator checked, the Philox words it draws from the torch
generator, and dropout_mask, the keep-mask a call with the same generator state applies."""

import torch
import triton
import triton.language as tl

from .checks import _autocast
from .helpers import _dropout_keep_tile, _dropout_state
from .launch import _launch
from .packed import _is_packed
from .shared import _cdiv


def _dropout_words(device, generator):
    """The Philox words (seed, offset) of one call with dropout, int64 (2,) on `device`, drawn from
    `generator` (None: the device's default generator) by a random op on the device: the generator's state
    advances as by any draw (so torch.manual_seed repeats a run and the next call draws other words), a CUDA
    graph draws anew on every replay (torch's graph-safe Philox state), and torch.compile traces the draw as
    an op of its graph, never a constant. The kernels read the words from memory (Rng), and the backward
    reads the forward's to regenerate its mask. Each word is below 2**62, a range whose width int64 holds
    (Inductor's own randint computes it)."""
    return torch.randint(0, 2**62, (2,), dtype=torch.int64, device=device, generator=generator)


def _device_index(device: torch.device) -> tuple[str, int | None]:
    """A device as (type, index), a CUDA device without an index (torch.Generator(device="cuda")) read as
    the current one, which is what it draws on."""
    if device.type == "cuda" and device.index is None:
        return "cuda", torch.cuda.current_device()
    return device.type, device.index


# The keep-mask kernel's tiles: multiples of 16, as _dropout_keep_tile takes them.
MASK_BLOCK = 64


@triton.jit
def _dropout_mask_kernel(Rng, Mask, dropout_p, H, Q_LEN, KV_LEN, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # The keep-mask (B, H, Q_LEN, KV_LEN) as bytes, by the helper the attention kernels call: one program per
    # query tile of one (batch, head), over every key tile.
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = off_bh // H
    off_h = off_bh % H
    seed, offset, threshold, _ = _dropout_state(Rng, dropout_p, True)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = Mask + (off_bh.to(tl.int64) * Q_LEN + offs_m[:, None]) * KV_LEN
    for start_n in range(0, KV_LEN, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        keep = _dropout_keep_tile(seed, offset, threshold, off_b * H + off_h, offs_m[:, None], offs_n[None, :], False)
        tl.store(rows + offs_n[None, :], keep.to(tl.uint8), mask=(offs_m[:, None] < Q_LEN) & (offs_n[None, :] < KV_LEN))


class Dropout:
    """Dropout of an Attention's calls (a mixin)."""

    def _check_dropout(self, q, dropout_p, generator):
        """dropout_p: a number in [0, 1); generator: None or a torch.Generator on q's device (None under
        torch.compile, which traces the default generator's draws but not a generator object's)."""
        # (NaN fails the comparison too.)
        if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float, torch.SymFloat)) or not 0 <= dropout_p < 1:
            self._fail(f"dropout_p must be a number in [0, 1) (the probability of dropping each attention weight), "
                       f"got {dropout_p!r}")
        if generator is None:
            return
        if not isinstance(generator, torch.Generator):
            self._fail(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        if torch.compiler.is_compiling():
            self._fail("generator must be None under torch.compile (dropout draws from the default generator there; "
                       "torch.manual_seed makes a compiled run repeat)")
        if _device_index(generator.device) != _device_index(q.device):
            self._fail(f"generator must be on {q.device} like q, got one on {generator.device}")

    def _dropout(self, q, dropout_p, generator):
        """A checked call's dropout: None for dropout_p = 0 (the kernels without it; nothing is drawn), else
        (its Philox words, drawn now: _dropout_words, dropout_p)."""
        if dropout_p == 0:
            return None
        return _dropout_words(q.device, generator), float(dropout_p)

    def _dropout_operands(self, dropout):
        """A call's dropout as the forward operators take it: ([its Philox words], dropout_p), or ([], 0.0)."""
        return ([dropout[0]], dropout[1]) if dropout is not None else ([], 0.0)

    def dropout_mask(self, q, k, v, *, dropout_p, generator=None, cu_seqlens_q=None, cu_seqlens_k=None,
                     max_seqlen_q=None, max_seqlen_k=None, **inputs):
        """The keep-mask a call attn(q, k, v, dropout_p=dropout_p, generator=generator, **inputs) made now
        applies: a bool tensor (B, H, Q_LEN, KV_LEN), True where P is kept (and divided by 1 - dropout_p);
        a packed call's (B, H, max_seqlen_q, max_seqlen_k), sequence b's keys and queries from 0 (its part
        is mask[b, :, :Q_LEN, :KV_LEN] of its lengths). It draws from the generator as the call does, so it
        advances the generator too: take the mask, restore the generator's state (get_state/set_state, or
        torch.manual_seed), then call. attngen.reference.evaluate takes the mask (dropout_mask=). All True
        for dropout_p = 0, which draws nothing. Materialises N x N values: for tests at small shapes."""
        q, k, v = _autocast(q, k, v)
        inputs = self._reduced(inputs)
        if _is_packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
            B, H, _, Q_LEN, KV_LEN, _, _ = self._check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                              max_seqlen_k, inputs)
            self._check_packed_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        else:
            B, H, _, Q_LEN, KV_LEN, _, _ = self._check(q, k, v, inputs)
        self._check_dropout(q, dropout_p, generator)
        dropout = self._dropout(q, dropout_p, generator)
        if dropout is None:
            return torch.ones((B, H, Q_LEN, KV_LEN), dtype=torch.bool, device=q.device)
        mask = torch.empty((B, H, Q_LEN, KV_LEN), dtype=torch.uint8, device=q.device)
        _launch(_dropout_mask_kernel, (_cdiv(Q_LEN, MASK_BLOCK), B * H), dropout[0], mask, dropout[1], H, Q_LEN,
                KV_LEN, BLOCK_M=MASK_BLOCK, BLOCK_N=MASK_BLOCK)
        return mask.view(torch.bool)
