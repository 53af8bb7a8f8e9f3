"""Context-parallel calls: each rank attends its shard of the queries to every rank's keys, by a ring of K/V shards or
one all-gather, forward and backward, with positions, masks and scores those of the whole sequence."""

from __future__ import annotations

import ast

import torch
import torch.distributed as dist

from attngen import ir
from attngen.api import Attention, build
from attngen.emit.module import sink_literal
from attngen.errors import ArgumentError
from attngen.frontend.positions import shifted, without_sink
from attngen.merge import accumulate
from attngen.plan.targets import PRESETS
from attngen.runtime.checks import _autocast
from attngen.runtime.reductions import reduced_inputs
from attngen.runtime.shared import _empty_in_layout
from attngen.runtime.sinks import sink_rows
from attngen.distributed import schedule as schedules
from attngen.distributed.schedule import Chunk, Sizes
from attngen.distributed.shards import _gather_into, _peer, _reduce_scatter_into, _rows, _world


class ContextParallel:
    """`context_parallel(attn, ...)`: call it as cp(q, k, v, return_lse=False, **inputs) with each rank's shard.

    Built once per attention: it compiles the spec with global positions (attngen.frontend.positions), whose
    kernels every pair of a query chunk and a key chunk runs, and plans each call's shapes once."""

    def __init__(self, attn: Attention, group=None, load_balance: str = "zigzag", schedule: str = "auto",
                 reduce_input_grads: bool = True):
        if not isinstance(attn, Attention):
            raise ArgumentError(f"attn must be an attngen.Attention (attngen.build(...)), got {type(attn).__name__}")
        if load_balance not in schedules.LOAD_BALANCES:
            raise ArgumentError(f"load_balance must be one of {', '.join(map(repr, schedules.LOAD_BALANCES))}, "
                                f"got {load_balance!r}")
        if schedule not in schedules.SCHEDULES:
            raise ArgumentError(f"schedule must be one of {', '.join(map(repr, schedules.SCHEDULES))}, "
                                f"got {schedule!r}")
        spec = attn.spec
        # Parts of a softmax row merge by their LSEs; a sigmoid row (each key's weight its own, no LSE) is their sum.
        self.sigmoid = spec.normalize == "sigmoid"
        self.attn, self.group, self.load_balance = attn, group, load_balance
        self.schedule, self.reduce_input_grads = schedule, reduce_input_grads
        self.shifted = shifted(spec)
        target = attn.plan.target if attn.plan.target.lower() in PRESETS else None
        # The kernels of one part of a row's keys: the sink, a term of the whole row, is merged once per row here.
        self.part = build(without_sink(self.shifted.spec), target=target)
        self.sink = None
        if spec.sink is not None:
            kernel_spec, reductions = ir.without_reductions(self.shifted.spec)
            self.sink = (ast.literal_eval(sink_literal(kernel_spec.sink, spec.param_values)),
                         tuple((r.name, r.op, r.source, r.dims) for r in reductions))
        self.inputs = tuple(i.name for i in spec.inputs)
        self.learnable = tuple(i.name for i in spec.learnable_inputs)
        self._plans, self._agreed, self._scalars = {}, set(), {}

    def __repr__(self):
        return f"ContextParallel({self.attn.spec.name}, load_balance={self.load_balance!r}, schedule={self.schedule!r})"

    # --- checks and plans -----------------------------------------------------------------------------------

    def _fail(self, message):
        raise ArgumentError(f"{self.attn.spec.name}: context_parallel: {message}")

    def _sizes(self, q, k, v, world) -> Sizes:
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                self._fail(f"{name} must be a 4-D tensor (B, heads, rows of this rank's shard, head_dim), got "
                           + (f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__))
        B, H, L_q, D = q.shape
        HKV, L_k = k.shape[1], k.shape[2]
        return Sizes(B, H, HKV, L_q * world, L_k * world, D, v.shape[3], q.element_size())

    def _agree(self, sizes: Sizes, device, world):
        """Every rank calls with the same shapes (the plan and the transfers assume it): checked once per shapes,
        by one all-gather."""
        key = (sizes, device)
        if key in self._agreed:
            return
        mine = torch.tensor([sizes.B, sizes.H, sizes.HKV, sizes.q_len, sizes.kv_len, sizes.D, sizes.DV,
                             sizes.element_bytes], dtype=torch.int64, device=device)
        every = torch.empty((world, mine.numel()), dtype=torch.int64, device=device)
        _gather_into(every, mine, self.group)
        if not bool((every == mine).all()):
            self._fail(f"every rank must call with the same shapes and dtype; got (B, H, HKV, Q_LEN, KV_LEN, D, DV, "
                       f"element bytes) = {[tuple(row) for row in every.tolist()]} across the ranks")
        self._agreed.add(key)

    def _plan(self, sizes: Sizes, world: int) -> schedules.Plan:
        key = (sizes, world)
        if key not in self._plans:
            limit = self.shifted.max_length
            if max(sizes.q_len, sizes.kv_len) > limit:
                self._fail(f"the whole sequence's lengths must be at most {limit} (the spec's length limit), got "
                           f"{sizes.q_len} and {sizes.kv_len}")
            found = schedules.plan(self.attn.spec, world, self.load_balance, sizes, self.schedule)
            starts = [c.start for cs in (*found.q_chunks, *found.kv_chunks) for c in cs]
            if max(starts) > self.shifted.max_start:
                self._fail(f"chunk starts must be at most {self.shifted.max_start} for this spec, whose integers stay "
                           f"exact only so far; got a chunk starting at {max(starts)}")
            if len(self._plans) >= 64:
                self._plans.clear()
            self._plans[key] = found
        return self._plans[key]

    def plan(self, q, k, v) -> schedules.Plan:
        """The plan of a call with these shards (the same on every rank): chunks, pair classes, schedule."""
        world, _ = _world(self.group)
        return self._plan(self._sizes(q, k, v, world), world)

    def explain(self, q, k, v) -> str:
        """How a call with these shards runs: the sharding, which chunk pairs are computed, the ring's paths and
        the schedule with the model's reason."""
        return self.plan(q, k, v).explain()

    def _scalar(self, value: int, device):
        """An int32 0-dim tensor of `value`, made once per device (torch.full: no copy from the host, no sync)."""
        key = (value, device)
        if key not in self._scalars:
            self._scalars[key] = torch.full((), value, dtype=torch.int32, device=device)
        return self._scalars[key]

    def _positions(self, q_chunk: Chunk, k_start: int, sizes: Sizes, device) -> dict:
        s = self.shifted
        return {s.q_start: self._scalar(q_chunk.start, device), s.k_start: self._scalar(k_start, device),
                s.q_len: self._scalar(sizes.q_len, device), s.kv_len: self._scalar(sizes.kv_len, device)}

    # --- the call -------------------------------------------------------------------------------------------

    def __call__(self, q, k, v, *, return_lse: bool = False, dropout_p: float = 0.0, **inputs):
        """Each rank's shard of O (B, H, rows, DV), and with return_lse=True of LSE (B, H, rows) float32, for q, k, v
        this rank's shards (shard(x, group, dim=2, load_balance=...)) and inputs given whole on every rank."""
        return _call(self, q, k, v, return_lse, dropout_p, inputs)

    def _check_inputs(self, inputs):
        call_arguments = sorted(set(inputs) & ir.CALL_ARGUMENTS)
        if call_arguments:
            self._fail(f"{', '.join(call_arguments)} cannot be passed: context-parallel calls are training and prefill "
                       f"calls over whole sequences (no KV cache, no packed batch, no tile tables)")
        unknown = [n for n in inputs if n not in self.inputs]
        if unknown:
            self._fail(f"unknown input(s) {', '.join(map(repr, unknown))}; the spec declares "
                       + (", ".join(self.inputs) or "none"))
        missing = [n for n in self.inputs if n not in inputs]
        if missing:
            self._fail(f"missing input(s) {', '.join(map(repr, missing))}")

    def _sink_rows(self, q, chunk: Chunk, sizes: Sizes, inputs):
        """The sink of every row of a query chunk (B, H, rows) fp32, at its global positions; differentiable in
        the inputs as torch computes it."""
        tree, reductions = self.sink
        everything = {**inputs, **self._positions(chunk, 0, sizes, q.device)}
        everything |= reduced_inputs(reductions, everything)
        return sink_rows(tree, everything, B=sizes.B, H=sizes.H, HKV=sizes.HKV, Q_LEN=chunk.length,
                         KV_LEN=sizes.kv_len, D=sizes.D, device=q.device)


def _call(cp: ContextParallel, q, k, v, return_lse, dropout_p, inputs):
    if return_lse and cp.sigmoid:
        cp._fail("return_lse=True needs a softmax spec, got one with normalize: sigmoid, which has no LSE; call "
                 "without return_lse")
    if dropout_p:
        cp._fail(f"dropout_p must be 0, got {dropout_p}: dropout draws its keep-mask from each call's local indices, "
                 f"so the shards would not draw the single-process mask")
    cp._check_inputs(inputs)
    q, k, v = _autocast(q, k, v)
    world, rank = _world(cp.group)
    sizes = cp._sizes(q, k, v, world)
    cp._agree(sizes, q.device, world)
    plan = cp._plan(sizes, world)
    run = _Run(cp, plan, rank)
    tensors = [inputs[name] for name in cp.inputs]
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v, *tensors)):
        for name, t in zip(cp.inputs, tensors):
            if isinstance(t, torch.Tensor) and t.requires_grad and name not in cp.learnable:
                cp._fail(f"input '{name}' requires grad, but the spec does not declare it learnable")
        out, lse = _ContextParallelFunction.apply(run, q, k, v, *tensors)
    else:
        with torch.no_grad():
            out, lse = run.forward(q, k, v, dict(zip(cp.inputs, tensors)))
    return (out, lse) if return_lse else out


class _Run:
    """One call's plan executed on this rank: the forward and backward of its schedule."""

    def __init__(self, cp: ContextParallel, plan: schedules.Plan, rank: int):
        self.cp, self.plan, self.rank = cp, plan, rank
        self.group = cp.group

    # --- the kernels of one pair ----------------------------------------------------------------------------

    def _part_forward(self, q, a: int, k, v, k_start: int, inputs):
        chunk = self.plan.q_chunks[self.rank][a]
        positions = self.cp._positions(chunk, k_start, self.plan.sizes, q.device)
        if self.cp.sigmoid:
            return self.cp.part(_rows(q, chunk), k, v, **inputs, **positions), None
        return self.cp.part(_rows(q, chunk), k, v, return_lse=True, **inputs, **positions)

    def _part_backward(self, q, a: int, k, v, k_start: int, out, lse, do, dlse, inputs):
        chunk = self.plan.q_chunks[self.rank][a]
        positions = self.cp._positions(chunk, k_start, self.plan.sizes, q.device)
        return self.cp.part.gradients(_rows(q, chunk), k, v, _rows(out, chunk), _optional_rows(lse, chunk),
                                      _rows(do, chunk), _optional_rows(dlse, chunk), **inputs, **positions)

    # --- transfers ------------------------------------------------------------------------------------------

    def _exchange(self, messages, payload, like):
        """Posts this rank's part of `messages` (one step's, in their order on every rank): sends of payload[kind]'s
        tensors, receives into new tensors shaped like like[kind]'s. Returns the work and the received tensors."""
        ops, received = [], {}
        for m in messages:
            if m.src == self.rank:
                for t in payload[m.kind]:
                    ops.append(dist.P2POp(dist.isend, t, _peer(self.group, m.dst), self.group))
            if m.dst == self.rank:
                buffers = tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in like[m.kind])
                received[m.kind] = buffers
                for t in buffers:
                    ops.append(dist.P2POp(dist.irecv, t, _peer(self.group, m.src), self.group))
        return (dist.batch_isend_irecv(ops) if ops else []), received

    # --- forward --------------------------------------------------------------------------------------------

    def forward(self, q, k, v, inputs):
        """This rank's (out in q's dtype, LSE float32, None for a sigmoid spec), its sink merged once per row."""
        B, H, rows, _ = q.shape
        # O in q's layout, as one process's call lays it out, summed in fp32 (a row no key reaches: 0 and LSE -inf).
        out = _empty_in_layout(q, v.shape[3], torch.float32).zero_()
        lse = None if self.cp.sigmoid else torch.full((B, H, rows), -torch.inf, dtype=torch.float32, device=q.device)
        if self.plan.schedule == "ring":
            self._ring_forward(q, k, v, inputs, out, lse)
        else:
            self._allgather_forward(q, k, v, inputs, out, lse)
        if self.cp.sink is not None:
            for chunk in self.plan.q_chunks[self.rank]:
                sink = self.cp._sink_rows(q, chunk, self.plan.sizes, inputs)
                accumulate(_rows(out, chunk), _rows(lse, chunk), torch.zeros_like(_rows(out, chunk)), sink)
        return out.to(q.dtype), lse

    def _ring_forward(self, q, k, v, inputs, out, lse):
        plan, r = self.plan, self.rank
        kv = (k.contiguous(), v.contiguous())
        for s in range(plan.world):
            # The next step's shard travels while this step's kernels run.
            work, received = self._exchange(plan.messages(s, backward=False), {"kv": kv}, {"kv": (k, v)})
            shard = plan.holds(r, s)
            if shard is not None:
                for a, b, _ in plan.pairs(r, shard):
                    chunk, rows = plan.kv_chunks[shard][b], plan.q_chunks[r][a]
                    o, l = self._part_forward(q, a, _rows(kv[0], chunk), _rows(kv[1], chunk), chunk.start, inputs)
                    accumulate(_rows(out, rows), _optional_rows(lse, rows), o, l)
            for w in work:
                w.wait()
            kv = received.get("kv")

    def _gathered(self, x):
        """The whole sequence of every rank's shard of x (B, heads, rows, ...), in sequence order."""
        plan = self.plan
        buffer = torch.empty((plan.world, *x.shape), dtype=x.dtype, device=x.device)
        _gather_into(buffer, x.contiguous(), self.group)
        whole = torch.empty((x.shape[0], x.shape[1], plan.sizes.kv_len, *x.shape[3:]), dtype=x.dtype, device=x.device)
        for j, shard in enumerate(plan.kv_chunks):
            for chunk in shard:
                whole[:, :, chunk.start:chunk.end] = _rows(buffer[j], chunk)
        return whole

    def _hull(self, a: int) -> tuple[int, int] | None:
        """The stretch of keys (start, end) holding every key chunk that query chunk a of this rank attends to."""
        plan, found = self.plan, []
        for j in range(plan.world):
            found += [plan.kv_chunks[j][b] for aa, b, _ in plan.pairs(self.rank, j) if aa == a]
        if not found:
            return None
        return min(c.start for c in found), max(c.end for c in found)

    def _allgather_forward(self, q, k, v, inputs, out, lse):
        whole_k, whole_v = self._gathered(k), self._gathered(v)
        for a, chunk in enumerate(self.plan.q_chunks[self.rank]):
            hull = self._hull(a)
            if hull is not None:
                lo, hi = hull
                o, l = self._part_forward(q, a, whole_k[:, :, lo:hi], whole_v[:, :, lo:hi], lo, inputs)
                _rows(out, chunk).copy_(o)
                if l is not None:
                    _rows(lse, chunk).copy_(l)

    # --- backward -------------------------------------------------------------------------------------------

    def backward(self, q, k, v, out, lse, do, dlse, inputs):
        """(dq, dk, dv, {name: gradient} of the learnable inputs) of this rank's shards, from the whole rows' out
        and LSE; the inputs' gradients summed over the group when the ContextParallel says so."""
        grads = {}

        def add(found):
            for name, g in found.items():
                if name in self.cp.learnable:
                    grads[name] = g.float() if name not in grads else grads[name] + g

        if self.plan.schedule == "ring":
            dq, dk, dv = self._ring_backward(q, k, v, out, lse, do, dlse, inputs, add)
        else:
            dq, dk, dv = self._allgather_backward(q, k, v, out, lse, do, dlse, inputs, add)
        if self.cp.sink is not None:
            add(self._sink_gradients(q, out, lse, do, dlse, inputs))
        learnable = [n for n in self.cp.learnable if isinstance(inputs[n], torch.Tensor)]
        flat = [grads.get(n, torch.zeros(inputs[n].shape, dtype=torch.float32, device=q.device)) for n in learnable]
        if self.cp.reduce_input_grads and flat and self.plan.world > 1:
            joined = torch.cat([g.reshape(-1) for g in flat])
            dist.all_reduce(joined, group=self.group)
            flat = list(torch.split(joined, [g.numel() for g in flat]))
        result = {n: g.reshape(inputs[n].shape).to(inputs[n].dtype) for n, g in zip(learnable, flat)}
        # Each gradient in its tensor's layout, as one process's backward lays them out.
        dk, dv = (_empty_in_layout(t, t.shape[3]).copy_(g) for t, g in ((k, dk), (v, dv)))
        return dq.to(q.dtype), dk, dv, result

    def _sink_gradients(self, q, out, lse, do, dlse, inputs):
        """The learnable inputs' gradients through the rows' sink: d LSE / d sink = exp(sink - LSE) and
        d O / d sink = -exp(sink - LSE) O, so the sink's gradient is -exp(sink - LSE) (rowsum(dO O) - dLSE)."""
        leaves = {n: inputs[n].detach().requires_grad_() for n in self.cp.learnable if inputs[n].is_floating_point()}
        found = {}
        if not leaves:
            return found
        for chunk in self.plan.q_chunks[self.rank]:
            with torch.enable_grad():
                sink = self.cp._sink_rows(q, chunk, self.plan.sizes, {**inputs, **leaves})
            if not sink.requires_grad:
                continue
            delta = (_rows(do, chunk).float() * _rows(out, chunk).float()).sum(-1)
            if dlse is not None:
                delta = delta - _rows(dlse, chunk)
            dsink = -torch.exp(sink.detach() - _rows(lse, chunk)) * delta
            grads = torch.autograd.grad(sink, list(leaves.values()), dsink, allow_unused=True)
            for name, g in zip(leaves, grads):
                if g is not None:
                    found[name] = g if name not in found else found[name] + g
        return found

    def _ring_backward(self, q, k, v, out, lse, do, dlse, inputs, add):
        plan, r, W = self.plan, self.rank, self.plan.world
        dq = _empty_in_layout(q, q.shape[3], torch.float32).zero_()
        sums_like = (torch.empty(k.shape, dtype=torch.float32, device=k.device),
                     torch.empty(v.shape, dtype=torch.float32, device=v.device))
        kv = (k.contiguous(), v.contiguous())
        own = home = sent = None  # own shard's sums from this rank's queries, from the others', and those to pass on
        for s in range(W + 1):
            payload = {"kv": kv, "acc": sent, "home": sent}
            work, received = self._exchange(plan.messages(s, backward=True), payload,
                                            {"kv": (k, v), "acc": sums_like, "home": sums_like})
            shard = plan.holds(r, s) if s < W else None
            part = None
            if shard is not None:
                for a, b, _ in plan.pairs(r, shard):
                    chunk = plan.kv_chunks[shard][b]
                    dq_a, dk_b, dv_b, found = self._part_backward(q, a, _rows(kv[0], chunk), _rows(kv[1], chunk),
                                                                  chunk.start, out, lse, do, dlse, inputs)
                    if part is None:
                        part = tuple(torch.zeros_like(t) for t in sums_like)
                    _rows(dq, plan.q_chunks[r][a]).add_(dq_a)
                    _rows(part[0], chunk).add_(dk_b)
                    _rows(part[1], chunk).add_(dv_b)
                    add(found)
            for w in work:
                w.wait()
            sent = None
            if shard is not None and s == 0:
                own = part
            elif shard is not None and plan.first[shard] is not None and plan.first[shard] <= s:
                incoming = received.get("acc")
                sent = incoming if part is None else part if incoming is None else tuple(
                    x.add_(y) for x, y in zip(part, incoming))
            if "home" in received:
                home = received["home"]
            kv = received.get("kv")
        sums = [x for x in (own, home) if x is not None]
        if not sums:
            return dq, torch.zeros_like(k), torch.zeros_like(v)
        dk, dv = sums[0] if len(sums) == 1 else tuple(x.add_(y) for x, y in zip(*sums))
        return dq, dk, dv

    def _allgather_backward(self, q, k, v, out, lse, do, dlse, inputs, add):
        plan = self.plan
        whole_k, whole_v = self._gathered(k), self._gathered(v)
        dq = _empty_in_layout(q, q.shape[3], torch.float32).zero_()
        whole_dk = torch.zeros(whole_k.shape, dtype=torch.float32, device=k.device)
        whole_dv = torch.zeros(whole_v.shape, dtype=torch.float32, device=v.device)
        for a, chunk in enumerate(plan.q_chunks[self.rank]):
            hull = self._hull(a)
            if hull is None:
                continue
            lo, hi = hull
            dq_a, dk, dv, found = self._part_backward(q, a, whole_k[:, :, lo:hi], whole_v[:, :, lo:hi], lo, out, lse,
                                                      do, dlse, inputs)
            _rows(dq, chunk).add_(dq_a)
            whole_dk[:, :, lo:hi] += dk
            whole_dv[:, :, lo:hi] += dv
            add(found)
        return dq, self._scattered(whole_dk), self._scattered(whole_dv)

    def _scattered(self, whole):
        """Each rank's shard of the sum over the ranks of `whole` (B, heads, sequence, ...) fp32."""
        plan = self.plan
        shape = (whole.shape[0], whole.shape[1], plan.kv_chunks[0][-1].local + plan.kv_chunks[0][-1].length,
                 *whole.shape[3:])
        buffer = torch.empty((plan.world, *shape), dtype=whole.dtype, device=whole.device)
        for j, shard in enumerate(plan.kv_chunks):
            for chunk in shard:
                _rows(buffer[j], chunk).copy_(whole[:, :, chunk.start:chunk.end])
        mine = torch.empty(shape, dtype=whole.dtype, device=whole.device)
        _reduce_scatter_into(mine, buffer, self.group)
        return mine


class _ContextParallelFunction(torch.autograd.Function):
    """The autograd node of a context-parallel call: the forward of its schedule, and a backward that
    recomputes every pair's scores from the whole rows' out and LSE."""

    @staticmethod
    def forward(ctx, run, q, k, v, *tensors):
        ctx.set_materialize_grads(False)
        inputs = dict(zip(run.cp.inputs, tensors))
        out, lse = run.forward(q, k, v, inputs)
        ctx.run = run
        ctx.save_for_backward(q, k, v, out, lse, *tensors)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if torch.is_grad_enabled():
            raise ArgumentError("context_parallel: double backward (create_graph=True) is not supported: the kernels' "
                                "gradients are not differentiable")
        q, k, v, out, lse, *tensors = ctx.saved_tensors
        run = ctx.run
        inputs = dict(zip(run.cp.inputs, tensors))
        if dout is None:
            dout = torch.zeros_like(out)
        if dlse is not None:
            # A row with no allowed key (LSE -inf) takes no gradient through its LSE, as a kernel's backward.
            dlse = torch.where(torch.isfinite(lse), dlse.float(), 0.0)
        dq, dk, dv, grads = run.backward(q, k, v, out, lse, dout, dlse, inputs)
        return (None, dq, dk, dv, *[grads.get(name) if ctx.needs_input_grad[4 + i] else None
                                    for i, name in enumerate(run.cp.inputs)])


def _optional_rows(x, chunk: Chunk):
    """x's rows of the chunk, or None where the call has no such tensor (a sigmoid spec's LSE, an unused dLSE)."""
    return None if x is None else _rows(x, chunk)
