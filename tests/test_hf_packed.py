"""attngen.hf on packed batches: the sequences DataCollatorWithFlattening packs into one row (position_ids
restarting at 0, no attention_mask, no cache) run as one packed call and give the logits, loss and
gradients of the sequences run one by one; FlashAttention's varlen kwargs (cu_seq_lens_q/k,
max_length_q/k) give the same call; a packed batch with padding, a cache or more than one row is refused.

Tiny float32 models: GQA, and windows (Mistral; Gemma-2 with a soft-cap) shorter than the longest
sequence. The reference is each sequence run alone in float64, its attention plain softmax attention
(_one_sequence_attention: transformers' eager takes its softmax in float32 whatever the dtype), and
the tolerance the house rule's (attngen.testing): at most 3x the error of the same float32 run, plus a
floor. Sequences that saw one another would be off by far more: one cross-document key moves the
logits by 1e-2.
"""

import attngen  # noqa: I001 before transformers' models, which import triton: attngen asks for the interpreter first
import copy
import inspect

import pytest
import torch
from transformers import (AttentionInterface, DataCollatorWithFlattening, DynamicCache, Gemma2Config,
                          Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM)
from transformers import masking_utils as mu

import attngen.hf as hf
from attngen import testing

hf.register()


def _one_sequence_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                            sliding_window=None, softcap=None, **kwargs):
    """Softmax attention over one whole sequence in the inputs' dtype: causal, within the layer's window,
    its scores soft-capped. With no mask function of its own, transformers hands it attention_mask=None."""
    assert attention_mask is None and not dropout
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    scores = query @ key.transpose(-1, -2) * scaling
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(query.shape[2], device=query.device)
    allowed = i[None, :] <= i[:, None]
    if sliding_window is not None:
        allowed &= i[:, None] - i[None, :] < sliding_window
    probabilities = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return (probabilities @ value).transpose(1, 2).contiguous(), None


AttentionInterface.register("one_sequence", _one_sequence_attention)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
WINDOW = 4  # shorter than the longest sequences, so the windows mask keys
SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, initializer_range=0.2)  # 0.2: O(1) scores, not near-uniform
CONFIGS = {
    "llama": (LlamaForCausalLM, lambda: LlamaConfig(**SIZES)),
    "mistral": (MistralForCausalLM, lambda: MistralConfig(sliding_window=WINDOW, **SIZES)),
    "gemma2": (Gemma2ForCausalLM, lambda: Gemma2Config(sliding_window=WINDOW, query_pre_attn_scalar=24,
                                                       attn_logit_softcapping=1.0, **SIZES)),
}
LENGTHS = (6, 1, 3, 9)  # a single token between two sequences; the last crosses a 16-row tile in no call


def _model(name, dtype=torch.float32):
    cls, config = CONFIGS[name]
    torch.manual_seed(0)
    return cls._from_config(config(), attn_implementation="one_sequence").to(DEVICE, dtype).train()


def _sequences(lengths=LENGTHS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, SIZES["vocab_size"], (n,), generator=g).tolist() for n in lengths]


def _packed(sequences, **options):
    """The batch DataCollatorWithFlattening makes of them, on DEVICE."""
    batch = DataCollatorWithFlattening(**options)([{"input_ids": s} for s in sequences])
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _step(model, run):
    """(loss, logits, parameter gradients) of run(model) -> (loss, logits)."""
    loss, logits = run(model)
    return [loss.detach(), logits.detach()] + list(torch.autograd.grad(loss, list(model.parameters())))


def _packed_run(batch, **kwargs):
    def run(model):
        out = model(**batch, **kwargs)
        return out.loss, out.logits
    return run


def _one_by_one(sequences):
    """The packed batch's loss (the mean over every predicted token) and logits, each sequence run alone."""
    def run(model):
        outs = [model(input_ids=torch.tensor([s], device=DEVICE), labels=torch.tensor([s], device=DEVICE),
                      use_cache=False) for s in sequences]
        predicted = [len(s) - 1 for s in sequences]
        loss = sum(out.loss * n for out, n in zip(outs, predicted) if n) / sum(predicted)
        return loss, torch.cat([out.logits for out in outs], dim=1)
    return run


def _assert_steps_match(name, model, actual, sequences):
    """actual, a (loss, logits, gradients) step of model, against the sequences run one by one through
    _one_sequence_attention, in float64 (the truth) and float32 (its error sets the tolerance)."""
    model.set_attn_implementation("one_sequence")
    truth = _step(copy.deepcopy(model).double(), _one_by_one(sequences))
    low = _step(model, _one_by_one(sequences))
    names = ["loss", "logits"] + [f"gradient of {parameter}" for parameter, _ in model.named_parameters()]
    for what, got, want, reference in zip(names, actual, truth, low):
        testing.assert_matches_reference(f"{name} {what}", got, want, reference)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_packed_batch_matches_the_sequences_one_by_one(name):
    """DataCollatorWithFlattening's batch, use_cache=False as transformers' Trainer sets it: transformers
    finds the sequences from position_ids and keeps them apart in its mask, which runs as a packed call."""
    model = _model(name)
    sequences = _sequences()
    model.set_attn_implementation("attngen")
    actual = _step(model, _packed_run(_packed(sequences), use_cache=False))
    _assert_steps_match(name, model, actual, sequences)


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_varlen_kwargs_give_the_position_ids_call(name):
    """cu_seq_lens_q/k and max_length_q/k are the packed call's offsets and lengths: with position_ids the
    same call (the kwargs are checked against the mask's documents), and with a cache, for which transformers
    builds one mask over the whole row, still the call that keeps the sequences apart."""
    model = _model(name)
    model.set_attn_implementation("attngen")
    sequences = _sequences()
    want = _step(model, _packed_run(_packed(sequences), use_cache=False))
    with_kwargs = _packed(sequences, return_flash_attn_kwargs=True)
    for use_cache in (False, True):  # True: an empty cache, made by the forward (the config's default)
        got = _step(model, _packed_run(with_kwargs, use_cache=use_cache))
        for what, a, b in zip(["loss", "logits", "gradients"], got, want):
            assert torch.equal(a, b), (use_cache, what)


def _refusals(model):
    """(case, call, message) of the packed batches whose numbers would depend on a guess."""
    sequences = _sequences()
    batch, with_kwargs = _packed(sequences), _packed(sequences, return_flash_attn_kwargs=True)
    ones = torch.ones_like(batch["input_ids"])
    two_rows = {k: torch.cat([v, v]) if k in ("input_ids", "position_ids", "labels") else v
                for k, v in with_kwargs.items()}
    other = _packed(_sequences((6, 4, 9)), return_flash_attn_kwargs=True)  # as many tokens, other sequences
    # transformers 5.24 renamed the forward's past_key_values to cache (the old name warns)
    cache = {("cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"):
             DynamicCache(config=model.config)}

    def after_a_prefix(model):
        model(input_ids=batch["input_ids"][:, :5], use_cache=True, **cache)
        return model(**with_kwargs, use_cache=True, **cache)

    return [
        ("padding mask", lambda m: m(**batch, attention_mask=ones),
         r"position_ids must rise by 1 .* got 5 then 0 at tokens 5 and 6 of row 0"),
        ("padding mask, varlen kwargs", lambda m: m(**with_kwargs, attention_mask=ones, use_cache=False),
         "attention_mask must be None with cu_seq_lens_q/k"),
        ("cache", lambda m: m(**batch), "pass use_cache=False"),
        ("cache holding a prefix, varlen kwargs", after_a_prefix,
         "keys must be the queries' own tokens .* 19 queries and 24 keys from a cache"),
        ("two rows", lambda m: m(**{k: v for k, v in two_rows.items() if not k.startswith(("cu_", "max_"))},
                                 use_cache=False), "batch_size must be 1"),
        ("two rows, varlen kwargs", lambda m: m(**two_rows),  # with a cache: one mask over each row
         "query must hold one row with cu_seq_lens_q/k"),
        ("varlen kwargs in part", lambda m: m(**batch, cu_seq_lens_q=with_kwargs["cu_seq_lens_q"], use_cache=False),
         "cu_seq_lens_k, max_length_q, max_length_k must be given with cu_seq_lens_q"),
        ("varlen kwargs of other sequences", lambda m: m(**batch, **{k: other[k] for k in hf._VARLEN_KWARGS},
                                                           use_cache=False),
         r"cu_seq_lens_q must mark the documents that position_ids mark .* got \[0, 6, 10, 19\] where position_ids "
         r"give \[0, 6, 7, 10, 19\]"),
        ("keys in other sequences", lambda m: m(**{**with_kwargs, "cu_seq_lens_k": other["cu_seq_lens_k"]},
                                                use_cache=False), "cu_seq_lens_k must equal cu_seq_lens_q"),
    ]


def test_ambiguous_packed_batches_are_refused():
    """Packed sequences with a padding mask, with a cache or in more than one row: transformers' backends
    disagree on them (sdpa mixes the sequences, FlashAttention splits them or ignores the split), so
    attngen says what it expected instead of guessing. Likewise varlen kwargs that are partial or disagree."""
    model = _model("llama")
    model.set_attn_implementation("attngen")
    for case, call, message in _refusals(model):
        with torch.no_grad(), pytest.raises(attngen.ArgumentError, match=message):
            call(model)
            pytest.fail(f"{case}: not refused")


def _documents(mask_function, length=19, local_size=None):
    mask = hf.prepare_mask(batch_size=1, q_length=length, kv_length=length, mask_function=mask_function,
                           local_size=local_size, device=DEVICE)
    bounds = None if mask.cu_seqlens is None else mask.cu_seqlens.tolist()
    return mask.causal, mask.window, bounds, mask.max_seqlen


def test_documents_are_recognised_by_what_the_mask_computes():
    """transformers' packed-sequence masks, with positions remapped to each sequence (5.24) or not (5.17),
    and the same masks written afresh, give the documents; so does a chunked mask, which is the same mask.
    One document, or none a query's neighbour sees (a window of 1), is no packed call."""
    sequence = torch.tensor([[0, 0, 0, 0, 0, 0, 1, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3]], device=DEVICE)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None].to(DEVICE)
    documents = [0, 6, 7, 10, 19]

    def packed(function):
        remap = getattr(mu, "remap_positions_for_packed_sequence", None)  # transformers >= 5.24
        if remap is not None:
            function = remap(function, positions)
        return mu.and_masks(function, mu.packed_sequence_mask_function(sequence))

    def fresh(window):
        on_cpu = sequence.cpu()  # the index tensors' device
        return lambda b, h, q, k: (k <= q) & (q - k < window) & (on_cpu[b, q] == on_cpu[b, k])

    assert _documents(packed(mu.causal_mask_function)) == (True, None, documents, 9)
    assert _documents(fresh(100)) == (True, None, documents, 9)
    assert _documents(packed(mu.sliding_window_causal_mask_function(WINDOW)), local_size=WINDOW) == (
        True, WINDOW, documents, 9)
    assert _documents(fresh(WINDOW)) == (True, WINDOW, documents, 9)
    assert _documents(mu.and_masks(mu.bidirectional_mask_function, mu.packed_sequence_mask_function(sequence))) == (
        False, None, documents, 9)
    chunked = mu.chunked_causal_mask_function(5, torch.zeros(1, dtype=torch.long))
    assert _documents(chunked) == (True, None, [0, 5, 10, 15, 19], 5)
    assert _documents(packed(mu.causal_mask_function), length=6) == (True, None, None, None)  # one document
    assert _documents(packed(mu.sliding_window_causal_mask_function(1)), local_size=1) == (True, 1, None, None)
    with pytest.raises(attngen.ArgumentError, match="attention_mask must be None when the mask function keeps"):
        hf.prepare_mask(batch_size=1, q_length=19, kv_length=19, mask_function=packed(mu.causal_mask_function),
                        attention_mask=torch.ones(1, 19, dtype=torch.bool, device=DEVICE), device=DEVICE)


def test_compiled_packed_training_step_matches_eager():
    """torch.compile (aot_eager on the CPU, as tests/test_hf.py; the GPU's Inductor below): transformers
    makes the packed mask over traced position_ids, which is read in eager after a graph break, and its
    documents reach the graph as a tensor."""
    torch._dynamo.reset()
    model = _model("gemma2")
    model.set_attn_implementation("attngen")
    run = _packed_run(_packed(_sequences()), use_cache=False)
    want = _step(model, run)
    try:
        got = _step(torch.compile(model, backend="aot_eager"), run)
    finally:
        torch._dynamo.reset()
    for what, a, b in zip(["loss", "logits"] + [n for n, _ in model.named_parameters()], got, want):
        testing.assert_matches_reference(f"compiled {what}", a, b.double(), b, factor=0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CONFIGS))
def test_compiled_packed_training_step_on_gpu(name):
    """A training step compiled by Inductor, from position_ids and from the varlen kwargs, against the
    eager step and against the sequences run one by one (the house rule, as above)."""
    torch._dynamo.reset()
    model = _model(name)
    sequences = _sequences()
    model.set_attn_implementation("attngen")
    runs = {"position_ids": _packed_run(_packed(sequences), use_cache=False),
            "varlen kwargs": _packed_run(_packed(sequences, return_flash_attn_kwargs=True), use_cache=False)}
    eager = _step(model, runs["position_ids"])
    compiled = torch.compile(model)
    try:
        steps = {path: _step(compiled, run) for path, run in runs.items()}
    finally:
        torch._dynamo.reset()
    _assert_steps_match(f"{name} eager", model, eager, sequences)
    for path, step in steps.items():
        _assert_steps_match(f"{name} compiled ({path})", model, step, sequences)
