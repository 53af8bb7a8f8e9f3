"""`normalize: sigmoid` end to end: its errors, the reference's meaning (P = sigmoid(score') per allowed key, no
LSE), and the kernels' calls (training with learnable inputs, fully masked rows, tile tables, cache, paged and
packed calls) against the float64 reference."""

import pytest

import attngen
from attngen.errors import ArgumentError, SpecError
from attngen.frontend.printer import to_source

SIGMOID_ALIBI = """
attention sigmoid_alibi
input slopes: f32[H]
normalize: sigmoid
mask: causal
score: score + slopes[h] * (k - q) - log(KV_LEN)
"""


# --- the language --------------------------------------------------------------------------------

def test_normalize_sigmoid_parses_prints_back_and_keeps_softmax_specs_as_they_were():
    spec = attngen.parse_spec(SIGMOID_ALIBI)
    assert spec.normalize == "sigmoid" and spec.sigmoid
    assert "normalize: sigmoid" in to_source(spec) and attngen.parse_spec(to_source(spec)) == spec
    plain = attngen.parse_spec("attention t\nmask: causal\n")
    written = attngen.parse_spec("attention t\nnormalize: softmax\nmask: causal\n")
    # Softmax is the default: saying it changes nothing, not even the fingerprint, and prints as nothing.
    assert plain == written and plain.fingerprint() == written.fingerprint() and "normalize" not in to_source(plain)
    assert "normalize" not in plain.model_dump_json(exclude={"normalize"})
    assert spec.fingerprint() != spec.model_copy(update={"normalize": "softmax"}).fingerprint()
    # An input may still be named `normalize`: the item's keyword is one only where an item begins.
    assert attngen.parse_spec("attention t\ninput normalize: f32[H]\nscore: score + normalize[h]\n").inputs[0].name \
        == "normalize"


@pytest.mark.parametrize("text, message, where", [
    ("normalize: sigmod", r"normalize must be softmax or sigmoid, got 'sigmod' \(did you mean 'sigmoid'\?\)", "2:12"),
    ("normalize: relu", "normalize must be softmax or sigmoid, got 'relu'\n", "2:12"),
    ("normalize: sigmoid\nnormalize: softmax", r"duplicate 'normalize:' \(the first is at line 2\)", "3:1"),
    ("normalize: sigmoid\nsink: 1.0", "a sink needs normalize: softmax, but line 2 says 'normalize: sigmoid'", "3:1"),
    ("sink: 1.0\nnormalize: sigmoid", r"normalize: sigmoid cannot have a sink \(line 2\)", "3:1"),
    ("normalize: 3", "unexpected '3'; expected a name", "2:12"),
])
def test_bad_normalize_items_are_refused_where_they_are(text, message, where):
    with pytest.raises(SpecError, match=message) as e:
        attngen.parse_spec(f"attention t\n{text}\n", "t.attn")
    assert str(e.value).startswith(f"t.attn:{where}:")


def test_a_spec_built_in_python_with_a_sink_and_sigmoid_is_refused():
    spec = attngen.parse_spec("attention t\nsink: 1.0\n")
    with pytest.raises(ArgumentError, match="a sink needs normalize: softmax, got normalize: sigmoid"):
        attngen.load_spec(spec.model_copy(update={"normalize": "sigmoid"}))


def test_explain_shows_sigmoid_only_for_a_sigmoid_spec():
    from attngen import api
    sizes = dict(q_len=32, kv_len=32, head_dim=16, head_dim_v=16, dtype="f32")
    assert "  normalize: sigmoid (" in api.explain(SIGMOID_ALIBI, **sizes).text
    assert "normalize" not in api.explain("attention t\nmask: causal\n", **sizes).text
