"""Stand-in steps for tests/scripts/test_gpu_check.py: a step that overruns its time box
(and cleans up when stopped), one that records a failure, one that raises, one that passes."""

import time


def overrun(ctx):
    ctx.record("before_the_sleep", True)
    try:
        time.sleep(60)
    finally:
        ctx.record("cleaned_up", True)


def fail(ctx):
    ctx.record("figure", 1.5)
    ctx.fail("a mismatch")
    ctx.record("after_the_failure", True)


def crash(ctx):
    raise ValueError("broken")


def fine(ctx):
    ctx.record("ok", True)
