"""The GPU check: one command that proves the engine on an NVIDIA GPU within minutes.

``scripts/gpu-check --out DIR`` runs the steps of ``main.STEPS`` one after another, each in
its own process under its own time box (``step.py``), and rewrites ``DIR/summary.json`` and
``DIR/summary.md`` after every step, so a step that fails or overruns is recorded and the
others still run. ``--dry-run`` runs the same steps on a CPU: Triton's interpreter, tiny
models and shapes (CI runs it, so the check cannot rot between GPU lendings). docs/GPU.md
says what to run, in which order, and how to read the summary.

Each step module has ``run(ctx)`` (in the step's process; ``ctx`` is a
``step.StepContext``), and ``summary(data)``, ``section(data)`` and ``goals(data, dry_run)``
(in the check's process, for the report: ``report.py``).
"""
