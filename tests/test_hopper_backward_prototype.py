"""The Gluon attention backward prototype for Hopper (tools/hopper/gluon_backward.py), on the CPU: its main
kernel compiles for sm_90 with wgmma, TMA and dQ atomics in the PTX, and the CPU model of its schedule
matches float64 autograd on awkward shapes (N = 1, N not a multiple of the tiles, GQA).

The kernel itself runs only on a Hopper GPU (Gluon kernels do not run under TRITON_INTERPRET in 3.6)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parent.parent / "tools" / "hopper" / "compile_backward.py"


def _load_tool():
    spec = importlib.util.spec_from_file_location("hopper_compile_backward", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


compile_backward = _load_tool()


def test_the_backward_compiles_for_sm90_with_wgmma_tma_and_atomics():
    # Triton compiles for sm_90 without a GPU but not in interpreter mode, hence the child process. The tool
    # also compiles the preprocess kernel and the JIT path's specialisations; any failure exits 1.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    configs = ["bf16:128:causal", "fp16:64:full", "bf16:128:causal:tma"]
    run = subprocess.run([sys.executable, str(TOOL), "--only", *configs, "--skip-model", "--json"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    assert sorted(results) == sorted(configs)
    for name, facts in results.items():
        counts = facts["counts"]
        # Five products a step (S^T, dP^T, dV, dK, dQ), each one wgmma per 16 of its K dimension, in the
        # masked and the unmasked loop: 2 x (D/16 + D/16 + 64/16 + 64/16 + 128/16) sites.
        head_dim = int(name.split(":")[1])
        assert facts["tile"] == "64x128x2", (name, facts["tile"])
        assert counts["wgmma.mma_async"] == 2 * (2 * head_dim // 16 + 4 + 4 + 8), (name, counts)
        assert counts["cp.async.bulk.tensor"] > 0 and counts["mbarrier"] > 0, (name, counts)
        assert counts["setmaxnreg"] > 0, (name, counts)
        if name.endswith(":tma"):  # dQ by TMA reduce-add, no atomics
            assert counts["cp.reduce.async.bulk.tensor"] > 0 and counts["atom.global"] == 0, (name, counts)
        else:
            assert counts["atom.global"] + counts["red.global"] > 0, (name, counts)
            assert counts["cp.reduce.async.bulk.tensor"] == 0, (name, counts)
        assert facts["ptxas_ok"], name


@pytest.mark.parametrize("dtype,head_dim,causal,shape", [
    ("bf16", 128, True, (1, 2, 1, 2)),      # N = 1: one ragged key tile and one ragged query tile
    ("bf16", 64, True, (1, 8, 300, 2)),     # GQA 8/2, N past two key tiles
    ("fp16", 128, False, (2, 4, 257, 4)),   # N = 2 * 128 + 1
    ("fp16", 64, True, (1, 2, 384, 1)),     # tiles divide N: unmasked steps past the diagonal
    ("bf16", 64, False, (1, 4, 100, 2)),
])
def test_the_schedule_model_matches_float64_autograd(dtype, head_dim, causal, shape):
    errors = compile_backward.model_case(dtype, head_dim, causal, *shape)
    assert all(e <= compile_backward.MODEL_TOLERANCE_EPS for e in errors.values()), errors
