"""Every manifest in deploy/, checked offline: against compact schemas of the Kubernetes, KubeRay
and Ray Serve fields (tests/server/k8s_schemas.py and ray_schemas.py, closed objects: a
misspelled or misplaced field fails), and for what the schemas cannot say: the Serve configs build this project's
application, the pieces of a file fit each other, and Ray's dashboard is not left open.
"""

from __future__ import annotations

import copy
import importlib
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (it comes with Ray)")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed")
pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install -e '.[ray]')")

from gptserve.server.ray.cli import build_app, parse_app_args  # noqa: E402
from gptserve.server.ray.deployment import DEPLOYMENT_NAME  # noqa: E402
from gptserve.server.ray.proxy_middleware import PROXY_CALLBACK  # noqa: E402
from gptserve.server.settings import Settings  # noqa: E402
from ray.scripts.scripts import start as ray_start_command  # noqa: E402
from ray.serve.schema import ServeDeploySchema  # noqa: E402

from tests.server.k8s_schemas import K8S_KINDS  # noqa: E402
from tests.server.ray_schemas import RAY_SERVICE, SERVE_CONFIG  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
DASHBOARD_PORT = 8265  # `ray start`'s default, and the port KubeRay's operator calls
KINDS = {**K8S_KINDS, ("ray.io/v1", "RayService"): RAY_SERVICE}


def load_documents() -> list[tuple[str, dict[str, Any]]]:
    """(`path#index`, document) for every YAML document under deploy/."""
    docs = []
    for path in sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")]):
        with path.open() as f:
            for index, doc in enumerate(yaml.safe_load_all(f)):
                if doc is not None:
                    docs.append((f"{path.relative_to(REPO)}#{index}", doc))
    return docs


DOCUMENTS = load_documents()


def of_kind(kind: str) -> list[tuple[str, dict[str, Any]]]:
    return [(name, doc) for name, doc in DOCUMENTS if doc.get("kind") == kind]


def serve_configs() -> list[tuple[str, dict[str, Any]]]:
    """Serve configs: files of their own, and each RayService's serveConfigV2."""
    configs = [(name, doc) for name, doc in DOCUMENTS if "apiVersion" not in doc]
    for name, service in of_kind("RayService"):
        configs.append((f"{name} serveConfigV2", yaml.safe_load(service["spec"]["serveConfigV2"])))
    return configs


def schema_errors(schema: dict[str, Any], doc: Any) -> list[str]:
    validator = jsonschema.Draft202012Validator(schema)
    return [
        f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
        for e in validator.iter_errors(doc)
    ]


def schema_for(doc: dict[str, Any]) -> dict[str, Any]:
    if "apiVersion" not in doc:
        return SERVE_CONFIG
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key not in KINDS:
        pytest.fail(f"no schema for {key}: add one to tests/server/k8s_schemas.py")
    return KINDS[key]


def quantity(value: str | int | float) -> float:
    """A CPU quantity ("2", "500m", 1.5) as cores."""
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def containers(template: dict[str, Any]) -> list[dict[str, Any]]:
    return template["spec"]["containers"]


# ---- the schemas ------------------------------------------------------------------------------


def test_deploy_holds_the_manifests_the_docs_describe() -> None:
    kinds = {doc.get("kind", "serve config") for _, doc in DOCUMENTS}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "RayService", "NetworkPolicy",
            "serve config"} <= kinds, kinds  # fmt: skip
    for schema in [*KINDS.values(), SERVE_CONFIG]:
        jsonschema.Draft202012Validator.check_schema(schema)


@pytest.mark.parametrize(("name", "doc"), DOCUMENTS, ids=[name for name, _ in DOCUMENTS])
def test_each_manifest_fits_its_schema(name: str, doc: dict[str, Any]) -> None:
    errors = schema_errors(schema_for(doc), doc)
    assert not errors, f"{name}:\n" + "\n".join(errors)


def _first(kind: str) -> dict[str, Any]:
    return copy.deepcopy(of_kind(kind)[0][1])


def _k8s_container(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["template"]["spec"]["containers"][0]


def _head(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["rayClusterConfig"]["headGroupSpec"]


MISTAKES: dict[str, tuple[str, Callable[[dict[str, Any]], None]]] = {
    "misspelled probe field": (
        "Deployment",
        lambda d: _k8s_container(d)["readinessProbe"].update(periodSecond=5),
    ),
    "probe field on the container": (
        "Deployment",
        lambda d: _k8s_container(d).update(initialDelaySeconds=10),
    ),
    "probe without a handler": (
        "Deployment",
        lambda d: _k8s_container(d)["livenessProbe"].pop("httpGet"),
    ),
    "misspelled resources": (
        "Deployment",
        lambda d: _k8s_container(d)["resources"].update(request={"cpu": "1"}),
    ),
    "bad quantity": (
        "Deployment",
        lambda d: _k8s_container(d)["resources"]["limits"].update(cpu="two"),
    ),
    "port name too long": ("Service", lambda d: d["spec"]["ports"][0].update(targetPort="h" * 16)),
    "rayStartParams beside the groups": (
        "RayService",
        lambda d: d["spec"]["rayClusterConfig"].update(rayStartParams={}),
    ),
    "rayStartParams value not a string": (
        "RayService",
        lambda d: _head(d)["rayStartParams"].update({"num-cpus": 0}),
    ),
    "KubeRay's old serveConfig field": ("RayService", lambda d: d["spec"].update(serveConfig={})),
    "a threshold KubeRay ignores": (
        "RayService",
        lambda d: d["spec"].update(serviceUnhealthySecondThreshold=300),
    ),
    "unknown auth mode": (
        "RayService",
        lambda d: d["spec"]["rayClusterConfig"]["authOptions"].update(mode="on"),
    ),
    "misspelled label selector": (
        "NetworkPolicy",
        lambda d: d["spec"]["podSelector"].update(matchLabel={"a": "b"}),
    ),
}


@pytest.mark.parametrize("mistake", MISTAKES)
def test_a_misspelled_or_misplaced_field_fails(mistake: str) -> None:
    kind, change = MISTAKES[mistake]
    doc = _first(kind)
    assert not schema_errors(schema_for(doc), doc)
    change(doc)
    assert schema_errors(schema_for(doc), doc), f"{mistake} passed the {kind} schema"


def test_a_misplaced_serve_option_fails() -> None:
    _, config = serve_configs()[0]
    good = copy.deepcopy(config)
    good["applications"][0]["deployments"] = [{"name": DEPLOYMENT_NAME, "health_check_period_s": 5}]
    assert not schema_errors(SERVE_CONFIG, good)
    misspelled = copy.deepcopy(good)
    misspelled["applications"][0]["deployments"][0]["health_check_period"] = 5
    misplaced = copy.deepcopy(config)
    misplaced["applications"][0]["health_check_period_s"] = 5  # a deployment's, not an app's
    for bad in (misspelled, misplaced):
        assert schema_errors(SERVE_CONFIG, bad)


def test_the_serve_schema_names_only_fields_ray_knows() -> None:
    """The compact Serve schema against Ray's own models: no field Ray would not read."""
    from ray.serve.schema import DeploymentSchema, HTTPOptionsSchema, ServeApplicationSchema

    app = SERVE_CONFIG["properties"]["applications"]["items"]
    pairs = [
        (SERVE_CONFIG, ServeDeploySchema),
        (SERVE_CONFIG["properties"]["http_options"], HTTPOptionsSchema),
        (app, ServeApplicationSchema),
        (app["properties"]["deployments"]["items"], DeploymentSchema),
    ]
    for schema, model in pairs:
        assert set(schema["properties"]) <= set(model.model_fields), model.__name__


# ---- what the schemas cannot say -------------------------------------------------------------


def resolve(import_path: str) -> Any:
    module_name, _, attribute = import_path.partition(":")
    target: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        target = getattr(target, part)
    return target


@pytest.mark.parametrize(("name", "config"), serve_configs(), ids=[n for n, _ in serve_configs()])
def test_each_serve_config_builds_this_projects_application(
    name: str, config: dict[str, Any]
) -> None:
    ServeDeploySchema.model_validate(config)  # Ray's own types and values
    for app in config["applications"]:
        builder = resolve(app["import_path"])
        assert callable(builder) and builder.__module__.startswith("gptserve.server.ray"), name
        settings, options = parse_app_args(app.get("args") or {})
        options.deployment_options(settings)
        assert type(build_app(app.get("args") or {})).__name__ == "Application"
        for override in app.get("deployments", []):  # Ray refuses a name the app lacks
            assert override["name"] == DEPLOYMENT_NAME, name


def test_ray_start_params_are_ray_start_flags() -> None:
    flags = {param.name for param in ray_start_command.params}
    for name, service in of_kind("RayService"):
        cluster = service["spec"]["rayClusterConfig"]
        groups = [cluster["headGroupSpec"], *cluster.get("workerGroupSpecs", [])]
        for group in groups:
            for key in group.get("rayStartParams", {}):
                assert key.replace("-", "_") in flags, f"{name}: `ray start` has no --{key}"


def test_the_ray_image_matches_the_rayservice_and_loads_the_proxy_callback() -> None:
    dockerfile = (DEPLOY / "ray" / "Dockerfile").read_text()
    (ray_version,) = re.findall(r"^ARG RAY_VERSION=(\S+)", dockerfile, re.MULTILINE)
    (callback,) = re.findall(r"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=(\S+)", dockerfile)
    assert callback == PROXY_CALLBACK and callable(resolve(callback))
    for name, service in of_kind("RayService"):
        assert service["spec"]["rayClusterConfig"]["rayVersion"] == ray_version, name


def test_a_replica_fits_on_a_ray_worker() -> None:
    """Each worker pod has the CPUs of at least one replica, or no replica ever starts."""
    for name, service in of_kind("RayService"):
        (app,) = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
        _, options = parse_app_args(app.get("args") or {})
        for group in service["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
            ray_container = containers(group["template"])[0]  # KubeRay's: the first
            cpus = quantity(ray_container["resources"]["requests"]["cpu"])
            assert cpus >= options.num_cpus, f"{name}: {group['groupName']} has {cpus} CPUs"


def test_the_kubernetes_pieces_fit_together() -> None:
    (_, deployment), (_, service), (_, hpa) = (
        of_kind("Deployment")[0], of_kind("Service")[0], of_kind("HorizontalPodAutoscaler")[0]
    )  # fmt: skip
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert service["spec"]["selector"].items() <= pod_labels.items()
    (container,) = containers(deployment["spec"]["template"])
    port_names = {p["name"] for p in container["ports"]}
    port_numbers = {p["containerPort"] for p in container["ports"]}
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in (port_numbers if isinstance(port["targetPort"], int)
                                      else port_names)  # fmt: skip
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
        assert container[probe]["httpGet"]["port"] in port_names
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    # SIGTERM's grace (after the preStop pause) covers the server's own drain
    pause = float(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > pause + Settings().shutdown_grace


def test_the_startup_probe_allows_for_a_slow_load() -> None:
    (_, deployment) = of_kind("Deployment")[0]
    (container,) = containers(deployment["spec"]["template"])
    startup = container["startupProbe"]
    allowed = (
        startup.get("initialDelaySeconds", 0)
        + startup["periodSeconds"] * startup["failureThreshold"]
    )
    assert allowed >= 300  # the docs promise 5 minutes for a load
    for probe in ("readinessProbe", "livenessProbe"):  # these wait for the startup probe
        assert "initialDelaySeconds" not in container[probe]
    for name, config in serve_configs():  # Ray's side: a replica's own limit on its load
        for app in config["applications"]:
            _, options = parse_app_args(app.get("args") or {})
            assert options.load_timeout >= 300, name


def test_the_ray_dashboard_is_local_or_fenced() -> None:
    """The dashboard runs Ray jobs for whoever reaches it: bound to loopback, or behind Ray's
    token and a NetworkPolicy of the same file that admits its port only from named peers."""
    for name, service in of_kind("RayService"):
        cluster = service["spec"]["rayClusterConfig"]
        head = cluster["headGroupSpec"]
        host = head.get("rayStartParams", {}).get("dashboard-host", "0.0.0.0")  # KubeRay's default
        if host in LOOPBACK:
            continue
        assert cluster.get("authOptions", {}).get("mode") == "token", name
        path = name.split("#")[0]
        policies = [doc for other, doc in of_kind("NetworkPolicy") if other.startswith(path + "#")]
        head_labels = head["template"]["metadata"]["labels"]
        fences = [
            p for p in policies
            if p["spec"]["podSelector"].get("matchLabels", {}).items() <= head_labels.items()
            and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
        ]  # fmt: skip
        assert fences, f"{name}: the dashboard listens on {host} with no NetworkPolicy on the head"
        for policy in fences:
            for rule in policy["spec"].get("ingress", []):
                ports = {p.get("port") for p in rule.get("ports", [])}
                if not rule.get("ports") or DASHBOARD_PORT in ports or "dashboard" in ports:
                    assert rule.get("from"), f"{name}: a rule admits the dashboard from anywhere"
