"""What a feature costs: a spec (or a call) with it against the same spec without it, timed side by side on
the GPU (the targets: a sink <= 1.05x the time without it; sigmoid attention <= 1.0x the same spec with
softmax; a deterministic backward <= 1.15x; dropout <= 1.3x), and dropout beside SDPA's own (its FLASH and
EFFICIENT backends, dropout_p on plain attention).

    python benchmarks/feature_cost.py [--shape B,H,N,D ...] [--only WORD ...] [--json FILE]

Each row: forward (no_grad) and forward+backward median ms (triton.testing.do_bench), bf16, the same
q, k, v for both builds; the ratio is the feature's time over the time without it. `--only` keeps the rows
whose feature names contain one of the words (e.g. `--only sigmoid deterministic`, `--only dropout`); several
shapes run one after another. A dropout row's call passes dropout_p (its time includes the draw of the
call's Philox words); its SDPA columns time scaled_dot_product_attention with and without the same
dropout_p on the same tensors.
"""

from __future__ import annotations

import argparse
import json
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import attngen
from attngen import testing
from attngen.plan.targets import PRESETS, Target

# The portable family alone, with the tiles of an sm_90 GPU's shared memory (a capability below 9 keeps the
# Hopper family out): its forward and the deterministic backward (the portable one, which a deterministic call
# runs on Hopper too, after the Hopper forward), set against the Hopper default.
PORTABLE_ON_HOPPER = Target(**{**PRESETS["h100"].model_dump(), "name": "portable on sm_90", "capability": (8, 9)})

DROPOUT_P = 0.1


class Case(NamedTuple):
    """A feature's row: the spec with it and the same spec without it, attngen.build's keywords for each, and
    the keywords of the call with it."""
    feature: str
    with_spec: str
    without_spec: str
    options: dict = {}
    call: dict = {}
    without_options: dict = {}


CASES = [
    Case("sink (gpt_oss_sinks: window 128, a learned sink per head)",
         "specs/gpt_oss_sinks.attn",
         "attention gpt_oss_no_sink\nparam window = 128\nmask: causal and q - k < window\n"),
    Case("sink on causal attention",
         "attention causal_sink\ninput sinks: f32[H] learnable\nmask: causal\nsink: sinks[h]\n",
         "specs/causal.attn"),
    # Sigmoid against softmax of the very same scores (the -log(KV_LEN) bias changes no softmax, but costs the
    # same), and against the catalog's ALiBi, which lacks that term.
    Case("sigmoid (sigmoid_alibi against the same spec with softmax)",
         "specs/sigmoid_alibi.attn",
         "attention softmax_alibi_log\ninput slopes: f32[H]\nmask: causal\n"
         "score: score + slopes[h] * (k - q) - log(KV_LEN)\n"),
    Case("sigmoid (sigmoid_alibi against alibi_causal)", "specs/sigmoid_alibi.attn", "specs/alibi_causal.attn"),
    # No score expression: the scale applied in exp2's argument (DEFER_SCALE) on both sides.
    Case("sigmoid on plain causal attention", "attention sigmoid_causal\nnormalize: sigmoid\nmask: causal\n",
         "specs/causal.attn"),
    # The same build with and without deterministic mode (its options: attngen.build's keywords).
    Case("deterministic backward (causal)", "specs/causal.attn", "specs/causal.attn", {"deterministic": True}),
    Case("deterministic backward (learned_rel_bias: a learned table's exact sums)", "specs/learned_rel_bias.attn",
         "specs/learned_rel_bias.attn", {"deterministic": True}),
    # The portable family's own cost of it (planned for an A100: the portable kernels alone), whose backward
    # writes dQ, dK and dV once a tile either way.
    Case("deterministic backward on the portable family (causal)", "specs/causal.attn", "specs/causal.attn",
         {"deterministic": True, "target": "a100"}, without_options={"target": "a100"}),
    Case("deterministic backward on the portable family against the Hopper family's default (causal)",
         "specs/causal.attn", "specs/causal.attn", {"deterministic": True, "target": PORTABLE_ON_HOPPER}),
    Case("deterministic backward on the portable family against the Hopper family's default (learned_rel_bias)",
         "specs/learned_rel_bias.attn", "specs/learned_rel_bias.attn",
         {"deterministic": True, "target": PORTABLE_ON_HOPPER}),
    # The same spec, its call with dropout_p and without.
    Case(f"dropout {DROPOUT_P} on causal attention", "specs/causal.attn", "specs/causal.attn",
         call={"dropout_p": DROPOUT_P}),
    Case(f"dropout {DROPOUT_P} on full attention", "specs/full.attn", "specs/full.attn", call={"dropout_p": DROPOUT_P}),
]
# SDPA's backends that take dropout_p, timed beside attngen's dropout rows (plain attention: causal or full).
SDPA_BACKENDS = {"sdpa flash": SDPBackend.FLASH_ATTENTION, "sdpa efficient": SDPBackend.EFFICIENT_ATTENTION}


def _time(attn, q, k, v, inputs, dout, backward):
    if not backward:
        with torch.no_grad():
            return triton.testing.do_bench(lambda: attn(q, k, v, **inputs), warmup=25, rep=200)
    leaves = [q, k, v, *(t for t in inputs.values() if isinstance(t, torch.Tensor) and t.requires_grad)]
    return triton.testing.do_bench(lambda: torch.autograd.grad(attn(q, k, v, **inputs), leaves, dout),
                                   warmup=25, rep=200)


def _sdpa(backend, causal, dropout_p):
    """scaled_dot_product_attention on one backend, called as an attngen call is."""
    def call(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=dropout_p)
    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", nargs="+", default=["2,16,8192,128"], help="B,H,N,D (one or more)")
    parser.add_argument("--only", nargs="*", help="only the rows whose feature names contain one of these words")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    cases = [case for case in CASES if not args.only or any(word in case[0] for word in args.only)]
    rows = []
    for shape in args.shape:
        rows += _rows(cases, *(int(x) for x in shape.split(",")))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name(),
                       "rows": rows}, f, indent=1)


def _rows(cases, B, H, N, D):
    """Each case's row at one shape, printed as it is measured."""
    q, k, v = (t.requires_grad_() for t in testing.random_qkv(B, H, H, N, N, D, D, torch.bfloat16, device="cuda"))
    dout = torch.randn_like(q)
    rows = []
    for case in cases:
        feature, call = case.feature, case.call
        row = {"feature": feature, "shape": [B, H, N, D]}
        for name, spec, build_options, keywords in (("with", case.with_spec, case.options, call),
                                                    ("without", case.without_spec, case.without_options, {})):
            attn = attngen.build(spec, **build_options)
            inputs = testing.random_inputs(attn.spec, B, H, H, N, N, device="cuda")
            for decl in attn.spec.learnable_inputs:  # the others are data: no gradient
                inputs[decl.name].requires_grad_()
            row[f"{name} families"] = (attn.forward_family(q, k, v, **inputs, **keywords),
                                       attn.backward_family(q, k, v, **inputs))
            for part, backward in (("fwd", False), ("fwd+bwd", True)):
                row[f"{name} {part} ms"] = _time(attn, q, k, v, {**inputs, **keywords}, dout, backward)
        for part in ("fwd", "fwd+bwd"):
            row[f"{part} ratio"] = row[f"with {part} ms"] / row[f"without {part} ms"]
        print(f"{feature} B{B} H{H} N{N} D{D} bf16, families {row['with families']}:")
        for part in ("fwd", "fwd+bwd"):
            print(f"  {part:8s} with {row[f'with {part} ms']:.3f} ms, without {row[f'without {part} ms']:.3f} ms: "
                  f"{row[f'{part} ratio']:.3f}x", flush=True)
        if "dropout_p" in call:
            _sdpa_columns(row, "causal" in case.with_spec, call["dropout_p"], q, k, v, dout)
        rows.append(row)
    return rows


def _sdpa_columns(row, causal, dropout_p, q, k, v, dout):
    """SDPA's backends with and without the same dropout_p on the same tensors, into a dropout row."""
    for backend_name, backend in SDPA_BACKENDS.items():
        for label, p in (("with", dropout_p), ("without", 0.0)):
            for part, backward in (("fwd", False), ("fwd+bwd", True)):
                try:
                    ms = _time(_sdpa(backend, causal, p), q, k, v, {}, dout, backward)
                except RuntimeError as e:  # a backend this GPU or build does not have
                    ms = None
                    row[f"{backend_name} error"] = str(e).splitlines()[0]
                row[f"{backend_name} {label} {part} ms"] = ms
        for part in ("fwd", "fwd+bwd"):
            theirs = row[f"{backend_name} with {part} ms"]
            if theirs is None:
                continue
            row[f"{backend_name} {part} ratio"] = theirs / row[f"{backend_name} without {part} ms"]
            row[f"attngen over {backend_name} {part}"] = row[f"with {part} ms"] / theirs
            print(f"  {backend_name:14s} {part:8s} with {theirs:.3f} ms, without "
                  f"{row[f'{backend_name} without {part} ms']:.3f} ms: {row[f'{backend_name} {part} ratio']:.3f}x;"
                  f" attngen's with over its: {row[f'attngen over {backend_name} {part}']:.3f}x", flush=True)


if __name__ == "__main__":
    main()
