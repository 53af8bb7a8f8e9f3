"""transformers training on the GPU under torch.compile with Inductor: tiny random Llama (GQA, left and
right padding), Mistral (sliding window), Gemma-2 (window and softcap) and Qwen2 in bf16.

A compiled training step (forward, loss, backward) with attn_implementation="attngen" must give the
eager attngen step's loss and gradients, and transformers' eager attention's within bf16 noise (eager,
not sdpa: a left-padded row sees no key, and eager's meaningless average there stays finite). Inductor
asserts the strides of every custom operator's outputs, which the CPU's aot_eager does not: this is
where a model's transposed (B, N, H, D) projections meet the layout contract.
"""

import pytest
import torch

import attngen.hf as hf

transformers = pytest.importorskip("transformers")
from transformers import (Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM,  # noqa: E402
                          MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM)

pytestmark = pytest.mark.gpu
hf.register()

WINDOW = 48  # shorter than the sequences, so the windows mask keys
SIZES = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, initializer_range=0.05)
CONFIGS = {
    "llama": (LlamaForCausalLM, lambda: LlamaConfig(**SIZES)),
    "mistral": (MistralForCausalLM, lambda: MistralConfig(sliding_window=WINDOW, **SIZES)),
    "gemma2": (Gemma2ForCausalLM, lambda: Gemma2Config(sliding_window=WINDOW, query_pre_attn_scalar=48,
                                                       attn_logit_softcapping=20.0, **SIZES)),
    "qwen2": (Qwen2ForCausalLM, lambda: Qwen2Config(**SIZES)),
}
B, N = 2, 160
DEVICE = "cuda"


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _batch(padding):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, SIZES["vocab_size"], (B, N), generator=g)
    mask = torch.ones(B, N, dtype=torch.long)
    if padding == "left":
        mask[0, :37] = 0
    elif padding == "right":
        mask[0, N - 37:] = 0
    return ids.to(DEVICE), mask.to(DEVICE)


def _step(model, ids, mask):
    """One training step's loss and parameter gradients. Labels only where both the token and the one
    before it (whose row predicts it) are real: a padded row's output means nothing."""
    real = mask.bool()
    predicted_by_real = torch.cat([torch.zeros_like(real[:, :1]), real[:, :-1]], dim=1)
    labels = torch.where(real & predicted_by_real, ids, -100)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    grads = torch.autograd.grad(loss, [p for p in model.parameters()])
    return loss.detach().float(), [g.float() for g in grads]


def _relative(got, want):
    return ((got - want).norm() / want.norm().clamp_min(1e-12)).item()


def _model(name):
    cls, config = CONFIGS[name]
    torch.manual_seed(0)
    return cls._from_config(config(), attn_implementation="eager").to(DEVICE, torch.bfloat16).train()


@pytest.mark.parametrize("mode", [None, "reduce-overhead"], ids=["default", "reduce_overhead"])
@pytest.mark.parametrize("name, padding", [("llama", "left"), ("llama", "right"), ("mistral", "none"),
                                           ("gemma2", "left"), ("qwen2", "right")])
def test_compiled_training_step_matches_eager_and_sdpa(name, padding, mode):
    model = _model(name)
    ids, mask = _batch(padding)
    reference_loss, reference_grads = _step(model, ids, mask)
    model.set_attn_implementation("attngen")
    eager_loss, eager_grads = _step(model, ids, mask)
    compiled = torch.compile(model, fullgraph=True, mode=mode)
    for _ in range(2):  # the second step replays (CUDA graphs under reduce-overhead)
        loss, grads = _step(compiled, ids, mask)
    # The same kernels: the compiled step equals eager attngen up to Inductor's fusion of the rest.
    assert abs(loss - eager_loss) <= 1e-2 * abs(eager_loss)
    # bf16 noise: attention's summation order differs from eager's; a wrong mask, window or cap moves the
    # loss and the gradients by far more (relative gradient error 0.3 and up).
    assert abs(loss - reference_loss) <= 2e-2 * abs(reference_loss)
    for got, want, reference in zip(grads, eager_grads, reference_grads):
        assert torch.isfinite(got).all()
        assert _relative(got, want) < 0.05
        assert _relative(got, reference) < 0.1
