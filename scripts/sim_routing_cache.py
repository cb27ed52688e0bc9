"""A model of bench_routing.py's shared-prefix load: what each policy's hit rate can be.

Not a benchmark: it runs no engine. Each engine is a block pool as ours: every block not in
use waits in an LRU queue, a new block is taken from its old end (dropping the hash it held),
a hit takes its block out of the queue, and a finished request gives its blocks back tail
first. With ``--protect F`` (the engine's ``--prefix-cache-protected-fraction``, whose default
is 0.8; this model's default, 0, is the plain LRU, vLLM's and ours before, which the diary's
earlier figures modelled) blocks that were hit wait in a second queue, taken from only when
the first is empty, at most F of the pool (past it the least recent goes back to the first
queue). The load is the benchmark's (``--groups`` prefixes of ``--prefix-blocks`` blocks, a
request is one of them at random plus ``--suffix-blocks`` blocks of its own and
``--output-blocks`` for its output, Poisson arrivals at ``--rate``); each request holds its
blocks for ``--hold`` seconds. Policies:

    random      an engine at random
    kv          the engine holding the longest prefix of the prompt, then the one with the
                fewest requests running
    split       a fixed split of the prefixes over the engines (``--split``, e.g. 4,4 or 5,3)
    one-engine  one engine with both engines' blocks

and ``ceiling``: every request but its prefix's first hits the whole prefix. It shows why
kv / random moves with random's luck at 80 blocks and stays near one engine holding both
caches: the LRU gives up prefix tails to the requests' own blocks however the prefixes are
placed (2026-11-26, docs/BENCHMARKS-diary.md, routing).

    .venv/bin/python scripts/sim_routing_cache.py --seeds 200 --protect 0.8
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
from collections import OrderedDict


class BlockPool:
    def __init__(self, num_blocks: int, protect: float = 0.0) -> None:
        self.free: OrderedDict[object, None] = OrderedDict((("empty", i), None) for i in range(num_blocks))
        self.protected: OrderedDict[object, None] = OrderedDict()
        self.cap = int(protect * num_blocks)
        self.reused: set = set()
        self.block_of: dict[object, object] = {}  # hash -> block
        self.hash_of: dict[object, object] = {}  # block -> hash
        self.refs: dict[object, int] = {}
        self.running = 0
        self._over = itertools.count()  # blocks past the pool, as a request waiting for room would take

    def match(self, hashes: list) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in self.block_of:
            n += 1
        return n

    def _new_block(self, block_hash) -> object:
        if self.free:
            block = self.free.popitem(last=False)[0]
        elif self.protected:
            block = self.protected.popitem(last=False)[0]
        else:
            block = ("over", next(self._over))
        self.reused.discard(block)
        old = self.hash_of.pop(block, None)
        if old is not None:
            del self.block_of[old]
        if block_hash is not None and block_hash not in self.block_of:
            self.block_of[block_hash], self.hash_of[block] = block, block_hash
        return block

    def start(self, hashes: list, extra_blocks: int) -> tuple[int, list]:
        hit = self.match(hashes)
        blocks = [self.block_of[h] for h in hashes[:hit]]
        for block in blocks:
            self.free.pop(block, None)
            self.protected.pop(block, None)
            if self.cap:
                self.reused.add(block)
        blocks += [self._new_block(h) for h in hashes[hit:] + [None] * extra_blocks]
        for block in blocks:
            self.refs[block] = self.refs.get(block, 0) + 1
        self.running += 1
        return hit, blocks

    def finish(self, blocks: list) -> None:
        for block in reversed(blocks):
            self.refs[block] -= 1
            if self.refs[block] == 0 and block[0] != "over":
                if block in self.reused:
                    self.protected[block] = None
                else:
                    self.free[block] = None
        while len(self.protected) > self.cap:
            block = self.protected.popitem(last=False)[0]
            self.reused.discard(block)
            self.free[block] = None
        self.running -= 1


def run(policy: str, seed: int, args) -> float:
    rng, choice_rng = random.Random(seed), random.Random(seed + 1)
    split = [int(n) for n in args.split.split(",")]
    home = [e for e, n in enumerate(split) for _ in range(n)]
    engines = [BlockPool(2 * args.num_gpu_blocks, args.protect)] if policy == "one-engine" else [
        BlockPool(args.num_gpu_blocks, args.protect) for _ in range(2)]
    ends: list = []
    now, cached, total, seen = 0.0, 0, 0, set()
    for i in range(args.requests):
        group = rng.randrange(args.groups)
        hashes = ([("prefix", group, b) for b in range(args.prefix_blocks)]
                  + [("own", i, b) for b in range(args.suffix_blocks)])
        while ends and ends[0][0] <= now:
            _, _, engine, blocks = heapq.heappop(ends)
            engines[engine].finish(blocks)
        if policy == "kv":
            best = max(e.match(hashes) for e in engines)
            fits = [k for k, e in enumerate(engines) if e.match(hashes) == best]
            least = min(engines[k].running for k in fits)
            engine = choice_rng.choice([k for k in fits if engines[k].running == least])
        elif policy == "split":
            engine = home[group]
        else:
            engine = choice_rng.randrange(len(engines))
        hit, blocks = engines[engine].start(hashes, args.output_blocks)
        if policy == "ceiling":
            hit = args.prefix_blocks if group in seen else 0
        seen.add(group)
        cached += min(hit, args.prefix_blocks) * args.block_size
        total += len(hashes) * args.block_size
        heapq.heappush(ends, (now + args.hold, i, engine, blocks))
        now += rng.expovariate(args.rate)
    return cached / total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--policies", default="random,kv,split,one-engine,ceiling")
    parser.add_argument("--num-gpu-blocks", type=int, default=80)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--prefix-blocks", type=int, default=16)
    parser.add_argument("--suffix-blocks", type=int, default=2)
    parser.add_argument("--output-blocks", type=int, default=1, help="blocks of each request's output")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--rate", type=float, default=3.0)
    parser.add_argument("--hold", type=float, default=0.6, help="seconds a request holds its blocks")
    parser.add_argument("--split", default="4,4", help="prefixes per engine for the split policy")
    parser.add_argument("--protect", type=float, default=0.0,
                        help="segmented LRU: at most this fraction of the pool is reused blocks kept past the rest")
    parser.add_argument("--seeds", type=int, default=100)
    args = parser.parse_args()
    for policy in args.policies.split(","):
        rates = sorted(run(policy, seed, args) for seed in range(args.seeds))
        print(f"{policy:10s} hit rate mean {sum(rates) / len(rates):.3f}  "
              f"p10 {rates[len(rates) // 10]:.3f}  p90 {rates[len(rates) * 9 // 10]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
