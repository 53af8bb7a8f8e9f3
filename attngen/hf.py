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

On a machine without a GPU, import attngen.hf before transformers' model classes: those import
triton, which must see the TRITON_INTERPRET=1 that attngen sets (register() says so if not).
"""

from __future__ import annotations

import math
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
_BUILT: dict[tuple, attngen.Attention] = {}  # (causal, window, padded, scale, softcap) -> its kernels


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


def spec_text(causal: bool, window: int | None, padded: bool, scale: float, softcap: float | None) -> str:
    """The one place spec text is formed: fixed lines, with only checked numbers substituted."""
    if window is not None and not causal:
        raise ArgumentError(f"window must come with a causal mask, got window={window!r} without one")
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
        raise ArgumentError(f"{name} must be a positive int, got {value!r}")
    return str(int(value))


def _float(value, name: str, positive: bool = False) -> str:
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or (positive and value <= 0)):
        raise ArgumentError(f"{name} must be a finite {'positive ' if positive else ''}number, got {value!r}")
    return repr(float(value))  # the shortest text that reads back as the same double; the grammar's NUMBER


def _kernels(causal: bool, window: int | None, padded: bool, scale: float, softcap: float | None):
    key = (causal, window, padded, float(scale), None if softcap is None else float(softcap))
    if key not in _BUILT:
        _build(key)
    return _BUILT[key]


@torch.compiler.disable  # parsing, planning and importing a module cannot be traced into a graph
def _build(key: tuple) -> None:
    _BUILT[key] = attngen.build(spec_text(*key))


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
    return _closure_pattern(mask_function, local_size)


@torch.compiler.disable  # dynamo cannot read these closure cells (AttributeError): read them outside the graph
def _closure_pattern(mask_function, local_size) -> tuple[bool, int | None]:
    parts = _cell(mask_function, _AND_CODE, "mask_functions")
    if parts is not None and len(parts) == 2 and mu.causal_mask_function in parts:
        window = _cell(parts[1] if parts[0] is mu.causal_mask_function else parts[0], _WINDOW_CODE, "sliding_window")
        if window is not None:
            _int(window, "the mask function's sliding_window")
            if local_size is not None and local_size != window:
                raise ArgumentError(f"local_size must equal the mask function's sliding window {window}, "
                                    f"got {local_size!r}")
            return True, window
    name = getattr(mask_function, "__qualname__", type(mask_function).__name__)
    raise ArgumentError(f"mask_function must be transformers' causal, sliding-window causal or bidirectional "
                        f"mask, got {name} (chunked, packed-sequence and or/and-combined masks are not "
                        f"supported by attngen.hf)")


def _cell(fn, code, name: str):
    if getattr(fn, "__code__", None) is not code:
        return None
    return fn.__closure__[code.co_freevars.index(name)].cell_contents


def prepare_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
                 mask_function=mu.causal_mask_function, attention_mask: torch.Tensor | None = None,
                 local_size: int | None = None, device=None, **kwargs) -> AttngenMask:
    """transformers' mask interface: the AttngenMask of queries at q_offset + i and keys at kv_offset + j."""
    causal, window = _pattern(mask_function, local_size)
    if isinstance(kv_offset, bool) or not isinstance(kv_offset, int):
        raise ArgumentError(f"kv_offset must be an int, got {kv_offset!r}")
    device = torch.device(device if device is not None else "cpu")
    if isinstance(q_offset, torch.Tensor):  # a static cache's length stays on the device: no sync
        offset = (q_offset.to(device) - kv_offset).to(torch.int32).reshape(())
    elif -2**31 <= q_offset - kv_offset < 2**31:
        offset = torch.full((), q_offset - kv_offset, dtype=torch.int32, device=device)  # a fill, not a copy
    else:
        raise ArgumentError(f"q_offset - kv_offset must fit in int32, got {q_offset} - {kv_offset}")
    keep = None
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.shape[0] != batch_size:
            raise ArgumentError(f"attention_mask must be a 2-D padding mask of {batch_size} rows, "
                                f"got shape {tuple(attention_mask.shape)}")
        # Key j is the token at kv_offset + j; slots past the mask (an unfilled static cache) are padding.
        keep = attention_mask[:, kv_offset:kv_offset + kv_length].to(device=device, dtype=torch.bool)
        if keep.shape[1] < kv_length:
            keep = torch.nn.functional.pad(keep, (0, kv_length - keep.shape[1]), value=False)
    return AttngenMask(batch_size, q_length, kv_length, causal, window, offset, keep)


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: AttngenMask | None, dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None,
                      is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: q (B, H, Q_LEN, D) and k, v (B, HKV, KV_LEN, D) to
    (attn_output (B, Q_LEN, H, D) contiguous, None); GQA runs natively, k and v are not repeated."""
    if dropout and module.training:
        raise ArgumentError(f"dropout must be 0 while training (attngen kernels have no dropout), got "
                            f"{dropout!r}: call model.eval() or set the config's attention_dropout to 0")
    active = sorted(n for n, v in kwargs.items() if n not in _INERT_KWARGS and v is not None and v is not False)
    if active:
        raise ArgumentError(f"attention arguments {', '.join(active)} must be unset for attngen, got "
                            f"{', '.join(f'{n}={_brief(kwargs[n])}' for n in active)} (attention weights, "
                            f"sinks, biases and packed-sequence lengths are not supported)")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    window, offset, keep = _mask_inputs(attention_mask, query, key, causal, sliding_window)
    attn = _kernels(causal, window, keep is not None, query.shape[-1] ** -0.5 if scaling is None else scaling, softcap)
    inputs = ({"offset": offset} if causal else {}) | ({"keep": keep.to(query.device)} if keep is not None else {})
    return attn(query, key, value, **inputs).transpose(1, 2).contiguous(), None


def _mask_inputs(mask, query, key, causal: bool, sliding_window):
    """(window, offset, keep) for this call, after checking the mask agrees with the call's arguments."""
    B, Q_LEN, KV_LEN = query.shape[0], query.shape[2], key.shape[2]
    if mask is None:
        # A call from outside transformers' mask code: rows and keys both start at position 0, so
        # causal attention needs as many keys as queries to mean anything.
        if causal and Q_LEN != KV_LEN:
            raise ArgumentError(f"attention_mask must be given for causal attention with Q_LEN != KV_LEN (the "
                                f"query positions are unknown), got None with Q_LEN={Q_LEN}, KV_LEN={KV_LEN}")
        if sliding_window is not None and not causal:
            raise ArgumentError(f"sliding_window must be None for bidirectional attention, got {sliding_window!r}")
        return sliding_window, torch.zeros((), dtype=torch.int32, device=query.device), None
    if not isinstance(mask, AttngenMask):
        raise ArgumentError(f"attention_mask must be the AttngenMask that attngen.hf's mask function builds "
                            f"(pass the model a 2-D padding mask, not a prepared mask), got {_brief(mask)}")
    if (mask.batch_size, mask.q_length, mask.kv_length) != (B, Q_LEN, KV_LEN):
        raise ArgumentError(f"attention_mask must be built for (B, Q_LEN, KV_LEN) = {(B, Q_LEN, KV_LEN)}, "
                            f"got one for {(mask.batch_size, mask.q_length, mask.kv_length)}")
    if mask.causal != causal:
        # transformers' own backends disagree on such a call: eager follows the mask, sdpa and flash is_causal.
        raise ArgumentError(f"is_causal (or module.is_causal) must agree with the mask transformers built "
                            f"({'causal' if mask.causal else 'bidirectional'}), got {causal!r}")
    if sliding_window is not None and sliding_window != mask.window:
        raise ArgumentError(f"sliding_window must agree with the mask transformers built (window "
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
        raise ArgumentError(f"name must be an identifier, got {name!r}")
    for interface, function in ((AttentionInterface(), attention_forward),
                                (mu.AttentionMaskInterface(), prepare_mask)):
        if name == "eager" or interface.get(name, function) is not function:
            raise ArgumentError(f"name must not be an attention implementation transformers already has, "
                                f"got {name!r}")
    if interpreter_came_too_late():
        raise RuntimeError("triton was imported before attngen could ask for its interpreter (transformers' "
                           "model classes import it): import attngen.hf first, or set TRITON_INTERPRET=1 "
                           "in the environment")
    _check_transformers_semantics()
    AttentionInterface.register(name, attention_forward)
    mu.AttentionMaskInterface.register(name, prepare_mask)
