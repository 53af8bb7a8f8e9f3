"""Call plans: what a call's facts decide (checks passed, family chosen, launches bound), worked out once per set of facts."""

import torch


# A short call's host time is Python: the checks, the families' per-call rules, the launches' argument
# facts. All of them read only what _call_facts collects of the call's tensors, so a call whose facts
# recur reuses the first one's decisions: it passed the same checks, goes to the same family, and the
# launch sites it binds (_plan_site) take arguments of the same facts.
class _CallPlan:
    """The decisions of calls with one set of facts: their sizes (B, H, HKV, Q_LEN, KV_LEN, D, DV) after
    the checks passed, the forward's (family, launch) and the backward's (family, name, launch), the
    launches bound by site, and the plans of their backwards by the facts of dO and dLSE
    (_backward_plan); `compiled` what its calls compiled ahead (ahead.py): 0 nothing, 1 the forward's
    kernels, 2 the backward's too."""

    __slots__ = ("sizes", "family", "backward_family", "launches", "backwards", "compiled")

    def __init__(self, sizes, family, backward_family):
        self.sizes, self.family, self.backward_family = sizes, family, backward_family
        self.launches, self.backwards = {}, {}
        self.compiled = 0


def _call_facts(q, k, v, inputs):
    """Everything the checks, the per-call rules and the bound launch sites read of a call's tensors:
    the inputs' names, the current device, and each tensor's dtype, device, shape, strides and 16-byte
    alignment; None when one of them is not a plain dense tensor or parameter (a subclass may answer
    these differently from call to call: such calls are checked in full every time)."""
    tensors = (q, k, v, *inputs.values())
    for t in tensors:
        if t.__class__ is not torch.Tensor and t.__class__ is not torch.nn.Parameter:
            return None
        if t.layout != torch.strided or t.is_nested:  # no strides to key on: _check refuses them
            return None
    return (tuple(inputs), torch.cuda.current_device() if q.is_cuda else None, *map(_layout_facts, tensors))


def _layout_facts(t):
    """A dense tensor's facts beside its values: dtype, device, shape, strides and 16-byte alignment."""
    return t.dtype, t.device, t.shape, t.stride(), t.data_ptr() % 16 == 0


def _tensor_facts(t):
    """What the checks and the launches read of a call's small integer tensor (a packed call's offsets, a cache
    call's kv_len, q_offset and page table) beside its values: its _layout_facts; None for anything but a plain
    dense tensor."""
    if t.__class__ is not torch.Tensor or t.layout != torch.strided:
        return None
    return _layout_facts(t)


def _backward_plan(plan, do, dlse):
    """The plan of a backward of a call of `plan` with this dO and dLSE: their facts (dtype, strides,
    16-byte alignment; their shapes are out's and LSE's) decide the backward launches' arguments beside
    the call's. None without a plan, or for a tensor subclass."""
    if plan is None:
        return None
    upstream = (do, dlse) if dlse is not None else (do,)
    if any(t.__class__ is not torch.Tensor for t in upstream):
        return None
    facts = tuple((t.dtype, t.stride(), t.data_ptr() % 16 == 0) for t in upstream)
    backward = plan.backwards.get(facts)
    if backward is None:
        if len(plan.backwards) >= 16:
            plan.backwards.clear()
        backward = plan.backwards[facts] = _CallPlan(plan.sizes, plan.family, plan.backward_family)
    return backward


def _plan_site(plan, *site):
    """_launch's `bind` for a launch site of a call with this plan (None: none, the launch binds by its facts).
    `site` tells apart the launches of one kernel in a call: it names the site and anything of the call
    besides the plan's facts that its arguments depend on."""
    return None if plan is None else (plan.launches, site)


class CallPlans:
    """Call plans of an Attention (a mixin)."""

    def _call_plan(self, q, k, v, inputs, deterministic=False, dropout=False):
        """The _CallPlan of a call of these tensors: a new one after _check passes, unless a call with the
        same facts made one already. `deterministic`: the call's backward must be (Attention.attn), which
        may choose another backward family; `dropout`: the call has dropout_p > 0, which the forward family's
        choice and the launches' arguments depend on."""
        def make():
            sizes = self._check(q, k, v, inputs)
            # Both families once per facts, whether the call then runs a backward (or is a cache call) or not.
            return _CallPlan(sizes, self._forward_family(q, k, v, sizes[2], sizes[4], False, dropout=dropout),
                             self._backward_family(q, k, v, deterministic=deterministic, dropout=dropout))
        facts = _call_facts(q, k, v, inputs)
        return self._planned((deterministic, dropout, *facts) if facts is not None else None, make)

    def _planned(self, facts, make):
        """The plan kept for these facts, else make()'s, kept for them (facts None: a call checked in full
        every time, whose plan is not kept); past call_plan_keys the plans are dropped and start over."""
        plan = self.call_plans.get(facts) if facts is not None else None
        if plan is None:
            plan = make()
            if facts is not None:
                if len(self.call_plans) >= self.call_plan_keys:
                    self.call_plans.clear()
                self.call_plans[facts] = plan
        return plan
