"""The portable family's runtime side: the launches of its kernels (forward; backward as dK/dV and dQ), which
every call none of the other families admits runs, and the interpreter runs alone."""

import contextlib

import torch

from ...runtime.arguments import (_batch_strides, _cache_launch, _call_sizes, _dot_precision, _fp8_launch,
                                  _kv_layout, _packed_launch, _side_stream, _sizes)
from ...runtime.helpers import LOG2E
from ...runtime.launch import _launch
from ...runtime.plans import _plan_site
from ...runtime.shared import _cdiv, _empty_in_layout


class Portable:
    """The portable family's launches for an Attention (a mixin)."""

    def _portable_forward(self, q, k, v, tensors, table, visits=None, cache=None, page_table=None, plan=None, packed=None,
                          sink=None, dropout=None, fp8=None):
        """Runs the portable forward kernel; `table` is its tile table (counts, indices), () without one;
        `cache`, `page_table`, `plan`, `sink` and `dropout` as for _forward; `packed` a packed call's (cu_seqlens_q,
        cu_seqlens_k, max_seqlen_q, max_seqlen_k, TOTAL_Q), whose q, k and v are (1, heads, TOTAL, D) views
        (_packed_view); its LSE is (1, H, TOTAL_Q). `fp8`: an FP8 call's descale factors of q, k and v ((B,
        HKV) fp32 each; q, k and v are float8_e4m3fn), whose O is bfloat16."""
        _, H, Q_ROWS, D = q.shape
        DV = v.shape[3]
        sm_scale = self.facts.softmax_scale(D)
        out = _empty_in_layout(q, DV, torch.bfloat16 if fp8 is not None else None)
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
        fp8_args, fp8_flag = _fp8_launch(fp8, lse)
        _launch(
            self.kernels.forward, grid, q, k, v, out, *self._row_args(lse), *self._sink_args(sink), sm_scale,
            sm_scale * LOG2E.value, *dropout_args, *fp8_args,
            *_batch_strides(q, packed), *k_strides, *v_strides, *_batch_strides(out, packed),
            *self._input_args(tensors), *table_args,
            B, H, HKV, Q_LEN, KV_LEN, visits if visits is not None else lse, *cache_args, *page_args, *packed_args,
            HEAD_DIM=D, HEAD_DIM_V=DV, HEAD_DIM_PAD=d_pad, HEAD_DIM_V_PAD=dv_pad,
            BLOCK_M=block_m, BLOCK_N=block_n, COUNT_VISITS=visits is not None, FOLLOW_TABLE=bool(table),
            DOT_PRECISION=_dot_precision(q.dtype), num_warps=warps, num_stages=stages, **cache_flags, **paging,
            **packed_flags, **dropout_flag, **fp8_flag, bind=_plan_site(plan, "forward", bool(table)))
        return out, lse

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
            delta, _, dsink = self._row_terms(out, do, dlse, plan=plan, sink=(sink, lse) if sink is not None else None)
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
