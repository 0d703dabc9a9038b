"""Compact JSON schemas of the KubeRay (ray.io/v1, KubeRay v1.5.1 and later) and Ray Serve config
fields that deploy/ uses, closed like those of tests/server/k8s_schemas.py: a misspelled or
misplaced field fails. A field left out here gets added, checked against KubeRay's API reference
or Ray's `ray.serve.schema` (tests/server/test_deploy_manifests.py checks that every Serve field
named here is one of Ray's).
"""

from __future__ import annotations

from tests.server.k8s_schemas import (
    BOOL,
    COUNT,
    DNS_LABEL,
    ENV_VAR,
    NUMBER,
    OPEN,
    POD_TEMPLATE,
    PORT_NUMBER,
    POSITIVE,
    RESOURCES,
    STR,
    STR_MAP,
    Schema,
    array,
    closed,
    resource,
)

# ---- KubeRay (ray.io/v1) -----------------------------------------------------------------------

RAY_START_PARAMS: Schema = STR_MAP  # `ray start` flags without the dashes; values are strings
HEAD_GROUP_SPEC = closed(
    {
        "rayStartParams": RAY_START_PARAMS,
        "template": POD_TEMPLATE,
        "serviceType": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
        "headService": OPEN,
        "enableIngress": BOOL,
    },
    required=("template",),
)
WORKER_GROUP_SPEC = closed(
    {
        "groupName": DNS_LABEL,
        "replicas": COUNT,
        "minReplicas": COUNT,
        "maxReplicas": COUNT,
        "idleTimeoutSeconds": COUNT,
        "rayStartParams": RAY_START_PARAMS,
        "template": POD_TEMPLATE,
        "numOfHosts": POSITIVE,
        "suspend": BOOL,
    },
    required=("groupName", "template"),
)
RAY_CLUSTER_SPEC = closed(
    {
        "rayVersion": {"type": "string", "pattern": r"^[0-9]+\.[0-9]+\.[0-9]+$"},
        "enableInTreeAutoscaling": BOOL,
        "autoscalerOptions": closed(
            {
                "idleTimeoutSeconds": COUNT,
                "upscalingMode": {"enum": ["Default", "Aggressive", "Conservative"]},
                "resources": RESOURCES,
                "env": array(ENV_VAR),
            }
        ),  # fmt: skip
        # enableK8sTokenAuth is left out: KubeRay does not support it for a RayService
        "authOptions": closed({"mode": {"enum": ["disabled", "token"]}, "secretName": STR}),
        "headGroupSpec": HEAD_GROUP_SPEC,
        "workerGroupSpecs": array(WORKER_GROUP_SPEC),
        "headServiceAnnotations": STR_MAP,
        "gcsFaultToleranceOptions": OPEN,
    },
    required=("headGroupSpec",),
)
# serviceUnhealthySecondThreshold and deploymentUnhealthySecondThreshold are left out: KubeRay
# ignores them since v1.1 (ray-project/kuberay#1685), so setting one would mislead a reader
RAY_SERVICE = resource(
    "ray.io/v1",
    "RayService",
    closed(
        {
            "serveConfigV2": STR,  # a Serve config as a YAML string: SERVE_CONFIG checks it
            "rayClusterConfig": RAY_CLUSTER_SPEC,
            "upgradeStrategy": closed(
                {"type": {"enum": ["NewCluster", "NewClusterWithIncrementalUpgrade", "None"]}}
            ),
            "serveService": OPEN,
            "excludeHeadPodFromServeSvc": BOOL,
            "rayClusterDeletionDelaySeconds": COUNT,
        },
        required=("serveConfigV2", "rayClusterConfig"),
    ),
)


# ---- Ray Serve config (`serve deploy`, `serve run`, serveConfigV2) ----------------------------

SERVE_DEPLOYMENT = closed(
    {
        "name": STR,
        "num_replicas": {"anyOf": [POSITIVE, {"const": "auto"}]},
        "max_ongoing_requests": POSITIVE,
        "max_queued_requests": {"type": "integer", "minimum": -1},
        "autoscaling_config": OPEN,
        "health_check_period_s": NUMBER,
        "health_check_timeout_s": NUMBER,
        "graceful_shutdown_timeout_s": NUMBER,
        "graceful_shutdown_wait_loop_s": NUMBER,
        "ray_actor_options": OPEN,
        "user_config": OPEN,
    },
    required=("name",),
)
SERVE_APPLICATION = closed(
    {
        "name": STR,
        "route_prefix": {"type": "string", "pattern": "^/"},
        "import_path": {"type": "string", "pattern": r"^[\w.]+:[\w.]+$"},
        "args": OPEN,
        "runtime_env": OPEN,
        "deployments": array(SERVE_DEPLOYMENT),
    },
    required=("import_path",),
)
SERVE_CONFIG = closed(
    {
        "proxy_location": {"enum": ["EveryNode", "HeadOnly", "Disabled"]},
        "http_options": closed(
            {
                "host": STR,
                "port": PORT_NUMBER,
                "root_path": STR,
                "request_timeout_s": NUMBER,
                "keep_alive_timeout_s": NUMBER,
            }
        ),  # fmt: skip
        "logging_config": OPEN,
        "applications": array(SERVE_APPLICATION, min_items=1),
    },
    required=("applications",),
)
