"""Family dispatch: which family's forward and backward a call runs, with the tile tables that family follows."""

import torch

from .checks import _autocast
from .operators import _dropout_keywords
from .packed import _is_packed
from .plans import _backward_plan
from .arguments import _kv_layout
from .shared import _packed_view


class Dispatch:
    """The family dispatch of an Attention (a mixin)."""

    def _forward(self, q, k, v, tensors, tables, visits=None, cache=None, page_table=None, family=None, plan=None,
                 sink=None, dropout=None, fp8=None):
        """Runs the forward pass with the first family whose per-call rule admits this call
        (FORWARD_FAMILIES, in the plan's order), else the portable one; `tables` holds the tile tables
        (counts, indices) at hand by kernel (_table_kernels), and the family follows its own, if there;
        `cache` is a cache call's (kv_len, q_offset), either None; `page_table` a paged cache's;
        `family` the call's (name, launch) when the caller has it already (_forward_family); `plan` the
        call's _CallPlan, which binds the launches (never with visits, a cache or the user's tables); `sink`
        the sink of every query row of a spec with one (_sink_rows), which every family's forward folds into
        its softmax; `dropout` a call's (Philox words, dropout_p) (Dropout._dropout), None without dropout, which
        only the families of DROPOUT_FAMILIES and the portable one take; `fp8` an FP8 call's descale factors
        (Fp8._fp8_attention), which likewise only FP8_FAMILIES and the portable one take. Counting visits
        (visit_counts) follows the portable tiles."""
        cached = cache is not None or page_table is not None
        if visits is not None:
            family = ("portable", None)
        elif family is None:
            family = self._forward_family(q, k, v, *_kv_layout(k, v, page_table)[:2], cached,
                                          dropout=dropout is not None, fp8=fp8 is not None)
        name, launch = family
        if launch is not None:
            # A family never sees a keyword its entry does not declare (the dispatch passes such calls on).
            return launch(q, k, v, tensors, tables.get(name, ()), cache, page_table, plan=plan, sink=sink,
                          **_dropout_keywords(dropout), **({} if fp8 is None else {"fp8": fp8}))
        return self._portable_forward(q, k, v, tensors, tables.get(0, ()), visits, cache, page_table, plan=plan, sink=sink,
                                      dropout=dropout, fp8=fp8)

    def _forward_family(self, q, k, v, HKV, KV_LEN, cached, after=None, packed=False, dropout=False, fp8=False):
        """(name, launch) of the first family of FORWARD_FAMILIES (those after the family named `after`,
        if given) whose per-call rule admits a call of these tensors over HKV heads of KV_LEN keys
        (`cached`: a cache call; k holds pages if paged; `packed`: a packed call's (1, heads, TOTAL, D)
        views, which only PACKED_FAMILIES take; `dropout`: a call with dropout, which only DROPOUT_FAMILIES
        take; `fp8`: an FP8 call, which only FP8_FAMILIES take); ("portable", None) when none does."""
        names = [name for name, _, _ in self.forward_families]
        families = self.forward_families[names.index(after) + 1:] if after is not None else self.forward_families
        return next(((name, launch) for name, serves, launch in families
                     if (not packed or name in self.facts.packed_families)
                     and (not dropout or name in self.facts.dropout_families) and (not fp8 or name in self.facts.fp8_families)
                     and serves(q, k, v, HKV, KV_LEN, cached)),
                    ("portable", None))

    def _forward_with_tables(self, q, k, v, tensors, known, build, plan=None, sink=None, dropout=None, fp8=None):
        """A training or inference call's forward (no cache), with the tile table of the family that runs
        it: known[kernel] (the user's) or build(key), which is then known. The family is chosen once: it
        decides which table to build and which kernel follows it; a call's _CallPlan has it, and binds the
        launches. `sink`, `dropout` and `fp8` as for _forward."""
        family = plan.family if plan is not None else self._forward_family(q, k, v, k.shape[1], k.shape[2], False,
                                                                           dropout=dropout is not None,
                                                                           fp8=fp8 is not None)
        kernels = self._forward_tables(family[0])
        return self._forward(q, k, v, tensors, dict(zip(kernels, self._resolve(kernels, q, v, known, build))), family=family,
                        plan=plan, sink=sink, dropout=dropout, fp8=fp8)

    def _forward_tables(self, name):
        """The kernels whose tile tables a forward call run by the family `name` needs built: the portable
        forward's, or a family's own if it follows tables (TABLE_FAMILIES; the others decide such masks
        element by element); none if the mask needs no tables."""
        if not self.facts.tile_table:
            return []
        return [0] if name == "portable" else [name] if name in self.facts.table_families else []

    def _backward_with_tables(self, q, k, v, out, lse, do, dlse, tensors, known, build, plan=None, deterministic=False,
                              sink=None, dropout=None):
        """The backward pass by the first family of BACKWARD_FAMILIES whose rule admits the call, else the
        portable one, with the tile tables it follows: known[kernel] (the user's, or the forward's where the
        tiles agree) or build(key). `plan`: the call's _CallPlan, which has the family and binds the
        launches (made for the same `deterministic`). `deterministic`: the gradients must be the same bits
        from run to run (Attention.attn). `sink`: the spec's sink rows, when their gradient is wanted.
        `dropout`: the forward's (_forward), whose mask the kernels regenerate. Returns dq, dk, dv, one gradient
        per input (None for inputs that are not learnable) and the sink rows' gradient (None without `sink`)."""
        if plan is not None:
            _, name, launch = plan.backward_family
        else:
            _, name, launch = self._backward_family(q, k, v, deterministic=deterministic, dropout=dropout is not None)
        kernels = ([1, 2] if launch is None else [name]) if self.facts.tile_table else []
        tables = dict(zip(kernels, self._resolve(kernels, q, v, known, build)))
        plan = _backward_plan(plan, do, dlse)
        if launch is not None:
            return launch(q, k, v, out, lse, do, dlse, tensors, tables.get(name, ()), plan=plan,
                          deterministic=deterministic, sink=sink, **_dropout_keywords(dropout))
        return self._portable_backward(q, k, v, out, lse, do, dlse, tensors, (tables.get(1, ()), tables.get(2, ())),
                                       plan=plan, deterministic=deterministic, sink=sink, dropout=dropout)

    def _backward_family(self, q, k, v, packed=False, deterministic=False, dropout=False):
        """(family, backward name, launch) of the first family of BACKWARD_FAMILIES whose rule admits a call
        of these tensors (`packed`: a packed call's views, which only PACKED_BACKWARD_FAMILIES take;
        `deterministic`: a backward whose gradients must be the same bits from run to run; `dropout`: the
        backward of a call with dropout, which only DROPOUT_FAMILIES take); ("portable", "portable", None)
        when none does."""
        return next(((family, name, launch) for family, name, serves, launch in self.backward_families
                     if (not packed or family in self.facts.packed_backward_families)
                     and (not dropout or family in self.facts.dropout_families) and serves(q, k, v, deterministic)),
                    ("portable", "portable", None))

    def forward_family(self, q, k, v, *, kv_len=None, q_offset=None, page_table=None, cu_seqlens_q=None, cu_seqlens_k=None,
                       max_seqlen_q=None, max_seqlen_k=None, dropout_p=0.0, **inputs):
        """The kernel family whose forward kernel a call with these arguments runs ("portable", or a
        family of FORWARD_FAMILIES whose per-call rule admits it; `attngen explain` gives the rules).
        The rules read the call's shapes: kv_len's and q_offset's values do not change the choice.
        A packed call (cu_seqlens_q=...) runs a family of PACKED_FAMILIES that admits its (1, heads, TOTAL,
        D) views, else the portable one; a call with dropout_p > 0 one of DROPOUT_FAMILIES; an FP8 call (float8_e4m3fn
        q, k and v: a dense forward) one of FP8_FAMILIES."""
        if isinstance(q, torch.Tensor) and q.dtype == torch.float8_e4m3fn:
            self._check(q, k, v, self._reduced(inputs), fp8=True)
            return self._forward_family(q, k, v, k.shape[1], k.shape[2], False, fp8=True)[0]
        q, k, v = _autocast(q, k, v)
        inputs = self._reduced(inputs)
        self._check_dropout(q, dropout_p, None)
        dropout = dropout_p != 0
        if _is_packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
            self._check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, inputs)
            q, k, v = map(_packed_view, (q, k, v))
            return self._forward_family(q, k, v, k.shape[1], k.shape[2], False, packed=True, dropout=dropout)[0]
        if page_table is not None:
            self._check_paged(q, k, v, page_table, kv_len, inputs)
        else:
            self._check(q, k, v, inputs)
        cached = kv_len is not None or q_offset is not None or page_table is not None
        return self._forward_family(q, k, v, *_kv_layout(k, v, page_table)[:2], cached, dropout=dropout)[0]

    def backward_family(self, q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                        deterministic=False, **inputs):
        """The kernel family whose backward kernels a (training) call with these arguments runs: "portable",
        or the family of BACKWARD_FAMILIES whose per-call rule admits it (of PACKED_BACKWARD_FAMILIES for a
        packed call). `deterministic` as for attn (torch.use_deterministic_algorithms(True) sets it too)."""
        q, k, v = _autocast(q, k, v)
        inputs = self._reduced(inputs)
        deterministic = bool(deterministic) or torch.are_deterministic_algorithms_enabled()
        if _is_packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
            self._check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, inputs)
            return self._backward_family(*map(_packed_view, (q, k, v)), packed=True, deterministic=deterministic)[0]
        self._check(q, k, v, inputs)
        return self._backward_family(q, k, v, deterministic=deterministic)[0]
