"""The monitoring profile, checked by reading: the Grafana dashboard is valid JSON made by
scripts/grafana_dashboard.py, and every panel's query names metrics the services export
(their registries, built here in-process); Prometheus scrapes every service of compose,
on the ports the services serve their metrics on."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml

from shared.protocol import EngineStats

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "docker" / "grafana" / "dashboards" / "natsllm.json"
METRIC = re.compile(r"\b(natsllm:[a-zA-Z0-9_:]+|process_[a-z_]+)\b")
ROLES = ("gateway", "tokenizer", "detokenizer", "scheduler", "worker")


def generator():
    spec = importlib.util.spec_from_file_location("grafana_dashboard", ROOT / "scripts" / "grafana_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def busy_engine(engine_id: str) -> EngineStats:
    """Stats with every optional part in use: LoRA, speculative decoding, P/D."""
    return EngineStats(engine_id, num_requests_running=3, kv_cache_usage_perc=0.5, prefix_cache_queries=10,
                       prefix_cache_hits=4, ready=True, spec_decode_num_drafts=2, spec_decode_num_draft_tokens=6,
                       spec_decode_num_accepted_tokens=3, spec_decode_num_accepted_tokens_per_pos=[2, 1],
                       kv_role="kv_consumer", kv_transfer_bytes=100, kv_transfer_requests=1, max_lora=2,
                       running_lora_adapters=["sql"], timestamp=1.0)


def sample_names(registry) -> set[str]:
    return {sample.name for family in registry.collect() for sample in family.samples}


@pytest.fixture(scope="module")
def exported(smollm_tokenizer) -> dict[str, set[str]]:
    """The sample names each kind of service exports, from its real registry."""
    from services.detokenizer.service import DetokenizerService
    from services.gateway.bus_client import GatewayService
    from services.gateway.config import GatewayConfig
    from services.scheduler.service import SchedulerService
    from services.tokenizer.service import TokenizerService
    from services.worker.metrics import step_seconds, worker_families
    from shared.bus import Service
    from shared.config import CacheConfig, SchedulerConfig
    from shared.protocol import RouterStats

    gateway = GatewayService(GatewayConfig())
    gateway.engine_stats.update(busy_engine("0"))
    gateway.router_stats.update(RouterStats("tokenizer-a", "kv", decisions={"kv_prefix": 2}))
    gateway.metrics.service_restarts = {"worker-0": 1}
    scheduler = SchedulerService("0", SchedulerConfig(), CacheConfig())
    scheduler.last_stats = busy_engine("0")
    scheduler.handoff_sender.decisions = {"decode-0": 2, "local": 1}
    tokenizer = TokenizerService(smollm_tokenizer, max_model_len=2048, vocab_size=49152)
    tokenizer.routed = {"0": 3}

    class Worker(Service):  # the worker service's families, without loading a model
        name = "worker"
        engine_id, rank, num_steps, num_sampled_tokens = "0", 0, 5, 7

        def metric_families(self):
            return worker_families(self)

    worker = Worker()
    step_seconds(worker.metrics_registry, "0", 0).observe(0.01)
    services = {"gateway": gateway, "scheduler": scheduler, "tokenizer": tokenizer,
                "detokenizer": DetokenizerService(smollm_tokenizer), "worker": worker}
    return {role: sample_names(service.metrics_registry) for role, service in services.items()}


def panels() -> list[dict]:
    return [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]


def test_the_dashboard_json_is_valid_and_made_by_its_script():
    dashboard = json.loads(DASHBOARD.read_text())
    assert DASHBOARD.read_text() == generator().render(), "run scripts/grafana_dashboard.py"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for p in panels():
        grid = p["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, p["title"]
        assert p["targets"] and all(t["expr"] and t["refId"] for t in p["targets"]), p["title"]
        assert p["datasource"]["uid"] == "${datasource}"
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource"]


def test_the_dashboard_has_a_panel_for_each_question():
    titles = " | ".join(p["title"] for p in panels()).lower()
    for topic in ("time to first token", "inter-token", "end-to-end", "tokens per second", "running requests per "
                  "engine", "waiting requests per engine", "kv cache usage per engine", "prefix cache hit rate",
                  "router decisions", "speculative decoding acceptance", "lora adapters in use", "p/d kv transfer",
                  "service restarts"):
        assert topic in titles, topic


def test_every_panel_query_names_a_metric_the_services_export(exported):
    everything = set().union(*exported.values())
    for p in panels():
        for target in p["targets"]:
            names = METRIC.findall(target["expr"])
            assert names, (p["title"], target["expr"])
            for name in names:
                assert name in everything, f"{p['title']}: {name} is exported by no service"
    # Each kind of service has its own: the panels read every one.
    assert "natsllm:worker_step_seconds_bucket" in exported["worker"]
    assert 'natsllm:num_requests_running' in exported["scheduler"] and "natsllm:routed_requests_total" in exported[
        "tokenizer"]
    assert "natsllm:handoffs_total" in exported["scheduler"] and "natsllm:router_decisions_total" in exported["gateway"]
    for role in ROLES:
        assert {"natsllm:service_info", "natsllm:handler_errors_total", "process_resident_memory_bytes"} <= exported[
            role], role


def compose(name: str) -> dict:
    return yaml.safe_load((ROOT / name).read_text())


def role_of(service: dict) -> str | None:
    command = service.get("command") or []
    return command[2].removeprefix("services.") if command[:2] == ["python", "-m"] else None


def test_prometheus_scrapes_every_service_where_it_serves_its_metrics():
    services = compose("docker-compose.yml")["services"]
    config = yaml.safe_load((ROOT / "docker" / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == set(ROLES)
    for name, service in services.items():
        role = role_of(service)
        if role is None:
            continue
        job = jobs[role]
        if role == "gateway":
            [static] = job["static_configs"]
            assert f"{name}:{service['environment']['PORT']}" in static["targets"]
            assert job["authorization"]["credentials_file"] in (ROOT / "docker" / "prometheus" / "run").read_text()
        else:
            [dns] = job["dns_sd_configs"]
            assert name in dns["names"] and dns["port"] == int(service["environment"]["METRICS_PORT"]), name
            assert service["environment"]["METRICS_HOST"] == "0.0.0.0", name
    # On the host's network: one loopback port per service, as docker/compose.host.yml gives them.
    host = compose("docker/compose.host.yml")["services"]
    host_config = yaml.safe_load((ROOT / "docker" / "prometheus" / "prometheus.host.yml").read_text())
    targets = {job["job_name"]: {t for s in job["static_configs"] for t in s["targets"]}
               for job in host_config["scrape_configs"]}
    ports = []
    for name, service in services.items():
        role = role_of(service)
        if role is None:
            continue
        env = host[name]["environment"]
        port = int(env["PORT"] if role == "gateway" else env["METRICS_PORT"])
        span = range(port, port + int(env.get("METRICS_PORT_SPAN", 1)))  # a scaled service's replicas
        assert all(f"127.0.0.1:{p}" in targets[role] for p in span), name
        ports += span
    assert len(ports) == len(set(ports)), "two services share a metrics port on the host's network"
    assert host["prometheus"]["environment"]["PROMETHEUS_CONFIG"] == "/etc/natsllm/prometheus.host.yml"


def test_grafana_is_provisioned_with_the_dashboard_and_prometheus():
    grafana = compose("docker-compose.yml")["services"]["grafana"]
    mounts = {volume.split(":")[0]: volume.split(":")[1] for volume in grafana["volumes"]}
    provider = yaml.safe_load((ROOT / "docker/grafana/provisioning/dashboards/natsllm.yml").read_text())
    assert mounts["./docker/grafana/dashboards"] == provider["providers"][0]["options"]["path"]
    assert mounts["./docker/grafana/provisioning"] == "/etc/grafana/provisioning"
    [source] = yaml.safe_load((ROOT / "docker/grafana/provisioning/datasources/prometheus.yml").read_text())[
        "datasources"]
    assert source["type"] == "prometheus" and source["url"] == "${PROMETHEUS_URL}"
    assert grafana["environment"]["PROMETHEUS_URL"] == "http://prometheus:9090"
