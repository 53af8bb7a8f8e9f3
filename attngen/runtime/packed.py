"""Packed calls: sequences of any lengths in FlashAttention's varlen layout, checked and run through the packed operators."""

import torch

from .ahead import compile_ahead
from .checks import CHECKED_VALUES
from .operators import _PackedAttention
from .plans import _CallPlan, _call_facts, _tensor_facts
from .shared import _packed_view


def _is_packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """Whether a call's keywords make it a packed call: any of the four (the others are then checked
    present by _check_packed, rather than silently ignored)."""
    return any(x is not None for x in (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))


class Packed:
    """Packed calls of an Attention (a mixin)."""

    def _packed_attention(self, q, k, v, inputs, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                          generator=None, deterministic=False):
        """A packed call (attn's cu_seqlens_q/k, max_seqlen_q/k; dropout_p and generator checked): checked, then
        the packed kernels behind _PackedAttention (eager, with the call's plan) or the packed operators (under
        torch.compile); `deterministic` as for attn."""
        packed = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        if torch.compiler.is_compiling():  # the operators' eager code plans nothing either
            plan = None
            self._check_packed(q, k, v, *packed, inputs)
        else:
            plan = self._packed_plan(q, k, v, inputs, *packed, deterministic=deterministic, dropout=dropout_p != 0)
        self._check_learnable(inputs)
        cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
        # Checking the values reads them on the host (one sync per call): skipped while a CUDA graph is
        # captured or under torch.compile, and for offsets already checked (CHECKED_VALUES).
        if not torch.compiler.is_compiling() and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
            offsets, facts = (cu_seqlens_q, cu_seqlens_k), ("packed", q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
            if not CHECKED_VALUES.holds(offsets, facts):
                self._check_packed_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
                CHECKED_VALUES.add(offsets, facts)
        tensors = [inputs[name].contiguous() for name in self.facts.inputs]
        sink = self._sink_rows(q, k, inputs, packed=(cu_seqlens_q, cu_seqlens_k))
        dropout = self._dropout(q, dropout_p, generator)
        if torch.compiler.is_compiling():
            return self.operators[4](q, k, v, tensors, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                     [sink] if sink is not None else [], *self._dropout_operands(dropout), deterministic)
        backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *tensors))
        compile_ahead(self, plan, q, k, v, tensors, sink, dropout, deterministic, backward,
                      packed=(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
        if not backward:
            return self._packed_forward(q, k, v, tensors, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sink,
                                        plan, dropout)
        return _PackedAttention.apply(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, plan, sink,
                                      deterministic, dropout, *tensors)

    def _packed_plan(self, q, k, v, inputs, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, deterministic=False,
                     dropout=False):
        """The _CallPlan of a packed call (plans.py): its checks passed and both families chosen once per set
        of facts, a dense call's (_call_facts) and those of the offsets' tensors and the longest lengths,
        which with them decide every launch's arguments' facts (and `deterministic` and `dropout`, as for
        _call_plan)."""
        facts = _call_facts(q, k, v, inputs)
        offsets = [_tensor_facts(t) for t in (cu_seqlens_q, cu_seqlens_k)]
        if facts is not None and None not in offsets:
            # The lengths' types too: True == 1 as a key, and _check_packed refuses a bool.
            facts = ("packed", deterministic, dropout, type(max_seqlen_q), max_seqlen_q, type(max_seqlen_k),
                     max_seqlen_k, *offsets, *facts)
        else:
            facts = None

        def make():
            sizes = self._check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, inputs)
            views = [_packed_view(t) for t in (q, k, v)]
            return _CallPlan(sizes, self._forward_family(*views, *views[1].shape[1:3], False, packed=True,
                                                         dropout=dropout),
                             self._backward_family(*views, packed=True, deterministic=deterministic, dropout=dropout))
        return self._planned(facts, make)

    def _check_packed(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, inputs):
        """A packed call's tensors, offsets' tensors and sizes; returns (B, H, HKV, max_seqlen_q, max_seqlen_k,
        D, DV), B its number of sequences."""
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                self._fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.layout != torch.strided or t.is_nested:
                self._fail(f"{name} must be a dense tensor, got a {'nested' if t.is_nested else t.layout} one")
            if t.dim() != 3:
                self._fail(f"{name} must have 3 dims (TOTAL, heads, head_dim) in a packed call (cu_seqlens_q=...), "
                      f"got shape {tuple(t.shape)}")
        self._check_tensors(*map(_packed_view, (q, k, v)))
        TOTAL_K, HKV = k.shape[0], k.shape[1]
        if v.shape[0] != TOTAL_K or v.shape[1] != HKV:
            self._fail(f"v must have {TOTAL_K} tokens of {HKV} heads like k, got shape {tuple(v.shape)}")
        for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if not (isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.dim() == 1 and t.shape[0] >= 2
                    and t.device == q.device):
                self._fail(f"{name} must be a 1-D int32 tensor of B + 1 >= 2 offsets on {q.device}, got "
                      + (f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__))
        if cu_seqlens_k.shape[0] != cu_seqlens_q.shape[0]:
            self._fail(f"cu_seqlens_k must have {cu_seqlens_q.shape[0]} offsets like cu_seqlens_q (one sequence each), "
                  f"got {cu_seqlens_k.shape[0]}")
        for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if not isinstance(n, (int, torch.SymInt)) or isinstance(n, bool):
                self._fail(f"{name} must be a Python int (the longest sequence's length), got {type(n).__name__}")
            if not 1 <= n <= self.facts.max_length:
                self._fail(f"{name} must lie in [1, {self.facts.max_length}] ({self.facts.max_length_reason}), got {n}")
        B = cu_seqlens_q.shape[0] - 1
        self._check_sizes(B, q.shape[1], HKV, max_seqlen_q, max_seqlen_k, q.shape[2], v.shape[2], inputs, q.device)
        return B, q.shape[1], HKV, max_seqlen_q, max_seqlen_k, q.shape[2], v.shape[2]

    def _check_packed_values(self, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        """A packed call's offsets: each from 0 to its tensor's TOTAL, non-decreasing, no sequence longer than
        its max_seqlen; every flag computed on the device, read in one sync."""
        checks = (("q", cu_seqlens_q, q.shape[0], max_seqlen_q), ("k", cu_seqlens_k, k.shape[0], max_seqlen_k))
        flags = []
        for _, cu, total, longest in checks:
            lengths = cu[1:] - cu[:-1]
            flags += [(cu[0] != 0) | (cu[-1] != total) | (lengths < 0).any(), (lengths > longest).any()]
        bad = torch.stack(flags).tolist()
        for n, (name, cu, total, longest) in enumerate(checks):
            if bad[2 * n]:
                shown = cu.tolist()
                shown = shown if len(shown) <= 8 else [*shown[:4], "...", *shown[-3:]]
                self._fail(f"cu_seqlens_{name} must rise from 0 to TOTAL = {total} ({name}.shape[0]) without decreasing, "
                      f"got {shown}")
            if bad[2 * n + 1]:
                self._fail(f"max_seqlen_{name} must be at least every sequence's length, got {longest} for a sequence of "
                      f"{int((cu[1:] - cu[:-1]).max())}")
