"""Spec text is data, never code; names are identifiers; the kernel cache serves only the module asked for."""

import ast
import functools
import hashlib
import os
import shutil
import stat
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import attngen
from attngen import cache as module_cache, ir, reference, testing
from attngen.errors import SpecError

ROOT = Path(__file__).parent.parent
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CAUSAL = "attention causal\nmask: causal\n"


def _module_ast(source: str) -> str:
    return ast.dump(ast.parse(source))


@functools.cache
def _causal_ast() -> str:
    """The plain causal module's program, parsed once for all the comments the property draws."""
    return _module_ast(attngen.compile_source(CAUSAL))


# --- spec text never becomes code ------------------------------------------------------------------

def test_a_comment_that_closes_the_docstring_runs_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = tmp_path / "e.attn"
    spec.write_text('attention causal\n# """; __import__("os").system("touch pwned"); """\nmask: causal\n')
    attn = attngen.build(spec)
    q, k, v = testing.random_qkv(1, 1, 1, 5, 5, 16, 16, torch.float32, device=DEVICE)
    attn(q, k, v)
    assert not (tmp_path / "pwned").exists()
    assert '# """; __import__("os").system("touch pwned"); """' in attn.path.read_text()


def test_a_comment_with_a_backslash_builds():
    attn = attngen.build("attention causal\n# C:\\xfiles \\N{oops} \\\nmask: causal\n")
    assert "C:\\xfiles" in attn.path.read_text()


# Characters Python's tokenizer or str.splitlines treats specially, and an encoding declaration
# (which Python obeys on a file's first two lines).
_TRICKY = ['"""', "'''", "\\", "\\N{DASH}", "\r", "\x00", "\x0b", "\x0c", "\x1c", "\x85", "\u2028", "\u2029",
           "\ud800", "\ufeff", "-*- coding: rot13 -*-", "coding=latin-1"]


_COMMENTS = st.lists(st.one_of(st.text(alphabet=st.characters(exclude_categories=[])), st.sampled_from(_TRICKY)),
                     min_size=1, max_size=6).map("".join)


# 30 drawn comments in the default tier and 120 others in the slow one (another test, other draws).
@settings(max_examples=30)
@given(_COMMENTS)
@example("-*- coding: rot13 -*-")
@example('"""; import os; os.system("x"); """')
def test_comment_text_never_changes_the_generated_module(comment):
    """Whatever a comment holds, the module parses to the same program as without it: comments
    are all that differ, so the kernels behave the same and nothing of the comment runs."""
    _check_comment(comment)


@pytest.mark.slow
@settings(max_examples=120)
@given(_COMMENTS)
def test_comment_text_never_changes_the_generated_module_in_more_drawn_comments(comment):
    _check_comment(comment)


def _check_comment(comment):
    comment = comment.replace("\n", "")  # a comment ends at the line break
    for text in (f"# {comment}\n{CAUSAL}", f"attention causal  # {comment}\nmask: causal # {comment}\n"):
        source = attngen.compile_source(text)
        assert _module_ast(source) == _causal_ast()
        source.encode("utf-8")  # the cache writes it as UTF-8: no lone surrogate survives


def test_names_are_identifiers_in_the_ir_itself():
    for name in ("../../x", "a b", "x\n", "", "é", "if", "x" * 65):
        with pytest.raises(ValueError):
            ir.Spec(name=name)
    for name in ("v", "self", "return_lse", "q", "causal", "lambda", "a/b"):
        with pytest.raises(ValueError):
            ir.InputDecl(name=name, dtype="f32", dims=())
    with pytest.raises(ValueError, match="declares no such input"):
        ir.Spec(name="s", mask=ir.Load(type="bool", input="layout", index=()))
    with pytest.raises(ValueError, match="declared once"):
        ir.Spec(name="s", params=(ir.ParamDecl(name="w", type="int", value=1),),
                inputs=(ir.InputDecl(name="w", dtype="f32", dims=()),))


@pytest.mark.parametrize("name, message", [
    ("v", "'v' is an argument of the attention call itself"),
    ("self", "'self' is an argument of the attention call itself"),
    ("return_lse", "'return_lse' is an argument of the attention call itself"),
    ("dropout_p", "'dropout_p' is an argument of the attention call itself"),
    ("generator", "'generator' is an argument of the attention call itself"),
    ("class", "'class' is a Python keyword"),
])
def test_input_names_that_could_never_be_passed_are_positioned_errors(name, message):
    with pytest.raises(SpecError) as err:
        attngen.parse_spec(f"attention s\ninput {name}: f32[H]\nscore: score\n", "s.attn")
    assert f"s.attn:2:7: {message}" in str(err.value)


def test_a_gradient_input_named_after_a_learnable_one_works():
    spec = "attention s\ninput x: f32[H] learnable\ninput grad_x: f32[H]\nscore: score * x[h] + grad_x[h]\n"
    attn = attngen.build(spec)
    q, k, v = testing.random_qkv(1, 2, 1, 9, 7, 16, 16, torch.float32, device=DEVICE)
    inputs = testing.random_inputs(attn.spec, 1, 2, 1, 9, 7, device=DEVICE)
    testing.check_against_reference(attn.spec, attn, q, k, v, inputs)


# --- the cache -------------------------------------------------------------------------------------

def test_a_hostile_spec_of_the_same_name_does_not_poison_the_cache():
    hostile = attngen.build("attention causal\n# not the stock one\nmask: k >= q\n")
    stock = attngen.build(ROOT / "specs" / "causal.attn")
    assert stock.path != hostile.path and stock.module is not hostile.module
    assert "# not the stock one" not in stock.path.read_text()
    same_meaning = attngen.build("attention causal\n# other words, same mask\nmask: causal\n")
    assert same_meaning.path != stock.path  # the text is in the module, so in the key


def test_a_changed_attngen_renders_anew(tmp_path):
    """An editable install whose code changed must not reuse the modules of its earlier self."""
    shutil.copytree(ROOT / "attngen", tmp_path / "pkg" / "attngen",
                    ignore=shutil.ignore_patterns("__pycache__"))
    path = os.pathsep.join([str(tmp_path / "pkg"), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONPATH": path, "ATTNGEN_CACHE_DIR": str(tmp_path / "cache")}
    # The copy must be what is imported (run outside the checkout, whose attngen `-c` would find first).
    script = f"""
import attngen
assert attngen.__file__.startswith({str(tmp_path / 'pkg')!r}), attngen.__file__
print(attngen.build({str(ROOT / 'specs' / 'causal.attn')!r}).path)
"""

    def build_path() -> Path:
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                                cwd=tmp_path, timeout=300)
        assert result.returncode == 0, result.stderr
        return Path(result.stdout.strip())

    before = build_path()
    template = tmp_path / "pkg" / "attngen" / "families" / "portable" / "fwd.py.jinja"
    template.write_text(template.read_text() + "\n# a change to a template\n")
    after = build_path()
    assert after != before and "# a change to a template" in after.read_text()
    codegen = tmp_path / "pkg" / "attngen" / "emit" / "expressions.py"
    codegen.write_text(codegen.read_text() + "\n# a change to the compiler's Python\n")
    assert build_path() != after


@pytest.mark.parametrize("damage", ["truncate", "edit"])
def test_a_damaged_cached_module_is_rebuilt_with_a_warning(damage, monkeypatch):
    path = attngen.build(CAUSAL).path
    text = path.read_text()
    path.write_text(text[: len(text) // 2] if damage == "truncate"
                    else text.replace("def softmax_scale(", "raise SystemExit('tampered')\n\n\ndef softmax_scale("))
    monkeypatch.setattr(module_cache, "_LOADED", {})
    with pytest.warns(RuntimeWarning, match=f"cached kernel module {path} does not match its seal"):
        attn = attngen.build(CAUSAL)
    assert attn.path == path and path.read_text() == text
    q, k, v = testing.random_qkv(1, 1, 1, 4, 4, 16, 16, torch.float32, device=DEVICE)
    attn(q, k, v)


def test_an_unusable_cache_directory_falls_back_with_one_warning(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr(module_cache, "_FALLBACK", [])
    monkeypatch.setattr(module_cache, "_LOADED", {})
    with pytest.warns(RuntimeWarning, match="cannot write kernel modules to the cache directory") as seen:
        first = attngen.build(CAUSAL)
        second = attngen.build(ROOT / "specs" / "sliding_window.attn")
    assert len([w for w in seen if "cannot write" in str(w.message)]) == 1
    assert first.path.parent == second.path.parent != blocker / "cache"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attngen.build(CAUSAL)


@pytest.mark.skipif(torch.cuda.is_available(), reason="only a machine without a GPU interprets kernels")
def test_triton_imported_before_attngen_is_a_clear_error_not_a_crash_in_a_kernel():
    # Triton reads TRITON_INTERPRET when first imported; attngen sets it too late then, and every
    # kernel would fail deep inside the interpreter ("Cannot call @triton.jit'd outside ...").
    code = ("import os; os.environ.pop('TRITON_INTERPRET', None)\n"
            "import triton, attngen\n"
            "try:\n    attngen.build('attention t\\nmask: causal\\n')\n"
            "except attngen.ArgumentError as e:\n    print('refused:', e)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert "refused: triton was imported before attngen could ask for its interpreter" in result.stdout, (
        result.stdout + result.stderr[-2000:])


# --- a file attngen did not write is never imported --------------------------------------------------

@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """A cache directory and a key folder of this test's own, and a runtime that has read neither."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path / "cache"))
    for state, empty in (("_FALLBACK", []), ("_LOADED", {}), ("_SECRET", [])):
        monkeypatch.setattr(module_cache, state, empty, raising=False)
    return tmp_path


def _forge(text: str, payload: str) -> str:
    """The cached module `text` with `payload` on top and its seal recomputed as anyone could: an
    unkeyed SHA-256 of the new body in place of the old digest."""
    body, _, seal = text.rstrip("\n").rpartition("\n")
    body = payload + "\n" + body + "\n"
    return body + seal.rpartition(" ")[0] + " " + hashlib.sha256(body.encode()).hexdigest() + "\n"


def test_a_planted_cache_module_never_runs(tmp_path):
    # A copy of attngen, so the key (which covers its code) stays the same across the three builds.
    shutil.copytree(ROOT / "attngen", tmp_path / "pkg" / "attngen", ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "pkg"), "ATTNGEN_CACHE_DIR": str(tmp_path / "cache"),
           "XDG_CONFIG_HOME": str(tmp_path / "config")}
    script = f"import attngen\nprint(attngen.build({CAUSAL!r}).path)\n"

    def build() -> subprocess.CompletedProcess:
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                                cwd=tmp_path, timeout=300)
        assert result.returncode == 0, result.stderr
        return result

    path = Path(build().stdout.strip())
    genuine = path.read_text()
    marker = tmp_path / "PWN"
    payload = f"import os; os.system('touch {marker}')"
    path.write_text(_forge(genuine, payload))
    result = build()
    assert not marker.exists()
    assert f"the cached kernel module {path} does not match its seal" in result.stderr
    assert path.read_text() == genuine  # rebuilt
    # The same planted module, reached through a symlink from the cache.
    planted = tmp_path / "planted.py"
    planted.write_text(_forge(genuine, payload))
    path.unlink()
    path.symlink_to(planted)
    result = build()
    assert not marker.exists()
    assert f"the cached kernel module {path} is a symbolic link" in result.stderr
    assert not path.is_symlink() and path.read_text() == genuine


def test_a_module_sealed_for_another_key_is_not_served(private_cache):
    other_text = "attention causal\n# another text, another key\nmask: causal\n"
    stock = attngen.build(CAUSAL).path
    other = attngen.build(other_text).path
    shutil.copyfile(stock, other)  # a module attngen wrote, under another module's name
    module_cache._LOADED.clear()
    with pytest.warns(RuntimeWarning, match=f"cached kernel module {other} does not match its seal"):
        rebuilt = attngen.build(other_text)
    assert "# another text, another key" in rebuilt.path.read_text()


def test_cache_files_and_folders_are_private_whatever_the_umask(private_cache):
    old = os.umask(0)
    try:
        path = attngen.build(CAUSAL).path
    finally:
        os.umask(old)
    key = module_cache.key_path()
    assert key.is_relative_to(private_cache / "config")
    for folder in (private_cache / "cache", private_cache / "config", key.parent):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    for file in (path, key):
        assert stat.S_IMODE(file.stat().st_mode) == 0o600, file


def _others_can_write(cache: Path, monkeypatch) -> str:
    cache.mkdir(mode=0o700)
    cache.chmod(0o777)
    return "writable by group or others"


def _someone_elses(cache: Path, monkeypatch) -> str:
    if os.geteuid() != 0:
        pytest.skip("only root can give a folder to another user")
    cache.mkdir(mode=0o700)
    os.chown(cache, 65534, 65534)
    return "owned by uid 65534"


def _a_symlink_to_a_folder_others_can_write(cache: Path, monkeypatch) -> str:
    target = cache.parent / "theirs"
    target.mkdir(mode=0o700)
    target.chmod(0o757)
    cache.symlink_to(target)
    return "writable by group or others"


def _the_keys_folder(cache: Path, monkeypatch) -> str:
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(module_cache.key_path().parent))
    return "holds attngen's seal key"


@pytest.mark.parametrize("make", [_others_can_write, _someone_elses, _a_symlink_to_a_folder_others_can_write,
                                  _the_keys_folder])
def test_a_cache_directory_others_control_is_refused_with_one_warning(make, private_cache, monkeypatch):
    why = make(private_cache / "cache", monkeypatch)
    cache = Path(os.environ["ATTNGEN_CACHE_DIR"])
    with pytest.warns(RuntimeWarning, match="cannot write kernel modules to the cache directory") as seen:
        first = attngen.build(CAUSAL)
        second = attngen.build(ROOT / "specs" / "sliding_window.attn")
    assert [why in str(w.message) and str(cache) in str(w.message) for w in seen] == [True]
    assert first.path.parent == second.path.parent != cache
    assert not any(p.suffix == ".py" for p in cache.iterdir())


@pytest.mark.parametrize("damage", ["readable by others", "not a regular file", "owned by another user",
                                    "in a folder others can write"])
def test_a_key_others_could_read_or_plant_is_refused_with_one_warning(damage, private_cache):
    attngen.build(CAUSAL)
    key = module_cache.key_path()
    if damage == "readable by others":
        key.chmod(0o644)
    elif damage == "in a folder others can write":
        key.parent.chmod(0o777)
    elif damage == "not a regular file":
        theirs = private_cache / "their.key"
        theirs.write_bytes(key.read_bytes())
        theirs.chmod(0o600)
        key.unlink()
        key.symlink_to(theirs)
    else:
        if os.geteuid() != 0:
            pytest.skip("only root can give a file to another user")
        os.chown(key, 65534, 65534)
    module_cache._SECRET.clear()
    module_cache._LOADED.clear()
    with pytest.warns(RuntimeWarning, match=f"cannot use the seal key {key}") as seen:
        first = attngen.build(CAUSAL)
        attngen.build(ROOT / "specs" / "sliding_window.attn")
    assert len(seen) == 1
    assert first.path.parent != private_cache / "cache"


# --- a Spec's fields reach code and file names only validated -----------------------------------------

@pytest.fixture(scope="module")
def causal_statements():
    return [type(node) for node in ast.parse(attngen.compile_source(CAUSAL)).body]


_SMUGGLED = ['x"""\nimport os; os.system("touch pwned")\n"""', "../../x", "a b", "", "x" * 65, "if", "é", "\\",
             "x\\", 'x"', "ok_name", "_"]


@settings(max_examples=60)
@given(st.one_of(st.sampled_from(_SMUGGLED), st.text(), st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,70}", fullmatch=True)))
@example(_SMUGGLED[0])
def test_a_spec_name_smuggled_past_validation_never_becomes_code(causal_statements, name):
    """model_copy and model_construct skip pydantic's validation: whatever name they carry, the
    module either names the spec with a valid identifier or is refused before any text exists."""
    spec = attngen.parse_spec(CAUSAL)
    valid = ir.name_problem(name, declared=False) is None
    for smuggled in (spec.model_copy(update={"name": name}),
                     ir.Spec.model_construct(**{**dict(spec), "name": name})):
        if not valid:
            with pytest.raises(attngen.ArgumentError, match="spec must be a valid Spec"):
                attngen.compile_source(smuggled)
            continue
        module = ast.parse(attngen.compile_source(smuggled))
        assert ast.get_docstring(module).startswith(f"{name}: fused attention kernels")
        assert [type(node) for node in module.body] == causal_statements


def test_smuggled_input_names_are_refused():
    spec = attngen.parse_spec("attention s\ninput x: f32[H]\nscore: score + x[h]\n")
    bad = spec.inputs[0].model_copy(update={"name": 'x=x), print("pwned"), (x'})
    for smuggled in (spec.model_copy(update={"inputs": (bad,)}),
                     ir.Spec.model_construct(**{**dict(spec), "inputs": (bad,)})):
        with pytest.raises(attngen.ArgumentError, match="spec must be a valid Spec"):
            attngen.compile_source(smuggled)


def test_the_cache_checks_file_names_with_no_assert(private_cache):
    with pytest.raises(attngen.ArgumentError, match="must be"):
        module_cache.load("../../x", "0" * 24, lambda: "")
    with pytest.raises(attngen.ArgumentError, match="must be"):
        module_cache.load("x", "../0", lambda: "")
    # python -O removes asserts: the checks must not be asserts.
    code = ("import attngen\n"
            f"spec = attngen.parse_spec({CAUSAL!r}).model_copy(update={{'name': '../../x'}})\n"
            "try:\n    attngen.build(spec)\nexcept attngen.ArgumentError as e:\n    print('refused:', e)\n")
    env = {**os.environ, "ATTNGEN_CACHE_DIR": str(private_cache / "a" / "b" / "cache"),
           "XDG_CONFIG_HOME": str(private_cache / "config")}
    result = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, env=env,
                            cwd=private_cache, timeout=300)
    assert "refused: spec must be a valid Spec" in result.stdout, result.stdout + result.stderr[-2000:]
    assert not list(private_cache.rglob("x_*.py"))


def test_float_constants_are_float32_in_the_kernels_and_the_reference():
    # In float64, (1.0 + 1e-8 - 1.0) * 1e8 is about 1 and the term is k; in float32, where the kernels
    # compute constants (and Python's float64 must not fold them for Triton), 1.0 + 1e-8 is 1.0 and the
    # term is 0. The float64 truth computes it in float32 too, so both mean the plain causal scores.
    text = "attention t\nmask: causal\nscore: score + (1.0 + 1e-8 - 1.0) * 1e8 * k\n"
    spec = attngen.parse_spec(text)
    q, k, v = testing.random_qkv(1, 2, 1, 20, 20, 16, 16, torch.float32)
    wide = [x.double() for x in (q, k, v)]
    plain = attngen.parse_spec("attention p\nmask: causal\n")
    assert torch.equal(reference.modified_scores(spec, *wide), reference.modified_scores(plain, *wide))
    testing.check_against_reference(spec, attngen.build(text), q, k, v)
