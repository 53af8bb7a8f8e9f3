"""The portable family's runtime side: its launches (forward, row terms, backward) and the per-call facts
every family's launch reads from the Attention (tiles, widths, inputs' arguments, the sink's rows)."""

import contextlib

import torch

from ...runtime.arguments import (_batch_strides, _cache_launch, _call_sizes, _dot_precision, _kv_layout,
                                  _packed_launch, _side_stream, _sink_strides, _sizes)
from ...runtime.helpers import EXACT_WORDS, LOG2E
from ...runtime.kernels import _exact_finish
from ...runtime.launch import _launch
from ...runtime.plans import _plan_site
from ...runtime.shared import _DTYPES, _cdiv, _empty_in_layout, _pad, _tile_widths


# The most terms an entry of an exact sum takes (helpers._exact_add: each adds below 2**24 to an int64 word).
EXACT_TERMS = 2**39


class Portable:
    """The portable family and the launch arguments of an Attention (a mixin)."""

    def _widths(self, D, DV):
        """Tile widths of the head dims (HEAD_DIM_PAD, HEAD_DIM_V_PAD), as Plan.widths gives them."""
        return _tile_widths(D, DV, self.facts.masked_width_floor)

    def _input_args(self, tensors):
        # Per input: pointer, then one stride and one size per dim (bool is read as bytes).
        args = []
        for name, t in zip(self.facts.inputs, tensors):
            args.append(t.view(torch.uint8) if t.dtype == torch.bool else t)
            args.extend(t.stride())
            args.extend(t.shape)
        return args

    def _tiles(self, q, v, kernel):
        # The head dims pick the tiles and the kernels' constexprs: under torch.compile with dynamic
        # shapes int() makes them static (a guard), as they are for the kernels.
        return self.facts.plan[(*self._widths(int(q.shape[-1]), int(v.shape[-1])), _DTYPES[q.dtype])][kernel]

    def _family_tiles(self, q, v, family):
        """A kernel family's (BLOCK_M, BLOCK_N, num_warps, num_stages, buffers) for these head dims and dtype
        (FAMILY_TILES; int() as in _tiles)."""
        return self.facts.family_tiles[(*self._widths(int(q.shape[-1]), int(v.shape[-1])), _DTYPES[q.dtype])][family]

    def _row_args(self, *rows):
        """A kernel's row-term arguments (the forward's LSE; the backward's LSE and delta) for a softmax spec; a
        sigmoid spec's kernels have no such parameters (emit.signatures.ROW_TERMS), and its calls carry an LSE
        buffer that no kernel writes or reads, only so that every path has one shape."""
        return [] if self.facts.sigmoid else list(rows)

    def _sink_args(self, sink):
        """A forward kernel's sink arguments: a spec with a sink passes the sink of every row (_sink_rows) and
        its strides (_sink_strides); a spec without one has no such parameters (emit.signatures.SINK)."""
        assert (sink is None) == (self.facts.sink is None), "every forward of a spec with a sink takes its rows, no other"
        return [sink, *_sink_strides(sink)] if sink is not None else []

    def _dropout_args(self, dropout, placeholder):
        """A kernel's dropout arguments (signatures.DROPOUT: the call's Philox words and dropout_p) and its
        DROPOUT flag; `dropout` is a call's (words, dropout_p) (Dropout._dropout) or None, when `placeholder`
        stands in for the words (never read)."""
        if dropout is None:
            return [placeholder, 0.0], dict(DROPOUT=False)
        return list(dropout), dict(DROPOUT=True)

    def _portable_forward(self, q, k, v, tensors, table, visits=None, cache=None, page_table=None, plan=None, packed=None,
                          sink=None, dropout=None):
        """Runs the portable forward kernel; `table` is its tile table (counts, indices), () without one;
        `cache`, `page_table`, `plan`, `sink` and `dropout` as for _forward; `packed` a packed call's (cu_seqlens_q,
        cu_seqlens_k, max_seqlen_q, max_seqlen_k, TOTAL_Q), whose q, k and v are (1, heads, TOTAL, D) views
        (_packed_view); its LSE is (1, H, TOTAL_Q)."""
        _, H, Q_ROWS, D = q.shape
        DV = v.shape[3]
        sm_scale = self.facts.softmax_scale(D)
        out = _empty_in_layout(q, DV)
        lse = torch.empty((q.shape[0], H, Q_ROWS), dtype=torch.float32, device=q.device)
        HKV, KV_LEN, k_strides, v_strides, page_args, paging = _kv_layout(k, v, page_table, lse)
        B, Q_LEN = q.shape[0], Q_ROWS
        if packed is not None:
            B, _, _, Q_LEN, KV_LEN = _call_sizes(q, k, packed)
            k_strides, v_strides = _batch_strides(k, packed), _batch_strides(v, packed)
        block_m, block_n, warps, stages = self._tiles(q, v, 0)
        d_pad, dv_pad = self._widths(D, DV)
        grid = (_cdiv(Q_LEN, block_m), B * H)
        cache_args, cache_flags = _cache_launch(cache, lse)
        packed_args, packed_flags = _packed_launch(packed, lse)
        table_args = self._table_args(self._table_key(q, v, 0), table, _sizes(q, k), placeholder=lse)
        dropout_args, dropout_flag = self._dropout_args(dropout, lse)
        _launch(
            self.kernels.forward, grid, q, k, v, out, *self._row_args(lse), *self._sink_args(sink), sm_scale,
            sm_scale * LOG2E.value, *dropout_args,
            *_batch_strides(q, packed), *k_strides, *v_strides, *_batch_strides(out, packed),
            *self._input_args(tensors), *table_args,
            B, H, HKV, Q_LEN, KV_LEN, visits if visits is not None else lse, *cache_args, *page_args, *packed_args,
            HEAD_DIM=D, HEAD_DIM_V=DV, HEAD_DIM_PAD=d_pad, HEAD_DIM_V_PAD=dv_pad,
            BLOCK_M=block_m, BLOCK_N=block_n, COUNT_VISITS=visits is not None, FOLLOW_TABLE=bool(table),
            DOT_PRECISION=_dot_precision(q.dtype), num_warps=warps, num_stages=stages, **cache_flags, **paging,
            **packed_flags, **dropout_flag, bind=_plan_site(plan, "forward", bool(table)))
        return out, lse

    def _row_terms(self, out, do, dlse, lse=None, q_rows=None, dq_sum=None, plan=None, sink=None, dq_bound=None):
        """(delta, lse2, dsink, dq_exp): delta = rowsum(dO * O) - dLSE, the softmax backward's row term, fp32 (B,
        H, q_rows) (q_rows >= Q_LEN, default Q_LEN; 0 past Q_LEN); with `lse`, lse2 is its base-2 LSE in the
        same rows, +inf past Q_LEN and where LSE = -inf (so P = exp2(s - lse2) = 0 there), else None. dLSE
        comes in any layout (a stride-0 expansion from .sum()); the kernel reads it as a dense array.
        `dq_sum`, an fp32 or int64 (B, H, Q_LEN, D) tensor laid out densely in any dim order (_empty_in_layout),
        is zeroed in the same pass. `plan`: the backward's (_backward_plan). `sink`: a spec's (sink rows, LSE),
        the rows in any strides (_sink_strides), LSE dense (B, H, Q_LEN); dsink is then the sink rows' gradient,
        -exp(sink - LSE) * delta, dense, else None.
        `dq_bound`: (K and V's min and max, fp32 (4,), log2 of a bound on |d score'/d score|) for a
        deterministic fixed-point dQ; dq_exp is then each row's scale exponent in delta's rows
        (kernels._bwd_preprocess's DQ_BOUND), else None."""
        B, H, Q_LEN, DV = out.shape
        D = dq_sum.shape[-1] if dq_sum is not None else DV
        dlse = dlse.contiguous() if dlse is not None else None
        q_rows = q_rows or Q_LEN
        delta = torch.empty((B, H, q_rows), dtype=torch.float32, device=out.device)
        lse2 = torch.empty_like(delta) if lse is not None else None
        dsink = torch.empty(sink[0].shape, dtype=torch.float32, device=out.device) if sink is not None else None
        dq_exp = torch.empty_like(delta) if dq_bound is not None else None
        # The kernel reads one LSE: for lse2 (BASE2_LSE) or for the sink's gradient (SINK_GRAD).
        lse_in = lse if lse is not None else sink[1] if sink is not None else delta
        pre_m = 64
        _launch(
            self.kernels.bwd_preprocess, (_cdiv(q_rows, pre_m), B * H), out, do, dlse if dlse is not None else delta,
            lse_in, delta, lse2 if lse2 is not None else delta, dq_sum if dq_sum is not None else delta,
            *((sink[0], *_sink_strides(sink[0])) if sink is not None else (delta, 0, 0, 0)),
            dsink if dsink is not None else delta,
            dq_exp if dq_exp is not None else delta, dq_bound[0] if dq_bound is not None else delta,
            dq_bound[1] if dq_bound is not None else 0.0, *out.stride(), *do.stride(), H, Q_LEN, q_rows,
            HEAD_DIM_V=DV, HEAD_DIM_V_PAD=_pad(DV), BLOCK_M=pre_m, HAS_DLSE=dlse is not None, BASE2_LSE=lse is not None,
            HEAD_DIM=D, HEAD_DIM_PAD=_pad(D), ZERO_DQ=dq_sum is not None, SINK_GRAD=sink is not None,
            DQ_BOUND=dq_bound is not None, bind=_plan_site(plan, "row terms"))
        return delta, lse2, dsink, dq_exp

    def _input_grads(self, tensors, device, deterministic=False, terms=0):
        """A gradient of zeros per learnable input, None for the others, that the kernels add into: fp32, or
        in deterministic mode the exact sums' EXACT_WORDS int64 words per entry (helpers._exact_add), whose
        headroom takes fewer than 2**39 terms an entry: `terms` bounds them (the call's score elements)."""
        if deterministic and any(learnable for _, _, learnable in self.facts.inputs.values()):
            if terms >= EXACT_TERMS:
                self._fail(f"a deterministic backward sums learnable inputs' gradients exactly, from at most 2**39 "
                           f"score elements (B * H * Q_LEN * KV_LEN), got {terms}: call it without deterministic")
            return [torch.zeros((t.numel(), EXACT_WORDS.value), dtype=torch.int64, device=device) if learnable
                    else None for (_, (_, _, learnable)), t in zip(self.facts.inputs.items(), tensors)]
        return [torch.zeros(t.shape, dtype=torch.float32, device=device) if learnable else None
                for (name, (dtype, dims, learnable)), t in zip(self.facts.inputs.items(), tensors)]

    def _learnable_flags(self, deterministic):
        """The DETERMINISTIC constexpr of the kernels that add learnable inputs' gradients (only they take it)."""
        return dict(DETERMINISTIC=deterministic) if any(learnable for _, _, learnable in self.facts.inputs.values()) else {}

    def _summed_input_grads(self, grads, tensors):
        """The gradients _input_grads gave the kernels, each as its input's dtype and shape: an exact sum's
        words rounded to float32 first (kernels._exact_finish), the same bits for the same words."""
        summed = []
        for g, t in zip(grads, tensors):
            if g is not None and g.dtype == torch.int64:
                out = torch.empty(t.shape, dtype=torch.float32, device=g.device)
                _launch(_exact_finish, (_cdiv(t.numel(), 1024),), g, out, t.numel(), BLOCK=1024, num_warps=4)
                g = out
            summed.append(g.to(t.dtype) if g is not None else None)
        return summed

    def _portable_backward(self, q, k, v, out, lse, do, dlse, tensors, tables, visits=None, plan=None, packed=None,
                           deterministic=False, sink=None, dropout=None):
        """Runs the portable backward kernels; `tables` are the dK/dV and dQ kernels' tile tables, `plan` the
        backward's (_backward_plan; never with visits), `packed` a packed call's, as for _portable_forward.
        `deterministic`: the learnable inputs' gradients summed exactly (dQ, dK and dV are each written once by
        one program, so they are the same bits run to run either way). `sink`: a spec's sink rows whose gradient
        is wanted (_sink_rows), which the row terms' pass then writes too. `dropout`: the forward's (_forward),
        whose mask the kernels regenerate.
        Returns dq, dk, dv, one gradient per input (None for inputs that are not learnable) and the sink rows'
        gradient (None without `sink`)."""
        D, DV = q.shape[3], v.shape[3]
        B, H, HKV, Q_LEN, KV_LEN = _call_sizes(q, k, packed)
        sm_scale = self.facts.softmax_scale(D)
        sizes = _sizes(q, k)
        # Upstream gradients come in any layout (stride 0 from .sum(), permuted views, slices): the
        # kernels read dO through its strides but along a unit-stride head dim (and _row_terms makes dLSE
        # dense). contiguous() copies only when needed (an expansion is not contiguous).
        do = do.contiguous() if do.stride(-1) != 1 else do
        # A sigmoid spec's backward needs no row terms (dS = P * (1 - P) * dP): no pass over O and dO, and LSE
        # (never read) stands in for delta as the placeholder of absent pointers; it has no sink.
        if self.facts.sigmoid:
            delta, dsink = lse, None
        else:
            delta, _, dsink, _ = self._row_terms(out, do, dlse, plan=plan, sink=(sink, lse) if sink is not None else None)
        tabled = tuple(bool(table) for table in tables)  # beside the plan's facts, the launches' arguments
        dq, dk, dv = _empty_in_layout(q, D), _empty_in_layout(k, D), _empty_in_layout(v, DV)
        grads = self._input_grads(tensors, q.device, deterministic, B * H * Q_LEN * KV_LEN)
        grad_args = [g for g in grads if g is not None]
        visits = visits or {}
        bm1, bn1, warps1, stages1 = self._tiles(q, v, 1)
        bm2, bn2, warps2, stages2 = self._tiles(q, v, 2)
        n_kv_tiles, n_q_tiles = _cdiv(KV_LEN, bn1), _cdiv(Q_LEN, bm2) * (H // HKV)
        table_args = [self._table_args(self._table_key(q, v, kernel), table, sizes, placeholder=delta)
                      for kernel, table in zip((1, 2), tables)]
        packed_args, packed_flags = _packed_launch(packed, delta)
        dropout_args, dropout_flag = self._dropout_args(dropout, delta)
        args = (q, k, v, do, *self._row_args(lse, delta), dq, dk, dv, sm_scale, sm_scale * LOG2E.value, *dropout_args,
                *[stride for t in (q, k, v, do, dq, dk, dv) for stride in _batch_strides(t, packed)],
                *self._input_args(tensors), *grad_args, *table_args[0], *table_args[1],
                B, H, HKV, Q_LEN, KV_LEN, visits.get("dkdv", delta), visits.get("dq", delta), *packed_args)
        d_pad, dv_pad = self._widths(D, DV)
        # The two kernels follow their tables together: both are built, or neither (a packed call).
        constants = dict(HEAD_DIM=D, HEAD_DIM_V=DV, HEAD_DIM_PAD=d_pad, HEAD_DIM_V_PAD=dv_pad,
                         BLOCK_M1=bm1, BLOCK_N1=bn1, BLOCK_M2=bm2, BLOCK_N2=bn2,
                         COUNT_VISITS=bool(visits), DOT_PRECISION=_dot_precision(q.dtype),
                         FOLLOW_TABLE=all(tabled) and self.facts.tile_table, **packed_flags,
                         **self._learnable_flags(deterministic), **dropout_flag)
        if self.facts.one_launch_backward:
            _launch(self.kernels.backward, (n_kv_tiles + n_q_tiles, B * HKV), *args, PARTS=3, num_warps=max(warps1, warps2),
                    num_stages=max(stages1, stages2), **constants, bind=_plan_site(plan, "backward", 3, tabled))
        else:
            # Two launches, on two streams on a GPU, so each half gets its own warp count and one's
            # last wave still overlaps the other's.
            side = _side_stream(q.device)
            if side is not None:
                side.wait_stream(torch.cuda.current_stream(q.device))
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                _launch(self.kernels.backward, (n_kv_tiles, B * HKV), *args, PARTS=1, num_warps=warps1, num_stages=stages1,
                        **constants, bind=_plan_site(plan, "backward", 1, tabled))
            _launch(self.kernels.backward, (n_q_tiles, B * HKV), *args, PARTS=2, num_warps=warps2, num_stages=stages2, **constants,
                    bind=_plan_site(plan, "backward", 2, tabled))
            if side is not None:
                torch.cuda.current_stream(q.device).wait_stream(side)
                if not torch.cuda.is_current_stream_capturing():  # a CUDA graph's pool is its own
                    for t in (q, k, v, do, lse, delta, dk, dv, *tensors):
                        t.record_stream(side)  # the allocator must not hand their memory out before dK/dV ends
        return dq, dk, dv, self._summed_input_grads(grads, tensors), dsink
