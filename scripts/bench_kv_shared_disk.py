"""Two engines sharing one disk folder, and an engine restarted: a long prompt prefilled on
the first stack is a disk hit on the second; the second stack stopped and started again
finds it too (its first request of that prompt).

Two ``scripts/serve`` stacks (each its own nats-server, scheduler and worker) point
``--kv-offloading-path`` at one folder. Printed: each request's TTFT and cached prompt tokens,
and whether the texts of the disk hits equal the text of a device prefix-cache hit of the
same prompt on the first engine (with this machine's default bfloat16 / int8 kernels a cached
prefix may already change the last digits of the logits against a whole prefill, tiers or
not; the exact float32 mode of the tests gives one text everywhere).

    .venv/bin/python scripts/bench_kv_shared_disk.py [--prompt-tokens 1500]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kv_tiers_bench import complete, documents, header, question, serving, summary  # noqa: E402

from shared.kv_unit_file import unit_files  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    args = parser.parse_args()
    header("KV tiers: two engines sharing one disk folder, and a restart")
    [doc] = documents(1, args.prompt_tokens, seed=7)
    prompt = doc + question(0)
    rows = {}
    with tempfile.TemporaryDirectory() as folder:
        flags = ["--kv-offloading-path", folder]
        with serving(flags) as first, serving(flags) as second:
            rows["first engine (computed)"] = complete(first.base_url, prompt, 8)
            rows["first engine again (device prefix cache)"] = complete(first.base_url, prompt, 8)
            time.sleep(1.0)  # its units are filed when the request ends
            rows["second engine (disk hit)"] = complete(second.base_url, prompt, 8)
        files = len(unit_files(folder))
        with serving(flags) as restarted:
            rows["second engine restarted (disk hit)"] = complete(restarted.base_url, prompt, 8)
    cached_texts = {t.text for name, t in rows.items() if "computed" not in name}
    for name, timed in rows.items():
        print(f"{name}: TTFT {timed.ttft * 1e3:.0f} ms, cached {timed.cached_tokens} of {timed.prompt_tokens}",
              flush=True)
    print(f"{files} unit files; disk hits give the device prefix cache's text: {len(cached_texts) == 1}; "
          f"the computed text too: {rows['first engine (computed)'].text in cached_texts}", flush=True)
    summary({"prompt_tokens": len(prompt), "unit_files": files, "same_text_as_prefix_cache": len(cached_texts) == 1,
             "ttft_ms": {k: v.ttft * 1e3 for k, v in rows.items()},
             "cached_tokens": {k: v.cached_tokens for k, v in rows.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
