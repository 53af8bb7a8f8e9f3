"""Context parallelism planned without communicating: which rows each rank holds, which (query chunk, key chunk)
pairs the mask leaves empty, which K/V shards travel where, and which schedule (ring or all-gather) a call runs.

Everything here is a pure function of the spec, the sizes and the group's size, so every rank computes the
same plan and posts matching sends and receives without agreeing on anything at run time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from attngen import intervals, ir
from attngen.errors import ArgumentError

LOAD_BALANCES = ("zigzag", "contiguous")
SCHEDULES = ("auto", "ring", "allgather")

# The model `choose_schedule` uses (stated in docs/api.md). The numbers are those of an H100/H200 node and
# only rank the two schedules: ATTENTION_FLOPS, what the forward kernels achieve (bf16, FLOPs as
# 2 * rows * keys * (D + DV) per visited pair); LINK_BYTES, one peer-to-peer direction of NVLink as a ring
# step uses it; GATHER_BYTES, an all-gather's bus bandwidth (NCCL spreads it over every link); STEP_SECONDS,
# what a ring step costs beyond its kernels and transfer (launches, the exchange's synchronisation, merges).
ATTENTION_FLOPS = 450e12
LINK_BYTES = 150e9
GATHER_BYTES = 300e9
STEP_SECONDS = 30e-6


@dataclass(frozen=True)
class Chunk:
    """A stretch of the sequence: positions start .. start + length - 1, rows local .. local + length - 1 of
    the shard that holds it."""
    start: int
    length: int
    local: int

    @property
    def end(self) -> int:
        return self.start + self.length


def chunks(length: int, world: int, rank: int, load_balance: str) -> tuple[Chunk, ...]:
    """The chunks rank `rank` of `world` holds of a sequence of `length` rows: with "contiguous" one chunk of
    length / world rows, with "zigzag" chunks rank and 2 * world - 1 - rank of 2 * world (so under a causal mask
    every rank holds as much work: an early chunk and a late one)."""
    if load_balance not in LOAD_BALANCES:
        raise ArgumentError(f"load_balance must be one of {', '.join(map(repr, LOAD_BALANCES))}, got {load_balance!r}")
    parts = world if load_balance == "contiguous" else 2 * world
    if length % parts:
        raise ArgumentError(f"a {load_balance} shard of a sequence over {world} ranks needs its length to be a "
                            f"multiple of {parts}, got {length}")
    c = length // parts
    if load_balance == "contiguous":
        return (Chunk(rank * c, c, 0),)
    return Chunk(rank * c, c, 0), Chunk((parts - 1 - rank) * c, c, c)


@dataclass(frozen=True)
class Sizes:
    """The shapes of one call on every rank: B, H, HKV, the global lengths, head dims, element bytes."""
    B: int
    H: int
    HKV: int
    q_len: int
    kv_len: int
    D: int
    DV: int
    element_bytes: int


def pair_class(spec: ir.Spec, q: Chunk, k: Chunk, sizes: Sizes) -> intervals.TileClass:
    """Whether the mask allows every (query, key) of the two chunks (FULL), none (EMPTY) or some: the interval
    classifier of the tiles, on a tile the size of the chunks, over every batch row and head and whatever the
    inputs hold (sound: EMPTY only where no input value allows a key)."""
    box = intervals.TileBox(
        q=(q.start, q.end - 1), k=(k.start, k.end - 1), params=spec.param_values,
        sizes={"B": sizes.B, "H": sizes.H, "HKV": sizes.HKV, "Q_LEN": sizes.q_len, "KV_LEN": sizes.kv_len,
               "D": sizes.D},
        uniform={}, dtypes={i.name: i.dtype for i in spec.inputs}, dims={i.name: i.dims for i in spec.inputs})
    return intervals.classify(spec.mask, box)


@dataclass(frozen=True)
class Message:
    """One transfer of a step: `kind` "kv" (a shard's K and V, for the next step), "acc" (its dK/dV sums, on to the
    rank that holds it next) or "home" (its dK/dV sums, to the shard's owner); the shard's owner `shard`."""
    kind: str
    src: int
    dst: int
    shard: int


@dataclass(frozen=True)
class Plan:
    """Every rank's view of one call: its chunks, the class of every chunk pair, and the ring's paths.

    q_chunks[r], kv_chunks[r]: the chunks rank r holds. classes[(r, a, j, b)]: the class of query chunk a of rank
    r against key chunk b of rank j. needs[r][j]: rank r attends to some key of rank j's shard. In the ring, rank
    r holds at step s the shard of rank (r - s) mod W, if it reached r: shard j goes around from j as far as
    `reach[j]` steps, the furthest position whose rank needs it (0: it never leaves home), and its dK/dV sums
    ride along from `first[j]`, the first rank after its owner that needs it, then go home."""
    world: int
    load_balance: str
    sizes: Sizes
    q_chunks: tuple[tuple[Chunk, ...], ...]
    kv_chunks: tuple[tuple[Chunk, ...], ...]
    classes: dict = field(repr=False)
    needs: tuple[tuple[bool, ...], ...]
    reach: tuple[int, ...]
    first: tuple[int | None, ...]
    schedule: str
    reason: str

    def pairs(self, rank: int, shard: int):
        """(query chunk index, key chunk index, class) of the pairs of rank `rank`'s queries and shard `shard`'s
        keys that the mask does not leave empty."""
        return [(a, b, c) for a in range(len(self.q_chunks[rank])) for b in range(len(self.kv_chunks[shard]))
                if (c := self.classes[(rank, a, shard, b)]) != intervals.TileClass.EMPTY]

    def holds(self, rank: int, step: int) -> int | None:
        """The shard rank `rank` holds at ring step `step`, or None when none reached it."""
        shard = (rank - step) % self.world
        return shard if step == 0 or step <= self.reach[shard] else None

    def messages(self, step: int, backward: bool) -> list[Message]:
        """The transfers posted at the start of ring step `step` (0 .. world; the last only sends dK/dV home), in
        the one order every rank posts them: the backward's dK/dV sums of step - 1 first, then the K/V shards
        for step + 1."""
        W, found = self.world, []
        if backward and step >= 1:
            for rank in range(W):
                shard, position = (rank - step + 1) % W, step - 1
                first = self.first[shard]
                if first is not None and first <= position <= self.reach[shard]:
                    if position < self.reach[shard]:
                        found.append(Message("acc", rank, (rank + 1) % W, shard))
                    else:
                        found.append(Message("home", rank, shard, shard))
        if step < W - 1:
            for rank in range(W):
                shard = (rank - step) % W
                if step + 1 <= self.reach[shard]:
                    found.append(Message("kv", rank, (rank + 1) % W, shard))
        return found

    def pair_map(self) -> str:
        """The classes of every (query chunk, key chunk) pair in sequence order: F full, P partial, . empty."""
        q_all = sorted((c.start, r, a) for r, cs in enumerate(self.q_chunks) for a, c in enumerate(cs))
        k_all = sorted((c.start, j, b) for j, cs in enumerate(self.kv_chunks) for b, c in enumerate(cs))
        letter = {intervals.TileClass.FULL: "F", intervals.TileClass.PARTIAL: "P", intervals.TileClass.EMPTY: "."}
        rows = [f"  q chunk {n:>3} (rank {r}): " + " ".join(letter[self.classes[(r, a, j, b)]] for _, j, b in k_all)
                for n, (_, r, a) in enumerate(q_all)]
        return "\n".join(rows)

    def explain(self) -> str:
        """What `ContextParallel.explain` prints: sharding, the pairs' classes, the ring's paths, the schedule."""
        s = self.sizes
        per = "chunks r and 2W-1-r" if self.load_balance == "zigzag" else "chunk r"
        shards = ", ".join(f"{j}: {'home only' if self.reach[j] == 0 else f'{self.reach[j]} step(s)'}"
                           for j in range(self.world))
        return "\n".join([
            f"context parallel over {self.world} rank(s), {self.load_balance} sharding (rank r holds {per}): "
            f"queries {s.q_len} ({len(self.q_chunks[0])} x {self.q_chunks[0][0].length} rows a rank), "
            f"keys {s.kv_len}",
            "pairs (query chunk x key chunk, in sequence order; F full, P partial, . empty: never computed):",
            self.pair_map(),
            f"ring: how far each rank's K/V shard travels: {shards}",
            f"schedule: {self.schedule} ({self.reason})",
        ])


def _class_table(spec: ir.Spec, world: int, q_chunks, kv_chunks, sizes: Sizes) -> dict:
    table = {}
    for r in range(world):
        for a, qc in enumerate(q_chunks[r]):
            for j in range(world):
                for b, kc in enumerate(kv_chunks[j]):
                    table[(r, a, j, b)] = pair_class(spec, qc, kc, sizes)
    return table


# A partial pair's share of allowed elements, estimated on a grid of SUBDIVISIONS x SUBDIVISIONS blocks: each
# counts 1 when the classifier finds it full, 1/2 when partial (a diagonal's share), 0 when empty.
SUBDIVISIONS = 4


def _pair_weight(spec: ir.Spec, q: Chunk, k: Chunk, cls: intervals.TileClass, sizes: Sizes) -> float:
    if cls != intervals.TileClass.PARTIAL:
        return 1.0 if cls == intervals.TileClass.FULL else 0.0
    n = min(SUBDIVISIONS, q.length, k.length)
    qs = [Chunk(q.start + i * q.length // n, (i + 1) * q.length // n - i * q.length // n, 0) for i in range(n)]
    ks = [Chunk(k.start + i * k.length // n, (i + 1) * k.length // n - i * k.length // n, 0) for i in range(n)]
    share = {intervals.TileClass.FULL: 1.0, intervals.TileClass.PARTIAL: 0.5, intervals.TileClass.EMPTY: 0.0}
    allowed = sum(share[pair_class(spec, a, b, sizes)] * a.length * b.length for a in qs for b in ks)
    return allowed / (q.length * k.length)


def _pair_flops(spec: ir.Spec, sizes: Sizes, q: Chunk, k: Chunk, cls: intervals.TileClass) -> float:
    """The forward FLOPs of a pair's allowed elements (estimated for a partial pair)."""
    return _pair_weight(spec, q, k, cls, sizes) * 2.0 * sizes.B * sizes.H * q.length * k.length * (sizes.D + sizes.DV)


def choose_schedule(plan_parts: dict, sizes: Sizes, world: int, requested: str) -> tuple[str, str]:
    """(schedule, why): the requested one, or for "auto" the faster by this model. A ring step s costs its
    slowest rank's kernels or the transfer of one K/V shard, whichever is longer (the transfer runs under the
    kernels), plus STEP_SECONDS when it moves anything; an all-gather moves every shard once at GATHER_BYTES
    (no kernel runs under it) and then runs every rank's pairs, two kernels a rank."""
    compute = plan_parts["compute"]  # compute[s]: the slowest rank's pair FLOPs at ring step s
    moves = plan_parts["moves"]  # moves[s]: whether K/V travel during step s
    shard_bytes = sizes.B * sizes.HKV * (sizes.kv_len // world) * (sizes.D + sizes.DV) * sizes.element_bytes
    link = shard_bytes / LINK_BYTES
    ring = sum(max(flops / ATTENTION_FLOPS, link if moving else 0.0) + (STEP_SECONDS if moving else 0.0)
               for flops, moving in zip(compute, moves))
    gather = (world - 1) * shard_bytes / GATHER_BYTES + plan_parts["total"] / ATTENTION_FLOPS + STEP_SECONDS
    model = (f"modelled ring {ring * 1e3:.3g} ms ({sum(moves)} step(s) moving a {shard_bytes / 2**20:.3g} MiB K/V "
             f"shard), all-gather {gather * 1e3:.3g} ms")
    if requested != "auto":
        return requested, f"as asked; {model}"
    return ("ring", model) if ring <= gather else ("allgather", model)


def plan(spec: ir.Spec, world: int, load_balance: str, sizes: Sizes, schedule: str = "auto") -> Plan:
    """The plan of a call of `spec` over `world` ranks with these global sizes (the mask decides the pairs)."""
    if schedule not in SCHEDULES:
        raise ArgumentError(f"schedule must be one of {', '.join(map(repr, SCHEDULES))}, got {schedule!r}")
    q_chunks = tuple(chunks(sizes.q_len, world, r, load_balance) for r in range(world))
    kv_chunks = tuple(chunks(sizes.kv_len, world, r, load_balance) for r in range(world))
    classes = _class_table(spec, world, q_chunks, kv_chunks, sizes)
    empty = intervals.TileClass.EMPTY
    needs = tuple(tuple(any(classes[(r, a, j, b)] != empty for a in range(len(q_chunks[r]))
                            for b in range(len(kv_chunks[j]))) for j in range(world)) for r in range(world))
    reach, first = [], []
    for j in range(world):
        positions = [p for p in range(1, world) if needs[(j + p) % world][j]]
        reach.append(max(positions, default=0))
        first.append(min(positions, default=None))
    flops = {(r, j): sum(_pair_flops(spec, sizes, q_chunks[r][a], kv_chunks[j][b], classes[(r, a, j, b)])
                         for a in range(len(q_chunks[r])) for b in range(len(kv_chunks[j]))
                         if classes[(r, a, j, b)] != empty)
             for r in range(world) for j in range(world)}
    compute = [max(flops[(r, (r - s) % world)] if s == 0 or s <= reach[(r - s) % world] else 0.0
                   for r in range(world)) for s in range(world)]
    moves = [any(s + 1 <= reach[(r - s) % world] for r in range(world)) for s in range(world)]
    parts = {"compute": compute, "moves": moves, "total": max(sum(flops[(r, j)] for j in range(world))
                                                              for r in range(world))}
    chosen, reason = choose_schedule(parts, sizes, world, schedule)
    return Plan(world, load_balance, sizes, q_chunks, kv_chunks, classes, needs, tuple(reach), tuple(first),
                chosen, reason)
