"""The Triton helpers every generated kernel calls: Python's integer division, tanh, pow, dots, masked
tile loads, loop bounds, visit counters and the gradient adds of learnable inputs."""

import triton
import triton.language as tl

# --- scalar and element helpers -------------------------------------------------------------
# Base-2 softmax (exp2 is one instruction): scores are scaled by log2(e) on the way in and the LSE
# by ln(2) on the way out. The host reads LOG2E.value, a float, to fold it into qk_scale.
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


# Python's floor division and modulo (Triton's `//` and `%` truncate toward zero, like C).
@triton.jit
def _floordiv(a, b):
    q = a // b
    return tl.where((a % b != 0) & ((a < 0) != (b < 0)), q - 1, q)


@triton.jit
def _floormod(a, b):
    r = a % b
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)


@triton.jit
def _ceildiv(a, b):
    return -_floordiv(-a, b)


@triton.jit
def _floordiv_f(a, b):
    return tl.floor(a / b)


@triton.jit
def _floormod_f(a, b):
    return a - b * tl.floor(a / b)


@triton.jit
def _tanh(x):
    # From exp of a non-positive number: no overflow for any x, exact limits at +-inf. Near 0 that
    # form loses digits to 1 - t (softcap's x = score / cap is small), so |x| < 0.25 uses the Taylor
    # series to x^13 instead, whose next term is below 2e-12 relative there.
    t = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    y = tl.where(x >= 0, y, -y)
    x2 = x * x
    series = x * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (
        -0.05396825396825397 + x2 * (0.021869488536155203 + x2 * (
            -0.008863235529902197 + x2 * 0.003592128036572481))))))
    return tl.where(tl.abs(x) < 0.25, series, y)


@triton.jit
def _tanh_approx(x):
    # One MUFU op (the portable _tanh takes an exp, a division and a polynomial); relative error about
    # 1e-5, far below the 16-bit inputs' rounding, and the same instruction FA3 uses for softcapping.
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _tan(x):
    # Triton's math has sin and cos but no tan (libdevice's is not in the interpreter).
    return tl.sin(x) / tl.cos(x)


@triton.jit
def _atan(x):
    # Cephes' atanf: reduced to |t| <= tan(pi/8) by atan(x) = pi/2 - atan(1/x) and pi/4 + atan((x-1)/(x+1)),
    # then a degree-9 odd polynomial; about 1 ulp of float32. Odd, so computed on |x|.
    a = tl.abs(x)
    big = a > 2.414213562373095
    mid = a > 0.4142135623730950
    t = tl.where(big, -1.0 / tl.maximum(a, 1.0), tl.where(mid, (a - 1.0) / (a + 1.0), a))
    base = tl.where(big, 1.5707963267948966, tl.where(mid, 0.7853981633974483, 0.0))
    z = t * t
    y = base + ((((8.05374449538e-2 * z - 1.38776856032e-1) * z + 1.99777106478e-1) * z
                 - 3.33329491539e-1) * z * t + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def _round(x):
    # The nearest integer, ties to even (as Python's round and torch.round), as a float. x - floor(x)
    # is exact except just below 0, where any rounding of it still picks the right neighbour.
    f = tl.floor(x)
    d = x - f
    odd = tl.floor(f * 0.5) * 2.0 != f
    return tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)


@triton.jit
def _pow(x, y):
    # x ** y for any signs, as torch.pow: negative x needs an integral y. The bool algebra stays
    # within y's shape and within x's (tl.where joins them), since y may be a scalar read once per
    # program while x is a block, and the interpreter cannot `&` the two.
    r = tl.exp2(y * tl.log2(tl.abs(x)))
    integral = tl.floor(y) == y
    odd = integral & (tl.floor(y * 0.5) * 2.0 != y)
    signed = tl.where(integral, tl.where(odd, -r, r), float("nan"))
    r = tl.where(x < 0, signed, r)
    return tl.where(y == 0, 1.0, r)


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr):
    # "ieee" asks for true fp32 products, so 16-bit operands are upcast first: the host asks so for
    # fp32 inputs (a no-op there) and for bf16 in Triton's interpreter, whose bf16 tl.dot is wrong.
    if DOT_PRECISION == "ieee":
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _load_tile(ptrs, rows_ok, cols_ok, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    # Bounds checks only where a tile can overhang: full tiles and unpadded head dims load plainly.
    if CHECK_ROWS:
        if CHECK_COLS:
            x = tl.load(ptrs, mask=rows_ok & cols_ok, other=0.0)
        else:
            x = tl.load(ptrs, mask=rows_ok, other=0.0)
    else:
        if CHECK_COLS:
            x = tl.load(ptrs, mask=cols_ok, other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _page_numbers(pages, offs_n, KV_LEN, PAGE_SIZE: tl.constexpr):
    # The physical page of each key of a paged cache's row (0 past the row's keys); clamped by the
    # caller to the pool, so no table entry can reach past its memory.
    return tl.load(pages + offs_n // PAGE_SIZE, mask=offs_n < KV_LEN, other=0)


@triton.jit
def _min_max_sum(lo_a, hi_a, sum_a, lo_b, hi_b, sum_b):
    # _scatter_tile's one reduction of a gradient tile: its smallest and largest address and its sum.
    return tl.minimum(lo_a, lo_b), tl.maximum(hi_a, hi_b), sum_a + sum_b


@triton.jit
def _sum_pair(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _index_bound(x, n):
    # A loop bound clamped to [0, n], as int32: bounds are computed in int64 (exactly: see
    # attngen.integers), and the loops' tile counters must keep one type (a clamp first keeps the
    # narrowing exact).
    return tl.minimum(tl.maximum(x, 0), n).to(tl.int32)


@triton.jit
def _tile_ranges(lo, hi, full_lo, full_hi, BLOCK: tl.constexpr):
    # Element bounds [lo, hi) to visit and [full_lo, full_hi) fully allowed, as tile numbers:
    # [start, first_full) masked, [first_full, last_full) unmasked, [last_full, end) masked.
    hi = tl.maximum(hi, lo)
    start = lo // BLOCK
    end = tl.where(hi > lo, (hi + BLOCK - 1) // BLOCK, start)
    first_full = (tl.maximum(full_lo, lo) + BLOCK - 1) // BLOCK
    last_full = tl.minimum(full_hi, hi) // BLOCK
    none_full = first_full >= last_full
    first_full = tl.where(none_full, end, first_full)
    last_full = tl.where(none_full, end, last_full)
    return start, first_full, last_full, end


@triton.jit
def _tile_start(tiles, j, j_hi, gap_at, gap, BLOCK: tl.constexpr, INDEXED: tl.constexpr):
    # The j-th tile of a loop: from a tile table's list (masked: j may be one past the end), or
    # the j-th of the grid, skipping `gap` tiles from number `gap_at` on (so one masked loop covers
    # the partial tiles on both sides of the fully allowed stretch).
    if INDEXED:
        t = tl.load(tiles + j, mask=j < j_hi, other=0)
    else:
        t = tl.where(j >= gap_at, j + gap, j)
    return t * BLOCK


@triton.jit
def _count_visit(visits, start, BLOCK: tl.constexpr, MASKED: tl.constexpr, COUNT_VISITS: tl.constexpr):
    # Instrumentation (visit_counts): 1 per masked visit of a tile, 16 per unmasked one.
    if COUNT_VISITS:
        if MASKED:
            tl.atomic_add(visits + start // BLOCK, 1, sem="relaxed")
        else:
            tl.atomic_add(visits + start // BLOCK, 16, sem="relaxed")


# --- deterministic sums ------------------------------------------------------------------------
# A learnable input's gradient gathers terms from many programs, and float addition depends on its
# order, so atomic float adds differ in the last bits from run to run. In deterministic mode each entry
# gets EXACT_WORDS int64 words instead: EXACT_DIGITS 24-bit digits of its sum's binary expansion (bits
# 2**-149 to 2**139, every float32's range, each digit a word with 39 bits of headroom for carries) and
# counts of its +inf, -inf and NaN terms. Integer addition is associative, so any order of the adds
# leaves the same words, and the sum they hold is exact; kernels._exact_finish rounds it to float32.
EXACT_DIGITS = tl.constexpr(12)
EXACT_WORDS = tl.constexpr(15)


@triton.jit
def _exact_add(Words, value, mask):
    # value's sign, mantissa and exponent from its bits: |value| = mantissa * 2**(position - 149), the
    # mantissa 24 bits (denormals: their 23 and position 0), so mantissa << (position % 24) spans at most
    # two digits, words position // 24 and the one above.
    bits = value.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 255
    fraction = bits & 8388607
    mantissa = tl.where(exponent > 0, fraction | 8388608, fraction)
    position = tl.maximum(exponent, 1) - 1
    shifted = mantissa.to(tl.int64) << (position % 24).to(tl.int64)
    low = shifted & 16777215
    high = shifted >> 24
    negative = bits < 0
    low = tl.where(negative, -low, low)
    high = tl.where(negative, -high, high)
    digit = Words + position // 24
    finite = exponent < 255
    special = exponent == 255
    if mask is not None:
        finite = finite & mask
        special = special & mask
    tl.atomic_add(digit, low, mask=finite & (low != 0), sem="relaxed")
    tl.atomic_add(digit + 1, high, mask=finite & (high != 0), sem="relaxed")
    # Non-finite terms are counted: an inf fraction is 0, a NaN's is not.
    count = tl.where(fraction != 0, EXACT_DIGITS + 2, tl.where(negative, EXACT_DIGITS + 1, EXACT_DIGITS))
    tl.atomic_add(Words + count, tl.where(special, 1, 0).to(tl.int64), mask=special, sem="relaxed")


@triton.jit
def _grad_add(Grad, offset, value, mask, DETERMINISTIC: tl.constexpr):
    # Adds gradient terms `value` (a scalar or a tile) into a learnable input's gradient at `offset`
    # where `mask` holds (None: everywhere): an fp32 atomic add (relaxed: only the sum after the kernel
    # matters, so no ordering fence per element), or in deterministic mode an exact add into the entry's words.
    if DETERMINISTIC:
        _exact_add(Grad + tl.cast(offset, tl.int64) * EXACT_WORDS, value, mask)
    else:
        tl.atomic_add(Grad + offset, value, mask=mask, sem="relaxed")


# --- dropout ---------------------------------------------------------------------------------
# Dropout keeps P[b, h, q, k] by a Philox4x32-7 draw (Triton's tl.philox at 7 rounds, FlashAttention-2's
# count, which passes TestU01's BigCrush; tl.rand's default is 10) of the call's two words (Rng: a seed and
# an offset the host drew from the torch generator) and (b, h, q, k) alone, so every kernel and tile shape
# regenerates the same bit and the mask is never stored. One draw (four 32-bit words, eight 16-bit halves)
# serves eight elements: (q, k) = (16A + 8a + x, 16C + 8c + 2y + e) with x < 8, y < 4 and a, c, e bits
# takes half e (0: the low 16 bits) of word 2a + c of the draw at counter (4C + y, 8A + x, b * H + h,
# offset) under key seed. The eight lie in one thread of every MMA accumulator layout's (q, k) tile (a
# thread holds rows r and r + 8 of a 16-row slab, and columns 2j, 2j + 1, 2j + 8, 2j + 9): the forward and
# the dQ pass draw once for eight elements. On the backward's transposed (k, q) tiles a thread holds key
# rows r and r + 8 only, so it draws once for four elements and reads the half of its key's bit 0. An
# element is kept when its half is at least round(dropout_p * 2**16) (at most 65535): the keep
# probability is 1 - dropout_p to within 2**-17, as FlashAttention-2's is to within 2**-8.
DROPOUT_ROUNDS = tl.constexpr(7)


@triton.jit
def _dropout_state(Rng, dropout_p, DROPOUT: tl.constexpr):
    # A program's (seed, offset, threshold, scale): the call's words (Rng, int64 [seed, offset], the
    # offset's low word a counter word), the threshold of the kept halves, and 1 / (1 - p), which the
    # kept P are scaled by; placeholders when DROPOUT is off (then nothing reads them).
    if DROPOUT:
        seed = tl.load(Rng)
        offset = tl.load(Rng + 1).to(tl.int32)
        threshold = tl.minimum(dropout_p * 65536.0 + 0.5, 65535.0).to(tl.int32)
        scale = 1.0 / (1.0 - dropout_p)
    else:
        seed = 0
        offset = 0
        threshold = 0
        scale = 1.0
    return seed, offset, threshold, scale


@triton.jit
def _dropout_counters(q, k):
    # The draw's first two counter words of queries q and keys k: k without its bits 0 and 3, q without
    # its bit 3.
    return (k // 16) * 4 + (k % 8) // 2, (q // 16) * 8 + q % 8


@triton.jit
def _dropout_half_kept(word, high, threshold):
    # Whether the 16-bit half of `word` (uint32) that `high` picks (a tensor) is kept.
    return tl.where(high, word >> 16, word & 0xFFFF).to(tl.int32) >= threshold


@triton.jit
def _dropout_halves_kept(word, threshold):
    # Whether the low and the high 16-bit half of `word` (uint32) are kept.
    return (word & 0xFFFF).to(tl.int32) >= threshold, (word >> 16).to(tl.int32) >= threshold


@triton.jit
def _dropout_keep(seed, offset, threshold, bh, q, k):
    # Whether dropout keeps the elements at queries q and keys k (int32 index tensors that broadcast to
    # the tile, in any layout) of batch x head bh = b * H + h: the definition above, element by element
    # (every element runs its own draw: _dropout_keep_tile shares one among eight or four).
    q = q + k * 0
    k = k + q * 0
    c0, c1 = _dropout_counters(q, k)
    w0, w1, w2, w3 = tl.philox(seed, c0, c1, bh, offset, DROPOUT_ROUNDS)
    low_k = k % 16 < 8
    word = tl.where(q % 16 < 8, tl.where(low_k, w0, w1), tl.where(low_k, w2, w3))
    return _dropout_half_kept(word, k % 2 == 1, threshold)


@triton.jit
def _dropout_keep_tile(seed, offset, threshold, bh, q, k, KEYS_ALONG_ROWS: tl.constexpr):
    # _dropout_keep of a tile: q and k are its query and key indices (int32, broadcasting to the tile;
    # (rows, columns) = (queries, keys), or (keys, queries) with KEYS_ALONG_ROWS, the backward's transposed
    # tiles), each axis consecutive from a multiple of 16. The tile is cut by the bits that every MMA
    # accumulator layout holds in one thread's registers, so the reshapes, splits and joins move no data:
    # the draws run on one part's indices, and each word (or half) lands on its part.
    q = q + k * 0
    k = k + q * 0
    ROWS: tl.constexpr = q.shape[0]
    COLUMNS: tl.constexpr = q.shape[1]
    if KEYS_ALONG_ROWS:
        # Quarters by the half bit (8) of each axis: a draw for four elements, each reading the half of its
        # key's bit 0 (the two threads of a key pair draw the same words).
        q = _dropout_quarter(q, ROWS, COLUMNS)
        k = _dropout_quarter(k, ROWS, COLUMNS)
        c0, c1 = _dropout_counters(q, k)
        w0, w1, w2, w3 = tl.philox(seed, c0, c1, bh, offset, DROPOUT_ROUNDS)
        high = k % 2 == 1
        k0, k1 = _dropout_half_kept(w0, high, threshold), _dropout_half_kept(w1, high, threshold)
        k2, k3 = _dropout_half_kept(w2, high, threshold), _dropout_half_kept(w3, high, threshold)
        # Word 2a + c goes to the quarter of query half a and key half c: (row half, column half) = (c, a).
        keep = tl.join(tl.join(k0, k2), tl.join(k1, k3))
        # (row pair, column pair, column half, row half) back to (rows, columns)
        keep = tl.reshape(keep, [ROWS // 16, 8, COLUMNS // 16, 8, 2, 2])
        return tl.reshape(tl.permute(keep, (0, 5, 1, 2, 4, 3)), [ROWS, COLUMNS])
    else:
        # Eighths by the query's bit 3 (a) and the key's bits 3 (c) and 0 (e): one draw for eight elements.
        q = _dropout_eighth(q, ROWS, COLUMNS)
        k = _dropout_eighth(k, ROWS, COLUMNS)
        c0, c1 = _dropout_counters(q, k)
        w0, w1, w2, w3 = tl.philox(seed, c0, c1, bh, offset, DROPOUT_ROUNDS)
        # Word 2a + c, half e, goes to eighth (a, c, e): joined as (.., e, c, a).
        k00, k01 = _dropout_halves_kept(w0, threshold)
        k10, k11 = _dropout_halves_kept(w1, threshold)
        k20, k21 = _dropout_halves_kept(w2, threshold)
        k30, k31 = _dropout_halves_kept(w3, threshold)
        keep = tl.join(tl.join(tl.join(k00, k01), tl.join(k10, k11)), tl.join(tl.join(k20, k21), tl.join(k30, k31)))
        # (A, x, C, y, e, c, a) back to (A, a, x) rows and (C, c, y, e) columns
        keep = tl.reshape(keep, [ROWS // 16, 8, COLUMNS // 16, 4, 2, 2, 2])
        return tl.reshape(tl.permute(keep, (0, 6, 1, 2, 5, 3, 4)), [ROWS, COLUMNS])


@triton.jit
def _dropout_quarter(x, ROWS: tl.constexpr, COLUMNS: tl.constexpr):
    # The quarter of tile x of row half 0 and column half 0, (ROWS // 2, COLUMNS // 2): rows 16A + x of
    # the tile at row 8A + x, columns alike.
    x = tl.permute(tl.reshape(x, [ROWS // 16, 2, 8, COLUMNS // 16, 2, 8]), (0, 2, 3, 5, 1, 4))
    x, _ = tl.split(tl.reshape(x, [ROWS // 2, COLUMNS // 2, 2, 2]))
    x, _ = tl.split(x)
    return x


@triton.jit
def _dropout_eighth(x, ROWS: tl.constexpr, COLUMNS: tl.constexpr):
    # The eighth of tile x of row bit 3, column bit 3 and column bit 0 all 0, (ROWS // 2, COLUMNS // 4):
    # rows 16A + x of the tile at row 8A + x, columns 16C + 2y at column 4C + y.
    x = tl.permute(tl.reshape(x, [ROWS // 16, 2, 8, COLUMNS // 16, 2, 4, 2]), (0, 2, 3, 5, 1, 4, 6))
    x, _ = tl.split(tl.reshape(x, [ROWS // 2, COLUMNS // 4, 2, 2, 2]))
    x, _ = tl.split(x)
    x, _ = tl.split(x)
    return x


@triton.jit
def _fp8_descales(QDescale, KDescale, VDescale, row):
    # An FP8 call's descale factors of one (batch, key/value head), at `row` of the three (B, HKV) tensors: the
    # scores' factor (q's times k's), O's (v's), or NaN for O where any factor is negative. Descale factors are
    # magnitudes (FlashAttention-3's), and the Hopper forward takes each row's max before scaling, which a
    # negative factor would turn into the min: such rows come out NaN in every family, never silently wrong.
    q_descale = tl.load(QDescale + row)
    k_descale = tl.load(KDescale + row)
    v_descale = tl.load(VDescale + row)
    negative = (q_descale < 0) | (k_descale < 0) | (v_descale < 0)
    return q_descale * k_descale, tl.where(negative, float("nan"), v_descale)


@triton.jit
def _cache_query_offset(KvLen, QOffset, b, Q_LEN, HAS_KV_LEN: tl.constexpr, HAS_Q_OFFSET: tl.constexpr):
    # The position of batch row b's first query in a cache call: q_offset[b], or kv_len[b] - Q_LEN when the
    # call left q_offset out (its queries are the newest tokens); 0 in any other call.
    q_off = 0
    if HAS_Q_OFFSET:
        q_off = tl.load(QOffset + b)
    elif HAS_KV_LEN:
        q_off = tl.load(KvLen + b) - Q_LEN
    return q_off


@triton.jit
def _cache_row_bad(b, KvLen, QOffset, PageTable, stride_pt, Q_LEN, MAX_KV, MAX_OFFSET, NUM_PAGES, MAX_PAGES,
                   HAS_KV_LEN: tl.constexpr, HAS_Q_OFFSET: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
                   BLOCK_PAGES: tl.constexpr):
    # Whether batch row b of a cache call has values outside its cache: q_offset[b] outside [0, MAX_OFFSET],
    # kv_len[b] outside [0, MAX_KV], or a page the row uses (PageTable[b, p] for p * PAGE_SIZE < kv_len[b])
    # outside [0, NUM_PAGES). The forward's kernels clamp those values to the cache, so its memory is safe;
    # a row this finds bad gets NaN in O and LSE, so what they computed is never taken for an answer.
    q_off = _cache_query_offset(KvLen, QOffset, b, Q_LEN, HAS_KV_LEN, HAS_Q_OFFSET)
    bad = (q_off < 0) | (q_off > MAX_OFFSET)
    if HAS_KV_LEN:
        kv_len = tl.load(KvLen + b)
        bad = bad | (kv_len < 0) | (kv_len > MAX_KV)
        if PAGED:
            for start in range(0, MAX_PAGES, BLOCK_PAGES):
                offs = start + tl.arange(0, BLOCK_PAGES)
                used = (offs < MAX_PAGES) & (offs * PAGE_SIZE < kv_len)
                page = tl.load(PageTable + b.to(tl.int64) * stride_pt + offs, mask=used, other=0)
                bad = bad | (tl.max(((page < 0) | (page >= NUM_PAGES)).to(tl.int32), 0) > 0)
    return bad
