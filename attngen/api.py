"""Runs the pipeline in order (frontend, analyze, plan, emit, load): the entry points users call."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from attngen import cache, ir
from attngen.analysis import analyze
from attngen.errors import ArgumentError
from attngen.frontend import SpecLike, load_spec, parse_spec, with_params  # attngen's public names
from attngen.plan import Plan, plan_for
from attngen.emit.bundle import bundle
from attngen.emit.module import render
from attngen.plan.targets import Target, get_target
from attngen.report.explain import report
from attngen.runtime import shared


@dataclass(frozen=True)
class Attention:
    """A built attention variant: call it as attn(q, k, v, *, kv_len=None, q_offset=None, page_table=None,
    return_lse=False, tile_tables=None, dropout_p=0.0, generator=None, deterministic=None, check_values=None,
    **inputs). `deterministic` (build's): every call's backward gives the same bits run after run; a call's own
    deterministic=True or False overrides it, and torch.use_deterministic_algorithms(True) turns it on for
    every call. `check_values` (build's; a call's own overrides it): cache calls check their values on the
    host, raising a ValueError, instead of on the device (NaN rows, no sync)."""
    spec: ir.Spec
    plan: Plan
    module: ModuleType
    path: Path
    deterministic: bool = False
    check_values: bool = False

    def __call__(self, q, k, v, *, kv_len=None, q_offset=None, page_table=None, cu_seqlens_q=None, cu_seqlens_k=None,
                 max_seqlen_q=None, max_seqlen_k=None, return_lse: bool = False, tile_tables=None,
                 dropout_p: float = 0.0, generator=None, deterministic: bool | None = None,
                 check_values: bool | None = None, q_descale=None, k_descale=None, v_descale=None, **inputs):
        return self.module.attn(q, k, v, kv_len=kv_len, q_offset=q_offset, page_table=page_table,
                                cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                                max_seqlen_k=max_seqlen_k, return_lse=return_lse, tile_tables=tile_tables,
                                dropout_p=dropout_p, generator=generator,
                                deterministic=self.deterministic if deterministic is None else deterministic,
                                check_values=self.check_values if check_values is None else check_values,
                                q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, **inputs)

    def dropout_mask(self, q, k, v, *, dropout_p: float, generator=None, cu_seqlens_q=None, cu_seqlens_k=None,
                     max_seqlen_q=None, max_seqlen_k=None, **inputs):
        """The keep-mask (B, H, Q_LEN, KV_LEN) bool that a call with these arguments, made with the generator
        in its present state, applies (a packed call's (B, H, max_seqlen_q, max_seqlen_k)); it draws from
        the generator as that call would. For tests at small shapes: attngen.reference.evaluate takes it."""
        return self.module.dropout_mask(q, k, v, dropout_p=dropout_p, generator=generator, cu_seqlens_q=cu_seqlens_q,
                                        cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                                        max_seqlen_k=max_seqlen_k, **inputs)

    def tile_tables(self, q, k, v, **inputs):
        """The tile tables of these mask inputs, to pass as attn(q, k, v, tile_tables=..., **inputs)
        in calls of the same shapes, dtype and device, which then skip building them. Build them
        again whenever the values the mask reads change: a call cannot tell they are stale."""
        return self.module.tile_tables(q, k, v, **inputs)

    def forward_family(self, q, k, v, *, kv_len=None, q_offset=None, page_table=None, cu_seqlens_q=None,
                       cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, dropout_p: float = 0.0,
                       **inputs) -> str:
        """The kernel family whose forward kernel a call with these arguments runs ("decode", "hopper"
        or "portable"): each family's rule on the call's shapes and device picks it (`attngen explain`
        lists them); an FP8 call (float8_e4m3fn q, k, v) runs the Hopper family's on a Hopper GPU, else the
        portable one."""
        return self.module.forward_family(q, k, v, kv_len=kv_len, q_offset=q_offset, page_table=page_table,
                                          cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                          max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, dropout_p=dropout_p,
                                          **inputs)

    def backward_family(self, q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                        max_seqlen_k=None, deterministic: bool | None = None, **inputs) -> str:
        """The kernel family whose backward kernels a training call with these arguments runs
        ("hopper" or "portable"), by the same kind of per-call rule as forward_family; `deterministic` as
        for a call."""
        return self.module.backward_family(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                           max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                           deterministic=self.deterministic if deterministic is None else deterministic,
                                           **inputs)

    def gradients(self, q, k, v, out, lse, do, dlse=None, **inputs):
        """The backward kernels alone: (dq, dk, dv, {name: gradient} of the learnable inputs) of a training call
        given `out`, `lse` and the upstream `do` (and `dlse`). With the output and LSE of an attention over
        more keys than k holds (partial results merged by LSE), this part's share of its gradients."""
        return self.module.gradients(q, k, v, out, lse, do, dlse, **inputs)

    def visit_counts(self, q, k, v, **inputs):
        """Which tiles each kernel visits, with mask code (1) or without (16); see the module's doc."""
        return self.module.visit_counts(q, k, v, **inputs)


@dataclass(frozen=True)
class Explanation:
    """The report of `explain`: its text, and the tile maps (kernel -> TileMap) it was computed from."""
    spec: ir.Spec
    text: str
    maps: dict


def _prepare(spec: SpecLike, params: dict | None, target: str | Target | None):
    """The pipeline up to the plan: parse (or take) the spec, apply params, analyze, plan."""
    parsed, text = load_spec(spec)
    facts = analyze(with_params(parsed, params))
    tgt = target if isinstance(target, Target) else get_target(target)
    return facts, text, tgt, plan_for(facts, tgt)


# TRITON_INTERPRET as generated modules read it; the package asks anew on every call.
_interpreting = shared._interpreting


def interpreter_came_too_late() -> bool:
    """TRITON_INTERPRET=1 is set, but triton built its own jit functions before it was: every kernel
    would fail inside them."""
    import triton

    return _interpreting() and isinstance(triton.language.zeros, triton.runtime.JITFunction)


def interpreter_problem() -> str | None:
    """Why kernels cannot run in Triton's interpreter in this process, or None when they can."""
    if not _interpreting():
        return ("target 'interpreter' needs TRITON_INTERPRET=1 set before triton is imported (attngen sets "
                "it itself on a machine with no CUDA GPU)")
    if interpreter_came_too_late():
        return ("triton was imported before attngen could ask for its interpreter (TRITON_INTERPRET=1 came "
                "too late): import attngen before anything that imports triton (transformers' model "
                "classes do), or set TRITON_INTERPRET=1 in the environment")
    return None


def compile_source(spec: SpecLike, *, params: dict | None = None, target: str | Target | None = None,
                   thin: bool = False) -> str:
    """The module source for a spec: standalone (the spec's kernels, then attngen's runtime inlined; imports
    only torch and triton), or with thin=True the spec's part alone, which imports attngen.runtime (what
    build() caches and loads)."""
    facts, text, _, kernel_plan = _prepare(spec, params, target)
    module = render(facts, kernel_plan, text)
    return module if thin else bundle(module, kernel_plan.families)


def explain(spec: SpecLike, *, q_len: int, kv_len: int, head_dim: int, head_dim_v: int, dtype: str,
            params: dict | None = None, target: str | Target | None = None) -> Explanation:
    """`attngen explain`: what the compiler decided for a spec at these sizes (report.explain)."""
    facts, _, _, kernel_plan = _prepare(spec, params, target)
    return Explanation(facts.source, *report(facts, kernel_plan, q_len, kv_len, head_dim, head_dim_v, dtype))


def build(spec: SpecLike, *, params: dict | None = None, target: str | Target | None = None,
          deterministic: bool = False, check_values: bool = False) -> Attention:
    """Compile a spec (path, text or Spec) into a callable with autograd; cached on disk. deterministic=True:
    its backward gives the same bits run after run (as torch.use_deterministic_algorithms(True) asks of
    every call); the kernels are the same, so the module is shared with a build without it. check_values=True:
    cache calls check kv_len, q_offset and the page table on the host and raise a ValueError naming bad values
    (one sync per call whose values changed) instead of the device check's NaN rows (Attention.attn's doc)."""
    for name, flag in (("deterministic", deterministic), ("check_values", check_values)):
        if not isinstance(flag, bool):
            raise ArgumentError(f"{name} must be a bool, got {type(flag).__name__}")
    facts, text, tgt, kernel_plan = _prepare(spec, params, target)
    problem = interpreter_problem() if tgt.interpreter else None
    if problem:
        raise ArgumentError(problem)
    parsed = facts.source
    # The source text is part of the module (its header), so it is part of the key: a spec of the
    # same name and meaning but other text never shares a module with it.
    key = cache.module_key(parsed.model_dump_json(), text, kernel_plan.model_dump_json())
    module, path = cache.load(parsed.name, key, lambda: render(facts, kernel_plan, text))
    return Attention(parsed, kernel_plan, module, path, deterministic, check_values)
