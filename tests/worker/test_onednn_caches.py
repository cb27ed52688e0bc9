"""The worker bounds oneDNN's and ideep's shape caches before torch reads the bound."""

from __future__ import annotations

import os
import subprocess
import sys

from services.worker.onednn_caches import CACHE_CAPACITY, VARIABLES, bound_onednn_caches


def test_a_users_setting_wins():
    environ = {"LRU_CACHE_CAPACITY": "7"}
    bound_onednn_caches(environ)
    assert environ == {"LRU_CACHE_CAPACITY": "7", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(CACHE_CAPACITY)}


def test_the_worker_sets_them_before_torch_is_imported():
    env = {k: v for k, v in os.environ.items() if k not in VARIABLES}
    probe = ("import os, sys; import services.worker.__main__; "
             "print('torch' in sys.modules, *(os.environ[v] for v in sys.argv[1:]))")
    out = subprocess.run([sys.executable, "-c", probe, *VARIABLES], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out == ["False"] + [str(CACHE_CAPACITY)] * len(VARIABLES)
