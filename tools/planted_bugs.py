"""Plants a known bug in a scratch copy of attngen and runs the CI fuzzing profile against it
(the same derandomized examples, without shrinking): the fuzzers must catch each one, and
the report says which properties did. Shows that tests/test_fuzz.py finds the bugs it is
meant to.

    python tools/planted_bugs.py [window-off-by-one] [tanh-derivative] ...
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# name -> (file, the text to replace, the bug, what it breaks)
BUGS = {
    "window-off-by-one": (
        "attngen/analysis/spans.py",
        "return [Affine(negd.cq, negd.ck, _const_add(negd.const, minus_one), negd.tq, negd.tk)]",
        "return [negd]",
        "`a < b` bounded as `a <= b`: a window `q - k < w` reaches one key too far in the loop bounds"),
    "tanh-derivative": (
        "attngen/analysis/derivatives.py",
        "return mul(sub(ONE, mul(expr, expr)), dx)",
        "return mul(sub(ONE, expr), dx)",
        "d tanh(x) = 1 - tanh(x) instead of 1 - tanh(x)^2"),
    "dropout-unscaled-dq": (
        "attngen/families/portable/bwd.py.jinja",
        "dp * dropout_scale, 0.0)",
        "dp, 0.0)",
        "dQ's kernel keeps dP where dropout kept P but forgets to divide it by 1 - p (dK and dV stay right)"),
}


def run(name: str) -> bool:
    path, good, bad, what = BUGS[name]
    with tempfile.TemporaryDirectory() as scratch:
        shutil.copytree(ROOT / "attngen", Path(scratch) / "attngen")
        shutil.copytree(ROOT / "tests", Path(scratch) / "tests")
        shutil.copytree(ROOT / "specs", Path(scratch) / "specs")
        shutil.copy(ROOT / "pyproject.toml", scratch)
        target = Path(scratch) / path
        text = target.read_text()
        assert text.count(good) == 1, f"{name}: the line to break is not in {path} exactly once"
        target.write_text(text.replace(good, bad))
        env = {**os.environ, "PYTHONPATH": scratch, "ATTNGEN_CACHE_DIR": str(Path(scratch) / "cache")}
        t0 = time.time()
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
                                 "--hypothesis-profile=ci-noshrink", "tests/test_fuzz.py"],
                                cwd=scratch, env=env, capture_output=True, text=True)
        failed = [line.split("::")[1].split()[0] for line in result.stdout.splitlines()
                  if line.startswith("FAILED") and "::" in line]
        caught = result.returncode == 1 and bool(failed)  # 1: tests failed (not a crash or a usage error)
        print(f"{name} ({what}): {'CAUGHT' if caught else 'MISSED'} in {time.time() - t0:.0f} s"
              + "".join(f"\n    failed: {t}" for t in failed))
        for line in result.stdout.splitlines():
            if line.startswith("E ") and ("Error:" in line or "exceeds" in line or "not all allowed" in line):
                print("   ", line[:240])
        return caught


if __name__ == "__main__":
    names = sys.argv[1:] or list(BUGS)
    sys.exit(0 if all([run(n) for n in names]) else 1)
