"""Compiles the Gluon Hopper attention kernel for sm_90 on a machine without a GPU and checks its PTX.

    python tools/hopper/compile_check.py [--ptx DIR] [--skip-model]

For bf16/fp16 x D 64/128 x causal off/on: compiles `attention_fwd_kernel` with
`triton.compile(GluonASTSource(...), target=GPUTarget("cuda", 90, 32))`, prints whether it compiled,
the counts of wgmma.mma_async, cp.async.bulk.tensor (TMA), mbarrier and setmaxnreg in the PTX, and the
registers / spills / shared memory (ptxas -v on the PTX; shared bytes from the kernel metadata).
A configuration also fails when one of those instructions is missing or ptxas reports spills.

Gluon kernels cannot run under TRITON_INTERPRET in triton 3.6 (`gluon.jit` always builds a
GluonJITFunction, which asks for a GPU driver at launch), so the CPU-checkable part is a tile-by-tile
model of the kernel's schedule (same tile ranges, masking split, base-2 online softmax, empty-row
rule, P rounded to the input dtype before PV) checked against SDPA's math backend on awkward shapes.
It checks the index arithmetic and numerics of the scheme, not the Gluon code's layouts.

Exit status 1 if any configuration fails. Runs without TRITON_INTERPRET (it is dropped if set).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

import gluon_attention as ga  # noqa: E402

COUNTED = ("wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier", "setmaxnreg")
GL_DTYPES = {"bf16": gl.bfloat16, "fp16": gl.float16}
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _desc_sig(dtype: str, block_shape: list[int]) -> str:
    # The string the JIT would build for a gluon TensorDescriptor argument (see
    # triton.language.str_to_ty: "tensordesc<dtype[block],Layout(...)>").
    layout = gl.NVMMASharedLayout.get_default_for(block_shape, GL_DTYPES[dtype])
    return f"tensordesc<{dtype}[{', '.join(map(str, block_shape))}],{layout!r}>"


def compile_config(dtype: str, head_dim: int, causal: bool, block_n: int | None = None, stages: int | None = None,
                   pingpong: bool = False):
    block_m, block_n, stages, num_warps, maxnreg = ga.launch_config(head_dim, causal, block_n, stages, pingpong)
    rows = block_m // 2 if pingpong else block_m
    fn = ga.attention_fwd_kernel
    signature = {
        "q_desc": _desc_sig(dtype, [rows, head_dim]),
        "k_desc": _desc_sig(dtype, [block_n, head_dim]),
        "v_desc": _desc_sig(dtype, [block_n, head_dim]),
        "o_desc": _desc_sig(dtype, [rows, head_dim]),
        "o_ptr": "*" + dtype, "lse_ptr": "*fp32", "sm_scale": "fp32", "N": "i32", "H": "i32", "GROUP": "i32",
    }
    constants = dict(HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages, CAUSAL=causal,
                     PINGPONG=pingpong)
    for p in fn.params:
        if p.is_constexpr:
            signature[p.name] = "constexpr"
    constexprs = {(i, ): constants[p.name] for i, p in enumerate(fn.params) if p.is_constexpr}
    compiled = triton.compile(GluonASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps, maxnreg=maxnreg))
    return compiled, dict(block_m=block_m, block_n=block_n, stages=stages, num_warps=num_warps, maxnreg=maxnreg,
                          workers="4+1" if pingpong else "1")


def ptxas_usage(ptx: str) -> dict:
    """Registers and spills as ptxas reports them (the cubin in compiled.asm has no readable counts)."""
    from triton.backends.nvidia.compiler import get_ptxas

    try:
        ptxas = get_ptxas().path
    except Exception:  # older/newer layouts of the nvidia backend
        ptxas = str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas")
    with tempfile.TemporaryDirectory() as folder:
        src = Path(folder, "k.ptx")
        src.write_text(ptx)
        run = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", str(src), "-o", str(Path(folder, "k.cubin"))],
                             capture_output=True, text=True)
    text = run.stdout + run.stderr
    usage = {}
    if m := re.search(r"Used (\d+) registers", text):
        usage["registers"] = int(m.group(1))
    if m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text):
        usage["spill_stores"], usage["spill_loads"] = int(m.group(1)), int(m.group(2))
    usage["warnings"] = [line.strip() for line in text.splitlines() if "warning" in line.lower()]
    return usage


def jit_path_compile(dtype: str, B: int, H: int, HKV: int, N: int, head_dim: int, causal: bool,
                     pingpong: bool = False):
    """Compile exactly as `gluon_attention.attention` would at launch: the JIT's own binder turns the host
    TensorDescriptors and ints into the signature (N=1 becomes a constexpr, N % 16 an alignment
    attribute), so shapes that specialise differently are covered without a GPU."""
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = ga.attention_fwd_kernel
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    td = TORCH_DTYPES[dtype]
    q = torch.empty(B, H, N, head_dim, dtype=td)
    k = torch.empty(B, HKV, N, head_dim, dtype=td)
    out = torch.empty_like(q)
    lse = torch.empty(B, H, N)
    block_m, block_n, stages, num_warps, maxnreg = ga.launch_config(head_dim, causal, pingpong=pingpong)
    rows = block_m // 2 if pingpong else block_m
    layout_m = ga.shared_layout([rows, head_dim], td)
    layout_n = ga.shared_layout([block_n, head_dim], td)
    q_desc = ga.TensorDescriptor.from_tensor(q.view(-1, head_dim), [rows, head_dim], layout_m)
    k_desc = ga.TensorDescriptor.from_tensor(k.view(-1, head_dim), [block_n, head_dim], layout_n)
    o_desc = ga.TensorDescriptor.from_tensor(out.view(-1, head_dim), [rows, head_dim], layout_m)
    kwargs = dict(HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages, CAUSAL=causal,
                  PINGPONG=pingpong, num_warps=num_warps, maxnreg=maxnreg, debug=False, instrumentation_mode="")
    bound, specialization, options = binder(q_desc, k_desc, k_desc, o_desc, out, lse, 0.125, N, H, H // HKV,
                                            **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(GluonASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


JIT_SHAPES = [("bf16", 1, 4, 4, 1, 128, True), ("fp16", 2, 8, 8, 1000, 64, False), ("bf16", 1, 32, 8, 1000, 128, True),
              ("fp16", 1, 4, 1, 129, 64, True)]


# ----------------------------------------------------------------------------------------------
# CPU model of the kernel's schedule


def model_attention(q, k, v, causal: bool, sm_scale: float | None = None):
    """Tile-by-tile float32 model of attention_fwd_kernel: same tile ranges (n_full / n_tiles), same
    masked/unmasked split, base-2 online softmax with the -inf guard, P rounded to q.dtype before PV,
    and rows past N of a tile computed but not written."""
    B, H, N, D = q.shape
    HKV = k.shape[1]
    group = H // HKV
    block_m, block_n, _, _, _ = ga.launch_config(D, causal)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    qk_scale = sm_scale * 1.4426950408889634
    kx = k.repeat_interleave(group, dim=1).float()
    vx = v.repeat_interleave(group, dim=1).float()
    out = torch.empty(B, H, N, D, dtype=q.dtype)
    lse = torch.empty(B, H, N, dtype=torch.float32)
    for pid_m in range(triton.cdiv(N, block_m)):
        off_m = pid_m * block_m
        rows = torch.arange(off_m, off_m + block_m)
        qt = torch.zeros(B, H, block_m, D)
        valid = rows < N
        qt[:, :, valid] = q[:, :, rows[valid]].float()
        if causal:
            n_tiles = triton.cdiv(min(off_m + block_m, N), block_n)
            n_full = min((off_m + 1) // block_n, N // block_n)
        else:
            n_tiles = triton.cdiv(N, block_n)
            n_full = N // block_n
        m_i = torch.full((B, H, block_m), float("-inf"))
        l_i = torch.zeros(B, H, block_m)
        o = torch.zeros(B, H, block_m, D)
        for j in range(n_tiles):
            masked = j == 0 or j >= max(n_full, 1)
            cols = torch.arange(j * block_n, (j + 1) * block_n)
            kt = torch.zeros(B, H, block_n, D)
            vt = torch.zeros(B, H, block_n, D)
            inb = cols < N
            kt[:, :, inb] = kx[:, :, cols[inb]]
            vt[:, :, inb] = vx[:, :, cols[inb]]
            s = qt @ kt.transpose(-1, -2)
            if masked:
                allowed = (cols < N)[None, :].expand(block_m, block_n)
                if causal:
                    allowed = allowed & (cols[None, :] <= rows[:, None])
                s = s.masked_fill(~allowed, float("-inf"))
            else:
                # The kernel skips the mask here; the model asserts that was legitimate.
                assert bool((cols < N).all()) and (not causal or bool((cols[None, :] <= rows[valid][:, None]).all()))
            m_new = torch.maximum(m_i, s.amax(-1) * qk_scale)
            m_use = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new) if masked else m_new
            p = torch.exp2(s * qk_scale - m_use[..., None])
            alpha = torch.exp2(m_i - m_use)
            l_i = l_i * alpha + p.sum(-1)
            o = o * alpha[..., None] + p.to(q.dtype).float() @ vt
            m_i = m_new
        empty = l_i == 0
        inv_l = torch.where(empty, torch.zeros_like(l_i), 1.0 / l_i)
        row_lse = torch.where(empty, torch.full_like(l_i, float("-inf")), (m_i + torch.log2(l_i)) * math.log(2))
        out[:, :, rows[valid]] = (o * inv_l[..., None])[:, :, valid].to(q.dtype)
        lse[:, :, rows[valid]] = row_lse[:, :, valid]
    return out, lse


def reference(q, k, v, causal: bool, sm_scale: float | None = None):
    """float32 SDPA (math backend on CPU) and its LSE, top-left causal."""
    B, H, N, D = q.shape
    group = H // k.shape[1]
    qf, kf, vf = q.float(), k.repeat_interleave(group, 1).float(), v.repeat_interleave(group, 1).float()
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    s = (qf @ kf.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, is_causal=causal, scale=scale)
    return out, lse


def model_check() -> int:
    torch.manual_seed(0)
    failures = 0
    shapes = [(1, 2, 1, 2), (1, 4, 100, 2), (2, 4, 257, 4), (1, 8, 300, 2), (1, 2, 384, 2)]
    for dtype in ("bf16", "fp16"):
        for head_dim in (64, 128):
            for causal in (False, True):
                for B, H, N, HKV in shapes:
                    td = TORCH_DTYPES[dtype]
                    q = torch.randn(B, H, N, head_dim).to(td)
                    k = torch.randn(B, HKV, N, head_dim).to(td)
                    v = torch.randn(B, HKV, N, head_dim).to(td)
                    out, lse = model_attention(q, k, v, causal)
                    ref_out, ref_lse = reference(q, k, v, causal)
                    err_o = (out.float() - ref_out).abs().max().item()
                    err_l = (lse - ref_lse).abs().max().item()
                    nan = bool(out.isnan().any() or lse.isnan().any())
                    ok = not nan and err_o < 2e-2 and err_l < 1e-3
                    failures += not ok
                    if not ok:
                        print(f"  model {dtype} D{head_dim} causal={causal} B{B} H{H} N{N} HKV{HKV}: "
                              f"max|dO|={err_o:.3g} max|dLSE|={err_l:.3g} nan={nan}  FAIL")
    print(f"schedule model vs SDPA math (CPU): {'OK' if not failures else f'{failures} FAILED'}")
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ptx", help="write each configuration's PTX to this folder")
    parser.add_argument("--skip-model", action="store_true", help="skip the CPU model check")
    args = parser.parse_args()
    failed = 0
    header = f"{'config':<22} {'status':<8} " + " ".join(f"{c:>20}" for c in COUNTED) + "   regs spill smem(B) tiles"
    print(header)
    for pingpong in (False, True):
      for dtype in ("bf16", "fp16"):
        for head_dim in (64, 128):
            for causal in (False, True):
                name = f"{'pp ' if pingpong else ''}{dtype} D{head_dim} {'causal' if causal else 'full'}"
                try:
                    compiled, cfg = compile_config(dtype, head_dim, causal, pingpong=pingpong)
                except Exception as exc:  # report every configuration, not only the first failure
                    failed += 1
                    msg = str(exc).strip().splitlines()
                    print(f"{name:<22} FAILED   {msg[-1] if msg else type(exc).__name__}")
                    continue
                ptx = compiled.asm["ptx"]
                if args.ptx:
                    Path(args.ptx).mkdir(parents=True, exist_ok=True)
                    Path(args.ptx, f"{'pp_' if pingpong else ''}{dtype}_d{head_dim}_{'causal' if causal else 'full'}.ptx"
                         ).write_text(ptx)
                counts = {c: ptx.count(c) for c in COUNTED}
                usage = ptxas_usage(ptx)
                spills = usage.get("spill_stores", 0) + usage.get("spill_loads", 0)
                missing = [c for c, n in counts.items() if n == 0]
                status = "OK" if not missing and not spills else "BAD"
                failed += status != "OK"
                print(f"{name:<22} {status:<8} " + " ".join(f"{counts[c]:>20}" for c in COUNTED) +
                      f"   {usage.get('registers', '?'):>4} {spills:>5} {compiled.metadata.shared:>7} "
                      f"{cfg['block_m']}x{cfg['block_n']}x{cfg['stages']} w{cfg['num_warps']}+{cfg['workers']} "
                      f"maxnreg={cfg['maxnreg']}")
                for warning in usage["warnings"]:
                    print(f"    ptxas: {warning}")
                if missing:
                    print(f"    missing from PTX: {', '.join(missing)}")
    for (dtype, B, H, HKV, N, head_dim, causal), pingpong in [(s, pp) for pp in (False, True) for s in JIT_SHAPES]:
        name = (f"JIT path {'pp ' if pingpong else ''}{dtype} B{B} H{H} HKV{HKV} N{N} D{head_dim} "
                f"{'causal' if causal else 'full'}")
        try:
            jit_path_compile(dtype, B, H, HKV, N, head_dim, causal, pingpong)
            print(f"{name}: OK")
        except Exception as exc:
            failed += 1
            msg = str(exc).strip().splitlines()
            print(f"{name}: FAILED {msg[-1] if msg else type(exc).__name__}")
    if not args.skip_model:
        failed += model_check() > 0
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
