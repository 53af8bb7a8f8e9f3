"""The host runtime of generated modules: ordinary Python that a module's kernels are handed to.

A generated module holds only what its spec decides (its kernels and its facts) and declares
`Attention(SpecFacts(...), Kernels(...), families={...})`; everything else a call runs lives here, one job a
module: checks (call checks), plans (call plans), tables (tile tables), arguments (the launch arguments
every family shares), dispatch (the family a call runs), families (each registered family's runtime side,
attngen/families/<name>/runtime.py, imported when a plan names it), operators (autograd and the
torch.compile operators), packed and kvcache (packed and cache calls), dropout (a call's dropout: its
checks, the Philox words drawn from torch's generator, the keep-mask), sinks (a spec's `sink:` logit of
every row, at which the forward kernels start its softmax), launch (launches bound once per specialization;
interpreter, Triton's CPU interpreter made fast where the kernels need it), helpers (the @triton.jit helpers
every kernel calls), kernels (the kernels no spec changes) and shared (the facts the planner shares).
Imports inside the package, and from the families' runtime sides, are relative, so `attngen compile` can
bundle them into a standalone module under a private name (attngen.emit.bundle).
"""
