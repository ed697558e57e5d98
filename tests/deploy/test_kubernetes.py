"""deploy/kubernetes/: every rendering validates offline against the Kubernetes API schemas,
the Python rendering equals kubectl's where kubectl exists, and the rendered StatefulSet
keeps what docs/deploy.md's "Kubernetes" tables and the supervisor's stop order promise."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gnosis_daemon.settings import load_settings
from supervisor.daemon import DRAIN_MARGIN_S
from tests.deploy.kustomize import PatchError, Unsupported, json_patch, render

REPO = Path(__file__).resolve().parents[2]
TREE = REPO / "deploy" / "kubernetes"
DOC = REPO / "docs" / "deploy.md"
K8S_VERSION = "1.30"
OVERLAYS = ("overlays/cpu", "overlays/gpu")


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """A copy of deploy/kubernetes with one more overlay: gpu + components/shared-tier."""
    root = tmp_path_factory.mktemp("k8s") / "kubernetes"
    shutil.copytree(TREE, root)
    # What docs/deploy.md says to do: add the component to an overlay.
    spec = yaml.safe_load((TREE / "overlays/gpu/kustomization.yaml").read_text())
    spec["components"] = ["../../components/shared-tier"]
    (root / "overlays" / "gpu-shared").mkdir()
    (root / "overlays" / "gpu-shared" / "kustomization.yaml").write_text(yaml.safe_dump(spec))
    return root


RENDERED = ("base", *OVERLAYS, "overlays/gpu-shared", "alternatives/ingress-nginx")


def key(doc: dict[str, Any]) -> tuple[str, str, str]:
    return doc["kind"], doc["metadata"].get("namespace", ""), doc["metadata"]["name"]


def by_key(docs: list[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, Any]]:
    out = {key(doc): doc for doc in docs}
    assert len(out) == len(docs), "two resources with the same kind, namespace and name"
    return out


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    [doc] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


# -- rendering ---------------------------------------------------------------------------


def test_the_tree_holds_exactly_the_kustomizations_the_tests_render():
    found = sorted(str(p.parent.relative_to(TREE)) for p in TREE.rglob("kustomization.yaml"))
    assert found == sorted(["base", *OVERLAYS, "components/shared-tier",
                            "alternatives/ingress-nginx"])


@pytest.mark.parametrize("where", RENDERED)
def test_python_rendering_equals_kubectl_kustomize(tree, where):
    ours = by_key(render(tree / where))
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed here; the Python rendering ran alone")
    result = subprocess.run(["kubectl", "kustomize", str(tree / where)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    theirs = by_key([d for d in yaml.safe_load_all(result.stdout) if d])
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert ours[k] == theirs[k], k


def test_renderings_hold_the_expected_resources(tree):
    daemon = {("ConfigMap", "gnosis", "gnosis-daemon"), ("StatefulSet", "gnosis", "gnosis-daemon"),
              ("Service", "gnosis", "gnosis-daemon"), ("Service", "gnosis", "gnosis-router"),
              ("PodDisruptionBudget", "gnosis", "gnosis-daemon"),
              ("ServiceAccount", "gnosis", "gnosis-router"), ("Role", "gnosis", "gnosis-router"),
              ("RoleBinding", "gnosis", "gnosis-router"), ("Deployment", "gnosis", "gnosis-router")}
    for where in OVERLAYS:
        assert set(by_key(render(tree / where))) == daemon
    # The base leaves the namespace to the overlays.
    assert set(by_key(render(tree / "base"))) == {(k, "", n) for k, _, n in daemon}
    assert set(by_key(render(tree / "overlays/gpu-shared"))) == daemon | {
        ("PersistentVolumeClaim", "gnosis", "gnosis-kv-shared")}
    assert set(by_key(render(tree / "alternatives/ingress-nginx"))) == {
        ("Ingress", "gnosis", "gnosis-daemon")}


# -- offline schema validation -----------------------------------------------------------


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("schema validation tried to use the network")
    monkeypatch.setattr(socket, "socket", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


def test_the_pinned_kubernetes_version_ships_with_kubernetes_validate():
    assert f"{K8S_VERSION}.0" in kubernetes_validate.utils.all_versions()


@pytest.mark.parametrize("where", RENDERED)
def test_every_rendered_object_validates_against_the_pinned_schemas(tree, where, no_network):
    docs = render(tree / where)
    for doc in docs:
        # strict: an unknown or misspelt field fails too. The version the schemas came from
        # is returned: exactly the pinned one, not an older fallback.
        assert kubernetes_validate.validate(doc, K8S_VERSION, strict=True) == K8S_VERSION, key(doc)


def test_validation_rejects_a_misspelt_field(no_network):
    statefulset = one(render(TREE / "base"), "StatefulSet", "gnosis-daemon")
    statefulset["spec"]["template"]["spec"]["terminationGracePeriod"] = 90
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(statefulset, K8S_VERSION, strict=True)


# -- what docs/deploy.md promises --------------------------------------------------------


def doc_table(first_header: str) -> list[list[str]]:
    """The rows of the docs/deploy.md table whose first column header is ``first_header``."""
    lines = DOC.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    assert rows, first_header
    return rows


def parts(docs):
    statefulset = one(docs, "StatefulSet", "gnosis-daemon")
    pod = statefulset["spec"]["template"]["spec"]
    [container] = pod["containers"]
    config = one(docs, "ConfigMap", "gnosis-daemon")["data"]
    return statefulset, pod, container, config


def quantity_bytes(text: str) -> int:
    number, unit = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti|)", text).groups()
    return int(number) * 1024 ** ("", "Ki", "Mi", "Gi", "Ti").index(unit)


@pytest.mark.parametrize("where", OVERLAYS)
def test_probes_are_the_documented_ones(tree, where):
    _, _, container, _ = parts(render(tree / where))
    rows = doc_table("probe")
    assert [row[0] for row in rows] == ["startupProbe", "readinessProbe", "livenessProbe"]
    for name, path, port, period, timeout, failures in rows:
        probe = container[name]
        assert probe["httpGet"] == {"path": path, "port": port}
        assert (probe["periodSeconds"], probe["timeoutSeconds"], probe["failureThreshold"]) == (
            int(period), int(timeout), int(failures))
    # Liveness must not follow the station: /health is 503 while it restarts.
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"


@pytest.mark.parametrize("where", OVERLAYS)
def test_grace_period_ports_and_volumes_are_the_documented_ones(tree, where):
    statefulset, pod, container, config = parts(render(tree / where))
    fields = dict(doc_table("field"))
    port = int(fields["container port http"])
    assert container["ports"] == [{"name": "http", "containerPort": port}]
    assert pod["terminationGracePeriodSeconds"] == int(fields["terminationGracePeriodSeconds"])
    assert config["GNOSIS_DRAIN_GRACE_S"] == fields["GNOSIS_DRAIN_GRACE_S"]
    assert config["GNOSIS_STOP_TIMEOUT_S"] == fields["GNOSIS_STOP_TIMEOUT_S"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    claims = {c["metadata"]["name"]: c["spec"] for c in statefulset["spec"]["volumeClaimTemplates"]}
    for name, label in (("state", "state volume"), ("model-cache", "model cache volume")):
        assert mounts[name] == fields[f"{label} mount"]
        assert claims[name]["resources"]["requests"]["storage"] == fields[f"{label} size"]
        assert claims[name]["accessModes"] == ["ReadWriteOnce"]


@pytest.mark.parametrize("where", OVERLAYS)
def test_the_supervisor_stops_within_the_grace_period(tree, where):
    statefulset, pod, container, config = parts(render(tree / where))
    settings = load_settings(environ={k: v for k, v in config.items() if k != "GNOSIS_MODEL"})
    assert "GNOSIS_DRAIN_GRACE_S" in config  # explicit, not the default
    stop = settings.drain_grace_s + DRAIN_MARGIN_S + settings.stop_timeout_s
    assert pod["terminationGracePeriodSeconds"] > stop
    startup = container["startupProbe"]
    window = startup["periodSeconds"] * startup["failureThreshold"]
    assert window > settings.station_start_timeout_s + settings.host_start_timeout_s
    # The disk tier's budget fits its volume.
    claims = {c["metadata"]["name"]: c["spec"] for c in statefulset["spec"]["volumeClaimTemplates"]}
    state_bytes = quantity_bytes(claims["state"]["resources"]["requests"]["storage"])
    assert settings.kv_disk_bytes < state_bytes


@pytest.mark.parametrize("where", OVERLAYS)
def test_everything_the_daemon_writes_is_on_a_writable_mount(tree, where):
    _, pod, container, config = parts(render(tree / where))
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
    env = {**config, **{e["name"]: e["value"] for e in container.get("env", []) if "value" in e}}
    for name in ("GNOSIS_RUNTIME_DIR", "GNOSIS_STATE_DIR", "GNOSIS_MODEL_CACHE_DIR", "HF_HOME",
                 "HOME"):
        assert any(env[name] == m or env[name].startswith(m + "/") for m in writable), name
    # The daemon refuses a runtime dir it does not own; an emptyDir's root is root's, so the
    # runtime dir must be a directory the daemon creates inside the mount.
    [runtime_mount] = [m["mountPath"] for m in container["volumeMounts"] if m["name"] == "runtime"]
    assert env["GNOSIS_RUNTIME_DIR"].startswith(runtime_mount + "/")
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]


@pytest.mark.parametrize("where", OVERLAYS)
def test_the_configmap_is_valid_settings(tree, where):
    config = parts(render(tree / where))[3]
    environ = {k: v for k, v in config.items() if k != "GNOSIS_MODEL"}  # not on this machine
    settings = load_settings(environ=environ)
    assert (settings.host, settings.port, settings.log_format) == ("0.0.0.0", 8000, "json")
    assert settings.device == ("cuda" if where.endswith("gpu") else "cpu")


def test_gpu_overlay_asks_for_one_l4():
    statefulset, pod, container, config = parts(render(TREE / "overlays/gpu"))
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-l4"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists",
                                   "effect": "NoSchedule"}]
    assert container["image"] == "gnosis-daemon:gpu"
    assert (config["GNOSIS_DTYPE"], config["GNOSIS_MODEL"]) == (
        "bfloat16", "/models/Mistral-7B-Instruct-v0.3")
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "gnosis-models",
                                                        "readOnly": True}} in pod["volumes"]


def test_cpu_overlay_asks_for_no_gpu():
    _, pod, container, config = parts(render(TREE / "overlays/cpu"))
    assert not any("nvidia" in name for name in container["resources"]["requests"])
    assert not any("nvidia" in name for name in container["resources"]["limits"])
    assert "nodeSelector" not in pod and "GNOSIS_MODEL" not in config  # the default model
    assert container["image"] == "gnosis-daemon:cpu"


def test_shared_tier_component(tree):
    docs = render(tree / "overlays/gpu-shared")
    _, pod, container, config = parts(docs)
    claim = one(docs, "PersistentVolumeClaim", "gnosis-kv-shared")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert config["GNOSIS_KV_SHARED_DIR"] == "/var/lib/gnosis-daemon/shared"
    assert {"name": "kv-shared",
            "mountPath": "/var/lib/gnosis-daemon/shared"} in container["volumeMounts"]
    assert {"name": "kv-shared",
            "persistentVolumeClaim": {"claimName": "gnosis-kv-shared"}} in pod["volumes"]
    # The GPU overlay's own additions survive the component.
    assert {m["name"] for m in container["volumeMounts"]} == {
        "state", "model-cache", "runtime", "tmp", "models", "kv-shared"}


def selector_matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_router_hashes_sessions_over_the_daemon_pods():
    docs = render(TREE / "overlays/cpu")
    statefulset, _, container, _ = parts(docs)
    router = one(docs, "Deployment", "gnosis-router")
    [rc] = router["spec"]["template"]["spec"]["containers"]
    args = rc["args"]
    assert "--policy=consistent_hash" in args and "--service-discovery" in args
    at = args.index("--selector")
    assert args[at + 2].startswith("--")  # one label: key=value
    selector = dict([args[at + 1].split("=", 1)])
    daemon_labels = statefulset["spec"]["template"]["metadata"]["labels"]
    assert selector_matches(selector, daemon_labels)
    assert not selector_matches(selector, router["spec"]["template"]["metadata"]["labels"])
    assert f"--service-discovery-port={container['ports'][0]['containerPort']}" in args
    assert "--service-discovery-namespace=$(POD_NAMESPACE)" in args
    assert rc["env"] == [{"name": "POD_NAMESPACE",
                          "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}]
    assert "--health-check-endpoint=/health" in args
    # It may list and watch pods in its namespace, as the service account it runs as.
    role = one(docs, "Role", "gnosis-router")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                              "verbs": ["get", "list", "watch"]}]
    binding = one(docs, "RoleBinding", "gnosis-router")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": "gnosis-router"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "gnosis-router",
                                    "namespace": "gnosis"}]
    assert router["spec"]["template"]["spec"]["serviceAccountName"] == "gnosis-router"
    # Its Service fronts its pods; the headless one is the StatefulSet's and selects the daemons.
    front = one(docs, "Service", "gnosis-router")
    router_labels = router["spec"]["template"]["metadata"]["labels"]
    assert selector_matches(front["spec"]["selector"], router_labels)
    assert front["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http"}]
    headless = one(docs, "Service", "gnosis-daemon")
    assert headless["spec"]["clusterIP"] == "None"
    assert statefulset["spec"]["serviceName"] == "gnosis-daemon"
    assert selector_matches(headless["spec"]["selector"], daemon_labels)
    pdb = one(docs, "PodDisruptionBudget", "gnosis-daemon")
    assert selector_matches(pdb["spec"]["selector"]["matchLabels"], daemon_labels)
    assert pdb["spec"]["maxUnavailable"] == 1


def test_ingress_alternative_hashes_the_session_header_onto_the_headless_service():
    [ingress] = render(TREE / "alternatives/ingress-nginx")
    annotations = ingress["metadata"]["annotations"]
    assert annotations["nginx.ingress.kubernetes.io/upstream-hash-by"] == "$http_x_session_id"
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    headless = one(render(TREE / "base"), "Service", "gnosis-daemon")
    assert backend == {"name": headless["metadata"]["name"],
                       "port": {"name": headless["spec"]["ports"][0]["name"]}}


@pytest.mark.parametrize("where", OVERLAYS)
def test_pods_run_as_the_images_non_root_user(tree, where):
    docs = render(tree / where)
    uid = int(re.search(r"useradd .*--uid (\d+)", (REPO / "Dockerfile.gpu").read_text()).group(1))
    _, pod, container, _ = parts(docs)
    router = one(docs, "Deployment", "gnosis-router")["spec"]["template"]["spec"]
    assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["fsGroup"]) == (uid, uid)
    for spec, ctr in ((pod, container), (router, router["containers"][0])):
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] > 0
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert ctr["securityContext"] == {"allowPrivilegeEscalation": False,
                                          "readOnlyRootFilesystem": True,
                                          "capabilities": {"drop": ["ALL"]}}


# -- the renderer's own rules ------------------------------------------------------------


def test_json_patch_follows_rfc_6902():
    doc = {"a": {"b": [1, 2]}, "c~d": 1, "e/f": 2}
    assert json_patch(doc, [{"op": "add", "path": "/a/b/1", "value": 9}]) == {
        "a": {"b": [1, 9, 2]}, "c~d": 1, "e/f": 2}
    assert json_patch(doc, [{"op": "add", "path": "/a/b/-", "value": 3}])["a"]["b"] == [1, 2, 3]
    assert json_patch(doc, [{"op": "replace", "path": "/a/b/0", "value": 7}])["a"]["b"] == [7, 2]
    assert json_patch(doc, [{"op": "remove", "path": "/c~0d"},
                            {"op": "remove", "path": "/e~1f"}]) == {"a": {"b": [1, 2]}}
    assert json_patch(doc, [{"op": "move", "from": "/a/b", "path": "/x"}]) == {
        "a": {}, "c~d": 1, "e/f": 2, "x": [1, 2]}
    copied = json_patch(doc, [{"op": "copy", "from": "/a/b/0", "path": "/a/b/-"}])
    assert copied["a"]["b"] == [1, 2, 1]
    assert json_patch(doc, [{"op": "test", "path": "/c~0d", "value": 1.0}]) == doc
    assert doc == {"a": {"b": [1, 2]}, "c~d": 1, "e/f": 2}  # the input is untouched
    for bad in ({"op": "replace", "path": "/nope", "value": 1}, {"op": "remove", "path": "/a/b/2"},
                {"op": "add", "path": "/a/b/3", "value": 1},
                {"op": "add", "path": "/x/y", "value": 1},
                {"op": "add", "path": "/a/b/01", "value": 1},
                {"op": "test", "path": "/c~0d", "value": True},
                {"op": "move", "from": "/a", "path": "/a/b/x"}, {"op": "frobnicate", "path": "/a"}):
        with pytest.raises(PatchError):
            json_patch(doc, [bad])


def test_renderer_refuses_what_it_does_not_implement(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: []\nconfigMapGenerator: []\n")
    with pytest.raises(Unsupported):
        render(tmp_path)


@pytest.mark.parametrize("where", OVERLAYS)
def test_each_pod_names_itself_as_the_replica(tree, where):
    """X-Gnosis-Replica carries the pod's name (``replica_name`` from the downward API)."""
    _, _, container, _ = parts(render(tree / where))
    env = {e["name"]: e for e in container["env"]}
    assert env["GNOSIS_REPLICA_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
