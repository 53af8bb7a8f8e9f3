"""Call checks: the tensors, sizes and inputs of a call against the spec's declarations, and the error every check raises."""

import weakref

import torch

from .launch import INTERPRETING
from .reductions import reduced_inputs
from .shared import _DTYPES, _INPUT_DTYPES


# A `raise` in code dynamo traces is, under fullgraph=True, dynamo's own "Observed exception", with
# the message only in its __cause__. A function dynamo calls instead of tracing (one marked
# assume_constant_result) raises past it, and dynamo hands an error that is also its UserError to the
# caller unwrapped (it adds the user code's lines to the message). So the caller of a compiled
# function gets the eager ValueError, with or without fullgraph, and the successful path is unchanged.
def _raise_while_tracing(message):
    from torch._dynamo.exc import UserError, UserErrorType  # loaded already: dynamo is tracing

    error = type("ValueError", (UserError, ValueError), {})  # UserError first: its __init__; named as the eager error
    raise error(UserErrorType.INVALID_INPUT, message)


# What torch.compiler.assume_constant_result sets, without importing dynamo (seconds) in every process.
_raise_while_tracing._dynamo_marked_constant = True


def _autocast(q, k, v):
    """q, k and v as torch.autocast hands them to scaled_dot_product_attention, which it runs in the
    lower precision on CUDA and the CPU: float tensors cast to the autocast dtype, while autocast is on for
    q's device. The custom operators have no autocast rule, so the cast is Python here, traced under
    torch.compile; .to() is differentiable, so gradients come back in the caller's dtypes."""
    if not isinstance(q, torch.Tensor) or not torch.is_autocast_enabled(q.device.type):
        return q, k, v
    dtype = torch.get_autocast_dtype(q.device.type)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype in _DTYPES else t for t in (q, k, v))


class CheckedValues:
    """Tensors whose values passed a check that reads them on the host (a sync), or gave a value derived
    from them on the device, with the facts they were checked against: a model passes one batch's
    cu_seqlens, or one decoding step's kv_len and page table, to every layer, and the sync would leave the
    GPU idle while the host prepares each layer's launches (a derived value costs launches of its own
    every layer). An entry holds the tensors weakly (their memory, while they live, is theirs: a new
    tensor at the same address is not mistaken for them) with their version counters (an in-place write,
    through any view, bumps it). Inference tensors have no version counter: they are checked every call."""

    def __init__(self, kept=8):
        self._entries = []
        self._kept = kept

    @staticmethod
    def _key(tensors):
        if any(t is not None and t.is_inference() for t in tensors):
            return None
        return tuple((weakref.ref(t), t._version) if t is not None else None for t in tensors)

    @staticmethod
    def _matches(key, tensors):
        return len(key) == len(tensors) and all(
            (k is None) == (t is None) and (t is None or (k[0]() is t and k[1] == t._version))
            for k, t in zip(key, tensors))

    def value(self, tensors, facts):
        """What was kept for these tensors (None allowed), unchanged, with these facts; None if nothing was."""
        if any(t is not None and t.is_inference() for t in tensors):
            return None
        return next((value for key, checked, value in self._entries if checked == facts and self._matches(key, tensors)),
                    None)

    def keep(self, tensors, facts, value):
        key = self._key(tensors)
        if key is None:
            return
        if len(self._entries) >= self._kept:
            del self._entries[0]
        self._entries.append((key, facts, value))

    def holds(self, tensors, facts):
        """Whether these tensors (None allowed), unchanged, passed the check with these facts."""
        return self.value(tensors, facts) is not None

    def add(self, tensors, facts):
        self.keep(tensors, facts, True)


# One for every spec's Attention: the facts name all a check depends on.
CHECKED_VALUES = CheckedValues()


class Checks:
    """The call checks of an Attention (a mixin: self is the Attention)."""

    def _fail(self, message):
        if torch.compiler.is_compiling():
            _raise_while_tracing(f"{self.facts.name}: {message}")
        raise ValueError(f"{self.facts.name}: {message}")

    def _check(self, q, k, v, inputs, fp8=False):
        """The sizes (B, H, HKV, Q_LEN, KV_LEN, D, DV) of a call with k and v (B, HKV, KV_LEN, D/DV),
        after checking the tensors and the inputs (`fp8`: an FP8 call's, of float8_e4m3fn tensors)."""
        self._check_tensors(q, k, v, fp8)
        B, H, Q_LEN, D = q.shape
        if k.shape[0] != B or v.shape[0] != B:
            self._fail(f"k and v must have batch size {B} like q, got {k.shape[0]} and {v.shape[0]}")
        HKV, KV_LEN = k.shape[1], k.shape[2]
        if v.shape[1] != HKV or v.shape[2] != KV_LEN:
            self._fail(f"v must have {HKV} heads and length {KV_LEN} like k, got shape {tuple(v.shape)}")
        self._check_sizes(B, H, HKV, Q_LEN, KV_LEN, D, v.shape[3], inputs, q.device)
        return B, H, HKV, Q_LEN, KV_LEN, D, v.shape[3]

    def _check_tensors(self, q, k, v, fp8=False):
        """q, k and v: 4-D tensors of one float dtype on one device, unit stride along the head dim; with
        `fp8` (an FP8 call), float8_e4m3fn."""
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                self._fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.layout != torch.strided or t.is_nested:
                self._fail(f"{name} must be a dense tensor, got a {'nested' if t.is_nested else t.layout} one")
            if t.dim() != 4:
                self._fail(f"{name} must have 4 dims (B, heads, length, head_dim), got shape {tuple(t.shape)}")
            if fp8 and t.dtype != torch.float8_e4m3fn:
                self._fail(f"{name} must be float8_e4m3fn like q (an FP8 call), got {t.dtype}")
            if not fp8 and t.dtype not in _DTYPES:
                self._fail(f"{name} must be float16, bfloat16 or float32, got {t.dtype}"
                           + (" (float8_e4m3fn q, k and v make an FP8 call: a forward without a backward pass, not a "
                              "cache or packed call)" if t.dtype == torch.float8_e4m3fn else ""))
            if t.device != q.device:
                self._fail(f"{name} must be on {q.device} like q, got {t.device}")
            if t.stride(-1) != 1:
                self._fail(f"{name} must be contiguous in its last dim (head_dim), got strides {t.stride()}")
        if k.dtype != q.dtype or v.dtype != q.dtype:
            self._fail(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
        if q.device.type != "cuda" and not INTERPRETING:
            self._fail(f"q must be on a CUDA device, got {q.device} (set TRITON_INTERPRET=1 to run on the CPU)")
        if k.shape[-1] != q.shape[-1]:
            self._fail(f"k must have head_dim {q.shape[-1]} like q, got shape {tuple(k.shape)}")

    def _check_sizes(self, B, H, HKV, Q_LEN, KV_LEN, D, DV, inputs, device):
        """The call's sizes against the module's limits, then the inputs against the spec's declarations."""
        if HKV == 0 or H % HKV != 0:
            self._fail(f"the query heads ({H}) must be a multiple of the key/value heads ({HKV})")
        if not (1 <= D <= 256 and 1 <= DV <= 256):
            self._fail(f"head dims must be between 1 and 256, got D={D}, DV={DV}")
        if min(B, H, Q_LEN, KV_LEN) < 1:
            self._fail(f"B, H, Q_LEN and KV_LEN must be at least 1, got {B}, {H}, {Q_LEN}, {KV_LEN}")
        if max(Q_LEN, KV_LEN) > self.facts.max_length:
            self._fail(f"Q_LEN and KV_LEN must be at most {self.facts.max_length} ({self.facts.max_length_reason}), got {Q_LEN} and {KV_LEN}")
        if B * H > self.facts.max_batch_heads:
            self._fail(f"B * H must be at most {self.facts.max_batch_heads} (the launch grid's limit), got {B} * {H}")
        sizes = {"B": B, "H": H, "HKV": HKV, "Q_LEN": Q_LEN, "KV_LEN": KV_LEN}
        # The user's inputs; those of the spec's reductions (the last ones) are computed from them (_reduced).
        reduced = {r[0] for r in self.facts.reductions}
        declared = [n for n in self.facts.inputs if n not in reduced]
        missing = [n for n in declared if n not in inputs]
        if missing:
            self._fail("missing input(s): " + ", ".join(f"{n}: {self._declared(n)}" for n in missing))
        unknown = [n for n in inputs if n not in self.facts.inputs]
        if unknown:
            self._fail(f"unknown input(s) {', '.join(map(repr, unknown))}; the spec declares "
                  + (", ".join(declared) or "none"))
        for name, (dtype, dims, learnable) in self.facts.inputs.items():
            t = inputs[name]
            if not isinstance(t, torch.Tensor):
                self._fail(f"input '{name}' must be a torch.Tensor {self._declared(name)}, got {type(t).__name__}")
            if t.layout != torch.strided or t.is_nested:
                self._fail(f"input '{name}' must be a dense tensor {self._declared(name)}, got a "
                      f"{'nested' if t.is_nested else t.layout} one")
            if t.dtype != _INPUT_DTYPES[dtype]:
                self._fail(f"input '{name}' must have dtype {_INPUT_DTYPES[dtype]} ({self._declared(name)}), got {t.dtype}")
            if t.device != device:
                self._fail(f"input '{name}' must be on {device} like q, got {t.device}")
            expected = [sizes.get(d, d) for d in dims]
            if t.dim() != len(dims) or any(e != "*" and e != n for e, n in zip(expected, t.shape)):
                want = "(" + ", ".join(str(e) if e != "*" else "*" for e in expected) + ")"
                self._fail(f"input '{name}' must have shape {want} ({self._declared(name)}), got {tuple(t.shape)}")

    def _reduced(self, inputs):
        """The call's inputs and, when the inputs its reductions read are tensors as declared, the reductions
        (sum(x[b, :])), computed in torch so autograd carries their gradients to those inputs; otherwise the
        inputs alone, for the checks to name what is wrong."""
        if not self.facts.reductions:
            return inputs
        passed = [r[0] for r in self.facts.reductions if r[0] in inputs]
        if passed:
            reduced = {r[0] for r in self.facts.reductions}
            self._fail(f"unknown input(s) {', '.join(map(repr, passed))}; the spec declares "
                       + ", ".join(n for n in self.facts.inputs if n not in reduced))
        for _, _, source, _ in self.facts.reductions:
            x, (dtype, dims, _) = inputs.get(source), self.facts.inputs[source]
            if (not isinstance(x, torch.Tensor) or x.layout != torch.strided or x.is_nested
                    or x.dtype != _INPUT_DTYPES[dtype] or x.dim() != len(dims)):
                return inputs
        try:
            derived = reduced_inputs(self.facts.reductions, inputs)
        except ValueError as e:
            self._fail(str(e))
        return {**inputs, **derived}

    def _declared(self, name):
        dtype, dims, learnable = self.facts.inputs[name]
        return f"{dtype}[{', '.join(map(str, dims))}]" + (" learnable" if learnable else "")

    def _check_learnable(self, inputs):
        if torch.is_grad_enabled():
            for name, (_, _, learnable) in self.facts.inputs.items():
                if inputs[name].requires_grad and not learnable:
                    self._fail(f"input '{name}' requires grad, but the spec does not declare it learnable, so it would "
                          f"get no gradient: declare it `input {name}: {self._declared(name)} learnable`, or pass it "
                          f"detached")

    def _no_double_backward(self):
        if torch.is_grad_enabled():
            # Under create_graph=True the kernels' gradients would come back without a graph, so a
            # loss built from them (a gradient penalty) would silently miss its own gradient.
            self._fail("double backward (backward with create_graph=True, as a gradient penalty needs) is not "
                  "supported: the kernels' gradients are not differentiable; compute such losses with "
                  "the float64 reference, attngen.reference.evaluate")
