"""The Gluon forward for Hopper (tools/hopper, issue 13's first kernel) keeps compiling for sm_90 with
the instructions it exists for: TMA copies, asynchronous wgmma, mbarriers and the register hand-off
of warp specialization. Triton compiles for sm_90 on a CPU; its interpreter must be off, so the
compile runs in a child process. Correctness and speed are the GPU's to tell (tools/hopper/gpu_bench.py,
BENCHMARKS.md)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

HOPPER = Path(__file__).parent.parent / "tools" / "hopper"

_COMPILE = textwrap.dedent('''
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import compile_check
    counts = {}
    for dtype, head_dim, causal, pingpong in (("bf16", 128, True, True), ("fp16", 64, False, False)):
        compiled, _ = compile_check.compile_config(dtype, head_dim, causal, pingpong=pingpong)
        ptx = compiled.asm["ptx"]
        counts[f"{dtype} D{head_dim} causal={causal} pingpong={pingpong}"] = {
            name: ptx.count(name) for name in compile_check.COUNTED}
    print(json.dumps(counts))
''')


def test_the_gluon_forward_compiles_for_sm90_with_tma_and_async_wgmma():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _COMPILE, str(HOPPER)], capture_output=True, text=True,
                            env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    counts = json.loads(result.stdout.strip().splitlines()[-1])
    for config, found in counts.items():
        for instruction in ("wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier", "setmaxnreg"):
            assert found[instruction] > 0, f"{config}: no {instruction} in the PTX"
