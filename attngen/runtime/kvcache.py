"""Cache calls: a contiguous or paged key/value cache with kv_len and q_offset, checked and run forward only."""

import torch

from .arguments import _cache_launch, _kv_layout
from .checks import CHECKED_VALUES
from .kernels import _cache_values_check
from .launch import _launch
from .plans import _CallPlan, _call_facts, _plan_site, _tensor_facts
from .shared import _next_power_of_2


class Cache:
    """Cache calls of an Attention (a mixin)."""

    def _check_paged(self, q, k, v, page_table, kv_len, inputs):
        """A paged call's tensors and sizes; returns MAX_KV, the longest row its page table can hold."""
        self._check_tensors(q, k, v)
        B, H, Q_LEN, D = q.shape
        NUM_PAGES, PAGE_SIZE, HKV = k.shape[0], k.shape[1], k.shape[2]
        if tuple(v.shape[:3]) != (NUM_PAGES, PAGE_SIZE, HKV):
            self._fail(f"v must hold pages (NUM_PAGES, PAGE_SIZE, HKV, DV) = ({NUM_PAGES}, {PAGE_SIZE}, {HKV}, DV) like k, "
                  f"got shape {tuple(v.shape)}")
        if PAGE_SIZE % 16 != 0:
            self._fail(f"the page size (k.shape[1]) must be a multiple of 16, got {PAGE_SIZE}")
        if not (isinstance(page_table, torch.Tensor) and page_table.dtype == torch.int32 and page_table.dim() == 2
                and page_table.shape[0] == B and page_table.device == q.device):
            self._fail(f"page_table must be an int32 tensor of shape ({B}, MAX_PAGES) on {q.device}, got "
                  + (f"{page_table.dtype} {tuple(page_table.shape)} on {page_table.device}"
                     if isinstance(page_table, torch.Tensor) else type(page_table).__name__))
        if kv_len is None:
            self._fail("a paged cache needs kv_len, each row's number of valid keys")
        MAX_KV = page_table.shape[1] * PAGE_SIZE
        self._check_sizes(B, H, HKV, Q_LEN, MAX_KV, D, v.shape[3], inputs, q.device)
        return MAX_KV

    def _cache_plan(self, q, k, v, inputs, kv_len, q_offset, page_table):
        """The _CallPlan of a cache call (plans.py): its checks passed and its forward family chosen once per
        set of facts, those of q, the cache's k and v and the inputs (_call_facts) and of kv_len, q_offset
        and page_table (or their absence), which with them decide every launch's arguments' facts. Its sizes
        are (B, H, HKV, Q_LEN, MAX_KV, D, DV), MAX_KV the longest row the cache holds. Under torch.compile
        nothing is kept."""
        key = None
        if not torch.compiler.is_compiling():
            facts = _call_facts(q, k, v, inputs)
            cache = [("absent",) if t is None else _tensor_facts(t) for t in (kv_len, q_offset, page_table)]
            key = ("cache", *cache, *facts) if facts is not None and None not in cache else None

        def make():
            B, H, Q_LEN, D = q.shape
            if page_table is not None:
                sizes = (B, H, k.shape[2], Q_LEN, self._check_paged(q, k, v, page_table, kv_len, inputs), D, v.shape[3])
            else:
                sizes = self._check(q, k, v, inputs)
            for name, t in (("kv_len", kv_len), ("q_offset", q_offset)):
                if t is not None and not (isinstance(t, torch.Tensor) and t.dtype == torch.int32
                                          and tuple(t.shape) == (B,) and t.device == q.device):
                    self._fail(f"{name} must be an int32 tensor of shape ({B},) on {q.device}, got "
                          + (f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor)
                             else type(t).__name__))
            return _CallPlan(sizes, self._forward_family(q, k, v, *_kv_layout(k, v, page_table)[:2], True), None)
        return self._planned(key, make)

    def _cache_attention(self, q, k, v, inputs, kv_len, q_offset, tile_tables, page_table=None, check_values=False):
        """A cache call (attn's kv_len, q_offset, page_table): checked, then the forward kernels alone.
        Its values (kv_len, q_offset, the page numbers) are checked on the device after the forward
        (_cache_forward), or with `check_values` on the host before it, which names the bad values."""
        plan = self._cache_plan(q, k, v, inputs, kv_len, q_offset, page_table)
        Q_LEN, MAX_KV = plan.sizes[3], plan.sizes[4]
        if tile_tables is not None:
            self._fail("tile_tables must be None in a call with kv_len, q_offset or page_table: tables are built for "
                  "query positions 0 .. Q_LEN-1, and cache calls run without them")
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *inputs.values())):
            self._fail("a call with kv_len or q_offset has no backward pass: call it under torch.no_grad(), or with "
                  "tensors that do not require grad")
        # A q_offset left out is kv_len - Q_LEN, which the kernels derive from kv_len themselves (no torch op).
        if kv_len is not None:
            kv_len = kv_len.contiguous()
        if q_offset is not None:
            q_offset = q_offset.contiguous()
        # check_values reads the values on the host (one sync per call where they changed): not while a CUDA
        # graph is captured or under torch.compile, which take the device check, nor for values already
        # checked (CHECKED_VALUES: the layers of one decoding step share kv_len and the page table).
        checked = (check_values and not torch.compiler.is_compiling()
                   and not (q.is_cuda and torch.cuda.is_current_stream_capturing()))
        if checked:
            values = (kv_len, q_offset, page_table)
            facts = ("cache", Q_LEN, MAX_KV, k.shape[0], self.facts.max_length)
            if not CHECKED_VALUES.holds(values, facts):
                self._check_cache_values(q, kv_len, q_offset, MAX_KV, page_table, k.shape[0])
                CHECKED_VALUES.add(values, facts)
        tensors = [inputs[name].contiguous() for name in self.facts.inputs]
        pages = [page_table.contiguous()] if page_table is not None else []
        sink = self._sink_rows(q, k, inputs, cache=(kv_len, q_offset, page_table is not None))
        if torch.compiler.is_compiling():
            return self.operators[3](q, k, v, tensors, [kv_len] if kv_len is not None else [],
                                     [q_offset] if q_offset is not None else [], pages, [sink] if sink is not None else [])
        return self._cache_forward(q, k, v, tensors, kv_len, q_offset, pages, sink, checked=checked, plan=plan)

    def _check_cache_values(self, q, kv_len, q_offset, MAX_KV, page_table, NUM_PAGES):
        """A cache call's values (q_offset None: kv_len - Q_LEN): every flag computed on the device, read in
        one sync; the message, only on failure, reads the offending range."""
        Q_LEN = q.shape[2]
        defaulted = q_offset is None
        if defaulted:
            q_offset = kv_len - Q_LEN
        flags = [(q_offset < 0).any(), (q_offset > self.facts.max_length - Q_LEN).any()]
        if kv_len is not None:
            flags += [(kv_len < 0).any(), (kv_len > MAX_KV).any()]
        if page_table is not None:
            page_size = MAX_KV // page_table.shape[1]
            used = torch.arange(page_table.shape[1], device=q.device) * page_size < kv_len[:, None]
            flags.append((used & ((page_table < 0) | (page_table >= NUM_PAGES))).any())
        bad = torch.stack(flags).tolist()
        if bad[0] or bad[1]:
            offset = "q_offset (by default kv_len - Q_LEN)" if defaulted else "q_offset"
            self._fail(f"query positions q_offset + 0 .. q_offset + {Q_LEN - 1} must lie in [0, {self.facts.max_length}): "
                  f"{offset} ranges over [{int(q_offset.min())}, {int(q_offset.max())}] for Q_LEN={Q_LEN}")
        if kv_len is not None and (bad[2] or bad[3]):
            length = "MAX_PAGES * PAGE_SIZE" if page_table is not None else "k.shape[2]"
            self._fail(f"kv_len must lie in [0, {MAX_KV}] (the cache's length, {length}), got values in "
                  f"[{int(kv_len.min())}, {int(kv_len.max())}]")
        if page_table is not None and bad[4]:
            named = page_table[used]
            self._fail(f"page_table must name pages in [0, {NUM_PAGES}) (k.shape[0]) for every page a row uses, got "
                  f"values in [{int(named.min())}, {int(named.max())}]")

    def _cache_forward(self, q, k, v, tensors, kv_len, q_offset, pages, sink, checked=False, plan=None):
        """A cache call's forward (a paged one with [page_table] in `pages`), by the family FORWARD_FAMILIES
        picks (the `plan`'s, _cache_plan, which binds the launches), with no tile table; `sink` as for
        _forward. Unless the host `checked` its values, the device checks them: within the forward for a
        family that does (its `checks_cache_values`), else after it; a batch row whose values lie outside
        the cache gets NaN in O and LSE."""
        page_table = pages[0] if pages else None
        family = plan.family if plan is not None else self._forward_family(q, k, v, *_kv_layout(k, v, page_table)[:2], True)
        out, lse = self._forward(q, k, v, tensors, {}, cache=(kv_len, q_offset), page_table=page_table, sink=sink,
                                 family=family, plan=plan)
        if not checked and not getattr(self.families.get(family[0]), "checks_cache_values", False):
            self._check_cache_values_on_device(q, k, v, out, lse, kv_len, q_offset, page_table, plan)
        return out, lse

    def _check_cache_values_on_device(self, q, k, v, out, lse, kv_len, q_offset, page_table, plan=None):
        """kernels._cache_values_check over a cache call's output: one small launch, no sync. The cache's
        length, page pool and paging are the forward kernels' own (_kv_layout); `plan` binds the launch."""
        B, H, Q_LEN = q.shape[:3]
        DV = out.shape[-1]
        _, MAX_KV, _, _, (pages, stride_pt, NUM_PAGES), paging = _kv_layout(k, v, page_table)
        MAX_PAGES = page_table.shape[1] if page_table is not None else 0
        lse_strides = lse.stride() if lse is not None else (0, 0, 0)
        cache_args, cache_flags = _cache_launch((kv_len, q_offset), out)
        _launch(_cache_values_check, (B,), out, lse, *cache_args, pages, *out.stride(), *lse_strides,
                stride_pt, H, Q_LEN, DV, MAX_KV, self.facts.max_length - Q_LEN, NUM_PAGES, MAX_PAGES, **cache_flags,
                HAS_LSE=lse is not None, BLOCK_PAGES=256, BLOCK_ROWS=16,
                HEAD_DIM_V_PAD=_next_power_of_2(DV), **paging, num_warps=1, bind=_plan_site(plan, "cache values"))
