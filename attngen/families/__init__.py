"""The kernel families, one folder each, registered here in the host's order of preference.

A family's folder holds its whole story: `family.py`, its plan entry (a plan.family.Family: which specs and
targets it serves, which kernels it provides, its per-call rule, its tiles); `emit.py`, its emit side (the
spec's code in its kernels' spellings, their signatures, the names its template defines and what its
module declares to the runtime); `kernels.py.jinja`, its template (emit/module.py.jinja includes it for
every family of a plan); `runtime.py`, its host side (its per-call rule, allocations, strides and
launches), imported only by modules whose plan names it; and, where its kernels share device code that no
spec changes, `device.py`, its device library (the portable forward's program, the Hopper family's
pipelines), imported by those modules' kernels. Adding a family is a folder and one entry below;
shared code names no family, it reads them from this tuple. The last family serves every call of every spec
on every target: the others serve the calls their rules admit, and pass the rest down the list.
"""

FAMILIES = ("decode", "hopper", "portable")
