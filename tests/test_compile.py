"""Built kernels under torch.compile: whole graphs with no break, dynamic lengths with no recompile,
the custom operators' own checks (opcheck), and the operator names that keep modules apart.

On the CPU the backend is aot_eager (Inductor would need a C++ compiler for the rest of the graph,
and the kernels run in Triton's interpreter anyway); the GPU run (tools/gpu_compile.py) covers
Inductor and CUDA graphs.
"""

import importlib.util
import sys

import pytest
import torch

import attngen
from attngen import testing
from attngen.runtime import arguments

B, H, HKV, D = 1, 2, 1, 16
SPECS = {  # one of each kind of host path: no inputs, a tile table, a learnable input, an input, kept tables
    "causal": ("specs/causal.attn", {}),
    "document_causal": ("specs/document_causal.attn", {}),
    "learned_rel_bias": ("specs/learned_rel_bias.attn", {}),
    "alibi_causal": ("specs/alibi_causal.attn", {}),
    "global_band": ("benchmarks/published/global_band.attn", {"w": 5, "g": 7}),
}


pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # conftest: every test's compiled graphs its own


def _case(name, n, heads=H, kv_heads=HKV, seed=0, head_dim=D):
    path, params = SPECS[name]
    attn = attngen.build(path, params=params)
    q, k, v = testing.random_qkv(B, heads, kv_heads, n, n, head_dim, head_dim, torch.float32, device="cpu", seed=seed)
    inputs = testing.random_inputs(attn.spec, B, heads, kv_heads, n, n, device="cpu", seed=seed)
    return attn, q, k, v, inputs


def _loss(attn):
    def loss(q, k, v, inputs):
        out, lse = attn(q, k, v, return_lse=True, **inputs)
        # LSE in the loss too, so its gradient path (dLSE) is compiled as well; empty rows are -inf.
        return out.square().sum() + torch.where(lse.isfinite(), lse, 0).sum()
    return loss


def _leaves(attn, q, k, v, inputs):
    learnable = [inputs[i.name] for i in attn.spec.learnable_inputs]
    return [x.requires_grad_() for x in (q, k, v, *learnable)]


@pytest.mark.parametrize("name", SPECS)
def test_fullgraph_forward_and_backward_equal_eager(name):
    attn, q, k, v, inputs = _case(name, 40)
    leaves = _leaves(attn, q, k, v, inputs)
    loss = _loss(attn)
    eager = loss(q, k, v, inputs)
    eager_grads = torch.autograd.grad(eager, leaves)
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)  # fullgraph: a break raises
    result = compiled(q, k, v, inputs)
    grads = torch.autograd.grad(result, leaves)
    # The same kernels on the same data: bit for bit what eager gives (which test_kernels checks
    # against the float64 reference).
    assert torch.equal(result, eager)
    for got, want in zip(grads, eager_grads):
        assert torch.equal(got, want)


def test_compiled_call_matches_the_reference():
    attn, q, k, v, inputs = _case("document_causal", 40, heads=4, kv_heads=2)
    compiled = torch.compile(lambda q, k, v, **kw: attn(q, k, v, **kw), backend="aot_eager", fullgraph=True)
    testing.check_against_reference(attn.spec, compiled, q, k, v, inputs)


# The learnable table's case is slow: six interpreted backward passes with the table's gradient (two
# minutes); fullgraph and opcheck run its host path by default.
@pytest.mark.parametrize("name, head_dim", [pytest.param("learned_rel_bias", 16, marks=pytest.mark.slow),
                                            ("document_causal", 64)])
def test_dynamic_lengths_compile_once(name, head_dim):
    attn, *_ = _case(name, 24)
    loss = _loss(attn)
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True, dynamic=True)
    for i, n in enumerate((24, 40, 57)):
        _, q, k, v, inputs = _case(name, n, heads=4, kv_heads=2, seed=i, head_dim=head_dim)
        leaves = _leaves(attn, q, k, v, inputs)
        want = torch.autograd.grad(loss(q, k, v, inputs), leaves)
        got = torch.autograd.grad(compiled(q, k, v, inputs), leaves)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        torch.compiler.set_stance("fail_on_recompile")  # a second length that recompiles raises


def test_passed_tile_tables_under_compile():
    attn, q, k, v, inputs = _case("document_causal", 40)
    tables = attn.tile_tables(q, k, v, **inputs)
    built = attn.module.TABLE_STATS["built"]
    leaves = _leaves(attn, q, k, v, inputs)

    def loss(q, k, v, inputs):
        return attn(q, k, v, tile_tables=tables, **inputs).square().sum()

    want = torch.autograd.grad(loss(q, k, v, inputs), leaves)
    got = torch.autograd.grad(torch.compile(loss, backend="aot_eager", fullgraph=True)(q, k, v, inputs), leaves)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert attn.module.TABLE_STATS["built"] == built  # every kernel followed the passed tables


def test_static_tables_under_compile():
    """A compiled call of a mask that reads no input follows the tables an eager call kept (it builds none);
    one of new lengths builds its own and keeps none (a compiled graph may run in memory that CUDA-graph trees
    hand out again: runtime/tables.py's STATIC_TABLES), until an eager call of those lengths keeps them."""
    attn, q, k, v, inputs = _case("global_band", 40)
    loss = _loss(attn)
    leaves = _leaves(attn, q, k, v, inputs)
    want = torch.autograd.grad(loss(q, k, v, inputs), leaves)
    built = attn.module.TABLE_STATS["built"]
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    got = torch.autograd.grad(compiled(q, k, v, inputs), leaves)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert attn.module.TABLE_STATS["built"] == built
    _, q, k, v, _ = _case("global_band", 56)
    leaves = _leaves(attn, q, k, v, inputs)
    got = torch.autograd.grad(compiled(q, k, v, inputs), leaves)
    # The new length's by-query table (forward), again for dQ (the forward's was not kept), and by-key (dK/dV).
    assert attn.module.TABLE_STATS["built"] == built + 3
    torch.autograd.grad(compiled(q, k, v, inputs), leaves)
    assert attn.module.TABLE_STATS["built"] == built + 6  # built again: none was kept
    assert all(torch.equal(a, b) for a, b in zip(got, torch.autograd.grad(loss(q, k, v, inputs), leaves)))
    assert attn.module.TABLE_STATS["built"] == built + 8  # the eager call's two, kept
    torch.autograd.grad(compiled(q, k, v, inputs), leaves)
    assert attn.module.TABLE_STATS["built"] == built + 8  # which the compiled call now follows


def test_tile_tables_built_inside_a_compiled_function():
    """tile_tables under torch.compile builds through the table operator, with no graph break; the
    compiled call follows those tables (it builds none of its own), and they come out of the compiled
    function usable."""
    attn, q, k, v, inputs = _case("document_causal", 40)
    leaves = _leaves(attn, q, k, v, inputs)

    def loss(q, k, v, inputs):
        tables = attn.tile_tables(q, k, v, **inputs)
        return attn(q, k, v, tile_tables=tables, **inputs).square().sum(), tables

    built = attn.module.TABLE_STATS["built"]
    eager, _ = loss(q, k, v, inputs)
    built_eager = attn.module.TABLE_STATS["built"] - built
    want = torch.autograd.grad(eager, leaves)
    result, tables = torch.compile(loss, backend="aot_eager", fullgraph=True)(q, k, v, inputs)
    got = torch.autograd.grad(result, leaves)
    assert torch.equal(result, eager) and all(torch.equal(a, b) for a, b in zip(got, want))
    assert attn.module.TABLE_STATS["built"] - built == 2 * built_eager  # the compiled call built only tile_tables'
    assert torch.equal(attn(q, k, v, tile_tables=tables, **inputs), attn(q, k, v, **inputs))


@pytest.mark.parametrize("fullgraph", [True, False])
def test_argument_errors_are_the_eager_ones_under_compile(fullgraph):
    """With or without fullgraph, a refused call raises the eager ValueError and message (dynamo adds
    the user code's lines), not dynamo's own error."""
    attn, q, k, v, inputs = _case("document_causal", 40)
    other_tables = attn.tile_tables(q[:, :, :24], k, v, **inputs)
    refused = {
        "input 'doc' must have dtype torch.int32": lambda q, k, v, doc: attn(q, k, v, doc=doc.long()),
        "q, k and v must share a dtype": lambda q, k, v, doc: attn(q, k, v.half(), doc=doc),
        r"tile_tables must be built for this call's \(B, H, HKV, Q_LEN, KV_LEN\)":
            lambda q, k, v, doc: attn(q, k, v, doc=doc, tile_tables=other_tables),
        "missing input": lambda q, k, v, doc: attn.tile_tables(q, k, v),
    }
    for message, function in refused.items():
        torch._dynamo.reset()
        with pytest.raises(ValueError, match=f"^document_causal: {message}"):
            torch.compile(function, backend="aot_eager", fullgraph=fullgraph)(q, k, v, inputs["doc"])


def test_autocast_casts_q_k_v_as_sdpa_does():
    """Under torch.autocast, float q, k and v are cast to its dtype (bfloat16 on the CPU here) before the
    kernels, in eager and compiled calls, as scaled_dot_product_attention is; the result is the reference's
    in that dtype, and gradients come back in the callers' dtypes. Outside autocast, mixed dtypes are refused."""
    attn, q, k, v, inputs = _case("alibi_causal", 40)

    def autocast(function):
        def call(q, k, v, **kw):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return function(q.float(), k.float(), v.float(), **kw)  # float32 in; bfloat16 leaves exactly
        return call

    q16, k16, v16 = (x.bfloat16() for x in (q, k, v))
    testing.check_against_reference(attn.spec, autocast(attn), q16, k16, v16, inputs)
    compiled = torch.compile(lambda q, k, v, **kw: attn(q, k, v, **kw), backend="aot_eager", fullgraph=True)
    testing.check_against_reference(attn.spec, autocast(compiled), q16, k16, v16, inputs)

    leaves = [q.requires_grad_(), k.requires_grad_(), v.bfloat16().requires_grad_()]  # float32 q, k as RoPE gives
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attn(*leaves, **inputs)
    assert out.dtype == torch.bfloat16
    assert [g.dtype for g in torch.autograd.grad(out.sum(), leaves)] == [torch.float32, torch.float32, torch.bfloat16]
    with pytest.raises(ValueError, match="q, k and v must share a dtype, got torch.float32, torch.float32, "
                                         "torch.bfloat16"):
        attn(*leaves, **inputs)


@pytest.mark.parametrize("name", ["document_causal", "learned_rel_bias", "global_band"])
def test_opcheck(name):
    attn, q, k, v, inputs = _case(name, 24)
    table_op, forward_op, backward_op = attn.module.OPERATORS[:3]
    tensors = [inputs[i.name] for i in attn.spec.inputs]
    tables = []
    if attn.module.FACTS.tile_table:
        key = attn.module._table_key(q, v, 0)
        torch.library.opcheck(table_op, (q, k, tensors, *key))
        tables = list(table_op(q, k, tensors, *key))
    learnable = [t.requires_grad_() for t, i in zip(tensors, attn.spec.inputs) if i.learnable]
    torch.library.opcheck(forward_op, ([x.requires_grad_() for x in (q, k, v)] + [tensors, tables, [], [], 0.0]))
    with torch.no_grad():
        out, lse = forward_op(q, k, v, tensors, tables, [], [], 0.0)
    module = attn.module
    backward_tables = module._resolve([1, 2], q, v, {}, module._builder(arguments._sizes(q, k), q.device, tensors))
    for t in (q, k, v, *learnable):
        t.requires_grad_(False)
    torch.library.opcheck(backward_op, (q, k, v, out, lse, torch.randn_like(out), torch.randn_like(lse),
                                        tensors, [t for table in backward_tables for t in table], [], 0.0))


def _import(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_operator_names_follow_the_module_text(tmp_path):
    source = attngen.compile_source("specs/sliding_window.attn", params={"window": 8})
    (tmp_path / "a.py").write_text(source)
    (tmp_path / "b.py").write_text(source)
    (tmp_path / "c.py").write_text(attngen.compile_source("specs/sliding_window.attn", params={"window": 9}))
    a, b, c = (_import(tmp_path / f"{n}.py", f"attngen_test_ops_{n}") for n in "abc")
    assert a.OPERATORS == b.OPERATORS  # the same module imported twice shares its operators
    assert a.OPERATORS[1] != c.OPERATORS[1]  # another window is another operator
    q, k, v = testing.random_qkv(1, 2, 2, 24, 24, 16, 16, torch.float32, device="cpu")
    compiled = torch.compile(lambda q, k, v: (a.attn(q, k, v), c.attn(q, k, v)), backend="aot_eager", fullgraph=True)
    out_a, out_c = compiled(q, k, v)
    assert torch.equal(out_a, a.attn(q, k, v)) and torch.equal(out_c, c.attn(q, k, v))
    assert not torch.equal(out_a, out_c)
