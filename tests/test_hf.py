"""attngen.hf against transformers' own eager attention: tiny random Llama, Mistral and Gemma-2 models.

The models are float32 on both sides, and everything but attention is the same code, so their logits
differ only by the order attention sums in: measured at up to 7 float32 ulps of the largest logit.
LOGIT_ULPS allows 64 (about 8e-6 x max|logit|), while a scale off by 0.1% already moves them by 900
to 14000 ulps, and a wrong mask, offset or cap by far more. (A float64 run of the same model is no
sharper reference: transformers' eager attention takes its softmax in float32 whatever the dtype.)
Only real (non-padded) tokens are compared: a padded query row sees no key, where attngen gives 0 and
eager a meaningless average; no real token reads such a row. The single calls below, whose reference
is plain softmax attention under transformers' own boolean mask, follow the house rule instead
(attngen.testing: against float64, at most 3x the float32 reference's own error plus a floor).
Compiled runs (torch.compile, fullgraph=True) are held to eager attngen, at LOGIT_ULPS as well.
"""

import os
import subprocess
import sys
from types import SimpleNamespace

import attngen  # noqa: I001 before transformers' models, which import triton: attngen asks for the interpreter first
import pytest
import torch
from transformers import (CompileConfig, Gemma2Config, Gemma2ForCausalLM, GptOssConfig, GptOssForCausalLM, LlamaConfig,
                          LlamaForCausalLM, MistralConfig, MistralForCausalLM)
from transformers import masking_utils as mu

import attngen.hf as hf
from attngen import reference, testing
from conftest import CPU_CALLS

hf.register()

WINDOW = 6  # shorter than the prompts, so the window masks keys and the sliding cache layers drop some
SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, initializer_range=0.2)  # 0.2: O(1) scores, not near-uniform
CONFIGS = {
    "llama": (LlamaForCausalLM, lambda: LlamaConfig(**SIZES)),
    "mistral": (MistralForCausalLM, lambda: MistralConfig(sliding_window=WINDOW, **SIZES)),
    # A cap of 1 bends O(1) scores; query_pre_attn_scalar 24 != head_dim, so the scale is not 1/sqrt(D).
    "gemma2": (Gemma2ForCausalLM, lambda: Gemma2Config(sliding_window=WINDOW, query_pre_attn_scalar=24,
                                                       attn_logit_softcapping=1.0, **SIZES)),
}


LOGIT_ULPS = 64


@pytest.fixture(scope="module")
def models():
    """name -> float32 model, switched between implementations by each run."""
    built = {}
    for name, (cls, config) in CONFIGS.items():
        torch.manual_seed(0)
        built[name] = cls._from_config(config(), attn_implementation="eager").eval()
    return built


def _assert_close_logits(name, actual, eager):
    """At most LOGIT_ULPS float32 ulps of the largest eager logit apart (testing.default_floor gives 4)."""
    floor = LOGIT_ULPS / testing.FLOOR_ULPS * testing.default_floor(eager, torch.float32)
    testing.assert_matches_reference(name, actual, eager.double(), eager, factor=0.0, floor=floor)


def _inputs(length, padding, seed=1):
    ids = torch.randint(0, SIZES["vocab_size"], (2, length), generator=torch.Generator().manual_seed(seed))
    if padding is None:
        return ids, None
    mask = torch.ones(2, length, dtype=torch.long)
    for row, pads in enumerate((5, 2)):  # rows padded differently: keep is per batch row
        mask[row, :pads] = 0 if padding == "left" else 1
        if padding == "right":
            mask[row, length - pads:] = 0
    return ids, mask


def _logits(model, implementation, ids, mask):
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


@pytest.mark.parametrize("name,padding", [("llama", None), ("llama", "left"), ("llama", "right"),
                                          ("mistral", None), ("mistral", "left"),
                                          ("gemma2", "left"), ("gemma2", "right")])
def test_logits_match_eager(models, name, padding):
    ids, mask = _inputs(20, padding)
    real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    actual, eager = (_logits(models[name], implementation, ids, mask) for implementation in ("attngen", "eager"))
    _assert_close_logits(f"{name} logits", actual[real], eager[real])


@CPU_CALLS
def test_gpt_oss_sinks_match_eager():
    """gpt-oss passes its learned sinks as s_aux: the logits of a padded batch, the sinks' gradients of a
    training step and greedy generation, as transformers' eager attention computes them (sliding and full
    layers)."""
    torch.manual_seed(0)
    config = GptOssConfig(sliding_window=WINDOW, num_local_experts=2, num_experts_per_tok=1, **SIZES)
    model = GptOssForCausalLM._from_config(config, attn_implementation="eager").eval()
    ids, mask = _inputs(12, "left")
    real = mask.bool()
    actual, eager = (_logits(model, implementation, ids, mask) for implementation in ("attngen", "eager"))
    _assert_close_logits("gpt-oss logits", actual[real], eager[real])
    sinks = [layer.self_attn.sinks for layer in model.model.layers]
    grads = {}
    for implementation in ("attngen", "eager"):
        model.set_attn_implementation(implementation)
        loss = model(input_ids=ids).logits.square().mean()
        grads[implementation] = torch.autograd.grad(loss, sinks)
    for got, want in zip(grads["attngen"], grads["eager"]):
        _assert_close_logits("gpt-oss d sinks", got, want)
    # Greedy generation: the prompt, then decoding steps whose sinks sit at the cache's positions.
    generated = {}
    for implementation in ("attngen", "eager"):
        model.set_attn_implementation(implementation)
        generated[implementation] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                                                   pad_token_id=0, eos_token_id=None)
    assert torch.equal(generated["attngen"], generated["eager"])


@CPU_CALLS
@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_generation_matches_eager(models, name):
    """Left-padded prompts of 10 tokens and 6 new ones: past the window, so the sliding cache layers
    hold only the newest keys (kv_offset > 0) while the full layers hold all of them."""
    ids, mask = _inputs(10, "left", seed=2)

    def generate(implementation):
        models[name].set_attn_implementation(implementation)
        return models[name].generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                     output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                                     eos_token_id=None)

    actual, eager = generate("attngen"), generate("eager")
    assert torch.equal(actual.sequences, eager.sequences)
    _assert_close_logits(f"{name} step logits", torch.stack(actual.logits), torch.stack(eager.logits))



def _model(name, device="cpu"):
    """A fresh float32 model, as `models` holds them: for runs that leave state on the model (generate's
    compiled forward)."""
    cls, config = CONFIGS[name]
    torch.manual_seed(0)
    return cls._from_config(config(), attn_implementation="eager").eval().to(device)


def _generate_static(model, implementation, device="cpu", **options):
    """Greedy generation with a static cache: before each forward generate prepares the masks itself
    (create_masks_for_generate) and passes them as the forward's attention_mask, which the model hands to
    its mask function again. Past the window, as test_greedy_generation_matches_eager."""
    ids, mask = _inputs(10, "left", seed=2)
    model.set_attn_implementation(implementation)
    return model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=6,
                          do_sample=False, cache_implementation="static", output_logits=True,
                          return_dict_in_generate=True, pad_token_id=0, eos_token_id=None, **options)


# Compiling a model takes 15-30 s on the CPU: the compiled tests run gemma2 (sliding and full layers,
# a softcap) or mistral by default, and the other models in the slow tier.
def _compiled_by_default(*names):
    return [name if name in names else pytest.param(name, marks=pytest.mark.slow) for name in CONFIGS]


@CPU_CALLS
@pytest.mark.parametrize("name", _compiled_by_default("gemma2"))
def test_static_cache_generation_matches_eager(fresh_dynamo, name):
    """Eager, and compiled with fullgraph=True as generate compiles a static cache's decoding steps (on
    a GPU by default; _compile_all_devices asks for it on the CPU)."""
    model = _model(name)
    eager = _generate_static(model, "eager")
    compile_config = CompileConfig(backend="aot_eager", fullgraph=True, mode=None)
    compile_config._compile_all_devices = True
    for run, options in (("eager attngen", {}), ("compiled attngen", {"compile_config": compile_config})):
        actual = _generate_static(model, "attngen", **options)
        assert torch.equal(actual.sequences, eager.sequences), run
        _assert_close_logits(f"{name} {run} step logits", torch.stack(actual.logits), torch.stack(eager.logits))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the decoding steps were compiled


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_static_cache_generation_compiled_by_inductor_on_gpu(fresh_dynamo, name):
    """generate's own compilation of a static cache's decoding steps on a GPU (Inductor, CUDA graphs:
    CompileConfig's defaults), with fullgraph=True so a graph break fails."""
    model = _model(name, "cuda")
    eager = _generate_static(model, "eager", "cuda", disable_compile=True)
    actual = _generate_static(model, "attngen", "cuda", compile_config=CompileConfig(fullgraph=True))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    assert torch.equal(actual.sequences, eager.sequences)
    _assert_close_logits(f"{name} step logits", torch.stack(actual.logits), torch.stack(eager.logits))


def _training_step(model, implementation, device="cpu", autocast=True):
    """Loss and parameter gradients of one forward and backward on left-padded prompts (padding
    positions carry no label), under torch.autocast in bfloat16: RoPE hands attention float32 q and k
    and a bfloat16 v."""
    ids, mask = _inputs(20, "left")
    ids, mask = ids.to(device), mask.to(device)
    model.set_attn_implementation(implementation)
    model.zero_grad()
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, attention_mask=mask, labels=torch.where(mask.bool(), ids, -100)).loss
    loss.backward()
    return [loss.detach()] + [p.grad.clone() for p in model.parameters()]


def _assert_autocast_step_like_sdpa(model, device):
    """attngen's loss and gradients under autocast are as close to the float32 model's (the truth) as
    sdpa's under the same autocast, within the house rule (testing.DEFAULT_FACTOR times its error)."""
    model.train()
    try:
        truth = _training_step(model, "sdpa", device, autocast=False)
        sdpa, actual = (_training_step(model, implementation, device) for implementation in ("sdpa", "attngen"))
    finally:
        model.eval()
    names = ["loss"] + [name for name, _ in model.named_parameters()]
    for name, got, want, low in zip(names, actual, truth, sdpa):
        testing.assert_matches_reference(f"autocast {name}", got, want.double(), low)


def test_autocast_training_step_matches_sdpa(models):
    _assert_autocast_step_like_sdpa(models["llama"], "cpu")


@pytest.mark.gpu
def test_autocast_training_step_matches_sdpa_on_gpu():
    _assert_autocast_step_like_sdpa(_model("llama", "cuda"), "cuda")


@CPU_CALLS
def test_decoding_steps_run_the_decode_kernels(models, monkeypatch):
    """Greedy generation of left-padded prompts: the prompt runs the portable forward (with its tile
    tables), each new token the split-KV decode kernels, which decide the padding mask key by key."""
    ids, mask = _inputs(40, "left", seed=2)  # 2 query heads per key/value head x 40 > 64 rows: the prompt is no decode tile
    model = models["llama"]
    model.set_attn_implementation("attngen")
    kwargs = dict(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=0, eos_token_id=None)
    model.generate(max_new_tokens=1, **kwargs)  # builds the spec
    ran = []

    def recording(name, launch):
        def run(*args, **kw):
            ran.append(name)
            return launch(*args, **kw)
        return run

    for name in vars(hf._BUILT):
        module = getattr(hf._BUILT, name).module
        monkeypatch.setattr(module.ATTENTION, "_portable_forward", recording("portable", module._portable_forward))
        monkeypatch.setattr(module.ATTENTION, "forward_families", tuple(
            (family, serves, recording(family, launch)) for family, serves, launch in module.forward_families))
    model.generate(max_new_tokens=4, **kwargs)
    layers = SIZES["num_hidden_layers"]
    assert ran == ["portable"] * layers + ["decode"] * layers * 3


# (q_length, kv_length, q_offset, kv_offset, window, padding): one call, as the cache layers make them.
CALLS = {
    "prefill": (7, 7, 0, 0, None, "left"),
    "decode_full_sliding_cache": (1, WINDOW, 10, 5, WINDOW, "left"),  # DynamicSlidingWindowLayer, 10 seen
    "chunk_into_sliding_cache": (3, WINDOW - 1 + 3, 9, 4, WINDOW, None),  # 9 seen, 3 more at once
    "static_cache_prefill": (4, 10, torch.tensor(0), 0, None, "short"),  # keys past the mask do not exist yet
    "bidirectional": (5, 9, 4, 0, "full", "left"),
}


@CPU_CALLS
@pytest.mark.parametrize("case", list(CALLS))
def test_one_call_matches_transformers_mask(case):
    """prepare_mask + attention_forward against transformers' own boolean mask (sdpa_mask) for the
    same positions, offsets and padding, evaluated as plain softmax attention in float64 and float32."""
    q_length, kv_length, q_offset, kv_offset, window, padding = CALLS[case]
    causal = window != "full"
    function = (mu.bidirectional_mask_function if not causal else mu.causal_mask_function if window is None
                else mu.sliding_window_causal_mask_function(window))
    seen = kv_length + kv_offset if padding != "short" else q_length
    padding_mask = None
    if padding is not None:
        padding_mask = torch.ones(2, seen, dtype=torch.bool)
        padding_mask[0, :3] = False
    args = dict(batch_size=2, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
                mask_function=function, attention_mask=padding_mask)
    allowed = mu.sdpa_mask(**args, allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    if allowed is None:
        allowed = torch.ones(2, 1, q_length, kv_length, dtype=torch.bool)
    q, k, v = testing.random_qkv(2, 4, 2, q_length, kv_length, 16, 16, torch.float32, device="cpu", seed=3)
    module = SimpleNamespace(training=False, is_causal=causal)
    mask = hf.prepare_mask(**args, local_size=window if causal else None)
    actual, _ = hf.attention_forward(module, q, k, v, mask, scaling=0.3,
                                     sliding_window=window if causal else None)

    def eager(dtype):
        kk, vv = (x.to(dtype).repeat_interleave(2, dim=1) for x in (k, v))
        scores = (0.3 * q.to(dtype) @ kk.transpose(-1, -2)).masked_fill(~allowed, float("-inf"))
        p = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no allowed key: 0, as attngen
        return (p @ vv).transpose(1, 2)

    testing.assert_matches_reference(case, actual, eager(torch.float64), eager(torch.float32))


def test_calls_without_a_mask_object_follow_is_causal():
    q, k, v = testing.random_qkv(1, 4, 2, 9, 9, 16, 16, torch.float32, device="cpu", seed=4)
    for causal in (True, False):
        actual, _ = hf.attention_forward(SimpleNamespace(training=False, is_causal=causal), q, k, v, None)
        allowed = torch.ones(9, 9, dtype=torch.bool).tril() if causal else torch.ones(9, 9, dtype=torch.bool)

        def eager(dtype):
            kk, vv = (x.to(dtype).repeat_interleave(2, dim=1) for x in (k, v))
            scores = (q.to(dtype) @ kk.transpose(-1, -2) / 4).masked_fill(~allowed, float("-inf"))
            return (torch.softmax(scores, dim=-1) @ vv).transpose(1, 2)

        testing.assert_matches_reference(f"causal={causal}", actual, eager(torch.float64), eager(torch.float32))


def test_the_output_of_transposed_projections_is_returned_without_a_copy():
    # transformers passes q, k, v as transposed (B, N, H, D) projections; O follows q's layout, so the
    # (B, N, H, D) output it gets back is a view of the kernel's O, not a copy of it.
    q, k, v = testing.random_qkv(1, 4, 2, 9, 9, 16, 16, torch.float32, device="cpu", seed=4, layout="transposed")
    out, _ = hf.attention_forward(SimpleNamespace(training=False, is_causal=True), q, k, v, None)
    assert out.is_contiguous() and out._base is not None


def test_spec_text_is_a_fixed_template_with_checked_numbers():
    assert hf.spec_text(True, 6, True, 0.25, 1.5) == (
        "attention hf_causal_window_padded_softcap\n"
        "input offset: i32[]\n"
        "input keep: bool[B, KV_LEN]\n"
        "mask: keep[b, k] and k <= q + offset and q + offset - k < 6\n"
        "scale: 0.25\n"
        "score: softcap(score, 1.5)\n")
    assert hf.spec_text(False, None, False, 1e-05, None) == "attention hf_full\nscale: 1e-05\n"
    for scale, cap in ((0.1 + 0.2, 2**-0.5), (1e-300, 50), (3, 3e38)):  # every number reads back as given
        spec = attngen.parse_spec(hf.spec_text(True, None, False, scale, cap))
        assert spec.scale.value == scale and spec.score.args[1].value == cap
    bad = [dict(scale=float("nan")), dict(scale="0.25"), dict(softcap=float("inf")), dict(softcap=0.0),
           dict(softcap=1e300),  # finite, but not in float32, where the kernels hold it
           dict(softcap="1.0) or true"), dict(window=2.5), dict(window=True), dict(window=0),
           dict(window="6 or true")]
    for overrides in bad:
        args = dict(causal=True, window=6, padded=False, scale=0.25, softcap=None) | overrides
        with pytest.raises(attngen.ArgumentError, match="must be a"):
            hf.spec_text(**args)


def test_each_combination_is_built_once(models, monkeypatch):
    builds = []
    build = attngen.build
    monkeypatch.setattr(hf, "_BUILT", hf._Built())
    monkeypatch.setattr(attngen, "build", lambda text: builds.append(text) or build(text))
    ids, mask = _inputs(12, "left")
    for _ in range(2):
        _logits(models["gemma2"], "attngen", ids, mask)
    assert len(builds) == 2  # the sliding and the full layers: the same scale and cap, one window
    assert sorted(t.splitlines()[0] for t in builds) == ["attention hf_causal_padded_softcap",
                                                         "attention hf_causal_window_padded_softcap"]


def test_registration_makes_the_name_valid(models):
    models["llama"].set_attn_implementation("attngen")
    assert models["llama"].config._attn_implementation == "attngen"
    torch.manual_seed(0)
    fresh = LlamaForCausalLM._from_config(CONFIGS["llama"][1](), attn_implementation="attngen")
    assert fresh.config._attn_implementation == "attngen"
    hf.register()  # again: nothing changes
    for name in ("sdpa", "eager", "not a name"):
        with pytest.raises(attngen.ArgumentError, match="name must"):
            hf.register(name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU attngen never asks for the interpreter")
def test_register_says_when_triton_was_imported_before_attngen():
    code = "from transformers import LlamaForCausalLM\nimport attngen.hf\nattngen.hf.register()\n"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "import attngen.hf first" in run.stderr


@CPU_CALLS
def test_attention_dropout_applies_while_training(monkeypatch):
    """A training forward passes the config's attention_dropout to every call (eval mode none): each call's output
    is the float64 reference's with the mask that call applied; torch.manual_seed repeats a training step bitwise,
    another seed does not."""
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(LlamaConfig(attention_dropout=0.3, **SIZES), attn_implementation="attngen")
    ids, mask = _inputs(8, "left")
    calls, kernels = [], hf._kernels

    class Recorded:
        """A call's kernels that also keep the call and the mask it applied, from the same generator state."""

        def __init__(self, attn):
            self.attn = attn

        def __call__(self, q, k, v, dropout_p=0.0, **inputs):
            state = torch.get_rng_state()
            out = self.attn(q, k, v, dropout_p=dropout_p, **inputs)
            after = torch.get_rng_state()
            torch.set_rng_state(state)
            drop = self.attn.dropout_mask(q, k, v, dropout_p=dropout_p, **inputs)
            torch.set_rng_state(after)  # the run's draws go on as without the recording
            calls.append((self.attn.spec, [t.detach() for t in (q, k, v, out)], inputs, dropout_p, drop))
            return out

    monkeypatch.setattr(hf, "_kernels", lambda *args: Recorded(kernels(*args)))
    torch.manual_seed(1)
    model.train()(input_ids=ids, attention_mask=mask)
    assert len(calls) == 2 and all(call[3] == 0.3 for call in calls)
    for spec, (q, k, v, out), inputs, p, drop in calls:
        assert 0 < drop.float().mean() < 1
        want = reference.evaluate(spec, q.double(), k.double(), v.double(), inputs, dropout_p=p, dropout_mask=drop)[0]
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    calls.clear()
    with torch.no_grad():
        model.eval()(input_ids=ids, attention_mask=mask)
    assert [call[3] for call in calls] == [0.0, 0.0]
    monkeypatch.setattr(hf, "_kernels", kernels)

    def step(seed):
        torch.manual_seed(seed)
        model.zero_grad()
        logits = model.train()(input_ids=ids, attention_mask=mask).logits
        logits.square().mean().backward()
        return [logits.detach(), *(p.grad.clone() for p in model.parameters())]
    first, again, other = step(1), step(1), step(2)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], other[0])


@pytest.mark.parametrize("refused", ["4-D mask", "output_attentions", "packed sequences in two rows"])
def test_model_level_refusals(models, refused):
    model = models["llama"]
    model.set_attn_implementation("attngen")
    ids, _ = _inputs(8, None)
    kwargs, message = {
        "4-D mask": (dict(attention_mask=torch.zeros(2, 1, 8, 8)), "attention_mask must be the AttngenMask"),
        "output_attentions": (dict(output_attentions=True), "output_attentions"),
        # Position ids that restart mark two packed sequences (looked for only without a cache):
        # transformers adds a mask overlay for them. Packed batches are one row (tests/test_hf_packed.py).
        "packed sequences in two rows": (dict(position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]] * 2),
                                              use_cache=False), "batch_size must be 1"),
    }[refused]
    with torch.no_grad(), pytest.raises(attngen.ArgumentError, match=message):
        model(input_ids=ids, **kwargs)


def test_call_level_refusals():
    q, k, v = testing.random_qkv(1, 4, 2, 4, 4, 16, 16, torch.float32, device="cpu", seed=5)
    causal = SimpleNamespace(training=False, is_causal=True)
    mask = hf.prepare_mask(batch_size=1, q_length=4, kv_length=4)
    window_mask = hf.prepare_mask(batch_size=1, q_length=4, kv_length=4, local_size=3,
                                  mask_function=mu.sliding_window_causal_mask_function(3))
    refusals = [
        (dict(attention_mask=mask, s_aux=torch.zeros(3)), r"s_aux must be a float tensor of shape \(4,\)"),
        (dict(attention_mask=mask, head_mask=torch.ones(4)), "head_mask"),
        (dict(attention_mask=mask, is_causal=False), "is_causal"),
        (dict(attention_mask=mask, sliding_window=3), "sliding_window must agree"),
        (dict(attention_mask=window_mask, sliding_window=4), "sliding_window must agree"),
        (dict(attention_mask=mask, softcap=float("nan")), "softcap must be a finite positive number"),
        (dict(attention_mask=torch.ones(1, 4, dtype=torch.bool)), "attention_mask must be the AttngenMask"),
        (dict(attention_mask=hf.prepare_mask(batch_size=1, q_length=4, kv_length=5)), r"\(B, Q_LEN, KV_LEN\)"),
    ]
    for kwargs, message in refusals:
        with pytest.raises(attngen.ArgumentError, match=message):
            hf.attention_forward(causal, q, k, v, **kwargs)
    with pytest.raises(attngen.ArgumentError, match="Q_LEN != KV_LEN"):
        hf.attention_forward(causal, q[:, :, :2], k, v, None)
    with pytest.raises(attngen.ArgumentError, match="mask_function must"):  # keys from a cache: no documents
        hf.prepare_mask(batch_size=1, q_length=4, kv_length=8, q_offset=4,
                        mask_function=mu.chunked_causal_mask_function(2, torch.zeros(1, dtype=torch.long)))
    with pytest.raises(attngen.ArgumentError, match="local_size must equal"):
        hf.prepare_mask(batch_size=1, q_length=4, kv_length=4, local_size=5,
                        mask_function=mu.sliding_window_causal_mask_function(3))
    assert hf.prepare_mask(batch_size=1, q_length=4, kv_length=4, attention_mask=mask) is mask  # generate's
    with pytest.raises(attngen.ArgumentError, match=r"attention_mask must be an AttngenMask built for .* got one "
                                                    r"built for \(1, 4, 4, True, 3\)"):
        hf.prepare_mask(batch_size=1, q_length=4, kv_length=4, attention_mask=window_mask)


def _first_key(batch_idx, head_idx, q_idx, kv_idx):
    """An attention sink's mask overlay: every query sees the first key."""
    return kv_idx == 0


def _recognised(mask_function, length=20, local_size=None):
    mask = hf.prepare_mask(batch_size=2, q_length=length, kv_length=length, mask_function=mask_function,
                           local_size=local_size)
    return mask.causal, mask.window


def test_masks_are_recognised_by_what_they_compute():
    """Functions written afresh, and transformers' own combined differently, are recognised as the masks
    they compute, at every length: the window from local_size where the call's keys cannot show it."""
    def window(w):
        return lambda b, h, q, k: (k <= q) & (k > q - w)

    same = {
        (True, None): [mu.causal_mask_function, lambda b, h, q, k: q >= k,
                       mu.or_masks(mu.causal_mask_function, mu.and_masks(mu.causal_mask_function, _first_key))],
        (False, None): [mu.bidirectional_mask_function, lambda b, h, q, k: torch.ones_like(q, dtype=torch.bool),
                        mu.or_masks(mu.causal_mask_function, mu.sliding_window_overlay(3))],  # allows every key
        (True, WINDOW): [mu.sliding_window_causal_mask_function(WINDOW), window(WINDOW),
                         mu.and_masks(mu.causal_mask_function, mu.sliding_window_overlay(WINDOW + 2), window(WINDOW))],
    }
    for (causal, w), functions in same.items():
        for function in functions:
            for length in (3, 20, 1000):  # 1000: a sample of the pairs, not every one
                local_size = w if w is not None and length <= w else None
                assert _recognised(function, length, local_size) == (causal, w), (function, length)
    assert _recognised(window(4096), 1000, local_size=4096) == (True, 4096)
    assert _recognised(mu.causal_mask_function, 1) == (None, None)  # one key: causal or not, the same


def test_model_with_its_own_mask_functions_matches_eager(models, monkeypatch):
    """Mistral's sliding-window mask made by a function written afresh, for attngen and eager alike."""
    def sliding_window_causal_mask_function(sliding_window):
        return lambda b, h, q, k: (q - k >= 0) & (q - k < sliding_window)

    monkeypatch.setattr(mu, "sliding_window_causal_mask_function", sliding_window_causal_mask_function)
    ids, mask = _inputs(20, "left")
    actual, eager = (_logits(models["mistral"], implementation, ids, mask) for implementation in ("attngen", "eager"))
    _assert_close_logits("mistral logits", actual[mask.bool()], eager[mask.bool()])


@pytest.mark.parametrize("length", [20, 1000])
def test_masks_that_only_look_alike_are_refused(length):
    """Sink masks agree with a causal or windowed mask at many pairs but not all; a window is refused when
    local_size says another. Chunked and packed-sequence masks keep documents apart, which only a packed
    batch's one row may do (tests/test_hf_packed.py)."""
    half = torch.tensor([[0] * (length // 2) + [1] * (length - length // 2)] * 2)
    chunk = length // 5
    refused = {
        "chunked": (mu.chunked_causal_mask_function(chunk, torch.zeros(2, dtype=torch.long)), chunk,
                    "batch_size must be 1 when the mask function keeps documents apart"),
        "chunked, left-padded": (mu.chunked_causal_mask_function(chunk, torch.tensor([0, 3])), chunk,
                                 "batch_size must be 1"),
        "packed": (mu.and_masks(mu.causal_mask_function, mu.packed_sequence_mask_function(half)), None,
                   rf"batch_size must be 1 .* got 2 rows .* query {length // 2} of row 0 does not see"),
        "window and sink": (mu.or_masks(mu.sliding_window_causal_mask_function(WINDOW), _first_key), WINDOW,
                            "(mask_function|local_size) must"),  # the first key is seen from afar
        "another window": (mu.sliding_window_causal_mask_function(WINDOW), WINDOW - 1,
                           f"local_size must equal the mask function's sliding window {WINDOW}, got {WINDOW - 1}"),
        "no window": (mu.causal_mask_function, WINDOW, "local_size must equal .* sees the key"),
        "not index-based": (lambda b, h, q, k: bool(k <= q), None, "mask_function must be an index-based mask"),
    }
    for case, (function, local_size, message) in refused.items():
        with pytest.raises(attngen.ArgumentError, match=message):
            _recognised(function, length, local_size)


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled(function, **options):
    """fullgraph=True: any graph break raises. aot_eager on the CPU, as in test_compile."""
    return torch.compile(function, backend="aot_eager", fullgraph=True, **options)


@pytest.mark.parametrize("name", _compiled_by_default("gemma2"))
def test_compiled_model_has_no_graph_break(models, fresh_dynamo, monkeypatch, name):
    """A compiled model equals eager attngen: a left-padded forward, then greedy generation through
    a compiled forward (prefill, and a decoding step past the window). No spec is built before: each
    is built while dynamo traces."""
    model = models[name]
    model.set_attn_implementation("attngen")
    monkeypatch.setattr(hf, "_BUILT", hf._Built())
    ids, mask = _inputs(20, "left")
    with torch.no_grad():
        actual = _compiled(model)(input_ids=ids, attention_mask=mask).logits
        _assert_close_logits(f"{name} compiled logits", actual, model(input_ids=ids, attention_mask=mask).logits)

    ids, mask = _inputs(10, "left", seed=2)

    def generate():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False,
                              output_logits=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)

    eager = generate()
    model.forward = _compiled(model.forward)
    try:
        actual = generate()
    finally:
        del model.forward  # the class's forward again
    assert torch.equal(actual.sequences, eager.sequences)
    _assert_close_logits(f"{name} compiled step logits", torch.stack(actual.logits), torch.stack(eager.logits))


@pytest.mark.parametrize("name", ["mistral", pytest.param("gemma2", marks=pytest.mark.slow)])
def test_compiled_training_step_has_no_graph_break(models, fresh_dynamo, name):
    """Forward and backward of a compiled model in training mode give eager attngen's gradients."""
    model = models[name]
    model.set_attn_implementation("attngen")
    ids, mask = _inputs(20, "left")
    real = mask.bool()[..., None]
    parameters = list(model.parameters())

    def gradients(forward):
        logits = forward(input_ids=ids, attention_mask=mask).logits
        return torch.autograd.grad(torch.where(real, logits, 0).square().sum(), parameters)

    model.train()
    try:
        eager, actual = gradients(model), gradients(_compiled(model))
    finally:
        model.eval()
    for (parameter, _), got, want in zip(model.named_parameters(), actual, eager):
        _assert_close_logits(f"{name} compiled gradient of {parameter}", got, want)


def test_compiled_calls_run_each_calls_kernel(fresh_dynamo):
    """One compiled function, called with another window, padding, scale or cap each time, runs each
    call's own kernel, with no graph break: dynamic=False keeps every value a constant dynamo guards
    on (and recompiles for), as a model's config values are."""
    q, k, v = testing.random_qkv(2, 4, 2, 8, 8, 16, 16, torch.float32, device="cpu", seed=6)
    padding_mask = torch.ones(2, 8, dtype=torch.bool)
    padding_mask[0, :3] = False
    module = SimpleNamespace(training=False, is_causal=True)

    def attention(padding_mask, window, scaling, softcap):
        function = mu.causal_mask_function if window is None else mu.sliding_window_causal_mask_function(window)
        mask = hf.prepare_mask(batch_size=2, q_length=8, kv_length=8, mask_function=function,
                               attention_mask=padding_mask)
        return hf.attention_forward(module, q, k, v, mask, scaling=scaling, softcap=softcap)[0]

    calls = [(padding_mask, 6, 0.25, None), (padding_mask, 3, 0.25, None), (None, 3, 0.25, None),
             (None, 3, 0.5, None), (None, 3, 0.5, 1.0), (padding_mask, None, 0.5, 1.0), (padding_mask, 6, 0.25, None)]
    compiled = _compiled(attention, dynamic=False)
    outputs = [compiled(*call) for call in calls]
    for call, output, previous in zip(calls, outputs, [None] + outputs):
        assert torch.equal(output, attention(*call)), call
        assert previous is None or not torch.equal(output, previous), call  # so a stale kernel would show


def _compiled_window(mask_function, local_size=None):
    """The window of a call with 8 keys, more than any window below: there every window shows."""
    return hf.prepare_mask(batch_size=1, q_length=8, kv_length=8, mask_function=mask_function,
                           local_size=local_size).window


def test_compiled_mask_reads_each_calls_window(fresh_dynamo):
    """The window under torch.compile is the mask function's own, call after call, wherever its closure
    was made. Dynamo guards only the code of a closure made outside the compiled code (here, passed in;
    or split off by a graph break, as when the window int turns symbolic on a recompile), so such a
    window is read in eager: one kept in the graph would repeat an earlier call's."""
    windows = [6, 3, 4, 5]
    cases = {  # how the compiled function comes by its mask function, from each call's argument
        "made inside": (mu.sliding_window_causal_mask_function, windows),
        "made outside": (lambda f: f, [mu.sliding_window_causal_mask_function(w) for w in windows]),
        "overlay made outside": (lambda f: mu.and_masks(f, mu.causal_mask_function),
                                 [mu.sliding_window_overlay(w) for w in windows]),
    }
    for case, (make, args) in cases.items():
        torch._dynamo.reset()
        compiled = torch.compile(lambda x, arg: (x, _compiled_window(make(arg))), backend="aot_eager")
        assert [compiled(torch.zeros(1), arg)[1] for arg in args] == windows, case


def test_compiled_refusals_are_the_eager_ones(fresh_dynamo):
    """Without fullgraph a refused mask raises the eager error under torch.compile too, closures over
    tensors (which dynamo cannot make constants) included."""
    refused = {
        "packed in two rows": (lambda x: hf.prepare_mask(2, 8, 8, mask_function=mu.and_masks(
            mu.causal_mask_function, mu.packed_sequence_mask_function(x.expand(2, -1)))), "batch_size must be 1"),
        "chunked": (lambda x: hf.prepare_mask(1, 4, 8, q_offset=4, mask_function=mu.chunked_causal_mask_function(
            2, x[:, 0])), "mask_function must"),
        "or": (lambda x: _compiled_window(mu.or_masks(mu.sliding_window_causal_mask_function(3), _first_key)),
               "mask_function must"),
        "local_size": (lambda x: _compiled_window(mu.sliding_window_causal_mask_function(3), 4), "local_size must"),
    }
    for case, (function, message) in refused.items():
        torch._dynamo.reset()
        with pytest.raises(attngen.ArgumentError, match=message):
            torch.compile(function, backend="aot_eager")(torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]]))  # 2 sequences


def test_compiled_refusals_are_the_eager_ones_with_fullgraph(fresh_dynamo):
    """With fullgraph=True too, a refusal is attngen's ArgumentError, not dynamo's own error."""
    q, k, v = testing.random_qkv(1, 4, 2, 4, 4, 16, 16, torch.float32, device="cpu", seed=5)
    causal = SimpleNamespace(training=False, is_causal=True)
    refused = {
        "or": (lambda x: _compiled_window(mu.or_masks(mu.sliding_window_causal_mask_function(3), _first_key)),
               "mask_function must"),
        "local_size": (lambda x: _compiled_window(mu.sliding_window_causal_mask_function(3), 4), "local_size must"),
        "sliding_window": (lambda x: hf.attention_forward(causal, x, k, v, hf.prepare_mask(1, 4, 4), sliding_window=3),
                           "sliding_window must agree"),
    }
    for case, (function, message) in refused.items():
        torch._dynamo.reset()
        with pytest.raises(attngen.ArgumentError, match=message):
            _compiled(function)(q)
