"""Kernel families are plug-ins: a folder of templates under attngen/emit/families/ plus an entry in
plan/families.py. A second family is added to a copy of the package with nothing else changed, and
the planner picks it where its entry says it serves, and says why it did not elsewhere."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import attngen
from attngen.analysis import analyze
from attngen.plan import families, get_target

ROOT = Path(__file__).resolve().parent.parent
CAUSAL = ROOT / "specs" / "causal.attn"


def test_the_portable_family_serves_every_target_and_says_so():
    spec = attngen.parse_spec(CAUSAL.read_text())
    for target in ("a100", "h100", "h200", "interpreter"):
        family, why = families.choose_family(analyze(spec), get_target(target))
        assert family is families.PORTABLE and why == families.PORTABLE.strength


def test_a_new_family_is_a_folder_and_an_entry(tmp_path):
    package = tmp_path / "pkg" / "attngen"
    shutil.copytree(ROOT / "attngen", package, ignore=shutil.ignore_patterns("__pycache__"))
    # The new family's templates: the portable ones, marked so the test can tell which were used.
    mirror = package / "emit" / "families" / "mirror"
    shutil.copytree(package / "emit" / "families" / "portable", mirror)
    kernels = mirror / "kernels.py.jinja"
    kernels.write_text("# rendered from the mirror family\n"
                       + kernels.read_text().replace("families/portable/", "families/mirror/"))
    script = f"""
import attngen
from attngen import api
from attngen.plan import families
assert attngen.__file__.startswith({str(package)!r}), attngen.__file__
MIRROR = families.Family("mirror", "a test family", lambda facts, target: None if target.name == "h200" else "h200 only")
families.FAMILIES = (MIRROR, families.PORTABLE)
for target in ("h200", "a100"):
    plan = api._prepare({str(CAUSAL)!r}, None, target)[3]
    source = attngen.compile_source({str(CAUSAL)!r}, target=target)
    print(target, plan.family, "# rendered from the mirror family" in source, plan.family_reason)
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "pkg"), os.environ.get("PYTHONPATH", "")]),
           "ATTNGEN_CACHE_DIR": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    h200, a100 = result.stdout.strip().splitlines()
    assert h200 == "h200 mirror True a test family"
    assert a100 == f"a100 portable False not mirror: h200 only; {families.PORTABLE.strength}"
