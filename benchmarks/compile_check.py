"""attngen under torch.compile on the GPU: Inductor fullgraph forward+backward against eager and the
float64 reference, dynamic lengths without recompiles, CUDA graphs (mode="reduce-overhead") in a
training step, and the per-call host overhead beside SDPA and FlexAttention, including the
torch.library.triton_op route that attngen did not take. Prints each result and writes JSON.

    python benchmarks/compile_check.py [--out compile.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
import traceback

import torch
import torch.nn.functional as F
import triton

import attngen
from attngen import testing

SPECS = ["causal", "document_causal", "learned_rel_bias", "gemma2_local", "alibi_causal"]
RESULTS: dict = {"versions": {"torch": torch.__version__, "triton": triton.__version__}}


def record(name, fn):
    """Runs one check, keeping its result or its error, so one failure does not hide the rest."""
    t0 = time.perf_counter()
    try:
        RESULTS[name] = fn()
        status = "ok"
    except Exception as e:  # every check reports; the run goes on
        traceback.print_exc()
        RESULTS[name] = {"error": f"{type(e).__name__}: {e}"[:1500]}
        status = "FAIL"
    print(f"{status:4} {name} ({time.perf_counter() - t0:.1f} s): {json.dumps(RESULTS[name])[:600]}", flush=True)


def case(name, B=2, H=8, HKV=2, N=1024, D=64, dtype=torch.bfloat16, seed=0):
    attn = attngen.build(f"specs/{name}.attn")
    q, k, v = testing.random_qkv(B, H, HKV, N, N, D, D, dtype, device="cuda", seed=seed)
    inputs = testing.random_inputs(attn.spec, B, H, HKV, N, N, device="cuda", seed=seed)
    return attn, q, k, v, inputs


def loss_fn(attn):
    def loss(q, k, v, inputs):
        out, lse = attn(q, k, v, return_lse=True, **inputs)
        return out.float().square().sum() + torch.where(lse.isfinite(), lse, 0).sum()
    return loss


def leaves(attn, q, k, v, inputs):
    learnable = [inputs[i.name] for i in attn.spec.learnable_inputs]
    return [x.requires_grad_() for x in (q, k, v, *learnable)]


def inductor_fullgraph(name):
    torch._dynamo.reset()
    attn, q, k, v, inputs = case(name)
    xs = leaves(attn, q, k, v, inputs)
    loss = loss_fn(attn)
    want = torch.autograd.grad(loss(q, k, v, inputs), xs)
    got = torch.autograd.grad(torch.compile(loss, fullgraph=True)(q, k, v, inputs), xs)
    nan = any(g.isnan().any().item() for g in got)
    # Bit for bit where the kernels are deterministic; a learnable input's gradient is summed with
    # atomics in any order, so there the reference check below is the measure.
    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want))
    equal = all(torch.equal(a, b) for a, b in zip(got, want))
    # And the compiled call against the float64 reference (out, lse, every gradient).
    compiled = torch.compile(lambda q, k, v, **kw: attn(q, k, v, **kw), fullgraph=True)
    small = case(name, B=1, H=4, HKV=2, N=512, seed=1)
    testing.check_against_reference(small[0].spec, compiled, *small[1:4], small[4])
    assert not nan and (equal or attn.spec.learnable_inputs), (equal, nan)
    return {"grads_equal_eager": equal, "max_diff_vs_eager": diff, "nan": nan, "reference": "match"}


def dynamic_lengths():
    torch._dynamo.reset()
    attn, *_ = case("document_causal")
    loss = loss_fn(attn)
    compiled = torch.compile(loss, fullgraph=True, dynamic=True)
    for i, n in enumerate((1024, 1536, 2047, 4096)):
        _, q, k, v, inputs = case("document_causal", N=n, seed=i)
        xs = leaves(attn, q, k, v, inputs)
        want = torch.autograd.grad(loss(q, k, v, inputs), xs)
        got = torch.autograd.grad(compiled(q, k, v, inputs), xs)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), n
        torch.compiler.set_stance("fail_on_recompile")
    torch.compiler.set_stance("default")
    return {"lengths": [1024, 1536, 2047, 4096], "recompiles": 0}


class Block(torch.nn.Module):
    """A transformer attention block: the model a training script would compile."""

    def __init__(self, attn, dim=512, heads=8, kv_heads=2):
        super().__init__()
        self.attn, self.heads, self.kv_heads, self.d = attn, heads, kv_heads, dim // heads
        self.qkv = torch.nn.Linear(dim, (heads + 2 * kv_heads) * self.d, bias=False)
        self.out = torch.nn.Linear(heads * self.d, dim, bias=False)

    def forward(self, x, inputs):
        B, N, _ = x.shape
        q, k, v = self.qkv(x).split([self.heads * self.d, self.kv_heads * self.d, self.kv_heads * self.d], -1)
        q, k, v = (t.view(B, N, -1, self.d).transpose(1, 2) for t in (q, k, v))
        o = self.attn(q, k, v, **inputs)
        return self.out(o.transpose(1, 2).reshape(B, N, -1))


def cuda_graphs(name):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    attn = attngen.build(f"specs/{name}.attn")
    torch.manual_seed(0)
    model = Block(attn).cuda().bfloat16()
    x = torch.randn(2, 1024, 512, device="cuda", dtype=torch.bfloat16)
    inputs = testing.random_inputs(attn.spec, 2, 8, 2, 1024, 1024, device="cuda", seed=0)

    def step(m):
        loss = m(x, inputs).float().square().mean()
        loss.backward()
        grads = [p.grad.clone() for p in m.parameters()]
        m.zero_grad(set_to_none=True)
        return loss.detach(), grads

    want_loss, want = step(model)
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    for _ in range(4):  # warm-up, record, replays
        loss, got = step(compiled)
    skips = dict(torch._dynamo.utils.counters["inductor"])
    close = all(torch.allclose(a.float(), b.float(), rtol=2e-2, atol=1e-3) for a, b in zip(got, want))
    graphs_used = skips.get("cudagraph_skips", 0) == 0
    t_eager = triton.testing.do_bench(lambda: step(model), return_mode="median")
    t_graph = triton.testing.do_bench(lambda: step(compiled), return_mode="median")
    assert close and graphs_used, (close, skips)
    return {"loss_eager": want_loss.item(), "loss_graphs": loss.item(), "grads_close": close,
            "cudagraph_skips": skips.get("cudagraph_skips", 0), "step_ms_eager": t_eager, "step_ms_graphs": t_graph}


def host_us(fn, calls=2000):
    """Microseconds per call of a loop of calls with one synchronisation: the host's cost per call
    when it is larger than the GPU's (the shapes here keep the GPU's under ~10 us)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return round((time.perf_counter() - t0) / calls * 1e6, 1)


def triton_op_forward(attn):
    """The forward through torch.library.triton_op + wrap_triton, the route not taken: a second
    copy of the module whose forward kernel Inductor sees."""
    from torch.library import triton_op, wrap_triton

    spec = importlib.util.spec_from_file_location("attngen_triton_op_probe", attn.path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    module._fwd_kernel = wrap_triton(module._fwd_kernel)

    @triton_op("attngen_probe::causal_forward", mutates_args=())
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return module._forward(q, k, v, [], ())

    return forward


def host_overhead():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.reset()
    attn, q, k, v, _ = case("causal", B=1, H=8, HKV=8, N=128, D=64)
    rows = {}
    with torch.no_grad():
        rows["attngen eager"] = host_us(lambda: attn(q, k, v))
        rows["attngen eager via custom op"] = host_us(lambda: attn.module.OPERATORS[1](q, k, v, [], [], [], [], 0.0))
        compiled = torch.compile(lambda q, k, v: attn(q, k, v), fullgraph=True)
        rows["attngen torch.compile"] = host_us(lambda: compiled(q, k, v))
        graphs = torch.compile(lambda q, k, v: attn(q, k, v), mode="reduce-overhead", fullgraph=True)
        rows["attngen torch.compile reduce-overhead"] = host_us(lambda: graphs(q, k, v))
        rows["SDPA eager (is_causal)"] = host_us(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, 128, 128, device="cuda")
        flex = torch.compile(flex_attention, fullgraph=True)
        rows["FlexAttention torch.compile (BlockMask built once)"] = host_us(lambda: flex(q, k, v, block_mask=mask))
        try:
            probe = triton_op_forward(attn)
            want = attn(q, k, v)
            compiled_probe = torch.compile(lambda q, k, v: probe(q, k, v)[0], fullgraph=True)
            same = torch.equal(compiled_probe(q, k, v), want)
            rows["attngen forward as triton_op, torch.compile"] = host_us(lambda: compiled_probe(q, k, v))
            rows["triton_op output equals eager"] = same
        except Exception as e:  # the route's failure is the measurement
            traceback.print_exc()
            rows["attngen forward as triton_op, torch.compile"] = f"{type(e).__name__}: {str(e)[:400]}"
    xs = [t.requires_grad_() for t in (q, k, v)]
    do = torch.randn_like(q)

    def fwd_bwd(fn):
        return lambda: torch.autograd.backward(fn(*xs), do)

    rows["fwd+bwd attngen eager"] = host_us(fwd_bwd(attn), 1000)
    rows["fwd+bwd attngen torch.compile"] = host_us(fwd_bwd(torch.compile(lambda q, k, v: attn(q, k, v))), 1000)
    rows["fwd+bwd SDPA eager"] = host_us(fwd_bwd(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)), 1000)
    rows["fwd+bwd FlexAttention torch.compile"] = host_us(fwd_bwd(lambda q, k, v: flex(q, k, v, block_mask=mask)), 1000)
    rows["shape"] = "B1 H8 N128 D64 bf16 causal; us per call, host-bound loop"
    rows["eager forward profile"] = profile_eager(attn, q.detach(), k.detach(), v.detach())
    return rows


def profile_eager(attn, q, k, v, calls=2000):
    """Where an eager forward call's host time goes: the functions with the most own time."""
    import cProfile
    import pstats

    with torch.no_grad():
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(calls):
            attn(q, k, v)
        profiler.disable()
    stats = pstats.Stats(profiler).stats
    top = sorted(stats.items(), key=lambda item: -item[1][2])[:12]
    return [f"{fn[2]} ({fn[0].rsplit('/', 1)[-1]}:{fn[1]}): {own / calls * 1e6:.1f} us own, "
            f"{total / calls * 1e6:.1f} us total" for fn, (_, _, own, total, _) in top]


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="compile.json")
    args = parser.parse_args()
    RESULTS["device"] = torch.cuda.get_device_name()
    for name in SPECS:
        record(f"inductor fullgraph fwd+bwd: {name}", lambda: inductor_fullgraph(name))
    record("dynamic=True, four lengths", dynamic_lengths)
    for name in ("causal", "document_causal", "learned_rel_bias"):
        record(f"reduce-overhead training step: {name}", lambda: cuda_graphs(name))
    record("host overhead", host_overhead)
    with open(args.out, "w") as f:
        json.dump(RESULTS, f, indent=2)


if __name__ == "__main__":
    main()
