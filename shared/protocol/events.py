"""KV cache events: what enters and leaves each engine's prefix cache (issue 31's router).

Nothing is published here yet. The coming messages (vLLM's ``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``, batched with a timestamp and a per-engine
sequence number, on a per-engine subject), their replay and dump requests, and their
channels go in this module.
"""
