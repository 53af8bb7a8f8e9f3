"""The attention object a generated module declares: its spec's facts and kernels behind attn(q, k, v, ...)."""

import torch

from ..families.portable.runtime import Portable
from .ahead import compile_ahead
from .arguments import _call_sizes, _sizes
from .checks import Checks, _autocast
from .dispatch import Dispatch
from .dropout import Dropout
from .fp8 import Fp8
from .facts import Kernels, SpecFacts
from .families import family
from .kvcache import Cache
from .launching import LaunchArguments
from .operators import Operators, _Attention
from .packed import Packed, _is_packed
from .plans import CallPlans
from .shared import _cdiv, _packed_view, _token_sequences
from .sinks import sink_rows, sink_view, whole_load
from .tables import Tables


class Attention(CallPlans, Dispatch, Operators, Packed, Cache, Fp8, Tables, Dropout, LaunchArguments, Portable, Checks):
    """One spec's attention: attn(q, k, v, ...) and its companions (tile_tables, forward_family,
    backward_family, visit_counts, dropout_mask) over the kernels a generated module hands over.

    `facts` are the spec's facts (SpecFacts), `kernels` its portable kernels (Kernels), `families` the
    kernels of each family beside the portable one that its plan names, by family name
    (runtime.families). The host code is split by job over the mixins above; each reads the spec only
    through self.facts, self.kernels and the families, so one process holds any number of specs.
    """

    def __init__(self, facts: SpecFacts, kernels: Kernels, families: dict | None = None):
        self.facts, self.kernels = facts, kernels
        self.families = {name: family(name, self, given) for name, given in (families or {}).items()}
        # The families whose forward a call may run, in order of preference: (name, per-call rule, launch);
        # a call none of them admits runs the portable forward.
        self.forward_families = tuple((name, self.families[name].serves, self.families[name].forward)
                                      for name in facts.forward_families)
        # Likewise for the backward: (family, its backward's name, which keys its tiles and its tile table,
        # per-call rule, launch). Each follows tile tables of its own tiles.
        self.backward_families = tuple((name, key, self.families[name].backward_serves, self.families[name].backward)
                                       for name, key in facts.backward_families)
        # Call plans by the facts of a call (plans.py); past call_plan_keys they are dropped and start over,
        # as launch._LAUNCHES's keys are.
        self.call_plans, self.call_plan_keys = {}, 256
        self.table_stats = {"built": 0}  # instrumentation: tables built, so tests can tell passed tables are reused
        self.static_tables = {}  # a mask's tables that depend on no input, kept once built (tables.py)
        # A sink that is one input at (b, h) (`sinks[h]`): its rows are that input viewed, with no evaluation.
        self.sink_load = whole_load(facts.sink, facts.inputs) if facts.sink is not None else None
        self.operators = self._operators()

    def __repr__(self):
        return f"Attention({self.facts.name}, families={list(self.families)})"

    def attn(self, q, k, v, *, kv_len=None, q_offset=None, page_table=None, cu_seqlens_q=None, cu_seqlens_k=None,
             max_seqlen_q=None, max_seqlen_k=None, return_lse=False, tile_tables=None, dropout_p=0.0, generator=None,
             deterministic=False, check_values=False, q_descale=None, k_descale=None, v_descale=None, **inputs):
        """This module's attention: softmax over the allowed keys of the modified scores (and the spec's
        sink, if it has one), times V; with `normalize: sigmoid`, sigmoid of each allowed key's score times V.

        Returns out (B, H, Q_LEN, DV) in q's dtype, and with return_lse=True also the natural-log
        LSE (B, H, Q_LEN) in float32 (-inf for a query row with no allowed key; the row's sink with a
        `sink:`; a sigmoid spec has no LSE and refuses return_lse=True). Differentiable in q, k, v and the
        learnable inputs, if any (once: no double backward).
        A cache call: k and v hold a cache of MAX_KV keys per row (B, HKV, MAX_KV, D/DV); kv_len
        ((B,) int32) is each row's number of valid keys, q_offset ((B,) int32) the position of its
        first query (by default kv_len - Q_LEN: the queries are the newest tokens; 0 without kv_len).
        The mask and score see those positions as q and kv_len[b] as KV_LEN. Forward only.
        A paged cache: k and v are pages (NUM_PAGES, PAGE_SIZE, HKV, D/DV), PAGE_SIZE a multiple of 16;
        page_table ((B, MAX_PAGES) int32) maps row b's logical page p to a physical one; kv_len is
        required (at most MAX_PAGES * PAGE_SIZE).
        A cache call's values are checked on the device, with no sync: a batch row whose kv_len lies outside
        [0, MAX_KV], whose query positions lie outside [0, max length), or which uses a page outside
        [0, NUM_PAGES) gets NaN in O and LSE (the kernels clamp such values to the cache, so no memory
        outside it is read). check_values=True checks them on the host before the forward instead and
        raises a ValueError naming them, at the cost of one sync per call whose values changed.
        A packed call (FlashAttention's varlen layout): q (TOTAL_Q, H, D), k and v (TOTAL_K, HKV, D/DV);
        sequence b is tokens cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of q (and likewise of k and v by
        cu_seqlens_k: (B + 1,) int32, from 0 to TOTAL); max_seqlen_q/k (Python ints, at least every sequence's
        length) size the grid. Positions restart at 0 in every sequence, b is its index and Q_LEN/KV_LEN its
        lengths; an input dim declared Q_LEN or KV_LEN is max_seqlen_q or max_seqlen_k long. Returns out
        (TOTAL_Q, H, DV) and LSE (H, TOTAL_Q); differentiable; runs without tile tables.
        tile_tables: from tile_tables(q, k, v, **inputs), to reuse the tables of a mask that reads
        inputs across calls (built for these inputs' current values; by default each call builds its own).
        dropout_p: the probability of dropping each attention weight P after the softmax (LSE keeps them all)
        or the sigmoid; the kept ones are divided by 1 - dropout_p. Applied whenever it is above 0, as by
        scaled_dot_product_attention (pass 0 outside training); not in cache calls. Each call draws two
        Philox words from `generator` (None: the default generator of q's device), so torch.manual_seed
        repeats it; the backward regenerates the same mask. dropout_mask(q, k, v, ...) returns it.
        Works under torch.compile (fullgraph, dynamic shapes, CUDA graphs) through OPERATORS. Under
        torch.autocast, float q, k and v are cast to its dtype first, as for scaled_dot_product_attention.
        An FP8 call: float8_e4m3fn q, k and v, each times its descale factor (q_descale, k_descale, v_descale:
        (B, HKV) float32, FlashAttention-3's layout; None for 1) the attention's q, k or v. Returns out in
        bfloat16; forward only, dense calls only (no cache, packed call or dropout), eager only.
        deterministic=True, or torch.use_deterministic_algorithms(True) at the time of the call: its backward
        gives the same bits every time (the portable family's backward, whose programs each write their dQ, dK
        and dV tiles once, and learnable inputs' gradients summed exactly; the forward always does).
        """
        if return_lse and self.facts.sigmoid:
            self._fail("return_lse=True needs a softmax spec, got one with normalize: sigmoid, which has no LSE (each "
                       "key's weight is sigmoid(score') on its own, with no sum over the row); call without return_lse")
        q, k, v = _autocast(q, k, v)
        inputs = self._reduced(inputs)
        descales = (q_descale, k_descale, v_descale)
        if isinstance(q, torch.Tensor) and q.dtype == torch.float8_e4m3fn:
            if dropout_p or any(t is not None for t in (kv_len, q_offset, page_table, cu_seqlens_q, cu_seqlens_k)):
                self._fail("an FP8 call (float8_e4m3fn q, k and v) is a dense forward: it takes no dropout_p, kv_len, "
                           "q_offset, page_table or cu_seqlens_q/k")
            out, lse = self._fp8_attention(q, k, v, inputs, descales, tile_tables)
            return (out, lse) if return_lse else out
        if any(t is not None for t in descales):
            self._fail("q_descale, k_descale and v_descale are an FP8 call's: q, k and v must be float8_e4m3fn, got "
                       + (str(q.dtype) if isinstance(q, torch.Tensor) else type(q).__name__))
        self._check_dropout(q, dropout_p, generator)
        deterministic = bool(deterministic) or torch.are_deterministic_algorithms_enabled()
        packed = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        if dropout_p and (kv_len is not None or q_offset is not None or page_table is not None):
            self._fail(f"dropout_p must be 0 in a call with kv_len, q_offset or page_table, got {dropout_p}: cache calls "
                       f"are inference, without a backward pass")
        if _is_packed(*packed):
            if kv_len is not None or q_offset is not None or page_table is not None:
                self._fail("kv_len, q_offset and page_table must be None in a packed call (cu_seqlens_q=...): "
                      "packed calls are training and prefill calls, positions restarting at 0 in every sequence")
            if tile_tables is not None:
                self._fail("tile_tables must be None in a packed call (cu_seqlens_q=...): tables are built for a batch of "
                      "equal lengths, and packed calls run without them")
            out, lse = self._packed_attention(q, k, v, inputs, *packed, dropout_p, generator, deterministic=deterministic)
            return (out, lse) if return_lse else out
        if kv_len is not None or q_offset is not None or page_table is not None:
            out, lse = self._cache_attention(q, k, v, inputs, kv_len, q_offset, tile_tables, page_table,
                                             check_values=check_values)
            return (out, lse) if return_lse else out
        if torch.compiler.is_compiling():  # the operators' eager code plans nothing either
            plan, sizes = None, self._check(q, k, v, inputs)
        else:
            plan = self._call_plan(q, k, v, inputs, deterministic, dropout=dropout_p != 0)
            sizes = plan.sizes
        B, H, HKV, Q_LEN, KV_LEN, _, _ = sizes
        self._check_learnable(inputs)
        known = {} if tile_tables is None else self._checked_tables(tile_tables, q, v, (B, H, HKV, Q_LEN, KV_LEN))
        if known:
            plan = None  # the user's tables are tensors the plan's facts do not cover: launches bind by their facts
        tensors = [inputs[name].contiguous() for name in self.facts.inputs]
        sink = self._sink_rows(q, k, inputs)
        dropout = self._dropout(q, dropout_p, generator)
        if torch.compiler.is_compiling():
            out, lse = self._compiled_attention(q, k, v, tensors, known, sink, deterministic, dropout)
            return (out, lse) if return_lse else out
        backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *tensors))
        compile_ahead(self, plan, q, k, v, tensors, sink, dropout, deterministic, backward)
        if backward:
            out, lse = _Attention.apply(self, q, k, v, known, plan, sink, deterministic, dropout, *tensors)
        else:  # nothing to differentiate: no autograd node (a tenth of a short call's host time)
            out, lse = self._forward_with_tables(q, k, v, tensors, known, self._builder(_sizes(q, k), q.device, tensors, plan),
                                            plan, sink, dropout)
        return (out, lse) if return_lse else out

    def gradients(self, q, k, v, out, lse, do, dlse=None, *, deterministic=False, **inputs):
        """The backward kernels of a training call of these q, k, v and inputs, given `out` and `lse` and the
        upstream gradients `do` (and `dlse`, None for none): (dq, dk, dv, {name: gradient} of each learnable
        input), in q's, k's, v's and each input's dtype; eager only, nothing differentiable.

        `out` (B, H, Q_LEN, DV) and `lse` (B, H, Q_LEN) float32 need not be this call's: the kernels
        recompute P = exp(score' - lse) and read delta = rowsum(dO * out) - dLSE, so given the output and LSE
        of an attention over more keys than k holds (this call's keys one part of them, the parts' results
        merged by their LSE: context-parallel shards, cascade attention) they return this part's share of
        that attention's gradients, and the shares of the parts add up to them. A spec with a sink counts
        its sink in `lse` and gets its gradient here (-exp(sink - lse) * delta per row). Reductions of inputs
        (`sum(x[b, :])`) pass their gradients on to the inputs they reduce. A sigmoid spec has no LSE: `lse`
        is None there (each key's weight is its own, so the parts' gradients add up as they are).
        `deterministic` (or torch.use_deterministic_algorithms(True)): the same bits every run, as for attn."""
        self._check_tensors(q, k, v)
        deterministic = bool(deterministic) or torch.are_deterministic_algorithms_enabled()
        if (lse is None) != self.facts.sigmoid:
            self._fail("lse must be None for a spec with normalize: sigmoid, which has no LSE, and given for a softmax "
                       f"spec, got {'None' if lse is None else 'a tensor'}")
        learnable = [name for name, (_, _, is_learnable) in self.facts.inputs.items() if is_learnable]
        # Learnable inputs read through a reduction or a sink get their gradient by autograd through the torch
        # code that computes those from them: leaves here, detached from any graph of the caller's.
        leaves = {name: t.detach().requires_grad_() for name, t in inputs.items()
                  if name in learnable and isinstance(t, torch.Tensor) and t.is_floating_point()}
        with torch.enable_grad():
            reduced = self._reduced({**inputs, **leaves})
            plan = self._call_plan(q, k, v, reduced, deterministic)
            B, H, _, Q_LEN, _, _, DV = plan.sizes
            for name, t, shape in (("out", out, (B, H, Q_LEN, DV)), ("do", do, (B, H, Q_LEN, DV)),
                                   ("lse", lse, (B, H, Q_LEN)), ("dlse", dlse, (B, H, Q_LEN))):
                if name in ("lse", "dlse") and t is None:
                    continue
                if not (isinstance(t, torch.Tensor) and tuple(t.shape) == shape and t.device == q.device
                        and t.is_floating_point()):
                    self._fail(f"{name} must be a float tensor of shape {shape} on {q.device}, got "
                               + (f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor)
                                  else type(t).__name__))
            if out.dtype != q.dtype or (lse is not None and lse.dtype != torch.float32):
                self._fail(f"out must have q's dtype {q.dtype} and lse float32, got {out.dtype} and "
                           f"{lse.dtype if lse is not None else None}")
            sink = self._sink_rows(q, k, reduced)
        tensors = [reduced[name].detach().contiguous() for name in self.facts.inputs]
        # The kernels read LSE as a dense (B, H, Q_LEN) array (a slice of a longer one is not), dO in q's dtype; a
        # sigmoid spec's kernels read none, and a placeholder stands in for it.
        out, do = out.detach(), do.detach().to(q.dtype)
        lse = lse.detach().contiguous() if lse is not None else out.new_empty((B, H, Q_LEN), dtype=torch.float32)
        dlse = dlse.detach().float() if dlse is not None else None
        wanted_sink = sink.detach() if sink is not None and sink.requires_grad else None
        dq, dk, dv, kernel_grads, dsink = self._backward_with_tables(
            q.detach(), k.detach(), v.detach(), out, lse, do, dlse, tensors, {},
            self._builder(_sizes(q, k), q.device, tensors, plan), plan, deterministic, wanted_sink)
        grads = {name: g for name, g in zip(self.facts.inputs, kernel_grads) if g is not None}
        # What reaches the user's inputs through torch code: the reductions' values and the sink rows.
        through = [(reduced[name], grads.pop(name)) for name, *_ in self.facts.reductions
                   if name in grads and reduced[name].requires_grad]
        if wanted_sink is not None:
            through.append((sink, dsink))
        result = {name: grads.get(name) for name in learnable if name in inputs}
        if through and leaves:
            chained = torch.autograd.grad([t for t, _ in through], list(leaves.values()), [g for _, g in through],
                                          allow_unused=True)
            for (name, leaf), g in zip(leaves.items(), chained):
                if g is not None:
                    result[name] = g if result.get(name) is None else result[name] + g.to(result[name].dtype)
        result = {name: (g if g is not None else torch.zeros_like(inputs[name])).to(inputs[name].dtype)
                  for name, g in result.items()}
        return dq, dk, dv, result

    def _sink_rows(self, q, k, inputs, cache=None, packed=None):
        """The sink of every query row of a checked call, which the forward kernels start each row's softmax
        at: (B, H, Q_LEN) fp32, or a packed call's (H, TOTAL_Q), in any strides (a `sinks[h]` is its input
        viewed: sinks.whole_load); None for a spec without a sink. Computed by torch from the inputs, so
        autograd carries its gradient (the kernels' autograd nodes return it) into the learnable ones.
        `cache`: a cache call's (kv_len, q_offset, whether its cache is paged); `packed`: a packed call's
        (cu_seqlens_q, cu_seqlens_k, ...)."""
        if self.facts.sink is None:
            return None
        if self.sink_load is not None:
            name, names = self.sink_load
            if packed is None:
                return sink_view(inputs[name], names, q.shape[0], q.shape[1], q.shape[2])
            if names == ("h",):
                return sink_view(inputs[name], names, 1, q.shape[1], q.shape[0])[0]
        inputs = {name: inputs[name] for name in self.facts.inputs}
        if packed is not None:
            cu_seqlens_q, cu_seqlens_k = packed[0].long(), packed[1].long()
            b, tokens = _token_sequences(cu_seqlens_q, q.shape[0])
            lengths_q, lengths_k = cu_seqlens_q.diff(), cu_seqlens_k.diff()
            return sink_rows(self.facts.sink, inputs, B=cu_seqlens_q.shape[0] - 1, H=q.shape[1], HKV=k.shape[1],
                             Q_LEN=lengths_q[b], KV_LEN=lengths_k[b], D=q.shape[-1], device=q.device,
                             b=b, q=tokens - cu_seqlens_q[b])
        B, H, Q_LEN, D = q.shape
        kv_len, q_offset, paged = cache if cache is not None else (None, None, False)
        if kv_len is not None and q_offset is None:
            q_offset = kv_len.long() - Q_LEN
        # A paged cache's k is (NUM_PAGES, PAGE_SIZE, HKV, D); it always has kv_len, which gives KV_LEN.
        HKV = k.shape[2] if paged else k.shape[1]
        return sink_rows(self.facts.sink, inputs, B=B, H=H, HKV=HKV, Q_LEN=Q_LEN, KV_LEN=k.shape[2], D=D,
                         device=q.device, q_offset=q_offset, kv_len=kv_len)

    def visit_counts(self, q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, **inputs):
        """Instrumentation: which tiles each kernel visits, from one forward and backward pass run with
        counters. Returns {"fwd": (B, H, query tiles, key tiles), "dq": the same for dQ's tiles,
        "dkdv": (B, H, key tiles, query tiles)} int32 tensors, one entry per tile: 0 skipped,
        1 visited with mask code, 16 visited without; any other value would be a repeated visit.
        A packed call's: B is its number of sequences, its tiles those of max_seqlen_q/k, counted from each
        sequence's first token."""
        q, k, v = _autocast(q, k, v)
        inputs = self._reduced(inputs)
        packed = None
        if _is_packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
            self._check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, inputs)
            self._check_packed_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
            packed = (cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), max_seqlen_q, max_seqlen_k, q.shape[0])
            sink = self._sink_rows(q, k, inputs, packed=packed)
            q, k, v = map(_packed_view, (q, k, v))
        else:
            self._check(q, k, v, inputs)
            sink = self._sink_rows(q, k, inputs)
        tensors = [inputs[name].contiguous() for name in self.facts.inputs]
        B, H, _, Q_LEN, KV_LEN = _call_sizes(q, k, packed)

        def counters(kernel, by_query):
            block_m, block_n = self._tiles(q, v, kernel)[:2]
            n_q, n_k = _cdiv(Q_LEN, block_m), _cdiv(KV_LEN, block_n)
            shape = (B, H, n_q, n_k) if by_query else (B, H, n_k, n_q)
            return torch.zeros(shape, dtype=torch.int32, device=q.device)

        counts = {"fwd": counters(0, True), "dkdv": counters(1, False), "dq": counters(2, True)}
        tables = self._resolve(range(3), q, v, {}, self._builder(_sizes(q, k), q.device, tensors)) if packed is None else [()] * 3
        with torch.no_grad():
            out, lse = self._portable_forward(q, k, v, tensors, tables[0], visits=counts["fwd"], packed=packed, sink=sink)
            self._portable_backward(q, k, v, out, lse, torch.ones_like(out), None, tensors, tables[1:],
                               visits={"dkdv": counts["dkdv"], "dq": counts["dq"]}, packed=packed)
        return counts
