"""The launch arguments every family's host side shares: a call's sizes, its key/value layout (a cache's,
a paged cache's), its cache and packed arguments, the dot precision, the SM count."""

import torch

from .launch import INTERPRETING


# Per device: its SM count (the decode family's splits, the Hopper forward's persistent grid).
_SM_COUNTS = {}


def _sm_count(device):
    # Triton's interpreter on the CPU: a few "SMs", so tests split the keys.
    if device.type != "cuda":
        return 4
    if device not in _SM_COUNTS:
        _SM_COUNTS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNTS[device]


def _dot_precision(dtype):
    # fp32 inputs get true fp32 products (tf32 would not be fp32 attention); so do bf16 inputs in
    # Triton's interpreter, whose bf16 tl.dot is wrong (_dot upcasts them; the products are exact).
    if dtype == torch.float32 or (dtype == torch.bfloat16 and INTERPRETING):
        return "ieee"
    return "tf32"


def _sink_strides(sink):
    """The (batch, head, row) strides the kernels read a sink's rows by: (B, H, Q_LEN) rows in their own
    strides (an expanded `sinks[h]` has 0s), a packed call's (H, TOTAL_Q) rows with batch stride 0."""
    return (0, *sink.stride()) if sink.dim() == 2 else sink.stride()


def _sizes(q, k):
    """(B, H, HKV, Q_LEN, KV_LEN) of a call."""
    return (q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2])


def _kv_layout(k, v, page_table, placeholder=None):
    """How a forward kernel reads the keys and values: (HKV, KV_LEN, k's and v's strides, the
    PageTable, stride_pt and NUM_PAGES arguments, the PAGED and PAGE_SIZE constexprs). A contiguous
    cache's strides are (batch, head, key, dim); a paged one's (page, head, slot, dim), and its
    KV_LEN is MAX_PAGES * PAGE_SIZE. `placeholder` stands in for an absent page table (never read)."""
    if page_table is None:
        return (k.shape[1], k.shape[2], k.stride(), v.stride(), (placeholder, 0, 1),
                dict(PAGED=False, PAGE_SIZE=1))
    paged_strides = lambda t: (t.stride(0), t.stride(2), t.stride(1), t.stride(3))  # noqa: E731
    return (k.shape[2], page_table.shape[1] * k.shape[1], paged_strides(k), paged_strides(v),
            (page_table, page_table.stride(0), k.shape[0]), dict(PAGED=True, PAGE_SIZE=k.shape[1]))


def _cache_launch(cache, placeholder):
    """A forward kernel's cache arguments: (KvLen, QOffset) tensors (`placeholder` where absent,
    never read) and their HAS_KV_LEN / HAS_Q_OFFSET flags."""
    kv_len, q_offset = cache if cache is not None else (None, None)
    args = [kv_len if kv_len is not None else placeholder, q_offset if q_offset is not None else placeholder]
    return args, dict(HAS_KV_LEN=kv_len is not None, HAS_Q_OFFSET=q_offset is not None)


def _fp8_launch(fp8, placeholder):
    """A forward kernel's FP8 arguments (signatures.FP8_SCALES: the (B, HKV) fp32 descale factors of q, k and v
    and their strides) and its FP8 flag, the portable and Hopper forwards' alike; `fp8` is an FP8 call's three
    factors (Fp8._fp8_attention), or None (then `placeholder` stands in for them, never read)."""
    if fp8 is None:
        return [placeholder, placeholder, placeholder, 0, 0], dict(FP8=False)
    return [*fp8, *fp8[0].stride()], dict(FP8=True)


def _packed_launch(packed, placeholder):
    """A portable kernel's packed-call arguments: (CuSeqlensQ, CuSeqlensK, TOTAL_Q) and its VARLEN flag;
    `packed` is a packed call's (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, TOTAL_Q), or None
    (then `placeholder` stands in for the offsets, never read)."""
    if packed is None:
        return [placeholder, placeholder, 0], dict(VARLEN=False)
    return [packed[0], packed[1], packed[4]], dict(VARLEN=True)


def _batch_strides(t, packed):
    """t's strides as a kernel takes them: (batch, head, row, column), the batch stride 0 in a packed call,
    whose (1, heads, TOTAL, D) view a program enters at its sequence's first token instead."""
    return (0, *t.stride()[1:]) if packed is not None else t.stride()


def _call_sizes(q, k, packed):
    """(B, H, HKV, Q_LEN, KV_LEN) as the portable kernels take them: a packed call's B is its number of
    sequences and its lengths the longest sequence's (the grid's)."""
    if packed is None:
        return _sizes(q, k)
    return (packed[0].shape[0] - 1, q.shape[1], k.shape[1], packed[2], packed[3])


_SIDE_STREAMS = {}


def _side_stream(device):
    if device.type != "cuda":
        return None
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]
