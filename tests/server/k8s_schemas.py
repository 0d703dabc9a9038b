"""Compact JSON schemas of the Kubernetes fields that deploy/ uses (apps/v1, v1, autoscaling/v2,
networking.k8s.io/v1), and the helpers tests/server/ray_schemas.py builds on.

Each object is closed (`additionalProperties: false`), so a misspelled field, or one put at the
wrong level, fails validation instead of being dropped in silence by the API server. The schemas
cover what deploy/ writes plus a few fields close to it, not whole APIs: a manifest that needs a
field left out here gets it added, checked against the Kubernetes API reference.
"""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]


def closed(properties: Schema, required: tuple[str, ...] = ()) -> Schema:
    """An object of exactly these optional properties, `required` among them."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


def array(items: Schema, min_items: int = 0) -> Schema:
    return {"type": "array", "items": items, "minItems": min_items}


def one_of_keys(*keys: str) -> list[Schema]:
    """Exactly one of `keys` present (a probe's or a hook's handler)."""
    return [{"required": [key]} for key in keys]


STR: Schema = {"type": "string"}
BOOL: Schema = {"type": "boolean"}
COUNT: Schema = {"type": "integer", "minimum": 0}
POSITIVE: Schema = {"type": "integer", "minimum": 1}
NUMBER: Schema = {"type": "number"}
STR_MAP: Schema = {"type": "object", "additionalProperties": STR}
OPEN: Schema = {"type": "object"}  # accepted, its inside unchecked (fields deploy/ does not use)
DNS_LABEL: Schema = {
    "type": "string",
    "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
    "maxLength": 63,
}
PORT_NUMBER: Schema = {"type": "integer", "minimum": 1, "maximum": 65535}
PORT_NAME: Schema = {
    "type": "string",
    "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
    "maxLength": 15,
}
PORT: Schema = {"anyOf": [PORT_NUMBER, PORT_NAME]}  # Kubernetes' IntOrString port
PROTOCOL: Schema = {"enum": ["TCP", "UDP", "SCTP"]}
QUANTITY: Schema = {  # Kubernetes' resource.Quantity: 2, "500m", "4Gi"
    "anyOf": [
        {"type": "number", "minimum": 0},
        {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$"},
    ]
}

# ---- core/v1 pieces ----------------------------------------------------------------------------

OBJECT_META = closed(
    {"name": DNS_LABEL, "namespace": DNS_LABEL, "labels": STR_MAP, "annotations": STR_MAP},
    required=("name",),
)
TEMPLATE_META = closed({"labels": STR_MAP, "annotations": STR_MAP})
LABEL_SELECTOR = closed(
    {
        "matchLabels": STR_MAP,
        "matchExpressions": array(
            closed(
                {
                    "key": STR,
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": array(STR),
                },  # fmt: skip
                required=("key", "operator"),
            )
        ),
    }
)
KEY_REF = closed({"name": STR, "key": STR, "optional": BOOL}, required=("key",))
ENV_VAR = closed(
    {
        "name": STR,
        "value": STR,
        "valueFrom": closed(
            {
                "secretKeyRef": KEY_REF,
                "configMapKeyRef": KEY_REF,
                "fieldRef": closed({"fieldPath": STR, "apiVersion": STR}, required=("fieldPath",)),
            },
        ),  # fmt: skip
    },
    required=("name",),
)
CONTAINER_PORT = closed(
    {"name": PORT_NAME, "containerPort": PORT_NUMBER, "protocol": PROTOCOL,
     "hostPort": PORT_NUMBER},
    required=("containerPort",),
)  # fmt: skip
HTTP_GET = closed(
    {
        "path": STR,
        "port": PORT,
        "host": STR,
        "scheme": {"enum": ["HTTP", "HTTPS"]},
        "httpHeaders": array(closed({"name": STR, "value": STR}, required=("name", "value"))),
    },
    required=("port",),
)
EXEC = closed({"command": array(STR, min_items=1)}, required=("command",))
TCP_SOCKET = closed({"port": PORT, "host": STR}, required=("port",))
PROBE = {
    **closed(
        {
            "httpGet": HTTP_GET,
            "exec": EXEC,
            "tcpSocket": TCP_SOCKET,
            "grpc": closed({"port": PORT_NUMBER, "service": STR}, required=("port",)),
            "initialDelaySeconds": COUNT,
            "periodSeconds": POSITIVE,
            "timeoutSeconds": POSITIVE,
            "successThreshold": POSITIVE,
            "failureThreshold": POSITIVE,
            "terminationGracePeriodSeconds": POSITIVE,
        }
    ),
    "oneOf": one_of_keys("httpGet", "exec", "tcpSocket", "grpc"),
}
LIFECYCLE_HANDLER = {
    **closed(
        {
            "httpGet": HTTP_GET,
            "exec": EXEC,
            "tcpSocket": TCP_SOCKET,
            "sleep": closed({"seconds": COUNT}, required=("seconds",)),
        }
    ),  # fmt: skip
    "oneOf": one_of_keys("httpGet", "exec", "tcpSocket", "sleep"),
}
RESOURCES = closed(
    {"requests": {"type": "object", "additionalProperties": QUANTITY},
     "limits": {"type": "object", "additionalProperties": QUANTITY}}
)  # fmt: skip
VOLUME_MOUNT = closed(
    {"name": STR, "mountPath": STR, "readOnly": BOOL, "subPath": STR},
    required=("name", "mountPath"),
)
CONTAINER = closed(
    {
        "name": DNS_LABEL,
        "image": STR,
        "imagePullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
        "command": array(STR),
        "args": array(STR),
        "workingDir": STR,
        "env": array(ENV_VAR),
        "envFrom": array(OPEN),
        "ports": array(CONTAINER_PORT),
        "startupProbe": PROBE,
        "readinessProbe": PROBE,
        "livenessProbe": PROBE,
        "lifecycle": closed({"preStop": LIFECYCLE_HANDLER, "postStart": LIFECYCLE_HANDLER}),
        "resources": RESOURCES,
        "volumeMounts": array(VOLUME_MOUNT),
        "securityContext": OPEN,
    },
    required=("name", "image"),
)
VOLUME = closed(
    {
        "name": DNS_LABEL,
        "persistentVolumeClaim": closed(
            {"claimName": STR, "readOnly": BOOL}, required=("claimName",)
        ),
        "emptyDir": closed({"medium": STR, "sizeLimit": QUANTITY}),
        "configMap": OPEN,
        "secret": OPEN,
    },
    required=("name",),
)
POD_SPEC = closed(
    {
        "containers": array(CONTAINER, min_items=1),
        "initContainers": array(CONTAINER),
        "volumes": array(VOLUME),
        "terminationGracePeriodSeconds": COUNT,
        "serviceAccountName": DNS_LABEL,
        "nodeSelector": STR_MAP,
        "tolerations": array(OPEN),
        "affinity": OPEN,
        "securityContext": OPEN,
        "imagePullSecrets": array(closed({"name": STR}, required=("name",))),
    },
    required=("containers",),
)
POD_TEMPLATE = closed({"metadata": TEMPLATE_META, "spec": POD_SPEC}, required=("spec",))


def resource(api_version: str, kind: str, spec: Schema) -> Schema:
    """A top-level object: apiVersion, kind, metadata with a name, and its spec."""
    return closed(
        {"apiVersion": {"const": api_version}, "kind": {"const": kind}, "metadata": OBJECT_META,
         "spec": spec},
        required=("apiVersion", "kind", "metadata", "spec"),
    )  # fmt: skip


# ---- Kubernetes kinds --------------------------------------------------------------------------

DEPLOYMENT = resource(
    "apps/v1",
    "Deployment",
    closed(
        {
            "replicas": COUNT,
            "selector": LABEL_SELECTOR,
            "template": POD_TEMPLATE,
            "strategy": OPEN,
            "minReadySeconds": COUNT,
            "revisionHistoryLimit": COUNT,
            "progressDeadlineSeconds": POSITIVE,
        },
        required=("selector", "template"),
    ),
)
SERVICE = resource(
    "v1",
    "Service",
    closed(
        {
            "selector": STR_MAP,
            "ports": array(
                closed(
                    {
                        "name": DNS_LABEL,
                        "port": PORT_NUMBER,
                        "targetPort": PORT,
                        "protocol": PROTOCOL,
                        "nodePort": PORT_NUMBER,
                        "appProtocol": STR,
                    },
                    required=("port",),
                ),  # fmt: skip
                min_items=1,
            ),
            "type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer", "ExternalName"]},
            "sessionAffinity": {"enum": ["None", "ClientIP"]},
        }
    ),
)
METRIC_TARGET = closed(
    {"type": {"enum": ["Utilization", "Value", "AverageValue"]},
     "averageUtilization": POSITIVE, "averageValue": QUANTITY, "value": QUANTITY},
    required=("type",),
)  # fmt: skip
SCALING_RULES = closed(
    {
        "stabilizationWindowSeconds": COUNT,
        "selectPolicy": {"enum": ["Max", "Min", "Disabled"]},
        "policies": array(
            closed(
                {
                    "type": {"enum": ["Pods", "Percent"]},
                    "value": POSITIVE,
                    "periodSeconds": POSITIVE,
                },
                required=("type", "value", "periodSeconds"),
            )  # fmt: skip
        ),
    }
)
HORIZONTAL_POD_AUTOSCALER = resource(
    "autoscaling/v2",
    "HorizontalPodAutoscaler",
    closed(
        {
            "scaleTargetRef": closed(
                {"apiVersion": STR, "kind": STR, "name": DNS_LABEL}, required=("kind", "name")
            ),
            "minReplicas": POSITIVE,
            "maxReplicas": POSITIVE,
            "metrics": array(
                closed(
                    {
                        "type": {
                            "enum": ["Resource", "Pods", "Object", "External", "ContainerResource"]
                        },  # fmt: skip
                        "resource": closed(
                            {"name": STR, "target": METRIC_TARGET}, required=("name", "target")
                        ),
                        "pods": closed(
                            {
                                "metric": closed(
                                    {"name": STR, "selector": LABEL_SELECTOR}, required=("name",)
                                ),
                                "target": METRIC_TARGET,
                            },
                            required=("metric", "target"),
                        ),  # fmt: skip
                    },
                    required=("type",),
                )
            ),
            "behavior": closed({"scaleUp": SCALING_RULES, "scaleDown": SCALING_RULES}),
        },
        required=("scaleTargetRef", "maxReplicas"),
    ),
)
PEER = closed(
    {"podSelector": LABEL_SELECTOR, "namespaceSelector": LABEL_SELECTOR,
     "ipBlock": closed({"cidr": STR, "except": array(STR)}, required=("cidr",))}
)  # fmt: skip
POLICY_PORT = closed({"port": PORT, "endPort": PORT_NUMBER, "protocol": PROTOCOL})
NETWORK_POLICY = resource(
    "networking.k8s.io/v1",
    "NetworkPolicy",
    closed(
        {
            "podSelector": LABEL_SELECTOR,
            "policyTypes": array({"enum": ["Ingress", "Egress"]}, min_items=1),
            "ingress": array(closed({"from": array(PEER), "ports": array(POLICY_PORT)})),
            "egress": array(closed({"to": array(PEER), "ports": array(POLICY_PORT)})),
        },
        required=("podSelector",),
    ),
)


K8S_KINDS: dict[tuple[str, str], Schema] = {
    ("apps/v1", "Deployment"): DEPLOYMENT,
    ("v1", "Service"): SERVICE,
    ("autoscaling/v2", "HorizontalPodAutoscaler"): HORIZONTAL_POD_AUTOSCALER,
    ("networking.k8s.io/v1", "NetworkPolicy"): NETWORK_POLICY,
}
