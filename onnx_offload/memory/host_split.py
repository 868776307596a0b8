"""Which of a step's non-resident weights the host's cores multiply, and which stream.

The model of a step: the streamed weights cross the link on the copy stream while the
compute stream runs; a host MatMul holds the compute stream for its bytes / the host's rate
(measured while the link runs) plus a fixed cost per node (the copies of X and Y and the
host node's launch). So

    step ~= max(streamed bytes / link rate,  resident GPU time + host seconds)

Moving a MatMul to the host takes b / link off the first side and adds b / rate + cost to
the second. The plan takes the subset of MatMuls that makes the step shortest (of equal
ones, the one with the most host bytes), which favours the weights the host runs fastest
per byte. MatMuls of one kind and size are interchangeable, so the search runs over how
many of each such group the host takes, and the plan spreads the ones it takes evenly
through the step: host MatMuls bunched at the end would leave the link idle while they run.
At the very end that holds whatever the spread: a host MatMul read after the last streamed
weight starts only once the link is done, so the plan counts such a tail on the link's side
(and an LM head read last streams unless the host is far faster).
The search is exact while the front of (host bytes, host seconds) points it keeps stays
under FRONT (a Llama-shaped step's does, float16 or int4: its MatMuls fall in a few groups).

A step of many tokens (a prompt) is compute-bound on the GPU and streams everything.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Mapping, Sequence, Tuple

import numpy as np

PREFILL_TOKENS = 8  # a step of more tokens than this streams every weight
NODE_SECONDS = 30e-6  # a host MatMul's fixed cost: two small copies and a host node
FRONT = 4096  # the most (host bytes, host seconds) points the plan weighs at once
TAIL = 8  # the longest run of host MatMuls at the end of the step the plan weighs


@dataclasses.dataclass(frozen=True)
class StepWeight:
    """A non-resident weight a step reads: its bytes, and where the host can compute the
    MatMul that reads it, that MatMul's name and the weight's kind ("float16", "bfloat16",
    "float32", "int4"). ``matmul`` is "" for a weight the host cannot compute."""

    name: str
    nbytes: int
    kind: str = ""
    matmul: str = ""


@dataclasses.dataclass(frozen=True)
class HostSplit:
    """The plan of one step: the MatMuls the host computes (in read order) with their
    weights, the weights that stream, and the predicted seconds of each side."""

    host: Tuple[str, ...]
    host_weights: Tuple[str, ...]
    streamed: Tuple[str, ...]
    host_bytes: int
    streamed_bytes: int
    stream_seconds: float  # streamed bytes / link rate
    host_seconds: float  # the host MatMuls' bytes / rate + their fixed costs
    compute_seconds: float  # resident GPU time + host_seconds
    tail_seconds: float  # the host seconds read after the last streamed weight, which the link cannot overlap

    @property
    def predicted_seconds(self) -> float:
        return max(self.stream_seconds + self.tail_seconds, self.compute_seconds)


def host_rate(rates: Mapping[str, Mapping[int, float]], kind: str, tokens: int) -> float:
    """The host's rate (bytes/s) for `kind` at a step of `tokens`: the one measured at the
    smallest batch of at least `tokens` (the rate falls as the batch grows, so this one
    does not overstate it), 0 where none was measured."""
    by_batch = rates.get(kind, {})
    fitting = [b for b in by_batch if b >= tokens]
    return float(by_batch[min(fitting)]) if fitting else 0.0


@dataclasses.dataclass
class _MatMul:
    name: str
    weights: List[str]
    nbytes: int
    kind: str
    position: int  # in read order
    host_seconds: float = 0.0


def _matmuls(weights: Sequence[StepWeight]) -> Tuple[List[_MatMul], List[StepWeight]]:
    """The host-computable MatMuls in read order, and the weights that must stream."""
    by_name: Dict[str, _MatMul] = {}
    fixed = []
    for w in weights:
        if w.nbytes < 0:
            raise ValueError(f"weight {w.name!r} has {w.nbytes} bytes")
        if not w.matmul:
            fixed.append(w)
            continue
        m = by_name.setdefault(w.matmul, _MatMul(w.matmul, [], 0, w.kind, len(by_name)))
        if m.kind != w.kind:
            raise ValueError(f"MatMul {w.matmul!r} reads weights of kinds {m.kind!r} and {w.kind!r}")
        m.weights.append(w.name)
        m.nbytes += w.nbytes
    return list(by_name.values()), fixed


def plan_host_split(weights: Sequence[StepWeight], link_rate: float, host_rates: Mapping[str, Mapping[int, float]],
                    gpu_seconds: float, tokens: int, node_seconds: float = NODE_SECONDS,
                    prefill_tokens: int = PREFILL_TOKENS, order_aware: bool = True) -> HostSplit:
    """The split of the step's non-resident `weights` (in read order) between the link
    (`link_rate` bytes/s) and the host (`host_rates`: kind -> {batch: bytes/s}, measured
    while the link runs), beside `gpu_seconds` of resident GPU work, for a step of `tokens`
    tokens. The host set is empty for a step of more than `prefill_tokens` tokens and
    where the host has no rate for a kind.

    `order_aware`: a host MatMul read after the last streamed weight cannot overlap the
    link (the compute stream reaches it only once every streamed weight has arrived), so
    the step is at least streamed / link + those MatMuls' seconds (``tail_seconds``). The
    plan is then the best of max(streamed / link + tail, compute) over tails of up to TAIL
    MatMuls (an LM head read last is the usual case that streams rather than end the
    step alone). Without it, the plan is the best of max(stream, compute) alone."""
    if link_rate <= 0:
        raise ValueError(f"link_rate must be positive, not {link_rate}")
    if tokens < 1 or gpu_seconds < 0 or node_seconds < 0:
        raise ValueError(f"tokens must be 1 or more and the seconds not negative (tokens={tokens}, "
                         f"gpu_seconds={gpu_seconds}, node_seconds={node_seconds})")
    matmuls, _ = _matmuls(weights)
    candidates = []
    if tokens <= prefill_tokens:
        for m in matmuls:
            rate = host_rate(host_rates, m.kind, tokens)
            if rate > 0 and m.nbytes > 0:
                m.host_seconds = m.nbytes / rate + node_seconds
                candidates.append(m)
    total = sum(w.nbytes for w in weights)
    # The step's units in read order (by their last weight): a MatMul, or a weight that streams.
    last_read = {}
    for i, w in enumerate(weights):
        last_read[w.matmul or ("", w.name)] = i
    by_name = {m.name: m for m in candidates}
    units = [by_name.get(key) for key in sorted(last_read, key=last_read.get)]
    best = None
    for k in range(0, min(TAIL, len(units)) + 1 if order_aware else 1):
        tail = units[len(units) - k:] if k else []
        if any(u is None for u in tail):
            break  # the tail cannot reach past a weight that streams
        fixed = set(id(u) for u in tail)
        if order_aware and k < len(units) and units[len(units) - k - 1] is not None:
            fixed.add(id(units[len(units) - k - 1]))  # the last streamed unit
        tail_b, tail_s = sum(m.nbytes for m in tail), sum(m.host_seconds for m in tail)
        free = [m for m in candidates if id(m) not in fixed]
        groups: Dict[Tuple[str, int], List[_MatMul]] = {}
        for m in free:
            groups.setdefault((m.kind, m.nbytes), []).append(m)
        counts, step, host_b = _best_counts(list(groups.values()), total - tail_b, link_rate,
                                            gpu_seconds + tail_s, tail_s if order_aware else 0.0)
        if best is None or step < best[0] * (1 - 1e-12) or (step <= best[0] * (1 + 1e-12) and host_b + tail_b > best[1]):
            chosen = list(tail) + [m for members, taken in zip(groups.values(), counts) for m in _evenly(members, taken)]
            best = (min(step, best[0]) if best else step, host_b + tail_b, chosen)
    return _split(weights, best[2], link_rate, gpu_seconds, matmuls)


def _best_counts(groups: List[List[_MatMul]], stream_bytes: int, link_rate: float, compute_seconds: float,
                 tail_seconds: float) -> Tuple[List[int], float, float]:
    """How many MatMuls of each group (members alike: one kind, one size) the host takes so
    that max((stream_bytes - their bytes) / link + tail_seconds, compute_seconds + their
    seconds) is least; of equal steps, the one with the most host bytes. Returns the counts,
    that step and those bytes. The Pareto front of (host bytes, host seconds) is built group
    by group, dominated points dropped; past FRONT points it keeps one point of each
    1/FRONT of the bytes (then the step is within stream_bytes / FRONT bytes of link time of
    the best)."""
    host_bytes, host_s = np.zeros(1), np.zeros(1)
    trail = []  # per group: (parent index, count) of each front point
    for members in groups:
        b, h = members[0].nbytes, members[0].host_seconds
        c = np.arange(len(members) + 1)
        cand_b = (host_bytes[:, None] + c * float(b)).ravel()
        cand_s = (host_s[:, None] + c * h).ravel()
        parent, count = np.repeat(np.arange(len(host_bytes)), len(c)), np.tile(c, len(host_bytes))
        keep = _pareto(cand_b, cand_s)
        if len(keep) > FRONT:
            buckets = np.floor(cand_b[keep] * (FRONT / max(stream_bytes, 1))).astype(np.int64)
            _, first = np.unique(buckets, return_index=True)  # per bucket, its point of the most bytes
            keep = keep[first]
        host_bytes, host_s = cand_b[keep], cand_s[keep]
        trail.append((parent[keep], count[keep]))
    step = np.maximum((stream_bytes - host_bytes) / link_rate + tail_seconds, compute_seconds + host_s)
    least = step.min()
    near = np.flatnonzero(step <= least * (1 + 1e-12))
    i = int(near[np.argmax(host_bytes[near])])
    found = (float(step[i]), float(host_bytes[i]))
    counts = []
    for parent, count in reversed(trail):
        counts.append(int(count[i]))
        i = int(parent[i])
    return counts[::-1], found[0], found[1]


def _pareto(host_bytes: np.ndarray, host_s: np.ndarray) -> np.ndarray:
    """The indices of the points no other point beats (more bytes for no more seconds),
    most bytes first."""
    order = np.lexsort((host_s, -host_bytes))
    s = host_s[order]
    best_before = np.concatenate(([np.inf], np.minimum.accumulate(s)[:-1]))
    return order[s < best_before]


def _evenly(members: List[_MatMul], taken: int) -> List[_MatMul]:
    """`taken` of `members` (in read order), evenly spaced through them."""
    return [members[(2 * j + 1) * len(members) // (2 * taken)] for j in range(taken)]


def _split(weights: Sequence[StepWeight], chosen: List[_MatMul], link_rate: float, gpu_seconds: float,
           matmuls: List[_MatMul]) -> HostSplit:
    names = {m.name for m in chosen}
    host = [m for m in matmuls if m.name in names]
    host_weights = {w for m in host for w in m.weights}
    streamed = [w for w in weights if w.name not in host_weights]
    last = max((i for i, w in enumerate(weights) if w.name not in host_weights), default=-1)
    after = {w.matmul for w in weights[last + 1:]}
    host_s = sum(m.host_seconds for m in host)
    streamed_bytes = sum(w.nbytes for w in streamed)
    return HostSplit(host=tuple(m.name for m in host), host_weights=tuple(w for m in host for w in m.weights),
                     streamed=tuple(w.name for w in streamed), host_bytes=sum(m.nbytes for m in host),
                     streamed_bytes=streamed_bytes, stream_seconds=streamed_bytes / link_rate,
                     host_seconds=host_s, compute_seconds=gpu_seconds + host_s,
                     tail_seconds=sum(m.host_seconds for m in host if m.name in after))


def step_timeline(weights: Sequence[StepWeight], host: Sequence[str], link_rate: float,
                  host_rates: Mapping[str, Mapping[int, float]], gpu_seconds: float, tokens: int,
                  node_seconds: float = NODE_SECONDS) -> float:
    """The step's seconds with order taken into account, for MatMuls `host` on the host: the
    link delivers the streamed weights in read order, and the compute stream, walking the
    weights in the same order, waits for each streamed one to arrive, spends a share of the
    resident GPU time at each (spread evenly), and runs each host MatMul where its first
    weight is read. max(streamed / link, GPU + host seconds) is the least this can be."""
    on_host, arrived, now, seen = set(host), 0.0, 0.0, set()
    share = gpu_seconds / max(len(weights), 1)
    for w in weights:
        if w.matmul in on_host:
            if w.matmul not in seen:
                seen.add(w.matmul)
                nbytes = sum(v.nbytes for v in weights if v.matmul == w.matmul)
                now += nbytes / host_rate(host_rates, w.kind, tokens) + node_seconds
        else:
            arrived += w.nbytes / link_rate
            now = max(now, arrived)
        now += share
    return now
