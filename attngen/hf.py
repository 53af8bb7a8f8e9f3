"""Runs transformers' attention calls on attngen kernels, as `attn_implementation="attngen"`.

`register()` adds two functions to transformers 5.x. The mask function (`prepare_mask`) runs once
per forward and mask type; instead of a 4-D mask it returns an `AttngenMask`: the pattern (causal,
sliding-window causal or bidirectional), the offset between query and key positions, and the 2-D
padding mask aligned to the keys. The attention function (`attention_forward`) maps that and the
call's scaling, softcap and sliding_window to a spec, built once per distinct combination.

Positions are transformers' own: query row i is at q_offset + i, key j at kv_offset + j (a
sliding-window cache layer keeps only the newest keys, so its kv_offset grows). The specs read
`offset = q_offset - kv_offset` as an `i32[]` input, so one kernel serves prefill and every
decoding step, with no N x N mask and no device sync. Whatever a spec cannot express exactly
(dropout while training, a prepared 4-D mask, attention weights as output, sinks, other mask
patterns) is refused with an error naming the argument. A query row that sees no key (a left-padding
token) gets 0, as with sdpa; eager averages every key there. Only padding positions see no key.

Under torch.compile a forward (prefill or decoding step) of transformers' models has no graph break,
so fullgraph=True works: kernels are built, and the mask functions the forward makes are read, while
dynamo traces (see _build). Every value that picks a kernel is one dynamo guards on, so a call with
another window, padding, scale or cap recompiles; a mask function made outside the compiled code,
whose window dynamo would not guard on, is read in eager after a graph break. Refusals are the
eager ones, fullgraph=True or not (see _refused).

On a machine without a GPU, import attngen.hf before transformers' model classes: those import
triton, which must see the TRITON_INTERPRET=1 that attngen sets (register() says so if not).
"""

from __future__ import annotations

import hashlib
import math
import types
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers import masking_utils as mu

import attngen
from attngen.api import interpreter_came_too_late
from attngen.errors import ArgumentError

# Keyword arguments transformers passes that cannot change what attention computes: the mask's positions
# are cache indices (q_offset, kv_offset), not position_ids, exactly as in transformers' eager attention.
_INERT_KWARGS = frozenset({"position_ids", "cache_position", "use_cache", "output_hidden_states",
                           "num_items_in_batch", "output_router_logits"})


@dataclass(frozen=True, eq=False)
class AttngenMask:
    """What the attention calls of one forward need, in place of a 4-D mask.

    causal: keys after the query are masked; window: keys `window` or more positions behind the
    query are masked too (None: no window); offset: i32[] tensor q_offset - kv_offset, so query row
    q and key k are q + offset - k apart; keep: bool (B, kv_length), the padding mask aligned to
    the keys (None: no padding).
    """
    batch_size: int
    q_length: int
    kv_length: int
    causal: bool
    window: int | None
    offset: torch.Tensor
    keep: torch.Tensor | None

    # transformers' mask functions read a mask's ndim to tell a 2-D padding mask (which they convert)
    # from anything else. generate with a static cache prepares the masks before each forward
    # (create_masks_for_generate) and passes them as the forward's attention_mask, which goes through
    # the mask function again: prepare_mask then returns its AttngenMask (see there).
    ndim = 4


def _refused(message: str) -> ArgumentError:
    """The ArgumentError to raise. Under torch.compile it is raised here, by a function dynamo calls
    instead of tracing, and is dynamo's UserError as well, which dynamo hands to the caller unwrapped:
    a `raise` in traced code would be its "Observed exception" under fullgraph=True (the generated
    modules' _fail does the same)."""
    if torch.compiler.is_compiling():
        _raise_while_tracing(message)
    return ArgumentError(message)


@torch.compiler.assume_constant_result
def _raise_while_tracing(message: str):
    from torch._dynamo.exc import UserError, UserErrorType

    raise type("ArgumentError", (UserError, ArgumentError), {})(UserErrorType.INVALID_INPUT, message)


def spec_text(causal: bool, window: int | None, padded: bool, scale: float, softcap: float | None) -> str:
    """The one place spec text is formed: fixed lines, with only checked numbers substituted."""
    if window is not None and not causal:
        raise _refused(f"window must come with a causal mask, got window={window!r} without one")
    terms = (["keep[b, k]"] if padded else []) + (["k <= q + offset"] if causal else [])
    if window is not None:
        terms.append(f"q + offset - k < {_int(window, 'window')}")
    lines = ["attention hf_" + ("causal" if causal else "full") + ("_window" if window is not None else "")
             + ("_padded" if padded else "") + ("_softcap" if softcap is not None else "")]
    lines += ["input offset: i32[]"] if causal else []
    lines += ["input keep: bool[B, KV_LEN]"] if padded else []
    lines += [f"mask: {' and '.join(terms)}"] if terms else []
    lines.append(f"scale: {_float(scale, 'scaling')}")
    if softcap is not None:
        lines.append(f"score: softcap(score, {_float(softcap, 'softcap', positive=True)})")
    return "\n".join(lines) + "\n"


def _int(value, name: str) -> str:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _refused(f"{name} must be a positive int, got {value!r}")
    return str(int(value))


def _float(value, name: str, positive: bool = False) -> str:
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or (positive and value <= 0)):
        raise _refused(f"{name} must be a finite {'positive ' if positive else ''}number, got {value!r}")
    return repr(float(value))  # the shortest text that reads back as the same double; the grammar's NUMBER


class _Built:
    """The kernels of each spec text built so far, one attribute each, named by _build.

    Attributes, not a dict: dynamo copies a dict when a trace first reads it, so a spec built later
    in the same trace (Gemma-2's second layer type) would be missing from the copy; an attribute is
    read from the object when the trace reaches it.
    """


_BUILT = _Built()


def _kernels(causal: bool, window: int | None, padded: bool, scale: float, softcap: float | None):
    return getattr(_BUILT, _build(spec_text(causal, window, padded, scale, softcap)))


# Under torch.compile a forward must not break the graph, yet dynamo can trace neither a build (parse,
# plan, render, import) nor a read of the closure cells of a function made inside the traced code, and
# a torch.compiler.disable'd function is a graph break itself. So _build and _constant_window are
# marked assume_constant_result: dynamo calls them while tracing and keeps their result as a constant,
# with no guard of its own. That is exact only while their arguments are values dynamo guards on (it
# recompiles when one changes): _build's spec text is made in the trace from such values (a value
# traced symbolically cannot become text, and breaks the graph instead); _constant_window checks its
# own (see there). In eager both are plain calls.
@torch.compiler.assume_constant_result
def _build(text: str) -> str:
    """The name of the _BUILT attribute that holds the kernels of this spec text, built on first use."""
    name = "spec_" + hashlib.sha256(text.encode()).hexdigest()  # an identifier; the same for the same text
    if not hasattr(_BUILT, name):
        setattr(_BUILT, name, attngen.build(text))
    return name


# transformers' mask functions are closures: the code object of each factory's inner function
# identifies the pattern exactly, and its closure cells hold the parts and the window.
_AND_CODE = mu.and_masks(mu.causal_mask_function).__code__
_WINDOW_CODE = mu.sliding_window_overlay(1).__code__


def _pattern(mask_function, local_size) -> tuple[bool, int | None]:
    """(causal, window) of one of transformers' mask functions; anything else is refused."""
    if mask_function is mu.causal_mask_function:
        return True, None
    if mask_function is mu.bidirectional_mask_function:
        return False, None
    window = None
    if getattr(mask_function, "__code__", None) is _AND_CODE:  # under dynamo too, which cannot read __closure__
        window = _traced_window(mask_function) if torch.compiler.is_compiling() else _window(mask_function)
    if window is None:
        name = getattr(mask_function, "__qualname__", type(mask_function).__name__)
        raise _refused(f"mask_function must be transformers' causal, sliding-window causal or bidirectional "
                            f"mask, got {name} (chunked, packed-sequence and or/and-combined masks are not "
                            f"supported by attngen.hf)")
    _int(window, "the mask function's sliding_window")
    if local_size is not None and local_size != window:
        raise _refused(f"local_size must equal the mask function's sliding window {window}, got {local_size!r}")
    return True, window


def _window(mask_function) -> int | None:
    """w when mask_function, an and_masks closure, is exactly and_masks(sliding_window_overlay(w),
    causal_mask_function) in either order (transformers' sliding_window_causal_mask_function, or an
    and_mask_function overlay on the causal mask); None for any other."""
    parts = _cell(mask_function, _AND_CODE, "mask_functions")
    if len(parts) != 2 or mu.causal_mask_function not in parts:
        return None
    return _cell(parts[1] if parts[0] is mu.causal_mask_function else parts[0], _WINDOW_CODE, "sliding_window")


def _cell(fn, code, name: str):
    if getattr(fn, "__code__", None) is not code:
        return None
    return fn.__closure__[code.co_freevars.index(name)].cell_contents


def _traced_window(mask_function) -> int | None:
    """_window(mask_function) while dynamo traces: a constant where that is exact, else read in eager."""
    # _constant_window needs the closure as a constant, which dynamo cannot make of one over tensors
    # (packed-sequence and chunked masks): it fails inside dynamo then, with no word of the mask. repr()
    # of such a closure is a graph break instead, after which this call runs in eager and refuses it.
    repr(mask_function)
    exact, window = _constant_window(mask_function, mask_function)
    return window if exact else _eager_window(mask_function)


@torch.compiler.assume_constant_result
def _constant_window(mask_function, same_mask_function) -> tuple[bool, int | None]:
    """(exact, _window(mask_function)), called by dynamo with one traced function as both arguments.

    Dynamo passes a function made in the traced code (transformers makes its masks in the forward)
    as a new function for each argument, rebuilt from the cell values it traced, which it guards on.
    A function made outside it arrives as itself, the same object twice, and dynamo guards only its
    code, not the cells this call reads: its window could change unseen, so the result is not exact
    and the window is read in eager. _window reads the cells of mask_function and of its parts, no
    deeper, so those are the functions checked.
    """
    parts = zip(_cell(mask_function, _AND_CODE, "mask_functions"),
                _cell(same_mask_function, _AND_CODE, "mask_functions"))
    exact = _rebuilt(mask_function, same_mask_function) and all(_rebuilt(a, b) for a, b in parts)
    return exact, _window(mask_function)


def _rebuilt(first, second) -> bool:
    """Whether two arguments of one _constant_window call are dynamo's two copies of one traced
    function, or a function with no cells, which has nothing dynamo would need to guard."""
    functions = isinstance(first, types.FunctionType) and isinstance(second, types.FunctionType)
    return functions and (first is not second or first.__closure__ is None)


_eager_window = torch.compiler.disable(_window)  # a graph break: for the closures _constant_window cannot trust


def prepare_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
                 mask_function=mu.causal_mask_function, attention_mask: torch.Tensor | None = None,
                 local_size: int | None = None, device=None, **kwargs) -> AttngenMask:
    """transformers' mask interface: the AttngenMask of queries at q_offset + i and keys at kv_offset + j."""
    causal, window = _pattern(mask_function, local_size)
    if isinstance(attention_mask, AttngenMask):
        return _prepared(attention_mask, batch_size, q_length, kv_length, causal, window)
    if isinstance(kv_offset, bool) or not isinstance(kv_offset, int):
        raise _refused(f"kv_offset must be an int, got {kv_offset!r}")
    device = torch.device(device if device is not None else "cpu")
    if isinstance(q_offset, torch.Tensor):  # a static cache's length stays on the device: no sync
        offset = (q_offset.to(device) - kv_offset).to(torch.int32).reshape(())
    elif -2**31 <= q_offset - kv_offset < 2**31:
        offset = torch.full((), q_offset - kv_offset, dtype=torch.int32, device=device)  # a fill, not a copy
    else:
        raise _refused(f"q_offset - kv_offset must fit in int32, got {q_offset} - {kv_offset}")
    keep = None
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.shape[0] != batch_size:
            raise _refused(f"attention_mask must be a 2-D padding mask of {batch_size} rows, "
                                f"got shape {tuple(attention_mask.shape)}")
        # Key j is the token at kv_offset + j; slots past the mask (an unfilled static cache) are padding.
        keep = attention_mask[:, kv_offset:kv_offset + kv_length].to(device=device, dtype=torch.bool)
        if keep.shape[1] < kv_length:
            keep = torch.nn.functional.pad(keep, (0, kv_length - keep.shape[1]), value=False)
    return AttngenMask(batch_size, q_length, kv_length, causal, window, offset, keep)


def _prepared(mask: AttngenMask, batch_size: int, q_length: int, kv_length: int, causal: bool,
              window: int | None) -> AttngenMask:
    """A mask prepared in advance for this very call (by generate, from the same cache state, as
    transformers does with its 4-D masks), returned as it is once its sizes and pattern agree."""
    built = (mask.batch_size, mask.q_length, mask.kv_length, mask.causal, mask.window)
    if built != (batch_size, q_length, kv_length, causal, window):
        raise _refused(f"attention_mask must be an AttngenMask built for (B, Q_LEN, KV_LEN, causal, window) = "
                            f"{(batch_size, q_length, kv_length, causal, window)}, got one built for {built}")
    return mask


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: AttngenMask | None, dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None,
                      is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: q (B, H, Q_LEN, D) and k, v (B, HKV, KV_LEN, D) to
    (attn_output (B, Q_LEN, H, D) contiguous, None); GQA runs natively, k and v are not repeated."""
    if dropout and module.training:
        raise _refused(f"dropout must be 0 while training (attngen kernels have no dropout), got "
                            f"{dropout!r}: call model.eval() or set the config's attention_dropout to 0")
    active = sorted(n for n, v in kwargs.items() if n not in _INERT_KWARGS and v is not None and v is not False)
    if active:
        raise _refused(f"attention arguments {', '.join(active)} must be unset for attngen, got "
                            f"{', '.join(f'{n}={_brief(kwargs[n])}' for n in active)} (attention weights, "
                            f"sinks, biases and packed-sequence lengths are not supported)")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    window, offset, keep = _mask_inputs(attention_mask, query, key, causal, sliding_window)
    attn = _kernels(causal, window, keep is not None, query.shape[-1] ** -0.5 if scaling is None else scaling, softcap)
    inputs = ({"offset": offset} if causal else {}) | ({"keep": keep.to(query.device)} if keep is not None else {})
    # transformers' projections reach here as transposed (B, N, H, D) views, and O follows q's layout:
    # the transpose back is then already contiguous, and contiguous() copies nothing.
    return attn(query, key, value, **inputs).transpose(1, 2).contiguous(), None


def _mask_inputs(mask, query, key, causal: bool, sliding_window):
    """(window, offset, keep) for this call, after checking the mask agrees with the call's arguments."""
    B, Q_LEN, KV_LEN = query.shape[0], query.shape[2], key.shape[2]
    if mask is None:
        # A call from outside transformers' mask code: rows and keys both start at position 0, so
        # causal attention needs as many keys as queries to mean anything.
        if causal and Q_LEN != KV_LEN:
            raise _refused(f"attention_mask must be given for causal attention with Q_LEN != KV_LEN (the "
                                f"query positions are unknown), got None with Q_LEN={Q_LEN}, KV_LEN={KV_LEN}")
        if sliding_window is not None and not causal:
            raise _refused(f"sliding_window must be None for bidirectional attention, got {sliding_window!r}")
        return sliding_window, torch.zeros((), dtype=torch.int32, device=query.device), None
    if not isinstance(mask, AttngenMask):
        raise _refused(f"attention_mask must be the AttngenMask that attngen.hf's mask function builds "
                            f"(pass the model a 2-D padding mask, not a prepared mask), got {_brief(mask)}")
    if (mask.batch_size, mask.q_length, mask.kv_length) != (B, Q_LEN, KV_LEN):
        raise _refused(f"attention_mask must be built for (B, Q_LEN, KV_LEN) = {(B, Q_LEN, KV_LEN)}, "
                            f"got one for {(mask.batch_size, mask.q_length, mask.kv_length)}")
    if mask.causal != causal:
        # transformers' own backends disagree on such a call: eager follows the mask, sdpa and flash is_causal.
        raise _refused(f"is_causal (or module.is_causal) must agree with the mask transformers built "
                            f"({'causal' if mask.causal else 'bidirectional'}), got {causal!r}")
    if sliding_window is not None and sliding_window != mask.window:
        raise _refused(f"sliding_window must agree with the mask transformers built (window "
                            f"{mask.window}), got {sliding_window!r}")
    return mask.window, mask.offset.to(query.device), mask.keep


def _brief(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dim()}-D {value.dtype} tensor of shape {tuple(value.shape)}"
    return repr(value) if isinstance(value, (bool, int, float, str)) else type(value).__name__


def _check_transformers_semantics() -> None:
    # The specs say `k <= q + offset` and `q + offset - k < window`: stop if this transformers means otherwise.
    window, overlay = 3, mu.sliding_window_overlay(3)
    for q in range(8):
        for k in range(8):
            if bool(mu.causal_mask_function(0, 0, q, k)) != (k <= q) or bool(overlay(0, 0, q, k)) != (q - k < window):
                raise RuntimeError(f"transformers' causal or sliding-window mask at q={q}, k={k} differs from "
                                   f"attngen.hf's specs: this transformers version is not supported")


def register(name: str = "attngen") -> None:
    """Make `attn_implementation=name` run attngen kernels (from_pretrained, from_config,
    set_attn_implementation); calling it again with the same name changes nothing."""
    if not isinstance(name, str) or not name.isidentifier():
        raise _refused(f"name must be an identifier, got {name!r}")
    for interface, function in ((AttentionInterface(), attention_forward),
                                (mu.AttentionMaskInterface(), prepare_mask)):
        if name == "eager" or interface.get(name, function) is not function:
            raise _refused(f"name must not be an attention implementation transformers already has, "
                                f"got {name!r}")
    if interpreter_came_too_late():
        raise RuntimeError("triton was imported before attngen could ask for its interpreter (transformers' "
                           "model classes import it): import attngen.hf first, or set TRITON_INTERPRET=1 "
                           "in the environment")
    _check_transformers_semantics()
    AttentionInterface.register(name, attention_forward)
    mu.AttentionMaskInterface.register(name, prepare_mask)
