"""The per-call facts every family's launches read from an Attention: tiles and widths, the inputs' arguments,
the rows' terms (the backward's row-terms pass, which gives a sink's gradient too), the sink's and dropout's
arguments, and the learnable inputs' gradients the kernels add into."""

import torch

from .arguments import _sink_strides
from .helpers import EXACT_WORDS
from .kernels import _exact_finish
from .launch import _launch
from .plans import _plan_site
from .shared import _PLAN_DTYPES, _cdiv, _pad, _tile_widths

# The most terms an entry of an exact sum takes (helpers._exact_add: each adds below 2**24 to an int64 word).
EXACT_TERMS = 2**39


class LaunchArguments:
    """What an Attention's launches share, whichever family runs them (a mixin)."""

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
        return self.facts.plan[(*self._widths(int(q.shape[-1]), int(v.shape[-1])), _PLAN_DTYPES[q.dtype])][kernel]

    def _family_tiles(self, q, v, family):
        """A kernel family's (BLOCK_M, BLOCK_N, num_warps, num_stages, buffers) for these head dims and dtype
        (FAMILY_TILES; int() as in _tiles)."""
        return self.facts.family_tiles[(*self._widths(int(q.shape[-1]), int(v.shape[-1])), _PLAN_DTYPES[q.dtype])][family]

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

    def _row_terms(self, out, do, dlse, lse=None, q_rows=None, dq_sum=None, plan=None, sink=None):
        """(delta, lse2, dsink): delta = rowsum(dO * O) - dLSE, the softmax backward's row term, fp32 (B,
        H, q_rows) (q_rows >= Q_LEN, default Q_LEN; 0 past Q_LEN); with `lse`, lse2 is its base-2 LSE in the
        same rows, +inf past Q_LEN and where LSE = -inf (so P = exp2(s - lse2) = 0 there), else None. dLSE
        comes in any layout (a stride-0 expansion from .sum()); the kernel reads it as a dense array.
        `dq_sum`, an fp32 (B, H, Q_LEN, D) tensor laid out densely in any dim order (_empty_in_layout), is
        zeroed in the same pass. `plan`: the backward's (_backward_plan). `sink`: a spec's (sink rows, LSE),
        the rows in any strides (_sink_strides), LSE dense (B, H, Q_LEN); dsink is then the sink rows' gradient,
        -exp(sink - LSE) * delta, dense, else None."""
        B, H, Q_LEN, DV = out.shape
        D = dq_sum.shape[-1] if dq_sum is not None else DV
        dlse = dlse.contiguous() if dlse is not None else None
        q_rows = q_rows or Q_LEN
        delta = torch.empty((B, H, q_rows), dtype=torch.float32, device=out.device)
        lse2 = torch.empty_like(delta) if lse is not None else None
        dsink = torch.empty(sink[0].shape, dtype=torch.float32, device=out.device) if sink is not None else None
        # The kernel reads one LSE: for lse2 (BASE2_LSE) or for the sink's gradient (SINK_GRAD).
        lse_in = lse if lse is not None else sink[1] if sink is not None else delta
        pre_m = 64
        _launch(
            self.kernels.bwd_preprocess, (_cdiv(q_rows, pre_m), B * H), out, do, dlse if dlse is not None else delta,
            lse_in, delta, lse2 if lse2 is not None else delta, dq_sum if dq_sum is not None else delta,
            *((sink[0], *_sink_strides(sink[0])) if sink is not None else (delta, 0, 0, 0)),
            dsink if dsink is not None else delta, *out.stride(), *do.stride(), H, Q_LEN, q_rows,
            HEAD_DIM_V=DV, HEAD_DIM_V_PAD=_pad(DV), BLOCK_M=pre_m, HAS_DLSE=dlse is not None, BASE2_LSE=lse is not None,
            HEAD_DIM=D, HEAD_DIM_PAD=_pad(D), ZERO_DQ=dq_sum is not None, SINK_GRAD=sink is not None,
            bind=_plan_site(plan, "row terms"))
        return delta, lse2, dsink

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
