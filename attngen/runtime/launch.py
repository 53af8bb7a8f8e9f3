"""Kernel launches bound once per specialization: the host cost of a repeated call.

Triton's JIT binds every launch anew: it specializes each argument (a native call per argument, which
for a TMA descriptor formats its layout as a string), builds a cache key from that and the options,
and only then finds the compiled kernel. On the H200's host that is ~20 us of a ~45 us launch, and a
short call makes one to four launches. `_launch` keeps, per launch site's kernel, the compiled kernel
for each set of facts Triton specializes on, and launches it directly when the facts recur.
"""

import torch
import triton.compiler

from . import interpreter
from .ahead import AHEAD
from .shared import _interpreting

# Triton chose compiled or interpreted kernels when it was first imported (above; attngen/__init__.py
# settles TRITON_INTERPRET then); read once, so code that torch.compile traces reads no environment.
INTERPRETING = _interpreting()
if INTERPRETING:
    interpreter.install()


# Per kernel: {facts of a launch: (compiled kernel, the values of its parameters after the positional
# arguments)}. A kernel has a handful of keys (its specializations and option sets); past _LAUNCH_KEYS
# they are dropped and start over.
_LAUNCHES = {}
_LAUNCH_KEYS = 256


def _launch_fact(arg):
    """What Triton 3.6 specializes one positional argument on (tests/test_launch.py checks it against
    the JIT's own binder): an int's == 1 (a constexpr), % 16 and width (i32, i64, u64); a tensor's
    dtype and 16-byte alignment; a descriptor's dtype, box and layout; a float's and a bool's type; or
    _UNBOUND for an argument of another kind."""
    cls = arg.__class__
    if cls is int:
        return int, arg == 1, arg % 16 == 0, -2**31 <= arg < 2**31, arg < 2**63
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if arg is None or cls is float or cls is bool:
        return cls
    if hasattr(arg, "block_shape") and hasattr(arg, "layout"):  # a TMA descriptor (Gluon's or Triton's)
        return cls, arg.base.dtype, tuple(arg.block_shape), arg.layout, arg.padding
    return _UNBOUND


_UNBOUND = object()  # an argument of a kind _launch_fact does not know: that launch always binds anew


def _launch(kernel, grid, *args, bind=None, **options):
    """kernel[grid](*args, **options): the constexprs and launch options by keyword, the rest
    positionally. The first launch of each set of facts (_launch_fact, the options, the device) goes
    through Triton's JIT, which compiles or finds the kernel; later ones launch that compiled kernel
    with the same arguments the JIT would pass (every parameter, in the signature's order).
    `bind` is (launches, site) of a call plan (plans.py's _CallPlan): when the plan's facts and the launch
    site decide every argument's facts, the plan keeps the compiled kernel in `launches` under the kernel
    and the site, and its later calls skip _launch_fact too."""
    if INTERPRETING:
        return kernel[grid](*args, **options)
    if AHEAD.get():  # a call's stand-in run (ahead.py): compile for these arguments, launch nothing
        return kernel.warmup(*args, grid=grid, **options)
    if bind is not None:
        bound = bind[0].get((kernel, bind[1]))
        if bound is not None:
            compiled, rest, facts = bound
            if _VERIFY_BINDS:
                _verify_bind(kernel, args, options, facts)
            return compiled[(*grid, 1, 1)[:3]](*args, *rest)  # a compiled kernel takes a 3-D grid
    facts = _launch_facts(args, options)
    known = _LAUNCHES.setdefault(kernel, {})
    bound = known.get(facts)
    if bound is None:
        compiled = kernel[grid](*args, **options)
        if not isinstance(compiled, triton.compiler.CompiledKernel) or _UNBOUND in facts:
            return compiled
        if len(known) >= _LAUNCH_KEYS:
            known.clear()
        parameters = list(kernel.signature.parameters.values())[len(args):]
        bound = known[facts] = compiled, tuple(options[p.name] if p.name in options else p.default
                                               for p in parameters)
    else:
        bound[0][(*grid, 1, 1)[:3]](*args, *bound[1])
        compiled = bound[0]
    if bind is not None:
        bind[0][kernel, bind[1]] = (*bound, facts)
    return compiled


# Tests set this: every launch a plan binds then recomputes its facts and fails if they differ from
# those the site was bound with (a site whose arguments the plan does not decide).
_VERIFY_BINDS = False


def _launch_facts(args, options):
    """The key of a launch: the device, each positional argument's _launch_fact and the keywords."""
    return (torch.cuda.current_device(), *map(_launch_fact, args), *options.items())


def _verify_bind(kernel, args, options, facts):
    if _launch_facts(args, options) != facts:
        raise AssertionError(f"{getattr(kernel, '__name__', kernel)}: a call plan's bound launch saw other "
                             f"argument facts than it was bound with")
