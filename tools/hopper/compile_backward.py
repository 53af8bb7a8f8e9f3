"""Compiles the Gluon attention backward prototype (gluon_backward.py) for sm_90 on a machine without a GPU,
reports its PTX, and checks a CPU model of its schedule against float64 autograd.

    python tools/hopper/compile_backward.py [--only bf16:128:causal ...] [--ptx DIR] [--skip-model]
                                            [--skip-compile] [--json]

Compile part, for bf16/fp16 x D 64/128 x causal off/on (or the --only configs, dtype:D:causal|full):
`_bwd_kernel` through `triton.compile(GluonASTSource(...), target=GPUTarget("cuda", 90, 32))`, the counts of
wgmma.mma_async, cp.async.bulk.tensor (TMA), mbarrier, setmaxnreg and atom/red.global in the PTX, and the
registers / spills that `ptxas -v --gpu-name sm_90a` reports (the consumer's budget is set by setmaxnreg,
so ptxas's "Used" is the launch cap, maxnreg; the spills are the whole kernel's). Also the preprocess kernel,
and the main kernel through the JIT's own binder on awkward shapes (N = 1 specialises to a constexpr).
A config fails when it does not compile or a counted instruction is missing; spills are reported, not
failed on (see NOTES.md). Triton must not be in interpreter mode: TRITON_INTERPRET is dropped here.

Model part: `model_backward` replays the kernel's schedule tile by tile in float32 (same grid of key
tiles, same query-tile ranges and masked/unmasked split, the TMA boxes' reads past a head's end, the
padded base-2 LSE and delta, P and dS rounded to the input dtype before their products, dQ accumulated
tile by tile in fp32 and scaled once) and is compared with torch autograd of float64 attention. It checks
the index arithmetic and numerics of the scheme, not the Gluon code's layouts or barriers.

Exit status 1 if anything fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
import triton  # noqa: E402

import gluon_backward as gb  # noqa: E402

COUNTED = ("wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier", "setmaxnreg", "atom.global", "red.global",
           "cp.reduce.async.bulk.tensor")
# The instructions the kernel exists for; a compile without them is a failure.
REQUIRED = ("wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier", "setmaxnreg")
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
CONFIGS = [(dtype, d, causal) for dtype in ("bf16", "fp16") for d in gb.HEAD_DIMS for causal in (False, True)]
# Compiled with dQ by atomics (the default) and by TMA reduce-add (":tma").
COMPILE_CONFIGS = [(*config, tma) for tma in (False, True) for config in CONFIGS]
# Shapes for the JIT-path compiles: (dtype, B, H, HKV, N, D, causal).
JIT_SHAPES = [("bf16", 1, 4, 4, 1, 128, True), ("fp16", 2, 8, 2, 1000, 64, False), ("bf16", 1, 32, 8, 129, 128, False)]
# The dQ path the JIT-path compiles take (each shape is compiled with both).
DQ_PATHS = {False: "atomics", True: "tma"}


def _desc_sig(dtype: str, block_shape: list[int]) -> str:
    # The string the JIT builds for a gluon TensorDescriptor argument (triton.language.str_to_ty parses it).
    from triton.experimental.gluon import language as gl

    element = {"bf16": gl.bfloat16, "fp16": gl.float16, "fp32": gl.float32}[dtype]
    layout = gl.NVMMASharedLayout.get_default_for(block_shape, element)
    return f"tensordesc<{dtype}[{', '.join(map(str, block_shape))}],{layout!r}>"


def compile_config(dtype: str, head_dim: int, causal: bool, dq_tma_reduce: bool = False):
    """The main kernel for one config, typed as backward() would type a launch (N etc. as plain i32)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    block_m, block_n, stages, num_warps, maxnreg = gb.launch_config(head_dim, causal)
    fn = gb._bwd_kernel
    signature = {
        "q_desc": _desc_sig(dtype, [block_m, head_dim]), "k_desc": _desc_sig(dtype, [block_n, head_dim]),
        "v_desc": _desc_sig(dtype, [block_n, head_dim]), "do_desc": _desc_sig(dtype, [block_m, head_dim]),
        "lse_desc": _desc_sig("fp32", [block_m]), "delta_desc": _desc_sig("fp32", [block_m]),
        "dq_desc": _desc_sig("fp32", [block_m, head_dim]), "dq_ptr": "*fp32", "dk_ptr": "*" + dtype,
        "dv_ptr": "*" + dtype, "qk_scale": "fp32", "sm_scale": "fp32",
        "N": "i32", "N_PAD": "i32", "H": "i32", "HKV": "i32"}
    constants = dict(HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages, CAUSAL=causal,
                     DQ_TMA_REDUCE=dq_tma_reduce)
    signature.update({p.name: "constexpr" for p in fn.params if p.is_constexpr})
    constexprs = {(i,): constants[p.name] for i, p in enumerate(fn.params) if p.is_constexpr}
    compiled = triton.compile(GluonASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps, maxnreg=maxnreg))
    return compiled, dict(tile=f"{block_m}x{block_n}x{stages}", num_warps=num_warps, maxnreg=maxnreg)


def compile_preprocess(dtype: str, head_dim: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = gb._bwd_preprocess
    signature = {"O": "*" + dtype, "DO": "*" + dtype, "Lse": "*fp32", "Delta": "*fp32", "Lse2": "*fp32",
                 "N": "i32", "N_PAD": "i32", "HEAD_DIM": "constexpr", "BLOCK_M": "constexpr"}
    constexprs = {(7,): head_dim, (8,): gb.launch_config(head_dim)[0]}
    return triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4))


def jit_path_compile(dtype: str, B: int, H: int, HKV: int, N: int, head_dim: int, causal: bool,
                     dq_tma_reduce: bool = False):
    """Compiles exactly what gluon_backward.backward would launch for these shapes: the JIT's binder turns
    the host descriptors, CPU tensors and ints into the signature and its specialisations."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import create_function_from_signature

    fn = gb._bwd_kernel
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    td = TORCH_DTYPES[dtype]
    q = torch.empty(B, H, N, head_dim, dtype=td)
    k = torch.empty(B, HKV, N, head_dim, dtype=td)
    block_m = gb.launch_config(head_dim, causal)[0]
    delta = torch.empty(B * H * triton.cdiv(N, block_m) * block_m)
    _, args, kwargs = gb.launch_args(q, k, k, q, delta, torch.empty_like(delta), q.float(), k, k, causal,
                                     dq_tma_reduce)
    kwargs.update(debug=False, instrumentation_mode="")
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(GluonASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def ptxas_usage(ptx: str) -> dict:
    """Registers and spills as `ptxas -v` reports them (the cubin in compiled.asm has no readable counts)."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as folder:
        src = Path(folder, "k.ptx")
        src.write_text(ptx)
        run = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", str(src), "-o",
                              str(Path(folder, "k.cubin"))], capture_output=True, text=True)
    text = run.stdout + run.stderr
    usage = {"ptxas_ok": run.returncode == 0}
    if m := re.search(r"Used (\d+) registers", text):
        usage["registers"] = int(m.group(1))
    if m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text):
        usage["spill_stores"], usage["spill_loads"] = int(m.group(1)), int(m.group(2))
    usage["warnings"] = [line.strip() for line in text.splitlines() if "warning" in line.lower()]
    return usage


def compile_report(configs, ptx_dir: str | None = None) -> dict:
    """name -> facts for each (dtype, D, causal, dq_tma_reduce); a config that fails to compile has an "error"."""
    results = {}
    for dtype, head_dim, causal, tma in configs:
        name = f"{dtype}:{head_dim}:{'causal' if causal else 'full'}" + (":tma" if tma else "")
        try:
            compiled, cfg = compile_config(dtype, head_dim, causal, tma)
        except Exception as exc:  # report every configuration, not only the first failure
            lines = str(exc).strip().splitlines()
            results[name] = {"error": lines[-1] if lines else type(exc).__name__}
            continue
        ptx = compiled.asm["ptx"]
        if ptx_dir:
            Path(ptx_dir).mkdir(parents=True, exist_ok=True)
            Path(ptx_dir, name.replace(":", "_") + ".ptx").write_text(ptx)
        results[name] = {"counts": {c: ptx.count(c) for c in COUNTED}, "shared": compiled.metadata.shared, **cfg,
                         **ptxas_usage(ptx)}
    return results


# ----------------------------------------------------------------------------------------------
# CPU model of the kernel's schedule


def _boxes(flat, starts, rows: int):
    """TMA boxes of `rows` rows of the (R, D) matrix `flat` starting at each of `starts`: rows past a head's
    end are the next head's, rows past the matrix are TMA's zero fill."""
    padded = torch.cat([flat, flat.new_zeros(rows, flat.shape[1])])
    index = (starts[:, None] + torch.arange(rows)[None, :]).clamp(max=flat.shape[0])
    return padded[index]


def model_backward(q, k, v, o, dout, lse, causal: bool):
    """dq, dk, dv as _bwd_kernel computes them, tile by tile in float32, vectorised over (batch, kv head)."""
    B, H, N, D = q.shape
    HKV = k.shape[1]
    group = H // HKV
    dtype = q.dtype
    block_m, block_n, _, _, _ = gb.launch_config(D, causal)
    sm_scale = 1.0 / math.sqrt(D)
    qk_scale = sm_scale * gb.LOG2E
    n_m = triton.cdiv(N, block_m)
    n_pad = n_m * block_m
    # _bwd_preprocess: padded rows get delta 0 and lse2 = +inf, as do rows whose LSE is -inf.
    delta = torch.zeros(B * H, n_pad)
    delta[:, :N] = (o.float() * dout.float()).sum(-1).reshape(B * H, N)
    lse2 = torch.full((B * H, n_pad), float("inf"))
    lse2[:, :N] = torch.where(lse == float("-inf"), float("inf"), lse * gb.LOG2E).reshape(B * H, N)
    q_flat, do_flat = q.reshape(-1, D), dout.reshape(-1, D)
    k_flat, v_flat = k.reshape(-1, D), v.reshape(-1, D)
    dq_accum = torch.zeros(B * H * N, D)
    dk = torch.empty(B * HKV * N, D, dtype=dtype)
    dv = torch.empty(B * HKV * N, D, dtype=dtype)
    bkv = torch.arange(B * HKV)  # one CTA per (key tile, b * HKV + hkv)
    head0 = (bkv // HKV) * H + (bkv % HKV) * group
    for j in range(triton.cdiv(N, block_n)):
        start_n = j * block_n
        if causal:
            i_lo, i_mid = start_n // block_m, min(triton.cdiv(start_n + block_n - 1, block_m), n_m)
        else:
            i_lo, i_mid = 0, 0
        if start_n + block_n > N:
            i_mid = n_m
        offs_n = start_n + torch.arange(block_n)
        kt = _boxes(k_flat, bkv * N + start_n, block_n).float()
        vt = _boxes(v_flat, bkv * N + start_n, block_n).float()
        dk_acc = torch.zeros(B * HKV, block_n, D)
        dv_acc = torch.zeros(B * HKV, block_n, D)
        for g in range(group):
            bh = head0 + g
            for i in range(i_lo, n_m):
                offs_m = i * block_m + torch.arange(block_m)
                qt = _boxes(q_flat, bh * N + i * block_m, block_m).float()
                dot = _boxes(do_flat, bh * N + i * block_m, block_m).float()
                l2 = lse2[bh, i * block_m:(i + 1) * block_m]
                dl = delta[bh, i * block_m:(i + 1) * block_m]
                s_t = kt @ qt.transpose(1, 2)
                p_t = torch.exp2(s_t * qk_scale - l2[:, None, :])
                allowed = (offs_n < N)[:, None].expand(block_n, block_m)
                if causal:
                    allowed = allowed & (offs_n[:, None] <= offs_m[None, :])
                if i < i_mid:
                    p_t = torch.where(allowed, p_t, 0.0)
                else:
                    # The kernel skips the mask here; the model asserts that was legitimate for the real
                    # queries (padding queries have P = 0 through lse2 = +inf).
                    assert bool(allowed[:, offs_m < N].all()), (j, i)
                dv_acc += p_t.to(dtype).float() @ dot
                dp_t = vt @ dot.transpose(1, 2)
                ds_t = (p_t * (dp_t - dl[:, None, :])).to(dtype).float()
                dk_acc += ds_t @ qt
                dq = ds_t.transpose(1, 2) @ kt
                rows = offs_m < N
                # Padding queries' dQ rows are exact zeros: the TMA reduce-add may add them to the next head.
                assert bool((dq[:, ~rows] == 0).all()), (j, i)
                index = (bh[:, None] * N + offs_m[None, rows]).reshape(-1)
                dq_accum.index_add_(0, index, dq[:, rows].reshape(-1, D))
        keys = offs_n < N
        index = (bkv[:, None] * N + offs_n[None, keys]).reshape(-1)
        dk[index] = (dk_acc[:, keys] * sm_scale).reshape(-1, D).to(dtype)
        dv[index] = dv_acc[:, keys].reshape(-1, D).to(dtype)
    dq = (dq_accum * sm_scale).to(dtype).reshape(B, H, N, D)
    return dq, dk.reshape(B, HKV, N, D), dv.reshape(B, HKV, N, D)


def reference(q, k, v, dout, causal: bool):
    """out, lse (natural log) and dq, dk, dv by torch autograd of float64 attention, top-left causal, GQA."""
    B, H, N, D = q.shape
    group = H // k.shape[1]
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    s = (qd @ kd.repeat_interleave(group, 1).transpose(-1, -2)) / math.sqrt(D)
    if causal:
        s = s.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.softmax(s, -1) @ vd.repeat_interleave(group, 1)
    out.backward(dout.double())
    return out.detach(), lse.detach(), qd.grad, kd.grad, vd.grad


# The model's error bound, in units of the input dtype's epsilon times the gradient's largest magnitude:
# P and dS are rounded to the input dtype before their products and the outputs are rounded once more,
# so errors of a few epsilons of the largest entry are the expected ones (measured: below 0.7).
MODEL_TOLERANCE_EPS = 8
MODEL_SHAPES = [(1, 2, 1, 2), (1, 4, 100, 2), (2, 4, 257, 4), (1, 8, 300, 2), (1, 2, 384, 1)]


def model_case(dtype: str, head_dim: int, causal: bool, B: int, H: int, N: int, HKV: int, seed: int = 0) -> dict:
    """Model vs float64 autograd on one shape: per gradient, max |error| / max |reference| in epsilons."""
    torch.manual_seed(seed)
    td = TORCH_DTYPES[dtype]
    q = torch.randn(B, H, N, head_dim).to(td)
    k = torch.randn(B, HKV, N, head_dim).to(td)
    v = torch.randn(B, HKV, N, head_dim).to(td)
    dout = torch.randn(B, H, N, head_dim).to(td)
    out, lse, *grads = reference(q, k, v, dout, causal)
    model = model_backward(q, k, v, out.to(td), dout, lse.float(), causal)
    eps = torch.finfo(td).eps
    errors = {}
    for name, got, want in zip(("dq", "dk", "dv"), model, grads):
        scale = want.abs().max().item() or 1.0
        errors[name] = float("nan") if got.isnan().any() else (got.double() - want).abs().max().item() / scale / eps
    return errors


def model_check() -> int:
    failures, worst = 0, 0.0
    for dtype, head_dim, causal in CONFIGS:
        for shape in MODEL_SHAPES:
            errors = model_case(dtype, head_dim, causal, *shape)
            bad = {name: e for name, e in errors.items() if not e <= MODEL_TOLERANCE_EPS}
            worst = max(worst, *errors.values())
            failures += bool(bad)
            if bad:
                print(f"  model {dtype} D{head_dim} causal={causal} B,H,N,HKV={shape}: {errors} (eps units) FAIL")
    print(f"schedule model vs float64 autograd (CPU), {len(CONFIGS) * len(MODEL_SHAPES)} cases: "
          f"{'OK' if not failures else f'{failures} FAILED'}, worst error {worst:.2f} eps x max|grad|")
    return failures


def _parse_config(text: str):
    dtype, head_dim, mask, *dq = text.split(":")
    return dtype, int(head_dim), mask == "causal", dq == ["tma"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", type=_parse_config, help="configs as dtype:D:causal|full[:tma]")
    parser.add_argument("--ptx", help="write each configuration's PTX to this folder")
    parser.add_argument("--skip-model", action="store_true", help="skip the CPU model check")
    parser.add_argument("--skip-compile", action="store_true", help="only the CPU model check")
    parser.add_argument("--json", action="store_true", help="print the compile facts as one JSON line at the end")
    args = parser.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)
    failed = 0
    if not args.skip_compile:
        results = compile_report(args.only or COMPILE_CONFIGS, args.ptx)
        print(f"{'config':<20} {'status':<7} " + " ".join(f"{c[:12]:>12}" for c in COUNTED) +
              "   regs spill(st/ld) smem(B)")
        for name, facts in results.items():
            if "error" in facts:
                failed += 1
                print(f"{name:<20} FAILED  {facts['error']}")
                continue
            missing = [c for c in REQUIRED if not facts["counts"][c]]
            failed += bool(missing) or not facts["ptxas_ok"]
            status = "OK" if not missing and facts["ptxas_ok"] else "BAD"
            print(f"{name:<20} {status:<7} " + " ".join(f"{facts['counts'][c]:>12}" for c in COUNTED) +
                  f"   {facts.get('registers', '?'):>4} {facts.get('spill_stores', '?')}/"
                  f"{facts.get('spill_loads', '?')} {facts['shared']:>8}  {facts['tile']} w{facts['num_warps']}+1 "
                  f"maxnreg={facts['maxnreg']}")
            for warning in facts["warnings"]:
                print(f"    ptxas: {warning}")
            if missing:
                print(f"    missing from PTX: {', '.join(missing)}")
        for dtype in ("bf16", "fp16"):
            for head_dim in gb.HEAD_DIMS:
                try:
                    compile_preprocess(dtype, head_dim)
                    print(f"preprocess {dtype} D{head_dim}: OK")
                except Exception as exc:
                    failed += 1
                    print(f"preprocess {dtype} D{head_dim}: FAILED {str(exc).strip().splitlines()[-1:]}")
        for (dtype, B, H, HKV, N, head_dim, causal), tma in [(s, t) for t in DQ_PATHS for s in JIT_SHAPES]:
            name = (f"JIT path {dtype} B{B} H{H} HKV{HKV} N{N} D{head_dim} {'causal' if causal else 'full'} "
                    f"dQ by {DQ_PATHS[tma]}")
            try:
                ptx = jit_path_compile(dtype, B, H, HKV, N, head_dim, causal, tma).asm["ptx"]
                ok = all(c in ptx for c in REQUIRED)
                failed += not ok
                print(f"{name}: {'OK' if ok else 'BAD (instructions missing)'}")
            except Exception as exc:
                failed += 1
                print(f"{name}: FAILED {str(exc).strip().splitlines()[-1:]}")
        if args.json:
            print(json.dumps(results))
    if not args.skip_model:
        failed += model_check() > 0
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
