"""The router: which engine a request goes to (docs/ARCHITECTURE.md, "Routing").

Not a process of its own: every tokenizer replica runs one (``services/tokenizer``), and a
P/D prefill scheduler runs one to choose decode engines (``services/scheduler/handoff.py``).

    config.py   RouterConfig: --router-mode and the busy threshold
    index.py    PrefixIndex: the block hashes each engine holds, from its KV events
    events.py   EngineEvents: one engine's event batches applied in order, holes found
    loads.py    EngineLoads: each engine's load, from its stats and what was sent since
    policy.py   the policies: kv, least-loaded, round-robin, random
    router.py   Router: the above together (pure: no bus)
    bus.py      RouterOnBus: its subscriptions, replays and dumps, RouterStats
"""
