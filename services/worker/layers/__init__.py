"""The building blocks every model is made of, each loading, sharding, quantizing and
repacking its own weights.

A model (``..models``) is a tree of these layers; each knows which checkpoint tensors it
reads (under their Hugging Face names, ``weights.WeightSlot``), which part of them this
tensor-parallel rank holds, and how its products run (plain, oneDNN-prepacked, or kept
quantized: ``..linear``). ``weights.load_model_weights`` walks the tree, so a model file
only composes layers and names its checkpoint tensors.

- ``linear.LinearLayer``: column-parallel (q/k/v, gate/up), row-parallel (o, down, with the
  all-reduce) or replicated matrices, from one or several checkpoint tensors.
- ``embedding.VocabEmbedding`` / ``embedding.LMHead``: the (vocab-parallel) embedding table
  and LM head, tied or not.
- ``norm.RMSNorm``: RMSNorm, Gemma's zero-centred ``(1 + w)`` variant included.
- ``rotary.RotaryEmbedding``: the cos/sin table of one rotary base and scaling.
- ``attention.PagedAttention``: rotary, KV write and paged attention of one layer, in its
  KV cache group (sliding window or full).
- ``moe.FusedMoE``: a mixture-of-experts MLP (router, top-k, experts split under TP).
"""
