"""Runs transformers' attention calls on attngen kernels, as `attn_implementation="attngen"`.

`register()` adds two functions to transformers 5.x. The mask function (`prepare_mask`) runs once
per forward and mask type; instead of a 4-D mask it returns an `AttngenMask`: the pattern (causal,
sliding-window causal or bidirectional), the offset between query and key positions, and the 2-D
padding mask aligned to the keys. The attention function (`attention_forward`) maps that and the
call's scaling, softcap and sliding_window to a spec, built once per distinct combination.

The pattern is recognised from what the mask function computes, through transformers' documented
contract (f(batch_idx, head_idx, q_idx, kv_idx) -> bool on index tensors) and the mask interface's
local_size (the window of sliding layers): the function is called at a few of the call's positions
to find the pattern, then checked at a sample of (batch, query, key) points (every pair for calls of
at most 64 keys). So a function written afresh is recognised as transformers' own are, and one that
differs anywhere in the sample (sinks, chunked attention over a cache's keys, a window other than
local_size) is refused with the point where it differs (see _recognised).

Positions are transformers' own: query row i is at q_offset + i, key j at kv_offset + j (a
sliding-window cache layer keeps only the newest keys, so its kv_offset grows). The specs read
`offset = q_offset - kv_offset` as an `i32[]` input, so one kernel serves prefill and every
decoding step, with no N x N mask and no device sync. The attention dropout a model passes while
training (its config's attention_dropout) is the call's dropout_p, drawn from torch's default
generator (so torch.manual_seed repeats a training step); in eval mode, as in transformers' eager
attention, none. Whatever a spec cannot express exactly (a prepared 4-D mask, attention weights as
output, other mask patterns) is refused with an error naming the argument. A query row that sees no key (a left-padding
token) gets 0, as with sdpa; eager averages every key there. Only padding positions see no key.
gpt-oss's learned attention sinks (the `s_aux` argument, one logit per query head) become the spec's
`sink: sinks[h]`, their gradient flowing back into the model's parameter.

Under torch.compile a forward (prefill or decoding step) of transformers' models has no graph break,
so fullgraph=True works: kernels are built, and the mask functions the forward makes are read, while
dynamo traces (see _build, _constant_pattern). Every value that picks a kernel is one dynamo guards
on, so a call with another window, padding, scale or cap recompiles; a mask function made outside the
compiled code, or over traced values, which dynamo would not guard on, is read in eager after a graph
break: so is the packed-sequence mask transformers makes over traced position_ids whenever a forward has
neither a cache nor an attention_mask (use_cache=False). Refusals are the eager ones, fullgraph=True or
not (see _refused).

A packed batch (DataCollatorWithFlattening's: sequences one after the other in one row, position_ids
restarting at 0, no attention_mask, no cache) reaches prepare_mask as a mask that keeps documents apart.
The documents are read from it too: one starts at each query that does not see the key just before
it; the pattern must then hold within each document and nothing across them (see _recognised). The
attention function runs one packed call (attn's cu_seqlens_q/k) over them, each document a sequence
whose positions start at 0, and takes FlashAttention's varlen kwargs (cu_seq_lens_q/k, max_length_q/k)
as that call's offsets when the model passes them. What transformers' backends disagree on is refused:
packed sequences with a padding mask, with a cache (where transformers builds one mask over the whole
row, seen in eager from position_ids that restart: _check_positions) or in more than one row.

On a machine without a GPU, import attngen.hf before transformers' model classes: those import
triton, which must see the TRITON_INTERPRET=1 that attngen sets (register() says so if not).
"""

from __future__ import annotations

import hashlib
import math
import random
import types
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers import masking_utils as mu

import attngen
from attngen.api import interpreter_came_too_late
from attngen.errors import ArgumentError

# Keyword arguments transformers passes that cannot change what attention computes: the mask's positions
# are cache indices (q_offset, kv_offset), not position_ids, exactly as in transformers' eager attention
# (position_ids are read only to refuse packed sequences the mask does not keep apart: _check_positions).
_INERT_KWARGS = frozenset({"position_ids", "cache_position", "use_cache", "output_hidden_states",
                           "num_items_in_batch", "output_router_logits"})


@dataclass(frozen=True, eq=False)
class AttngenMask:
    """What the attention calls of one forward need, in place of a 4-D mask.

    causal: keys after the query are masked (None: the call has one key, where causal and
    bidirectional agree, so the attention call's is_causal decides); window: keys `window` or more
    positions behind the query are masked too (None: no window); offset: i32[] tensor q_offset - kv_offset, so query row
    q and key k are q + offset - k apart; keep: bool (B, kv_length), the padding mask aligned to
    the keys (None: no padding); cached: the keys may include some from before this call (a cache's),
    so they are not the queries' own tokens. cu_seqlens, max_seqlen: the documents a packed batch's mask
    keeps apart, as a packed call's int32 offsets on the device and longest length (None: not packed);
    the pattern then holds within each document, positions counted from its start.
    """
    batch_size: int
    q_length: int
    kv_length: int
    causal: bool
    window: int | None
    offset: torch.Tensor
    keep: torch.Tensor | None
    cached: bool = False
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int | None = None
    # The position_ids tensors _check_positions has read for this mask: every layer of a forward passes the
    # same one, which is then read on the host once, not once per layer.
    positions_read: list = field(default_factory=list, repr=False)

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


def spec_text(causal: bool, window: int | None, padded: bool, scale: float, softcap: float | None,
              sinks: bool = False) -> str:
    """The one place spec text is formed: fixed lines, with only checked numbers substituted. `sinks`: the
    model passes a learned sink logit per query head (gpt-oss's s_aux)."""
    if window is not None and not causal:
        raise _refused(f"window must come with a causal mask, got window={window!r} without one")
    terms = (["keep[b, k]"] if padded else []) + (["k <= q + offset"] if causal else [])
    if window is not None:
        terms.append(f"q + offset - k < {_int(window, 'window')}")
    lines = ["attention hf_" + ("causal" if causal else "full") + ("_window" if window is not None else "")
             + ("_padded" if padded else "") + ("_softcap" if softcap is not None else "")
             + ("_sinks" if sinks else "")]
    lines += ["input offset: i32[]"] if causal else []
    lines += ["input keep: bool[B, KV_LEN]"] if padded else []
    lines += ["input sinks: f32[H] learnable"] if sinks else []
    lines += [f"mask: {' and '.join(terms)}"] if terms else []
    lines.append(f"scale: {_float(scale, 'scaling')}")
    if softcap is not None:
        lines.append(f"score: softcap(score, {_float(softcap, 'softcap', positive=True)})")
    lines += ["sink: sinks[h]"] if sinks else []
    return "\n".join(lines) + "\n"


_FLOAT32_MAX = 3.4028234663852886e38


def _int(value, name: str) -> str:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _refused(f"{name} must be a positive int, got {value!r}")
    return str(int(value))


def _float(value, name: str, positive: bool = False) -> str:
    # Finite in float32: the kernels hold float constants as float32 numbers (the language refuses others).
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or abs(value) > _FLOAT32_MAX or (positive and value <= 0)):
        raise _refused(f"{name} must be a finite {'positive ' if positive else ''}number (float32), got {value!r}")
    return repr(float(value))  # the shortest text that reads back as the same double; the grammar's NUMBER


class _Built:
    """The kernels of each spec text built so far, one attribute each, named by _build.

    Attributes, not a dict: dynamo copies a dict when a trace first reads it, so a spec built later
    in the same trace (Gemma-2's second layer type) would be missing from the copy; an attribute is
    read from the object when the trace reaches it.
    """


_BUILT = _Built()


def _kernels(causal: bool, window: int | None, padded: bool, scale: float, softcap: float | None, sinks: bool):
    return getattr(_BUILT, _build(spec_text(causal, window, padded, scale, softcap, sinks)))


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


# Masks are recognised by calling them, as transformers' mask interfaces do: a mask function is
# f(batch_idx, head_idx, q_idx, kv_idx) -> bool over broadcastable index tensors (here flat CPU ones, so
# an index-only function costs no device sync). The pattern is read at a few positions, then checked at
# a sample of (batch, query, key) points: corners, the diagonal and the window's edges of many rows,
# and pseudo-random pairs (every pair when the call has at most _EVERY_PAIR keys).
_EVERY_PAIR = 64
_SYNTHETIC_KEYS = 2**31 - 1  # the positions a function dynamo rebuilt from constants is read at (see _pattern)


def _pattern(mask_function, local_size, batch_size: int, kv_offset: int, kv_length: int, packable: bool, device):
    """(causal, window, packed) of mask_function, as _with_documents finds them; anything else is refused."""
    if torch.compiler.is_compiling():
        # A closure over values dynamo traces (tensors, symbolic ints: packed-sequence and chunked masks,
        # a window made symbolic by a recompile) cannot be handed to _constant_pattern; repr() of one is
        # a graph break, after which this call runs in eager and _eager_pattern reads it.
        repr(mask_function)
        exact, found = _constant_pattern(mask_function, mask_function, local_size)
        if not exact:
            found = _eager_pattern(mask_function, local_size, batch_size, kv_offset, kv_length, packable, device)
    else:
        found = _with_documents(mask_function, local_size, batch_size, kv_offset, kv_length, packable, device)
    if isinstance(found, str):
        raise _refused(found)
    return found


def _with_documents(mask_function, local_size, batch_size: int, first: int, count: int, packable: bool, device):
    """_recognised, its documents made a packed call's (cu_seqlens, max_seqlen) on the device, or None. One
    eager function under torch.compile, so that the offsets reach the graph as a tensor input rather than
    as constants it would recompile for at each new packing."""
    found = _recognised(mask_function, local_size, batch_size, first, count, packable)
    if isinstance(found, str) or found[2] is None:
        return found
    causal, window, bounds = found
    return causal, window, (torch.tensor(bounds, dtype=torch.int32, device=device), max(_lengths(bounds)))


def _recognised(mask_function, local_size, batch_size: int, first: int, count: int, packable: bool = False):
    """(causal, window, bounds) when mask_function is causal, sliding-window causal or bidirectional at the
    key positions first .. first + count - 1 (those of the call, at which it may read tensors of that size)
    for every batch row, else the message refusing it. causal is None when there is one key, where the two
    agree; local_size, when given, must be the window. bounds is None, or, in a packable call (queries and
    keys the same positions from 0, as in a packed batch), the documents [bounds[i], bounds[i + 1]) when the
    mask is one of those patterns within each document and keeps the documents apart."""
    name = getattr(mask_function, "__qualname__", type(mask_function).__name__)
    if local_size is not None and (isinstance(local_size, bool) or not isinstance(local_size, int) or local_size < 1):
        return f"local_size must be a positive int, got {local_size!r}"
    try:
        bounds = _document_bounds(mask_function, batch_size, count, name) if packable else None
        if isinstance(bounds, str):
            return bounds
        # The pattern is read within one document (the longest, where a window shows most), as in a call of its own.
        start, length = (first, count) if bounds is None else max(zip(bounds, _lengths(bounds)), key=lambda d: d[1])
        found = _read_pattern(mask_function, local_size, start, length)
        if isinstance(found, str):
            return found
        causal, window = found
        q, k = _sample(first, first + count - 1, window)
        if bounds is not None:
            more_q, more_k = _document_pairs(bounds)
            q, k = torch.cat([q, more_q]), torch.cat([k, more_k])
        got = _allowed(mask_function, batch_size, q, k).reshape(batch_size, -1)
    except Exception as error:  # any function that is not index-based: say what it raised
        return (f"mask_function must be an index-based mask f(batch_idx, head_idx, q_idx, kv_idx), got {name}, "
                f"which raised {type(error).__name__}: {error}")
    want = ((k <= q) if causal is not False else torch.ones_like(q, dtype=torch.bool))
    if window is not None:
        want = want & (q - k < window)
    if bounds is not None:
        document = torch.tensor(bounds[1:-1])
        want = want & (torch.bucketize(q, document, right=True) == torch.bucketize(k, document, right=True))
    wrong = (got != want).nonzero()
    if len(wrong):
        b, i = wrong[0].tolist()
        seen = (("causal" if causal is not False else "bidirectional") + (f" with window {window}" if window else "")
                + (f" within each of {len(bounds) - 1} documents" if bounds is not None else ""))
        return (f"mask_function must be a causal, sliding-window causal or bidirectional mask, got {name}, which "
                f"gives {bool(got[b, i])} at (batch_idx, q_idx, kv_idx) = ({b}, {int(q[i])}, {int(k[i])}) where "
                f"the {seen} mask it otherwise matches gives {bool(want[i])} (chunked and other combined masks "
                f"are not supported by attngen.hf)")
    return causal, window, bounds


def _read_pattern(mask_function, local_size, first: int, count: int):
    """(causal, window) read at a few of the positions first .. first + count - 1 (each checked later), or
    the message refusing local_size."""
    last = first + count - 1
    # One call: the first query and the last key, the last query and the first key, and the last
    # query's keys on either side of local_size's window edge.
    edge = [] if local_size is None or local_size >= count else [last - local_size + 1, last - local_size]
    seen = _allowed(mask_function, 1, [first, last] + [last] * len(edge), [last, first] + edge).tolist()
    causal = None if count == 1 else not seen[0]
    window = None
    if causal and not seen[1] and (local_size is None or seen[2:] != [True, False]):
        window = _first_masked_distance(mask_function, last, count - 1)
    if local_size is not None and causal is not False:
        if causal and seen[1] and local_size < count:
            return (f"local_size must equal the mask function's sliding window, got {local_size!r}, but the "
                    f"query at position {last} sees the key {count - 1} positions behind it")
        if window is not None and window != local_size:
            return f"local_size must equal the mask function's sliding window {window}, got {local_size!r}"
        window = local_size
    return causal, window


def _document_bounds(mask_function, batch_size: int, count: int, name: str):
    """[0, s1, ..., count]: the documents a mask keeps apart, read from every pair of neighbours, since a
    document starts at each query that cannot see the key just before it. None when every query sees its
    neighbour (one document) or none does (a window of 1, the same mask however the keys are split). Packed
    sequences come in one batch row (DataCollatorWithFlattening's): otherwise the message refusing them."""
    q = torch.arange(1, count)
    apart = ~_allowed(mask_function, batch_size, q, q - 1).reshape(batch_size, -1)
    if not apart.any() or apart.all():
        return None
    if batch_size > 1:
        b, i = apart.nonzero()[0].tolist()
        return (f"batch_size must be 1 when the mask function keeps documents apart (packed sequences go in one "
                f"row, as DataCollatorWithFlattening packs them), got {batch_size} rows and {name}, whose query "
                f"{i + 1} of row {b} does not see the key before it")
    return [0, *(apart[0].nonzero()[:, 0] + 1).tolist(), count]


def _lengths(bounds: list[int]) -> list[int]:
    return [end - start for start, end in zip(bounds, bounds[1:])]


def _document_pairs(bounds: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) around the first, the last and 14 pseudo-random documents: their first and last rows against
    their own first and last keys and the previous document's (every neighbouring pair is read already)."""
    draw = random.Random(0).randrange
    documents = {0, len(bounds) - 2} | {draw(len(bounds) - 1) for _ in range(14)}
    pairs = []
    for i in sorted(documents):
        start, last = bounds[i], bounds[i + 1] - 1
        keys = [start, last] + ([] if i == 0 else [bounds[i - 1], start - 1])
        pairs += [(row, key) for row in (start, last) for key in keys]
    return torch.tensor(pairs).T


def _allowed(mask_function, batch_size: int, q, k) -> torch.Tensor:
    """mask_function at every batch row and (q[i], k[i]) pair, as bool (batch_size * len(q),)."""
    q, k = torch.as_tensor(q, dtype=torch.long), torch.as_tensor(k, dtype=torch.long)
    b = torch.zeros_like(q)
    if batch_size > 1:
        b = torch.arange(batch_size).repeat_interleave(len(q))
        q, k = q.repeat(batch_size), k.repeat(batch_size)
    out = mask_function(b, torch.zeros_like(b), q, k)
    return torch.as_tensor(out).to(device="cpu", dtype=torch.bool).expand(b.shape)


def _first_masked_distance(mask_function, query: int, masked: int) -> int:
    """The smallest d such that the query at `query` masks the key d positions behind it, knowing it masks
    the one `masked` behind (a window's edge: every row of the sample checks the keys on either side)."""
    seen = 0
    while masked - seen > 1:
        distances = torch.arange(seen + 1, masked, max(1, -(-(masked - seen - 1) // 64)))
        hits = (~_allowed(mask_function, 1, torch.full_like(distances, query), query - distances)).nonzero()
        if len(hits):
            masked = int(distances[hits[0, 0]])
            seen = int(distances[hits[0, 0] - 1]) if hits[0, 0] > 0 else seen
        else:
            seen = int(distances[-1])
    return masked


def _sample(first: int, last: int, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k): every pair of positions in first .. last when there are at most _EVERY_PAIR, else for
    the first, last, middle, window-edge and 16 pseudo-random rows the keys at both ends, beside the
    diagonal, at both sides of the window's edge and at 8 pseudo-random positions."""
    if last - first < _EVERY_PAIR:
        positions = torch.arange(first, last + 1)
        return positions.repeat_interleave(len(positions)), positions.repeat(len(positions))
    draw = random.Random(0).randint  # the same sample every call
    edges = [] if window is None else [first + window - 1, first + window, first + window + 1]
    rows = [first, first + 1, (first + last) // 2, last - 1, last] + edges + [draw(first, last) for _ in range(16)]
    near = [0, -1, 1] + ([] if window is None else [1 - window, -window])
    pairs = [(q, min(max(key, first), last)) for q in (min(r, last) for r in rows)
             for key in [q + d for d in near] + [first, last] + [draw(first, last) for _ in range(8)]]
    return torch.tensor(pairs).T


@torch.compiler.assume_constant_result
def _constant_pattern(mask_function, same_mask_function, local_size) -> tuple[bool, object]:
    """(exact, _recognised(mask_function) at _SYNTHETIC_KEYS positions), called by dynamo with one traced
    function as both arguments, and kept as a constant.

    Dynamo passes a function made in the traced code (transformers makes its masks in the forward) as a
    new function for each argument, rebuilt from the values it traced, which it guards on; such a
    function reads no tensor, so any positions may be read. A function made outside arrives as itself,
    the same object twice, and dynamo guards only its code, not what it closes over: what it computes
    could change unseen, so the result is not exact and the function is read in eager.
    """
    if not _rebuilt(mask_function, same_mask_function):
        return False, None
    return True, _recognised(mask_function, local_size, 1, 0, _SYNTHETIC_KEYS)  # never packable: no call's keys


def _rebuilt(first, second) -> bool:
    """Whether dynamo guards all that two copies of one traced function compute with: every function
    among them and what they close over (tuples too) is one dynamo rebuilt (two distinct copies) or
    closes over nothing (a plain function, which dynamo guards by identity). This reads closures only
    to ask dynamo's question; the mask itself is recognised by calling it."""
    if isinstance(first, tuple) and isinstance(second, tuple):
        return len(first) == len(second) and all(_rebuilt(a, b) for a, b in zip(first, second))
    if not isinstance(first, types.FunctionType):
        return not callable(first)
    if not isinstance(second, types.FunctionType) or (first is second and first.__closure__ is not None):
        return False
    cells = zip(first.__closure__ or (), second.__closure__ or ())
    return all(_rebuilt(a.cell_contents, b.cell_contents) for a, b in cells)


_eager_pattern = torch.compiler.disable(_with_documents)  # a graph break: for the functions dynamo does not rebuild


def prepare_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
                 mask_function=mu.causal_mask_function, attention_mask: torch.Tensor | None = None,
                 local_size: int | None = None, device=None, **kwargs) -> AttngenMask:
    """transformers' mask interface: the AttngenMask of queries at q_offset + i and keys at kv_offset + j."""
    if isinstance(kv_offset, bool) or not isinstance(kv_offset, int):
        raise _refused(f"kv_offset must be an int, got {kv_offset!r}")
    device = torch.device(device if device is not None else "cpu")
    # Keys from before this call (a cache's) or a query offset kept on the device (a static cache's):
    # then queries and keys are not the same tokens, and no mask over them is a packed batch.
    cached = not (isinstance(q_offset, int) and q_offset == 0 and kv_offset == 0 and q_length == kv_length)
    causal, window, packed = _pattern(mask_function, local_size, batch_size, kv_offset, kv_length,
                                      not cached and kv_length > 1, device)
    if packed is not None and attention_mask is not None:
        # Packed sequences have no padding (transformers looks for them only without a padding mask): with
        # both, which tokens belong together would be a guess.
        raise _refused(f"attention_mask must be None when the mask function keeps documents apart (packed "
                       f"sequences, which have no padding), got {_brief(attention_mask)}")
    if isinstance(attention_mask, AttngenMask):
        return _prepared(attention_mask, batch_size, q_length, kv_length, causal, window)
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
    return AttngenMask(batch_size, q_length, kv_length, causal, window, offset, keep, cached, *(packed or (None, None)))


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
    (attn_output (B, Q_LEN, H, D) contiguous, None); GQA runs natively, k and v are not repeated.
    A packed batch (one row of documents, from the mask or FlashAttention's varlen kwargs) is one packed call.
    `dropout` applies while the module trains, as in transformers' eager attention."""
    dropout_p = dropout if module.training else 0.0
    lengths = {name: kwargs.pop(name) for name in _VARLEN_KWARGS if kwargs.get(name) is not None}
    sinks = _sinks(kwargs.pop("s_aux", None), query)
    active = sorted(n for n, v in kwargs.items() if n not in _INERT_KWARGS and v is not None and v is not False)
    if active:
        raise _refused(f"attention arguments {', '.join(active)} must be unset for attngen, got "
                            f"{', '.join(f'{n}={_brief(kwargs[n])}' for n in active)} (attention weights, "
                            f"and biases are not supported)")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    window, offset, keep = _mask_inputs(attention_mask, query, key, causal, sliding_window)
    if lengths:
        packed = _varlen_lengths(attention_mask, lengths, query, key)
    else:
        packed = _mask_lengths(attention_mask, kwargs.get("position_ids"), query)
    attn = _kernels(causal, window, keep is not None, query.shape[-1] ** -0.5 if scaling is None else scaling, softcap,
                    sinks is not None)
    inputs = ({"offset": offset} if causal else {}) | ({"keep": keep.to(query.device)} if keep is not None else {})
    inputs |= {"sinks": sinks} if sinks is not None else {}
    if packed is not None:
        return _packed_attention(attn, query, key, value, inputs, *packed, dropout_p), None
    # transformers' projections reach here as transposed (B, N, H, D) views, and O follows q's layout:
    # the transpose back is then already contiguous, and contiguous() copies nothing.
    return attn(query, key, value, dropout_p=dropout_p, **inputs).transpose(1, 2).contiguous(), None


def _sinks(s_aux, query):
    """gpt-oss's s_aux (a learned sink logit per query head, (H,)) as the spec's f32 `sinks` input, or None.
    The cast is differentiable: the parameter's gradient flows back through it."""
    if s_aux is None:
        return None
    H = query.shape[1]
    if not isinstance(s_aux, torch.Tensor) or not s_aux.is_floating_point() or tuple(s_aux.shape) != (H,):
        raise _refused(f"s_aux must be a float tensor of shape ({H},) (one sink logit per query head), got "
                       f"{_brief(s_aux)}")
    return s_aux.to(device=query.device, dtype=torch.float32)


# FlashAttention's varlen kwargs, as DataCollatorWithFlattening(return_flash_attn_kwargs=True) makes them and
# models hand them to the attention function: the packed call's cu_seqlens_q/k and max_seqlen_q/k.
_VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _packed_attention(attn, query, key, value, inputs, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      dropout_p=0.0):
    """One packed call over the documents of the batch's one row, as (1, TOTAL, H, D) contiguous."""
    # The row's (1, heads, TOTAL, D) tensors are FlashAttention's varlen (TOTAL, heads, D) as views.
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    out = attn(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
               max_seqlen_k=max_seqlen_k, dropout_p=dropout_p, **inputs)
    return out.unsqueeze(0).contiguous()


def _mask_lengths(mask, position_ids, query):
    """The packed call's (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) when the mask keeps
    documents apart, else None, once position_ids show no packed sequences the mask would mix."""
    if isinstance(mask, AttngenMask) and mask.cu_seqlens is not None:
        return mask.cu_seqlens, mask.cu_seqlens, mask.max_seqlen, mask.max_seqlen
    if isinstance(mask, AttngenMask):
        _check_positions(mask, position_ids, query)
    return None


def _check_positions(mask: AttngenMask, position_ids, query) -> None:
    """Refuses position_ids that fall back between two real tokens of a row the mask does not split: packed
    sequences that transformers did not keep apart, since it looks for them only with neither a cache nor a
    padding mask, and then builds one mask over the whole row (FlashAttention would split it). Read on the
    host once per forward, in eager only: under torch.compile or a CUDA graph capture it is not made."""
    B, Q_LEN = query.shape[0], query.shape[2]
    if (torch.compiler.is_compiling() or (query.is_cuda and torch.cuda.is_current_stream_capturing())
            or Q_LEN < 2 or not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2
            or position_ids.shape[1] != Q_LEN or position_ids.shape[0] not in (1, B)
            or (mask.cached and mask.keep is not None)  # keep is aligned to keys the queries may not be
            or any(read is position_ids for read in mask.positions_read)):
        return
    positions = position_ids.expand(B, Q_LEN)  # transformers' models may pass one row for every batch row
    restart = positions[:, 1:] - positions[:, :-1] != 1
    if mask.keep is not None:  # padding has positions of its own (generate gives it 1): only real neighbours count
        restart = restart & mask.keep[:, 1:] & mask.keep[:, :-1]
    found = restart.nonzero()
    if len(found):
        b, i = found[0].tolist()
        raise _refused(
            f"position_ids must rise by 1 between the real tokens of a row where transformers builds one mask "
            f"over the row, got {int(positions[b, i])} then {int(positions[b, i + 1])} at tokens {i} and {i + 1} "
            f"of row {b} (packed sequences?): transformers keeps packed sequences apart only with no cache and no "
            f"attention_mask, so pass use_cache=False and no attention_mask, the sequences in one row as "
            f"DataCollatorWithFlattening packs them")
    mask.positions_read.append(position_ids)


def _varlen_lengths(mask, lengths: dict, query, key):
    """FlashAttention's varlen kwargs as the packed call's (cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k), once the call is one they can describe: one row of the same tokens as queries and keys,
    no padding, no keys from before, and documents that agree with those the mask keeps apart, if any."""
    missing = [name for name in _VARLEN_KWARGS if name not in lengths]
    if missing:
        raise _refused(f"{', '.join(missing)} must be given with {', '.join(lengths)} (FlashAttention's varlen "
                       f"kwargs come together, as DataCollatorWithFlattening(return_flash_attn_kwargs=True) "
                       f"makes them), got None")
    if query.shape[0] != 1:
        raise _refused(f"query must hold one row with cu_seq_lens_q/k (the packed sequences one after the other, "
                       f"as DataCollatorWithFlattening packs them), got batch size {query.shape[0]}")
    if isinstance(mask, AttngenMask) and mask.keep is not None:
        raise _refused(f"attention_mask must be None with cu_seq_lens_q/k (packed sequences have no padding), "
                       f"got a padding mask of shape {tuple(mask.keep.shape)}")
    if (isinstance(mask, AttngenMask) and mask.cached) or query.shape[2] != key.shape[2]:
        raise _refused(f"the keys must be the queries' own tokens with cu_seq_lens_q/k (packed sequences start "
                       f"at position 0: no cache holding earlier keys), got {query.shape[2]} queries and "
                       f"{key.shape[2]} keys" + (" from a cache" if isinstance(mask, AttngenMask) and mask.cached
                                                  else ""))
    cu_q, cu_k = (lengths[name].to(device=query.device, dtype=torch.int32) if isinstance(lengths[name], torch.Tensor)
                  else lengths[name] for name in ("cu_seq_lens_q", "cu_seq_lens_k"))
    max_q, max_k = (int(lengths[name]) if isinstance(lengths[name], torch.Tensor) else lengths[name]
                    for name in ("max_length_q", "max_length_k"))
    if max_q != max_k:
        raise _refused(f"max_length_k must equal max_length_q (queries and keys are the same tokens), got "
                       f"{max_k!r} and {max_q!r}")
    # Comparing offsets reads them on the host: in eager only, as the packed call checks its offsets.
    if (isinstance(cu_q, torch.Tensor) and isinstance(cu_k, torch.Tensor) and not torch.compiler.is_compiling()
            and not (query.is_cuda and torch.cuda.is_current_stream_capturing())):
        if cu_k is not cu_q and not torch.equal(cu_k, cu_q):
            raise _refused(f"cu_seq_lens_k must equal cu_seq_lens_q (queries and keys are the same tokens), got "
                           f"{_shown(cu_k)} and {_shown(cu_q)}")
        documents = mask.cu_seqlens if isinstance(mask, AttngenMask) else None
        if documents is not None and not torch.equal(cu_q, documents):
            raise _refused(f"cu_seq_lens_q must mark the documents that position_ids mark (by restarting), got "
                           f"{_shown(cu_q)} where position_ids give {_shown(documents)}")
    return cu_q, cu_k, max_q, max_k


def _shown(cu: torch.Tensor) -> list:
    shown = cu.tolist()
    return shown if len(shown) <= 8 else [*shown[:4], "...", *shown[-3:]]


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
    if mask.causal is not None and mask.causal != causal:
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
    AttentionInterface.register(name, attention_forward)
    mu.AttentionMaskInterface.register(name, prepare_mask)
