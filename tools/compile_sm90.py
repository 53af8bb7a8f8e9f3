"""Compiles every kernel of every catalog spec's module for sm_90 (Hopper) on a machine without a GPU, so
a template that Triton rejects is caught before any device time is spent; prints each kernel's PTX size.

    python tools/compile_sm90.py [--only causal document_causal ...] [--family hopper] [--head-dim 64] [--ptx DIR]
                                 [--json] [--folder benchmarks/published] [--context-parallel] [--plain]

With --context-parallel it compiles instead the spec each rank of a context-parallel call runs (global
positions read from scalar inputs, no sink: attngen.frontend.positions).

Triton's compiler needs no GPU (`triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`); it
must run without TRITON_INTERPRET, so each module is compiled in a child process that imports only the
generated module. Parameter types follow the kernels' declared signatures (attngen.emit.signatures):
pointers by name, ints as i32, the scales and dropout_p as fp32. Each kernel that forms P is compiled with
dropout too (DROPOUT, labelled _dropout), a portable backward that adds learnable inputs' gradients also in
deterministic mode and with both (_deterministic, _dropout_deterministic), and the runtime's keep-mask kernel
once a module.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Pointer parameters and their element types in a bf16 call; every other non-constexpr parameter is an
# i32 (strides, sizes, lengths) except the fp32 scales.
POINTERS = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Out": "*bf16", "DO": "*bf16", "DQ": "*bf16", "DK": "*bf16",
            "DV": "*bf16", "Lse": "*fp32", "Delta": "*fp32", "DLse": "*fp32", "Visits": "*i32", "VisitsKV": "*i32",
            "VisitsQ": "*i32", "State": "*i8", "Num": "*i32", "Idx": "*i32", "OutPart": "*fp32",
            "LsePart": "*fp32", "KvLen": "*i32", "QOffset": "*i32", "PageTable": "*i32",
            "work_counter": "*i32", "Lse2": "*fp32", "DqSum": "*fp32", "Dq": "*bf16", "CuSeqlensQ": "*i32",
            "CuSeqlensK": "*i32", "Sink": "*fp32", "DSink": "*fp32", "Words": "*i64", "Rng": "*i64", "Mask": "*u8",
            "QDescale": "*fp32", "KDescale": "*fp32", "VDescale": "*fp32"}
FLOATS = {"sm_scale", "qk_scale", "scale", "dropout_p"}
INPUT_TYPES = {"f32": "*fp32", "f16": "*fp16", "bf16": "*bf16", "i32": "*i32", "i64": "*i64", "bool": "*u8"}


def _type(name: str, inputs: dict) -> str:
    if name in POINTERS:
        return POINTERS[name]
    if name.endswith("TblNum") or name.endswith("TblIdx"):
        return "*i32"
    if name.endswith("_ptr") and name[:-4] in inputs:
        return INPUT_TYPES[inputs[name[:-4]][0]]
    if name.endswith("_grad") and name[:-5] in inputs:
        return "*fp32"
    return "fp32" if name in FLOATS else "i32"


def _label(constants: dict) -> str:
    """What tells apart launches of one kernel: the backward's PARTS and a LABEL of our own."""
    return f"{constants.get('PARTS', '')}{constants.get('LABEL', '')}"


def compile_module(path: str, ptx_dir: str | None, families: list[str] | None = None, head_dim: int = 128,
                   plain: bool = False) -> dict:
    """In a process without TRITON_INTERPRET: compile the module's kernels at D = DV = head_dim (a power of
    two), bf16, on its h200 plan (only those of `families`, by name prefix, when given; with `plain`, only the
    launches without a label: no packed, paged, dropout or deterministic variants)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    spec = importlib.util.spec_from_file_location("attngen_sm90_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    target = GPUTarget("cuda", 90, 32)
    plan = module.FACTS.plan[(head_dim, head_dim, "bf16")]
    head = dict(HEAD_DIM=head_dim, HEAD_DIM_V=head_dim, HEAD_DIM_PAD=head_dim, HEAD_DIM_V_PAD=head_dim,
                COUNT_VISITS=False, DOT_PRECISION="tf32", HAS_KV_LEN=False, HAS_Q_OFFSET=False, PAGED=False,
                PAGE_SIZE=1, VARLEN=False, DROPOUT=False, FP8=False)
    forward = dict(head, BLOCK_M=plan[0][0], BLOCK_N=plan[0][1], FOLLOW_TABLE=bool(module.FACTS.tile_table))
    # Also a cache call over pages of 16 keys (no tile table, per-row lengths and offsets) and a packed call.
    launches = [("_fwd_kernel", forward, plan[0]),
                ("_fwd_kernel", dict(forward, FOLLOW_TABLE=False, HAS_KV_LEN=True, HAS_Q_OFFSET=True, PAGED=True,
                                     PAGE_SIZE=16, LABEL="_paged"), plan[0]),
                ("_fwd_kernel", dict(forward, FOLLOW_TABLE=False, VARLEN=True, LABEL="_packed"), plan[0]),
                ("_fwd_kernel", dict(forward, DROPOUT=True, LABEL="_dropout"), plan[0]),
                ("_fwd_kernel", dict(forward, FP8=True, LABEL="_fp8"), plan[0])]  # float8_e4m3fn q, k and v
    backward = dict(head, BLOCK_M1=plan[1][0], BLOCK_N1=plan[1][1], BLOCK_M2=plan[2][0], BLOCK_N2=plan[2][1],
                    FOLLOW_TABLE=bool(module.FACTS.tile_table), VARLEN=False, DETERMINISTIC=False)
    for parts, tiles in ((3, max(plan[1], plan[2])), (1, plan[1]), (2, plan[2])):
        launches.append(("_bwd_kernel", dict(backward, PARTS=parts), tiles))
    launches.append(("_bwd_kernel", dict(backward, PARTS=3, FOLLOW_TABLE=False, VARLEN=True, LABEL="_packed"),
                     max(plan[1], plan[2])))
    for parts, tiles in ((3, max(plan[1], plan[2])), (1, plan[1]), (2, plan[2])):
        launches.append(("_bwd_kernel", dict(backward, PARTS=parts, DROPOUT=True, LABEL="_dropout"), tiles))
    learnable = any(learnable for _, _, learnable in module.FACTS.inputs.values())
    if learnable:  # deterministic mode: the learnable inputs' gradients summed exactly, and rounded after
        launches.append(("_bwd_kernel", dict(backward, PARTS=3, DETERMINISTIC=True, LABEL="_deterministic"),
                         max(plan[1], plan[2])))
        launches.append(("_bwd_kernel", dict(backward, PARTS=3, DETERMINISTIC=True, DROPOUT=True,
                                             LABEL="_dropout_deterministic"), max(plan[1], plan[2])))
        launches.append(("_exact_finish", dict(BLOCK=1024), (0, 0, 4, 1)))
    for family, tiles in module.FACTS.family_tiles.get((head_dim, head_dim, "bf16"), {}).items():
        if family == "decode":  # one decode tile of 4 query heads x 1 query, and the merge of the splits
            launches.append(("_decode_fwd_kernel", dict(head, BLOCK_M=16, BLOCK_N=tiles[1]),
                             tiles))
            launches.append(("_decode_combine", dict(HEAD_DIM_V=head_dim, HEAD_DIM_V_PAD=head_dim, SPLIT_BLOCK=16,
                                                     HAS_SINK=module.FACTS.sink is not None,
                                                     ADD_PARTS=module.FACTS.normalize == "sigmoid", CHECK=True,
                                                     HAS_KV_LEN=True, HAS_Q_OFFSET=False, PAGED=True, PAGE_SIZE=16,
                                                     BLOCK_PAGES=2048),
                             (0, 0, 4, 1)))
        if family == "hopper":
            hopper = _hopper_runtime(module)
            hopper_fwd = dict(head, BLOCK_M=tiles[0], BLOCK_N=tiles[1], STAGES=tiles[3], Q_BUFFERS=tiles[4],
                              CONSUMERS=hopper._hopper_consumers(tiles[0]), DEFER_SCALE=module.HOPPER_PLAIN_SCORE)

            def call_rows(dropout, fp8):  # the rows the runtime's forward gives a dropout or FP8 call
                rows = hopper._hopper_forward_rows(tiles[0], dropout, fp8)
                return dict(BLOCK_M=rows, CONSUMERS=hopper._hopper_consumers(rows))

            launches += [("_hopper_fwd_kernel", dict(hopper_fwd, FOLLOW_TABLE=bool(module.FACTS.tile_table), VARLEN=False),
                          tiles),
                         ("_hopper_fwd_kernel", dict(hopper_fwd, FOLLOW_TABLE=False, VARLEN=True, LABEL="_packed"),
                          tiles),
                         ("_hopper_fwd_kernel", dict(hopper_fwd, FOLLOW_TABLE=bool(module.FACTS.tile_table), VARLEN=False,
                                                     DROPOUT=True, LABEL="_dropout", **call_rows(True, False)), tiles),
                         # float8_e4m3fn q, k and V^T
                         ("_hopper_fwd_kernel", dict(hopper_fwd, FOLLOW_TABLE=bool(module.FACTS.tile_table), VARLEN=False,
                                                     FP8=True, LABEL="_fp8", **call_rows(False, True)), tiles)]
        if family == "hopper_bwd":
            hopper = _hopper_runtime(module)
            hopper_bwd = dict(head, BLOCK_M=tiles[0], BLOCK_N=tiles[1], STAGES=tiles[3],
                              SPLIT_D=hopper._hopper_backward_config(*tiles[1:3])[2])

            def folds(block_m, dropout):  # the runtime's FOLD_ROWS and FOLD_LSE for such a call
                fold_rows, fold_lse = hopper._hopper_folds(block_m, module.FACTS.normalize != "sigmoid", dropout,
                                                           module.HOPPER_PLAIN_SCORE,
                                                           module.softmax_scale(head_dim))
                return dict(BLOCK_M=block_m, FOLD_ROWS=fold_rows, FOLD_LSE=fold_lse)

            dropout_rows = hopper._hopper_backward_rows(tiles[0], True, bool(module.FACTS.tile_table))
            launches += [("_hopper_bwd_kernel", dict(hopper_bwd, FOLLOW_TABLE=bool(module.FACTS.tile_table), VARLEN=False,
                                                     **folds(tiles[0], False)), tiles),
                         ("_hopper_bwd_kernel", dict(hopper_bwd, FOLLOW_TABLE=False, VARLEN=True, LABEL="_packed",
                                                     **folds(tiles[0], False)), tiles),
                         # Dropout calls walk the rows the runtime's backward gives them.
                         ("_hopper_bwd_kernel", dict(hopper_bwd, FOLLOW_TABLE=bool(module.FACTS.tile_table), VARLEN=False,
                                                     DROPOUT=True, LABEL="_dropout", **folds(dropout_rows, True)),
                          tiles)]
            # Its row terms' pass, which also zeros dQ's fp32 sum (a sigmoid spec has none), and the pass that
            # scales and rounds it. (Deterministic calls run the portable backward: the Hopper one has no such mode.)
            if module.FACTS.normalize != "sigmoid":
                preprocess = dict(HEAD_DIM_V=head_dim, HEAD_DIM_V_PAD=head_dim, BLOCK_M=64, HAS_DLSE=True,
                                  BASE2_LSE=True, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim, ZERO_DQ=True,
                                  SINK_GRAD=False)
                launches.append(("_bwd_preprocess", preprocess, (0, 0, 4, 1)))
                if module.FACTS.sink is not None:  # the sink rows' gradient, in the same pass
                    launches.append(("_bwd_preprocess", dict(preprocess, SINK_GRAD=True, LABEL="_sink"), (0, 0, 4, 1)))
            launches.append(("_hopper_dq_finish", dict(BLOCK=_hopper_runtime(module).HOPPER_DQ_FINISH_BLOCK), (0, 0, 4, 1)))
    # The runtime's kernel of attn.dropout_mask (the keep-mask by the kernels' own helper).
    launches.append(("_dropout_mask_kernel", dict(BLOCK_M=64, BLOCK_N=64), (0, 0, 4, 1)))
    if module.FACTS.tile_table:
        for name in ("_table_by_query_classify", "_table_by_key_classify"):
            launches.append((name, dict(BLOCK_M=plan[0][0], BLOCK_N=plan[0][1], ROW_STEP=0, ROW_POINTS=1,
                                        LOOP_STEP=0, LOOP_POINTS=1), (0, 0, 4, 1)))
    sizes = {}
    for name, constants, tiles in launches:
        if families and not any(name.startswith(f"_{family}") for family in families):
            continue
        if plain and constants.get("LABEL"):
            continue
        fn = getattr(module, name) if hasattr(module, name) else getattr(_runtime_module(module, name), name)
        signature = {p.name: ("constexpr" if p.is_constexpr else _type(p.name, module.FACTS.inputs)) for p in fn.params}
        if constants.get("DETERMINISTIC"):  # the learnable inputs' gradients are int64 words then
            signature = {n: "*i64" if n.endswith("_grad") and t == "*fp32" else t for n, t in signature.items()}
        if constants.get("FP8") and "Q" in signature:  # the portable forward's pointers
            signature = {**signature, "Q": "*fp8e4nv", "K": "*fp8e4nv", "V": "*fp8e4nv"}
        if name == "_exact_finish":
            signature = {**signature, "Out": "*fp32"}
        constexprs = {(i,): constants[p.name] for i, p in enumerate(fn.params) if p.is_constexpr}
        if name in ("_hopper_fwd_kernel", "_hopper_bwd_kernel"):
            compiled = _compile_hopper(module, fn, signature, constexprs, constants, tiles, target)
        else:
            # Pointers 16-byte aligned, as Triton specializes a launch on torch's allocations.
            aligned = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params)
                       if signature[p.name].startswith("*")}
            compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs=aligned), target=target,
                                      options=dict(num_warps=tiles[2], num_stages=tiles[3]))
        ptx = compiled.asm["ptx"]
        if ptx_dir:
            # Without debug lines, so two versions of a template compare by their instructions alone.
            lines = [line for line in ptx.splitlines() if not line.lstrip().startswith((".loc", ".file", "//"))]
            stem = Path(ptx_dir, f"{Path(path).stem}{name}{_label(constants)}")
            stem.with_suffix(".ptx").write_text("\n".join(lines))
            # And the cubin, for nvdisasm (SASS: instruction counts, dependency chains, spills).
            stem.with_suffix(".cubin").write_bytes(compiled.asm["cubin"])
        sizes[f"{name}{_label(constants)}"] = {"ptx_lines": ptx.count("\n"), "shared": compiled.metadata.shared,
                                                        "spill_stores": _spill_stores(compiled.asm["cubin"]),
                                                        "wgmma": "wgmma" in ptx,
                                                        "mma": "mma.sync" in ptx, "tanh_approx": "tanh.approx" in ptx,
                                                        "rcp_approx": "rcp.approx" in ptx,
                                                        "tma": "cp.async.bulk.tensor" in ptx,
                                                        "setmaxnreg": "setmaxnreg" in ptx}
    return sizes


def _spill_stores(cubin: bytes) -> int | None:
    """The register spill stores (STL) in a cubin's SASS, by the nvdisasm Triton ships; None without it."""
    import triton

    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    if not nvdisasm.is_file():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True, check=True).stdout
    return len(re.findall(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?STL\b", sass, re.MULTILINE))


def _runtime_module(module, name):
    """The runtime module (of the bundle's own copy of attngen.runtime, or of a family's runtime side) that
    defines kernel `name`, which the generated module does not import (the runtime launches it)."""
    for part in ("runtime.kernels", "runtime.dropout", "runtime"):
        found = next((m for key, m in sys.modules.items() if key.endswith(f".{part}") and hasattr(m, name)), None)
        if found is not None:
            return found
    raise LookupError(name)


def _hopper_runtime(module):
    """The Hopper family's runtime module of a generated module (the bundle's own copy of attngen.families.hopper.runtime)."""
    return sys.modules[type(module.ATTENTION.families["hopper"]).__module__]


def _compile_hopper(module, fn, signature, constexprs, constants, tiles, target):
    """The Hopper family's Gluon forward or backward, typed as a bf16 launch of its host code would type
    it: TMA descriptors of the tiles' boxes (the forward's consumers each have a box of their own query rows;
    the backward reduces dQ into fp32)."""
    import triton
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    block_m, block_n = constants["BLOCK_M"], constants["BLOCK_N"]
    d, dv = constants["HEAD_DIM_PAD"], constants["HEAD_DIM_V_PAD"]

    def descriptor(shape, element="bf16"):
        layout = gl.NVMMASharedLayout.get_default_for(
            shape, {"bf16": gl.bfloat16, "fp32": gl.float32, "fp8e4nv": gl.float8e4nv}[element])
        return f"tensordesc<{element}[{', '.join(map(str, shape))}],{layout!r}>"
    box = _hopper_runtime(module)._hopper_tile_box
    if "CONSUMERS" in constants:
        rows = block_m // constants["CONSUMERS"]
        boxes = {"q_desc": box(rows, d), "k_desc": box(block_n, d), "v_desc": box(block_n, dv),
                 "o_desc": box(rows, dv)}
        if constants.get("FP8"):  # e4m3 Q, K and V^T boxes (head dims x keys), O bf16
            signature = {**signature, **{name: descriptor(shape, "fp8e4nv") for name, shape in
                                         (("q_desc", box(rows, d)), ("k_desc", box(block_n, d)),
                                          ("v_desc", box(dv, block_n)))}}
            boxes = {"o_desc": box(rows, dv)}
        num_warps, maxnreg = _hopper_runtime(module)._hopper_launch_config(block_m, constants["CONSUMERS"])
    else:
        boxes = {"q_desc": box(block_m, d), "k_desc": box(block_n, d), "v_desc": box(block_n, dv),
                 "do_desc": box(block_m, dv)}
        rows = {"lse_desc": descriptor([1, block_m], "fp32"), "delta_desc": descriptor([1, block_m], "fp32")}
        # (A sigmoid spec's backward reads no row terms: it has no such parameters.)
        signature = {**signature, "dq_desc": descriptor(box(block_m, d), "fp32"),
                     **{name: value for name, value in rows.items() if name in signature}}
        num_warps, maxnreg, _ = _hopper_runtime(module)._hopper_backward_config(block_n, tiles[2])
    signature = {**signature, **{name: descriptor(shape) for name, shape in boxes.items()}}
    return triton.compile(GluonASTSource(fn, signature, constexprs), target=target,
                          options=dict(num_warps=num_warps, maxnreg=maxnreg))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--ptx", help="write each kernel's PTX (without debug lines) and cubin to this folder")
    parser.add_argument("--family", nargs="*", help="only these families' kernels (e.g. hopper)")
    parser.add_argument("--json", action="store_true", help="print one JSON object: spec -> kernel -> facts")
    parser.add_argument("--head-dim", type=int, default=128, help="D = DV of the launches (a power of two)")
    parser.add_argument("--folder", default=str(ROOT / "specs"), help="the folder of the .attn specs (default specs/)")
    parser.add_argument("--context-parallel", action="store_true",
                        help="compile the specs with global positions that context-parallel calls run")
    parser.add_argument("--plain", action="store_true",
                        help="only the plain launches: no packed, paged, dropout or deterministic variants")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(compile_module(args.child, args.ptx, args.family, args.head_dim, args.plain)))
        return
    import attngen
    from attngen.frontend.positions import shifted, without_sink

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    failed = 0
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for path in sorted(Path(args.folder).glob("*.attn")):
            if args.only and path.stem not in args.only:
                continue
            module = Path(folder) / f"{path.stem}.py"
            source = path.read_text()
            if args.context_parallel:
                source = without_sink(shifted(attngen.parse_spec(source)).spec)
            module.write_text(attngen.compile_source(source, target="h200"))
            ptx = ["--ptx", str(Path(args.ptx).resolve())] if args.ptx else []
            if args.ptx:
                Path(args.ptx).mkdir(parents=True, exist_ok=True)
            family = ["--family", *args.family] if args.family else []
            plain = ["--plain"] if args.plain else []
            run = subprocess.run([sys.executable, __file__, "--child", str(module), *ptx, *family, *plain,
                                  "--head-dim", str(args.head_dim)], env=env,
                                 capture_output=True, text=True)
            if run.returncode != 0:
                failed += 1
                print(f"{path.stem}: FAILED\n{run.stderr[-3000:]}")
                continue
            kernels = results[path.stem] = json.loads(run.stdout.strip().splitlines()[-1])
            if not args.json:
                print(f"{path.stem}: " + ", ".join(f"{k} {v['ptx_lines']} PTX lines, {v['shared']} B shared"
                                                   for k, v in kernels.items()))
    if args.json:
        print(json.dumps(results))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
