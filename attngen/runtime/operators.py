"""Autograd and torch.compile: the eager autograd node and the torch.library custom operators of a spec's kernels."""

import torch

from .plans import _backward_plan
from .arguments import _sizes
from .shared import _empty_in_layout, _packed_view, _unpacked
from .tables import _pairs


def _dropout(rng, dropout_p):
    """An operator's dropout operands (Dropout._dropout_operands) as the launches take them: (words, dropout_p),
    or None without dropout."""
    return (rng[0], dropout_p) if rng else None


def _dropout_keywords(dropout):
    """A family launch's keywords for a call's dropout: {"dropout": it} for a call with dropout, which only a
    family whose entry has `dropout` is given (the dispatch passes such calls on), else none, so a family
    without dropout never sees the keyword."""
    return {} if dropout is None else {"dropout": dropout}


class _Attention(torch.autograd.Function):
    """Eager calls: the kernels behind one autograd node, reached without the dispatcher."""

    @staticmethod
    def forward(ctx, rt, q, k, v, known, plan, sink, deterministic, dropout, *tensors):
        # rt: the Attention whose call this is (its kernels, tables and families); sink: its sink of every
        # row (_sink_rows), None without one; deterministic: whether its backward must give the same bits
        # every time (the plan was made for it); dropout: its (Philox words, dropout_p), None without, which
        # the backward regenerates the mask from
        ctx.set_materialize_grads(False)  # an unused LSE gets no gradient pass of its own
        ctx.rt, ctx.plan, ctx.deterministic, ctx.dropout = rt, plan, deterministic, dropout
        ctx.build = rt._builder(_sizes(q, k), q.device, tensors, plan)
        out, lse = rt._forward_with_tables(q, k, v, tensors, known, ctx.build, plan, sink, dropout)
        ctx.save_for_backward(q, k, v, out, lse, sink, *tensors)
        ctx.known = known  # the user's tables, or the forward's, which serves dQ when their tiles agree
        return out, lse

    @staticmethod
    def backward(ctx, do, dlse):
        ctx.rt._no_double_backward()
        q, k, v, out, lse, sink, *tensors = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(out)
        # The sink rows' gradient comes from the backward's own row terms' pass (one pass over O and dO).
        dq, dk, dv, input_grads, dsink = ctx.rt._backward_with_tables(
            q, k, v, out, lse, do, dlse, tensors, ctx.known, ctx.build, ctx.plan, ctx.deterministic,
            sink if ctx.needs_input_grad[6] else None, ctx.dropout)
        return (None, dq, dk, dv, None, None, dsink, None, None, *input_grads)


class _PackedAttention(torch.autograd.Function):
    """Eager packed calls: the packed kernels behind one autograd node, without the dispatcher (on the
    CPU, 169 against 40 us of host time a forward of 16 sequences of 64 through the custom operator,
    against a dense call of the same tokens)."""

    @staticmethod
    def forward(ctx, rt, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, plan, sink, deterministic,
                dropout, *tensors):
        # plan: the call's _CallPlan (packed.py's _packed_plan); sink, deterministic and dropout: as _Attention's
        ctx.rt, ctx.max_seqlens, ctx.plan = rt, (max_seqlen_q, max_seqlen_k), plan
        ctx.deterministic, ctx.dropout = deterministic, dropout
        out, lse = rt._packed_forward(q, k, v, list(tensors), cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      sink, plan, dropout)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, sink, *tensors)
        return out, lse

    @staticmethod
    def backward(ctx, do, dlse):
        ctx.rt._no_double_backward()
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, sink, *tensors = ctx.saved_tensors
        dq, dk, dv, input_grads, dsink = ctx.rt._packed_backward(
            q, k, v, out, lse, do, dlse, tensors, cu_seqlens_q, cu_seqlens_k, *ctx.max_seqlens,
            _backward_plan(ctx.plan, do, dlse), ctx.deterministic, sink if ctx.needs_input_grad[9] else None,
            ctx.dropout)
        return (None, dq, dk, dv, None, None, None, None, None, dsink, None, None, *input_grads)


# Under torch.compile the kernels run as opaque custom operators (torch.library.custom_op: table,
# forward, backward, the forward of cache calls, which has no backward, and a packed call's forward and
# backward) with fake implementations that give shapes, and an autograd
# formula that calls the backward operator, so a compiled model has no graph break and dynamic lengths
# need no recompile. The host code is the same Python as in eager; eager calls skip the dispatcher,
# which costs more per call than the autograd.Function above (a forward of B1 H8 N128 D64 on an H200:
# 100.7 against 97.9 us of host time, benchmarks/compile_check.py).
# The names carry the digest of the generated module's code (SpecFacts.digest): an identical module
# imported again in this process reuses the operators, any other module gets its own.
class Operators:
    """The custom operators of an Attention (a mixin: self is the Attention; self.operators holds them)."""

    # A backward operator returns the learnable inputs' gradients alone (an operator's list output holds
    # tensors, not None), in the order of INPUTS.
    def _learnable_grads_like(self, tensors):
        """The fakes' learnable-input gradients: one shaped like each learnable input."""
        return [t.new_empty(t.shape) for (_, (_, _, learnable)), t in zip(self.facts.inputs.items(), tensors) if learnable]

    def _per_input(self, grads):
        """A backward operator's learnable gradients spread over INPUTS: None for an input that is not learnable."""
        grads = iter(grads)
        return [next(grads) if learnable else None for (_, (_, _, learnable)) in self.facts.inputs.items()]

    def _define_operators(self, table_name, forward_name, backward_name, cache_name, packed_name, packed_backward_name,
                          sink_grad_name=None):
        @torch.library.custom_op(f"attngen::{table_name}", mutates_args=())
        def table_op(q: torch.Tensor, k: torch.Tensor, tensors: list[torch.Tensor], by_query: bool,
                     block_m: int, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
            # A fresh table, never a kept one (keep=False builds it anew): a compiled graph owns an operator's
            # outputs and may reuse their memory once they are dead.
            return self._build_table((by_query, block_m, block_n), _sizes(q, k), q.device, tensors, keep=False)

        @table_op.register_fake
        def _(q, k, tensors, by_query, block_m, block_n):
            return self._empty_table((by_query, block_m, block_n), _sizes(q, k), q.device)

        if sink_grad_name is not None:
            # The gradient of a spec's sink rows, -exp(sink - LSE) * (rowsum(dO * O) - dLSE), by the row-terms
            # kernel that eager calls run too, so a compiled call's gradients equal an eager one's. `out` and
            # `do` are (B, H, Q_LEN, DV) (a packed call's (1, H, TOTAL_Q, DV) views), `lse` and `sink` dense alike.
            @torch.library.custom_op(f"attngen::{sink_grad_name}", mutates_args=())
            def sink_grad_op(out: torch.Tensor, do: torch.Tensor, dlse: list[torch.Tensor], lse: torch.Tensor,
                             sink: torch.Tensor) -> torch.Tensor:
                return self._row_terms(out, do, dlse[0] if dlse else None, sink=(sink, lse))[2]

            @sink_grad_op.register_fake
            def _(out, do, dlse, lse, sink):
                return torch.empty_like(sink)

        # `sink` (here and in the cache and packed forwards): [] or [the sink of every row] (_sink_rows), whose
        # gradient the autograd formulas take from sink_grad_op, beside the backward operators. `rng` and
        # `dropout_p` (here, in the packed forward and in both backwards): a call with dropout's [Philox words]
        # (drawn in the traced graph, so they are never constants of it: Dropout._dropout) and its p, or [] and 0.
        # `deterministic` (here, in the packed forward and in both backwards, last): whether the backward must
        # give the same bits every time, which the autograd formulas pass on to the backward operators.
        @torch.library.custom_op(f"attngen::{forward_name}", mutates_args=())
        def forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tensors: list[torch.Tensor],
                       tables: list[torch.Tensor], sink: list[torch.Tensor], rng: list[torch.Tensor], dropout_p: float,
                       deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
            # The user's tables, if any, else the table of the family that runs, built here (at run time,
            # where the family is known without guarding the compiled graph on the shapes).
            known = dict(zip(self._table_kernels(True), _pairs(tables)))
            return self._forward_with_tables(q, k, v, tensors, known,
                                             self._builder(_sizes(q, k), q.device, tensors, store=False),
                                             sink=sink[0] if sink else None, dropout=_dropout(rng, dropout_p))

        # The fakes allocate by the rule every family's launch follows (_empty_in_layout), so the strides
        # torch.compile plans with are the ones the kernels write.
        @forward_op.register_fake
        def _(q, k, v, tensors, tables, sink, rng, dropout_p, deterministic=False):
            B, H, Q_LEN, _ = q.shape
            return _empty_in_layout(q, v.shape[3]), q.new_empty((B, H, Q_LEN), dtype=torch.float32)

        @torch.library.custom_op(f"attngen::{backward_name}", mutates_args=())
        def backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                        do: torch.Tensor, dlse: torch.Tensor, tensors: list[torch.Tensor], tables: list[torch.Tensor],
                        rng: list[torch.Tensor], dropout_p: float, deterministic: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
            # The user's tables, if any, else those of the family that runs, built here (as the forward does).
            known = dict(zip(self._table_kernels(True), _pairs(tables)))
            dq, dk, dv, input_grads, _ = self._backward_with_tables(q, k, v, out, lse, do, dlse, tensors, known,
                                                                 self._builder(_sizes(q, k), q.device, tensors,
                                                                               store=False),
                                                                 deterministic=deterministic,
                                                                 dropout=_dropout(rng, dropout_p))
            return dq, dk, dv, [g for g in input_grads if g is not None]

        @backward_op.register_fake
        def _(q, k, v, out, lse, do, dlse, tensors, tables, rng, dropout_p, deterministic=False):
            return (_empty_in_layout(q, q.shape[3]), _empty_in_layout(k, k.shape[3]), _empty_in_layout(v, v.shape[3]),
                    self._learnable_grads_like(tensors))

        # The dispatcher drops an argument equal to its default (deterministic=False) from the autograd node's
        # inputs, and setup_context sees it filled back in: the gradients returned cover it only when True.
        def setup_context(ctx, inputs, output):
            q, k, v, tensors, tables, sink, rng, dropout_p, deterministic = inputs
            ctx.save_for_backward(q, k, v, *output, *sink, *rng, *tensors, *tables)
            ctx.counts, ctx.dropout_p = (len(sink), len(rng), len(tensors), len(tables)), dropout_p
            ctx.deterministic = deterministic

        def backward(ctx, do, dlse):
            self._no_double_backward()
            q, k, v, out, lse, *rest = ctx.saved_tensors
            n_sink, n_rng, n_tensors, n_tables = ctx.counts
            sink, rng, rest = rest[:n_sink], rest[n_sink:n_sink + n_rng], rest[n_sink + n_rng:]
            tensors, flat = rest[:n_tensors], rest[n_tensors:]
            dq, dk, dv, grads = backward_op(q, k, v, out, lse, do, dlse, list(tensors), list(flat), list(rng),
                                            ctx.dropout_p, ctx.deterministic)
            grads = (dq, dk, dv, self._per_input(grads), [None] * n_tables,
                     [sink_grad_op(out, do, [dlse] if dlse is not None else [], lse, s) for s in sink], [None] * n_rng,
                     None)
            return (*grads, None) if ctx.deterministic else grads

        forward_op.register_autograd(backward, setup_context=setup_context)

        @torch.library.custom_op(f"attngen::{cache_name}", mutates_args=())
        def cache_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tensors: list[torch.Tensor],
                     kv_len: list[torch.Tensor], q_offset: list[torch.Tensor], pages: list[torch.Tensor],
                     sink: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
            # kv_len, q_offset, pages: [] or [one tensor] (lists: optional tensors in the operator's schema)
            return self._cache_forward(q, k, v, tensors, kv_len[0] if kv_len else None, q_offset[0] if q_offset else None,
                                       pages, sink[0] if sink else None)

        @cache_op.register_fake
        def _(q, k, v, tensors, kv_len, q_offset, pages, sink):
            B, H, Q_LEN, _ = q.shape
            return _empty_in_layout(q, v.shape[-1]), q.new_empty((B, H, Q_LEN), dtype=torch.float32)

        # Compiled packed calls run these two (eager ones _PackedAttention): q, k, v, O and the gradients are (TOTAL, heads, D),
        # LSE (H, TOTAL_Q); max_seqlen_q/k size the grid.
        @torch.library.custom_op(f"attngen::{packed_name}", mutates_args=())
        def packed_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tensors: list[torch.Tensor],
                      cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                      sink: list[torch.Tensor], rng: list[torch.Tensor], dropout_p: float, deterministic: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor]:
            return self._packed_forward(q, k, v, tensors, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                        sink[0] if sink else None, dropout=_dropout(rng, dropout_p))

        @packed_op.register_fake
        def _(q, k, v, tensors, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sink, rng, dropout_p,
              deterministic=False):
            return (_unpacked(_empty_in_layout(_packed_view(q), v.shape[-1])),
                    q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32))

        @torch.library.custom_op(f"attngen::{packed_backward_name}", mutates_args=())
        def packed_backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                               do: torch.Tensor, dlse: torch.Tensor, tensors: list[torch.Tensor],
                               cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                               max_seqlen_k: int, rng: list[torch.Tensor], dropout_p: float, deterministic: bool = False
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
            dq, dk, dv, input_grads, _ = self._packed_backward(q, k, v, out, lse, do, dlse, tensors, cu_seqlens_q,
                                                            cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                            deterministic=deterministic,
                                                            dropout=_dropout(rng, dropout_p))
            return dq, dk, dv, [g for g in input_grads if g is not None]

        @packed_backward_op.register_fake
        def _(q, k, v, out, lse, do, dlse, tensors, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, rng,
              dropout_p, deterministic=False):
            return (*(_unpacked(_empty_in_layout(_packed_view(t), t.shape[-1])) for t in (q, k, v)),
                    self._learnable_grads_like(tensors))

        def packed_setup_context(ctx, inputs, output):  # `deterministic` as for setup_context
            (q, k, v, tensors, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sink, rng, dropout_p,
             deterministic) = inputs
            ctx.save_for_backward(q, k, v, *output, cu_seqlens_q, cu_seqlens_k, *sink, *rng, *tensors)
            ctx.max_seqlens, ctx.n_sink, ctx.n_rng = (max_seqlen_q, max_seqlen_k), len(sink), len(rng)
            ctx.dropout_p, ctx.deterministic = dropout_p, deterministic

        def packed_backward(ctx, do, dlse):
            self._no_double_backward()
            q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *rest = ctx.saved_tensors
            sink, rng, tensors = rest[:ctx.n_sink], rest[ctx.n_sink:ctx.n_sink + ctx.n_rng], rest[ctx.n_sink + ctx.n_rng:]
            dq, dk, dv, grads = packed_backward_op(q, k, v, out, lse, do, dlse, list(tensors), cu_seqlens_q,
                                                   cu_seqlens_k, *ctx.max_seqlens, list(rng), ctx.dropout_p,
                                                   ctx.deterministic)
            grads = (dq, dk, dv, self._per_input(grads), None, None, None, None,
                     [sink_grad_op(_packed_view(out), _packed_view(do), [dlse[None]] if dlse is not None else [], lse, s)
                      for s in sink], [None] * ctx.n_rng, None)
            return (*grads, None) if ctx.deterministic else grads

        packed_op.register_autograd(packed_backward, setup_context=packed_setup_context)

    def _packed_forward(self, q, k, v, tensors, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sink,
                        plan=None, dropout=None):
        """A checked packed call's (out (TOTAL_Q, H, DV), LSE (H, TOTAL_Q)), by the family that serves it;
        `sink` as for _forward, (H, TOTAL_Q); `plan` the call's _CallPlan, which has the family and binds the
        launches (None under torch.compile); `dropout` as for _forward."""
        packed = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q.shape[0])
        q, k, v = map(_packed_view, (q, k, v))
        _, launch = plan.family if plan is not None else self._forward_family(q, k, v, k.shape[1], k.shape[2], False,
                                                                              packed=True, dropout=dropout is not None)
        if launch is not None:
            out, lse = launch(q, k, v, tensors, (), packed=packed, plan=plan, sink=sink, **_dropout_keywords(dropout))
        else:
            out, lse = self._portable_forward(q, k, v, tensors, (), packed=packed, plan=plan, sink=sink, dropout=dropout)
        return _unpacked(out), lse[0]

    def _packed_backward(self, q, k, v, out, lse, do, dlse, tensors, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                         max_seqlen_k, plan=None, deterministic=False, sink=None, dropout=None):
        """A packed call's (dq, dk, dv, one gradient per input, None where not learnable, the sink rows'
        gradient), in the packed layout; `plan` the backward's (_backward_plan), or None; `deterministic`,
        `sink` (the (H, TOTAL_Q) rows) and `dropout` (the forward's) as for _backward_with_tables."""
        packed = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q.shape[0])
        q, k, v, out, do = map(_packed_view, (q, k, v, out, do))
        _, _, launch = plan.backward_family if plan is not None else self._backward_family(
            q, k, v, packed=True, deterministic=deterministic, dropout=dropout is not None)
        if launch is not None:
            dq, dk, dv, input_grads, dsink = launch(q, k, v, out, lse[None], do, dlse[None], tensors, (), packed=packed,
                                                    plan=plan, deterministic=deterministic, sink=sink,
                                                    **_dropout_keywords(dropout))
        else:
            dq, dk, dv, input_grads, dsink = self._portable_backward(q, k, v, out, lse[None], do, dlse[None], tensors,
                                                                     ((), ()), packed=packed, plan=plan,
                                                                     deterministic=deterministic, sink=sink,
                                                                     dropout=dropout)
        return _unpacked(dq), _unpacked(dk), _unpacked(dv), input_grads, dsink

    def _operators(self):
        """The (table, forward, backward, cache forward, packed forward, packed backward) custom operators of
        this module's kernels, and a spec with a sink's seventh, its sink rows' gradient."""
        parts = ("table", "forward", "backward", "cache", "packed", "packed_backward",
                 *(("sink_grad",) if self.facts.sink is not None else ()))
        names = [f"{self.facts.name}_{self.facts.digest}_{part}" for part in parts]
        if not all(hasattr(torch.ops.attngen, name) for name in names):
            self._define_operators(*names)
        return tuple(getattr(torch.ops.attngen, name).default for name in names)

    def _operator_builder(self, q, k, tensors):
        """build(key) for _resolve under torch.compile: the table operator."""
        return lambda key: tuple(self.operators[0](q, k, list(tensors), *key)) if self.facts.tile_table else ()

    def _compiled_attention(self, q, k, v, tensors, known, sink, deterministic=False, dropout=None):
        # The user's tables travel whole (the backward follows them too); else none: the forward operator
        # picks the family at run time and builds its table (asking which here would guard the graph on the
        # shapes, a recompile where dynamic lengths cross a family's rule), and the backward builds its own.
        tables = self._resolve(self._table_kernels(True), q, v, known, self._operator_builder(q, k, tensors)) if known else []
        return self.operators[1](q, k, v, tensors, [t for table in tables for t in table],
                                 [sink] if sink is not None else [], *self._dropout_operands(dropout), deterministic)
