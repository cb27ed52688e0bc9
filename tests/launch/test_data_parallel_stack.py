"""The launcher's data-parallel engines: their ids and processes, the flags each gets (KV
events for the routers, each worker's cores), and ``--router-mode`` to the tokenizers; the
core sets and a worker binding itself to its cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.launch.service_flags import split_service_args
from services.launch.stack import Stack, StackConfig, engine_gpus, visible_gpus
from services.scheduler.config import KVEventsConfig
from shared.config import ConfigError, ModelRunConfig
from shared.cpu_sets import cores_for_rank, format_cpu_list, parse_cpu_list, split_cores

ROOT = Path(__file__).resolve().parents[2]


def started(config: StackConfig) -> dict[str, list[str]]:
    """The services ``Stack.start`` would launch (nats and processes left out): name -> argv."""
    stack = Stack(config)
    launched = {}
    stack.start_service = lambda name, module, args, env=None: launched.setdefault(name, [module, *args])
    stack.nats = object()
    cfg = stack.config
    cores = iter(stack.worker_cores)
    for engine_id, kv_role in cfg.engines():
        stack._start_engine(engine_id, kv_role, [], [next(cores) for _ in range(cfg.tensor_parallel_size)])
    return launched


def test_each_engine_gets_its_own_gpus_when_there_are_enough():
    assert engine_gpus(2, 2, ["0", "1", "2", "3"]) == ["0,1", "2,3"]
    assert engine_gpus(2, 1, ["4", "5", "6"]) == ["4", "5"]
    assert engine_gpus(2, 2, ["0", "1"]) == [None, None]  # too few: shared, as TP ranks share them
    assert engine_gpus(1, 2, ["0", "1", "2", "3"]) == [None]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}) == ["2", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_data_parallel_engines_have_their_own_ids_processes_events_and_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    launched = started(StackConfig(data_parallel_size=2, tensor_parallel_size=2))
    assert set(launched) == {"engine-0-scheduler", "engine-1-scheduler", "engine-0-worker-0", "engine-0-worker-1",
                             "engine-1-worker-0", "engine-1-worker-1"}
    assert {flag(argv, "--engine-id") for argv in launched.values()} == {"0", "1"}
    assert all(flag(argv, "--kv-transfer-config") is None for argv in launched.values())
    for name in ("engine-0-scheduler", "engine-1-scheduler"):
        assert KVEventsConfig(flag(launched[name], "--kv-events-config")).enabled
    cores = [flag(launched[f"engine-{e}-worker-{r}"], "--cpu-omp-threads-bind") for e in "01" for r in "01"]
    assert cores == ["0-1", "2-3", "4-5", "6-7"]


def test_one_engine_is_as_before():
    launched = started(StackConfig())
    assert set(launched) == {"scheduler", "worker-0"}
    assert flag(launched["scheduler"], "--kv-events-config") is None  # no router needs them
    assert flag(launched["worker-0"], "--cpu-omp-threads-bind") == "nobind"


def test_pd_instances_are_data_parallel_too():
    config = StackConfig(prefill_engines=1, decode_engines=1, data_parallel_size=2, cpu_omp_threads_bind="nobind")
    assert config.engines() == [("prefill-0", "kv_producer"), ("prefill-1", "kv_producer"),
                                ("decode-0", "kv_consumer"), ("decode-1", "kv_consumer")]
    launched = started(config)
    assert {n for n in launched if n.endswith("scheduler")} == {f"{e}-scheduler" for e, _ in config.engines()}
    assert all(KVEventsConfig(flag(a, "--kv-events-config")).enabled for n, a in launched.items()
               if n.endswith("scheduler"))


def test_explicit_cores_per_worker_and_a_users_kv_events_config_win():
    launched = started(StackConfig(data_parallel_size=2, cpu_omp_threads_bind="0-3|4-7",
                                   args=["--kv-events-config", json.dumps({"enable_kv_cache_events": False})]))
    assert [flag(launched[f"engine-{e}-worker-0"], "--cpu-omp-threads-bind") for e in "01"] == ["0-3", "4-7"]
    assert launched["engine-0-scheduler"].count("--kv-events-config") == 1
    with pytest.raises(ConfigError, match="2 worker"):
        Stack(StackConfig(data_parallel_size=2, cpu_omp_threads_bind="0-3"))
    with pytest.raises(ConfigError, match="cpu_omp_threads_bind"):
        Stack(StackConfig(data_parallel_size=2, cpu_omp_threads_bind="0-x|1"))
    with pytest.raises(ConfigError, match="data_parallel_size"):
        Stack(StackConfig(data_parallel_size=0))


def test_router_flags_go_to_the_tokenizers():
    shares = split_service_args(["--router-mode", "round-robin", "--router-busy-threshold", "0.8",
                                 "--kv-events-config", "{}"])
    assert shares["tokenizer"] == ["--router-mode", "round-robin", "--router-busy-threshold", "0.8"]
    assert shares["scheduler"] == ["--kv-events-config", "{}"] and shares["worker"] == []


def test_core_sets():
    assert parse_cpu_list("0-3,8,2") == [0, 1, 2, 3, 8]
    assert format_cpu_list([8, 0, 1, 2, 3, 5]) == "0-3,5,8"
    assert split_cores(list(range(10)), 3) == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert split_cores([0, 1], 4) == [[0], [1], [0], [1]]  # fewer cores than workers: shared round the cores
    assert cores_for_rank("0-3|4-7", 1) == [4, 5, 6, 7] and cores_for_rank("2-3", 1) == [2, 3]
    assert cores_for_rank("auto", 0) is None and cores_for_rank("nobind", 0) is None
    for bad in ("a", "3-1", "1,,2", "-1"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)
    with pytest.raises(ConfigError):
        ModelRunConfig(cpu_omp_threads_bind="0-3|x")


def test_a_worker_binds_itself_before_torch_loads():
    cpu = min(os.sched_getaffinity(0))
    code = ("import os\nfrom services.worker.cpu_binding import apply_cpu_binding\n"
            f"apply_cpu_binding('9999|{cpu}', 1)\n"
            "import torch\nprint(sorted(os.sched_getaffinity(0)), torch.get_num_threads())")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [f"[{cpu}]", "1"]
