"""The worker's OpenMP wait policy: the setting, its export, and libgomp reading it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from services.worker.openmp_wait import VARIABLE, apply_omp_wait_policy
from shared.config import ConfigError, ModelRunConfig


def test_the_default_is_libgomps_and_any_case_is_taken():
    assert ModelRunConfig().omp_wait_policy == "default"
    assert ModelRunConfig(omp_wait_policy="ACTIVE").omp_wait_policy == "active"
    with pytest.raises(ConfigError, match="omp_wait_policy"):
        ModelRunConfig(omp_wait_policy="spin")


def test_export_and_libgomps_own_default():
    environ = {}
    apply_omp_wait_policy("passive", environ)
    assert environ == {VARIABLE: "PASSIVE"}
    apply_omp_wait_policy("active", environ)
    assert environ == {VARIABLE: "ACTIVE"}
    apply_omp_wait_policy("default", environ)
    assert environ == {}


def _libgomp_spin_count(env: dict[str, str], *flags: str) -> int:
    """The spin count libgomp reports at start (OMP_DISPLAY_ENV: 0 when passive, 300000
    for its default, 3e10 when active) in a process that parses
    the worker's flags, applies the policy as the worker's main() does, then loads torch."""
    probe = ("import sys; import services.worker.__main__ as m; from shared.cli import config_from_args; "
             "from shared.config import ModelRunConfig; assert 'torch' not in sys.modules; "
             "args = m.build_parser().parse_args(sys.argv[1:]); "
             "m.apply_omp_wait_policy(config_from_args(ModelRunConfig, args).omp_wait_policy); "
             "import torch; torch.ones(4096).add_(1)")
    env = {**{k: v for k, v in os.environ.items() if k != VARIABLE}, **env, "OMP_DISPLAY_ENV": "VERBOSE"}
    out = subprocess.run([sys.executable, "-c", probe, *flags], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    (line,) = [line for line in out.stderr.splitlines() if line.strip().startswith("GOMP_SPINCOUNT")]
    return int(line.split("=", 1)[1].strip().strip("'"))


def test_libgomp_runs_with_the_worker_flag_or_the_users_variable():
    assert _libgomp_spin_count({}) == 300_000
    assert _libgomp_spin_count({}, "--omp-wait-policy", "passive") == 0
    assert _libgomp_spin_count({VARIABLE: "active"}) > 300_000
    assert _libgomp_spin_count({"GOMP_SPINCOUNT": "1000"}) == 1000
