"""The deployment files: `compose.yaml` alone and with each overlay in `deploy/` renders
with `docker-compose config` (Debian's package; `.ci/run` installs it), and the rendered
result says what a deployment needs: the token on gateway and worker, the Temporal dev
server's search attributes and flags, each variant's own `luftpause.toml` whose endpoints
are services that actually run. The `luftpause.toml` files in `deploy/` and the one in the
Kubernetes ConfigMap are validated with the real loader.

Without `docker-compose` the compose tests skip, saying why, unless `CI` is set: in CI
they fail, so nothing is skipped there."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

# PyYAML comes with uvicorn[standard], a runtime dependency of the gateway.
import yaml

from luftpause.config import Config, load_config
from luftpause.temporal_dev import DB_FLAGS, LATENCY_FLAGS, ORDER_FLAGS
from tests.system import missing_tool
from worker.main import GRACEFUL_SHUTDOWN
from workflows.contract import SEARCH_ATTRIBUTES

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CONFIG_PATH = "/etc/luftpause/luftpause.toml"

# Values for every variable the files interpolate, so rendering is complete and the
# `${VAR:?...}` guards pass.
ENV = {
    "LUFTPAUSE_TOKEN": "token-from-the-environment",
    "HOSTED_API_KEY": "hosted-key-from-the-environment",
    "HF_TOKEN": "hf-token-from-the-environment",
}

# variant -> overlays after compose.yaml, and the luftpause.toml its gateway and worker use.
VARIANTS: dict[str, tuple[tuple[str, ...], str]] = {
    "base": ((), "luftpause.compose.toml"),
    "ollama": (("ollama",), "luftpause.ollama.toml"),
    "sglang": (("sglang",), "luftpause.sglang.toml"),
    "hosted": (("hosted",), "luftpause.hosted.toml"),
    "otel": (("otel",), "luftpause.compose.toml"),
    "sglang+otel": (("sglang", "otel"), "luftpause.sglang.toml"),
}
OVERLAY_FILES = sorted(p.name for p in DEPLOY.glob("compose.*.yaml"))


def _docker_compose() -> str:
    exe = shutil.which("docker-compose")
    if exe is not None:
        return exe
    reason = (
        "docker-compose is not installed (Debian/Ubuntu: apt-get install docker-compose); "
        "it validates compose.yaml and the overlays in deploy/"
    )
    missing_tool(reason)


def _run_config(overlays: tuple[str, ...], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    files = ["-f", "compose.yaml"]
    for name in overlays:
        files += ["-f", f"deploy/compose.{name}.yaml"]
    # A clean environment: nothing of the developer's (LUFTPAUSE_BIND, COMPOSE_FILE, ...)
    # changes what is rendered.
    clean = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ} | env
    return subprocess.run(
        [_docker_compose(), *files, "config"],
        cwd=ROOT,
        env=clean,
        capture_output=True,
        text=True,
        timeout=60,
    )


_rendered: dict[tuple[str, ...], dict[str, Any]] = {}


def render(overlays: tuple[str, ...]) -> dict[str, Any]:
    """`docker-compose -f compose.yaml [-f deploy/compose.X.yaml ...] config`, parsed."""
    if overlays not in _rendered:
        out = _run_config(overlays, ENV)
        assert out.returncode == 0, out.stderr
        assert "WARN" not in out.stderr.upper(), out.stderr  # e.g. an unset variable
        doc = yaml.safe_load(out.stdout)
        assert isinstance(doc, dict)
        _rendered[overlays] = doc
    return _rendered[overlays]


def services(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return dict(doc["services"])


def active(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The services `up` starts without `--profile`."""
    return {name: s for name, s in services(doc).items() if not s.get("profiles")}


def env_of(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def mounts(service: dict[str, Any]) -> dict[str, str]:
    """Mount target -> source."""
    found = {}
    for v in service.get("volumes") or []:
        if isinstance(v, str):
            source, target = v.split(":")[:2]
        else:
            source, target = v.get("source", ""), v["target"]
        found[target] = source
    return found


def command(service: dict[str, Any]) -> list[str]:
    cmd = service.get("command") or []
    return cmd.split() if isinstance(cmd, str) else [str(c) for c in cmd]


def depends_on(service: dict[str, Any]) -> dict[str, str]:
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return dict.fromkeys(deps, "service_started")
    return {name: d.get("condition", "service_started") for name, d in deps.items()}


def contains(seq: list[str], part: tuple[str, ...] | list[str]) -> bool:
    n = len(part)
    return any(tuple(seq[i : i + n]) == tuple(part) for i in range(len(seq) - n + 1))


def variant_config(variant: str) -> Config:
    return load_config(DEPLOY / VARIANTS[variant][1])


# --- compose: every variant ---------------------------------------------------------------


def test_every_overlay_in_deploy_is_a_tested_variant() -> None:
    tested = {f"compose.{o}.yaml" for overlays, _ in VARIANTS.values() for o in overlays}
    assert set(OVERLAY_FILES) == tested


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_renders_with_the_core_services(variant: str) -> None:
    doc = render(VARIANTS[variant][0])
    assert {"temporal", "gateway", "worker", "fake-mcp"} <= set(active(doc))


@pytest.mark.parametrize("variant", VARIANTS)
def test_token_reaches_gateway_and_worker(variant: str) -> None:
    svc = services(render(VARIANTS[variant][0]))
    for name in ("gateway", "worker"):
        assert env_of(svc[name])["LUFTPAUSE_TOKEN"] == ENV["LUFTPAUSE_TOKEN"], name


def test_token_unset_means_empty_not_an_error() -> None:
    out = _run_config((), {})
    assert out.returncode == 0, out.stderr
    svc = services(yaml.safe_load(out.stdout))
    assert env_of(svc["gateway"])["LUFTPAUSE_TOKEN"] == ""


@pytest.mark.parametrize("variant", VARIANTS)
def test_gateway_and_worker_read_the_variants_config(variant: str) -> None:
    svc = services(render(VARIANTS[variant][0]))
    expected = DEPLOY / VARIANTS[variant][1]
    for name in ("gateway", "worker"):
        assert env_of(svc[name])["LUFTPAUSE_CONFIG"] == CONFIG_PATH
        assert Path(mounts(svc[name])[CONFIG_PATH]) == expected, name


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_host_in_the_config_is_a_running_service(variant: str) -> None:
    """Endpoints, tool servers, Temporal and gateway_url name services that `up` starts
    (or the Docker host, or a hosted API): a fake engine dropped by an overlay is not
    left in the config, nor a replacement engine left out of compose."""
    doc = render(VARIANTS[variant][0])
    cfg = variant_config(variant)
    running = set(active(doc))
    urls = [e.url for e in cfg.endpoints] + [m.url for m in cfg.mcp_servers if m.url]
    urls.append(cfg.gateway_url)
    for url in urls:
        parts = urlsplit(url)
        if parts.scheme == "https" or parts.hostname == "host.docker.internal":
            continue
        assert parts.hostname in running, url
    assert cfg.temporal.address.split(":")[0] in running
    assert urlsplit(cfg.gateway_url).hostname == "gateway"


@pytest.mark.parametrize("variant", VARIANTS)
def test_dependencies_are_running_and_checkable(variant: str) -> None:
    doc = render(VARIANTS[variant][0])
    run = active(doc)
    for name, service in run.items():
        for dep, condition in depends_on(service).items():
            assert dep in run, f"{name} depends on {dep}, which does not start"
            if condition == "service_healthy":
                assert "healthcheck" in run[dep], f"{name} waits for {dep}'s health"
            if condition == "service_completed_successfully":
                assert run[dep].get("restart") == "no", dep


@pytest.mark.parametrize("variant", VARIANTS)
def test_published_ports_bind_loopback_by_default(variant: str) -> None:
    for name, service in services(render(VARIANTS[variant][0])).items():
        for port in service.get("ports") or []:
            host_ip = port.split(":")[0] if isinstance(port, str) else port.get("host_ip")
            assert host_ip == "127.0.0.1", (name, port)


def test_luftpause_bind_opens_the_ports() -> None:
    out = _run_config((), {**ENV, "LUFTPAUSE_BIND": "0.0.0.0"})
    assert out.returncode == 0, out.stderr
    ports = services(yaml.safe_load(out.stdout))["gateway"]["ports"]
    assert any(str(p).startswith("0.0.0.0:8080:8080") for p in ports), ports


# --- compose: the base file ---------------------------------------------------------------


def test_temporal_is_the_dev_server_with_the_runtimes_flags() -> None:
    svc = services(render(()))
    temporal = svc["temporal"]
    assert temporal["image"].startswith("temporalio/temporal:")
    cmd = command(temporal)
    assert cmd[:2] == ["server", "start-dev"]
    assert contains(cmd, ("--ip", "0.0.0.0"))
    assert contains(cmd, LATENCY_FLAGS)
    assert contains(cmd, ORDER_FLAGS)
    assert contains(cmd, DB_FLAGS)
    registered = {cmd[i + 1] for i, flag in enumerate(cmd) if flag == "--search-attribute"}
    assert registered == {f"{key.name}=Keyword" for key in SEARCH_ATTRIBUTES}
    db_file = cmd[cmd.index("--db-filename") + 1]
    volume = mounts(temporal)[str(Path(db_file).parent)]
    assert volume in render(())["volumes"]  # a named volume: the db survives `down`
    assert mounts(svc["temporal-volume"])[str(Path(db_file).parent)] == volume
    published = {
        p.split(":")[-2] if isinstance(p, str) else str(p["published"]) for p in temporal["ports"]
    }
    assert {"7233", "8233"} <= published
    assert "healthcheck" in temporal


def test_base_serves_two_fake_engines_and_the_fake_mcp_server() -> None:
    svc = active(render(()))
    for name in ("engine-a", "engine-b"):
        cmd = command(svc[name])
        assert cmd[0] == "fake-engine" and contains(cmd, ("--host", "0.0.0.0"))
    assert command(svc["fake-mcp"])[:3] == ["fake-mcp", "--transport", "http"]
    assert [e.name for e in variant_config("base").endpoints] == ["engine-a", "engine-b"]


def test_luftpause_services_share_one_image_from_deploy_dockerfile() -> None:
    svc = services(render(()))
    ours = [s for s in svc.values() if "build" in s]
    assert {"gateway", "worker", "engine-a", "engine-b", "fake-mcp"} <= {
        name for name, s in svc.items() if "build" in s
    }
    assert len({s["image"] for s in ours}) == 1
    for s in ours:
        assert Path(s["build"]["context"]) == ROOT
        assert s["build"]["dockerfile"] == "deploy/Dockerfile"


def test_long_running_services_restart() -> None:
    for name, service in services(render(())).items():
        if name != "temporal-volume":
            assert service.get("restart") == "unless-stopped", name


# --- compose: the overlays ----------------------------------------------------------------


@pytest.mark.parametrize("variant", ["ollama", "sglang", "hosted"])
def test_replacing_overlays_drop_the_fake_engines(variant: str) -> None:
    doc = render(VARIANTS[variant][0])
    assert not {"engine-a", "engine-b"} & set(active(doc))
    assert {"engine-a", "engine-b"} <= set(services(doc))  # still there behind a profile


def test_ollama_on_the_host_is_the_only_replica() -> None:
    gateway = services(render(("ollama",)))["gateway"]
    hosts = gateway["extra_hosts"]  # a mapping (docker-compose 1.x) or "host:ip" strings
    if isinstance(hosts, list):
        hosts = dict(h.split(":", 1) for h in hosts)
    assert hosts["host.docker.internal"] == "host-gateway"
    (endpoint,) = variant_config("ollama").endpoints
    assert endpoint.kind == "ollama"
    assert endpoint.url == "http://host.docker.internal:11434"


def test_sglang_test_bed_two_replicas_on_one_gpu() -> None:
    svc = active(render(("sglang",)))
    replicas = {name: s for name, s in svc.items() if "sglang" in str(s.get("image", ""))}
    assert sorted(replicas) == ["sglang-a", "sglang-b"]
    # A pinned release, not `latest`: the bed's figures are of one SGLang.
    assert {s["image"] for s in replicas.values()} == {"lmsysorg/sglang:v0.5.19-cu129"}
    served = {m for e in variant_config("sglang").endpoints for m in e.models}
    gpus = set()
    for name, s in replicas.items():
        cmd = command(s)
        assert contains(cmd, ("--model-path", "meta-llama/Llama-3.2-1B-Instruct")), name
        assert contains(cmd, ("--quantization", "fp8")), name
        assert "--enable-metrics" in cmd and "--enable-priority-scheduling" in cmd, name
        assert "--enable-cache-report" in cmd, name  # usage's cached_tokens: shared prefix
        assert contains(cmd, ("--host", "0.0.0.0")) and contains(cmd, ("--port", "30000"))
        assert float(cmd[cmd.index("--mem-fraction-static") + 1]) < 1
        assert cmd[cmd.index("--served-model-name") + 1] in served
        assert env_of(s)["HF_TOKEN"] == ENV["HF_TOKEN"]
        (device,) = s["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
        gpus.add(tuple(device["device_ids"]))
        assert "healthcheck" in s
    assert len(gpus) == 1  # both replicas on the same GPU
    # The second measures free memory only once the first holds its share.
    assert depends_on(replicas["sglang-b"]) == {"sglang-a": "service_healthy"}
    assert {e.kind for e in variant_config("sglang").endpoints} == {"sglang"}


def test_sglang_needs_a_hugging_face_token() -> None:
    out = _run_config(("sglang",), {k: v for k, v in ENV.items() if k != "HF_TOKEN"})
    assert out.returncode != 0
    assert "HF_TOKEN" in out.stderr


def test_hosted_key_comes_from_the_environment_to_the_gateway_only() -> None:
    svc = services(render(("hosted",)))
    (endpoint,) = variant_config("hosted").endpoints
    assert endpoint.kind == "openai" and endpoint.url.startswith("https://")
    assert endpoint.api_key_env is not None
    assert env_of(svc["gateway"])[endpoint.api_key_env] == ENV["HOSTED_API_KEY"]
    assert endpoint.api_key_env not in env_of(svc["worker"])


def test_hosted_refuses_to_render_without_the_key() -> None:
    out = _run_config(("hosted",), {k: v for k, v in ENV.items() if k != "HOSTED_API_KEY"})
    assert out.returncode != 0
    assert "HOSTED_API_KEY" in out.stderr


@pytest.mark.parametrize("variant", ["otel", "sglang+otel"])
def test_otel_exports_to_jaeger(variant: str) -> None:
    svc = active(render(VARIANTS[variant][0]))
    jaeger = svc["jaeger"]
    # Jaeger v2 (v1, jaegertracing/all-in-one, reached end of life at the end of 2025);
    # its OTLP receivers listen beyond the container.
    assert jaeger["image"].startswith("jaegertracing/jaeger:2.")
    assert env_of(jaeger)["JAEGER_LISTEN_HOST"] == "0.0.0.0"
    names = set()
    for name in ("gateway", "worker"):
        env = env_of(svc[name])
        assert urlsplit(env["OTEL_EXPORTER_OTLP_ENDPOINT"]).hostname == "jaeger", name
        names.add(env["OTEL_SERVICE_NAME"])
    assert len(names) == 2


# --- the configuration files --------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(DEPLOY.glob("luftpause.*.toml")), ids=lambda p: p.name)
def test_deploy_configs_load(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.endpoints
    assert cfg.temporal.address == "temporal:7233"


def test_every_deploy_config_is_used_by_a_variant() -> None:
    used = {toml for _, toml in VARIANTS.values()}
    assert {p.name for p in DEPLOY.glob("luftpause.*.toml")} == used


# --- the image ----------------------------------------------------------------------------


def test_dockerfile_copies_every_package_of_the_distribution() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {
        p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    }
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    copied = set(re.findall(r"^COPY (\w+) \./\1$", dockerfile, re.MULTILINE))
    assert packages <= copied
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    for name in [*packages, "pyproject.toml", "README.md", "LICENSE"]:
        assert f"!{name}/" in ignore or f"!{name}" in ignore, name
    assert re.search(r"^FROM python:3\.11-slim\b", dockerfile, re.MULTILINE)
    assert re.search(r"^USER (?!0\b|root\b)\S+", dockerfile, re.MULTILINE)
    assert 'ENTRYPOINT ["luftpause"]' in dockerfile
    assert not re.search(r"^RUN .*\[dev\]", dockerfile, re.MULTILINE)  # no dev extras


# --- Kubernetes ---------------------------------------------------------------------------


def _k8s(name: str) -> dict[tuple[str, str], dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / name).read_text()) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return dict(container)


def _token_from_secret(container: dict[str, Any]) -> bool:
    for item in container["env"]:
        if item["name"] == "LUFTPAUSE_TOKEN":
            return "secretKeyRef" in item.get("valueFrom", {})
    return False


def _mounts_config(deployment: dict[str, Any]) -> bool:
    spec = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    container = _container(deployment)
    env = {e["name"]: e.get("value") for e in container["env"]}
    for mount in container["volumeMounts"]:
        source = volumes[mount["name"]].get("configMap", {}).get("name")
        if source == "luftpause-config":
            return bool(env.get("LUFTPAUSE_CONFIG") == mount["mountPath"] + "/luftpause.toml")
    return False


def test_k8s_config_map_holds_a_valid_config(tmp_path: Path) -> None:
    objects = _k8s("gateway.yaml")
    config_map = objects[("ConfigMap", "luftpause-config")]
    path = tmp_path / "luftpause.toml"
    path.write_text(config_map["data"]["luftpause.toml"])
    cfg = load_config(path)
    service = objects[("Service", "luftpause-gateway")]
    assert urlsplit(cfg.gateway_url).hostname == service["metadata"]["name"]
    assert urlsplit(cfg.gateway_url).port == service["spec"]["ports"][0]["port"]


def test_k8s_gateway_is_one_process_with_health_probes() -> None:
    objects = _k8s("gateway.yaml")
    gateway = objects[("Deployment", "luftpause-gateway")]
    assert gateway["spec"]["replicas"] == 1
    assert gateway["spec"]["strategy"]["type"] == "Recreate"  # never two during a rollout
    container = _container(gateway)
    assert container["args"][0] == "gateway"
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    assert _token_from_secret(container)
    assert _mounts_config(gateway)
    selector = objects[("Service", "luftpause-gateway")]["spec"]["selector"]
    labels = gateway["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items()
    # Discovery is DNS only: the pod needs no Kubernetes API token.
    assert gateway["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


def test_k8s_worker_scales_and_shuts_down_gracefully() -> None:
    worker = _k8s("worker.yaml")[("Deployment", "luftpause-worker")]
    spec = worker["spec"]["template"]["spec"]
    assert worker["spec"]["replicas"] >= 1
    assert spec["terminationGracePeriodSeconds"] > GRACEFUL_SHUTDOWN.total_seconds()
    assert spec["automountServiceAccountToken"] is False
    container = _container(worker)
    assert container["args"][0] == "worker"
    assert _token_from_secret(container)
    assert _mounts_config(worker)


def test_k8s_readme_registers_every_search_attribute() -> None:
    readme = (DEPLOY / "k8s" / "README.md").read_text()
    for key in SEARCH_ATTRIBUTES:
        assert f"--name {key.name} --type Keyword" in readme, key.name
