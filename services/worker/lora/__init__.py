"""Multi-LoRA on the worker: PEFT adapters (``adapter.py``), the batched shrink/expand over a
step's mixed adapters (``batched.py``), and the slots adapters live in (``slots.py``)."""
