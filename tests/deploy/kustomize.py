"""Render deploy/kubernetes/ the way `kubectl kustomize` does, for the few kustomize features
those files use, so the tests can run where kubectl is not installed (CI).

Supported: Kustomization and Component files with ``resources`` (files and directories),
``components``, ``patches`` (JSON 6902 operations, targeted by kind and name), ``images``
(newName, newTag, digest) and ``namespace``. Anything else raises ``Unsupported``: a
kustomization that grows a feature this module does not render fails the tests loudly
instead of being rendered differently from kubectl. Where kubectl exists the tests also
compare both renderings.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "components", "patches", "images",
                      "namespace"}
# Kinds the files use, and whether each is namespaced; an unknown kind raises.
NAMESPACED = {"ConfigMap": True, "Service": True, "StatefulSet": True, "Deployment": True,
              "ServiceAccount": True, "Role": True, "RoleBinding": True,
              "PodDisruptionBudget": True, "PersistentVolumeClaim": True, "Ingress": True,
              "Namespace": False, "ClusterRole": False, "ClusterRoleBinding": False}


class Unsupported(Exception):
    """The kustomization uses something this renderer does not implement."""


class PatchError(Exception):
    """A JSON patch operation that RFC 6902 says must fail."""


def load_documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def render(directory: Path) -> list[dict[str, Any]]:
    """The resources a kustomization directory produces, in no particular order."""
    return _build(Path(directory), [], expect="Kustomization")


def _build(directory: Path, docs: list[dict[str, Any]], expect: str) -> list[dict[str, Any]]:
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    if spec.get("kind", "Kustomization") != expect:
        raise Unsupported(f"{directory}: kind {spec.get('kind')!r}, expected {expect}")
    unknown = set(spec) - KUSTOMIZATION_KEYS
    if unknown:
        raise Unsupported(f"{directory}: {sorted(unknown)}")
    docs = list(docs)
    for entry in spec.get("resources", []):
        path = directory / entry
        docs += render(path) if path.is_dir() else load_documents(path)
    for entry in spec.get("components", []):
        docs = _build(directory / entry, docs, expect="Component")
    for patch in spec.get("patches", []):
        _patch(docs, patch, directory)
    if "namespace" in spec:
        _set_namespace(docs, spec["namespace"])
    for image in spec.get("images", []):
        _set_image(docs, image)
    return docs


def _patch(docs: list[dict[str, Any]], patch: dict[str, Any], where: Path) -> None:
    target = patch.get("target") or {}
    if set(patch) != {"target", "patch"} or set(target) - {"kind", "name"}:
        raise Unsupported(f"{where}: patch {patch}")
    operations = yaml.safe_load(patch["patch"])
    if not isinstance(operations, list):
        raise Unsupported(f"{where}: only JSON 6902 patches (a list of operations)")
    matched = [doc for doc in docs
               if target.get("kind", doc["kind"]) == doc["kind"]
               and target.get("name", doc["metadata"]["name"]) == doc["metadata"]["name"]]
    if not matched:
        raise Unsupported(f"{where}: patch target {target} matches no resource")
    for doc in matched:
        replaced = json_patch(doc, operations)
        doc.clear()
        doc.update(replaced)


def _set_namespace(docs: list[dict[str, Any]], namespace: str) -> None:
    for doc in docs:
        if doc["kind"] not in NAMESPACED:
            raise Unsupported(f"kind {doc['kind']}: namespaced or not?")
        if not NAMESPACED[doc["kind"]]:
            continue
        doc["metadata"]["namespace"] = namespace
        if doc["kind"] == "RoleBinding":
            for subject in doc.get("subjects", []):
                if subject.get("kind") == "ServiceAccount":
                    if "namespace" in subject:
                        # kustomize's rule for those depends on where the namespace came from.
                        raise Unsupported("a ServiceAccount subject that names its namespace")
                    subject["namespace"] = namespace


def _set_image(docs: list[dict[str, Any]], image: dict[str, Any]) -> None:
    if set(image) - {"name", "newName", "newTag", "digest"}:
        raise Unsupported(f"image {image}")
    for doc in docs:
        pod = doc.get("spec", {}).get("template", {}).get("spec", {})
        for container in pod.get("containers", []) + pod.get("initContainers", []):
            name, tag = _split_image(container["image"])
            if name != image["name"]:
                continue
            if "digest" in image:
                tag = "@" + image["digest"]
            elif "newTag" in image:
                tag = ":" + image["newTag"]
            container["image"] = image.get("newName", name) + tag


def _split_image(image: str) -> tuple[str, str]:
    """("registry:5000/a/b", ":tag" or "@sha256:..." or "")."""
    if "@" in image:
        name, digest = image.split("@", 1)
        return name, "@" + digest
    slash = image.rfind("/")
    colon = image.rfind(":")
    if colon > slash:
        return image[:colon], image[colon:]
    return image, ""


# -- RFC 6902 (JSON Patch) -------------------------------------------------------------


def json_patch(document: Any, operations: list[dict[str, Any]]) -> Any:
    """``document`` with ``operations`` applied in order (RFC 6902: add, remove, replace,
    move, copy, test); the input is not modified. Any failing operation raises PatchError
    and no partial result is returned."""
    result = copy.deepcopy(document)
    for op in operations:
        result = _apply(result, op)
    return result


def _tokens(pointer: str) -> list[str]:
    if pointer == "":
        return []
    if not pointer.startswith("/"):
        raise PatchError(f"pointer {pointer!r} does not start with /")
    return [t.replace("~1", "/").replace("~0", "~") for t in pointer[1:].split("/")]


def _index(container: list[Any], token: str, allow_end: bool) -> int:
    if token == "-" and allow_end:
        return len(container)
    if not token.isdigit() or (len(token) > 1 and token.startswith("0")):
        raise PatchError(f"bad array index {token!r}")
    index = int(token)
    if index > len(container) or (index == len(container) and not allow_end):
        raise PatchError(f"array index {index} out of range")
    return index


def _parent(document: Any, tokens: list[str]) -> Any:
    node = document
    for token in tokens[:-1]:
        if isinstance(node, dict):
            if token not in node:
                raise PatchError(f"no member {token!r}")
            node = node[token]
        elif isinstance(node, list):
            node = node[_index(node, token, allow_end=False)]
        else:
            raise PatchError(f"cannot descend into {node!r}")
    return node


def _get(document: Any, pointer: str) -> Any:
    tokens = _tokens(pointer)
    if not tokens:
        return document
    parent = _parent(document, tokens)
    last = tokens[-1]
    if isinstance(parent, dict):
        if last not in parent:
            raise PatchError(f"no member {last!r}")
        return parent[last]
    if isinstance(parent, list):
        return parent[_index(parent, last, allow_end=False)]
    raise PatchError(f"cannot descend into {parent!r}")


def _add(document: Any, pointer: str, value: Any) -> Any:
    tokens = _tokens(pointer)
    if not tokens:
        return value
    parent = _parent(document, tokens)
    last = tokens[-1]
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        parent.insert(_index(parent, last, allow_end=True), value)
    else:
        raise PatchError(f"cannot add into {parent!r}")
    return document


def _remove(document: Any, pointer: str) -> Any:
    tokens = _tokens(pointer)
    if not tokens:
        raise PatchError("cannot remove the whole document")
    _get(document, pointer)  # must exist
    parent = _parent(document, tokens)
    if isinstance(parent, dict):
        del parent[tokens[-1]]
    else:
        del parent[_index(parent, tokens[-1], allow_end=False)]
    return document


def _apply(document: Any, op: dict[str, Any]) -> Any:
    kind = op.get("op")
    path = op.get("path")
    if not isinstance(path, str):
        raise PatchError(f"operation without a path: {op}")
    if kind in ("add", "replace", "test") and "value" not in op:
        raise PatchError(f"operation without a value: {op}")
    if kind == "add":
        return _add(document, path, copy.deepcopy(op["value"]))
    if kind == "remove":
        return _remove(document, path)
    if kind == "replace":
        _get(document, path)  # must exist
        if path == "":
            return copy.deepcopy(op["value"])
        return _add(_remove(document, path), path, copy.deepcopy(op["value"]))
    if kind in ("move", "copy"):
        source = op.get("from")
        if not isinstance(source, str):
            raise PatchError(f"{kind} without from: {op}")
        if kind == "move" and (path + "/").startswith(source + "/") and path != source:
            raise PatchError("cannot move a value into itself")
        value = copy.deepcopy(_get(document, source))
        if kind == "move":
            document = _remove(document, source)
        return _add(document, path, value)
    if kind == "test":
        if not _json_equal(_get(document, path), op["value"]):
            raise PatchError(f"test failed at {path}")
        return document
    raise PatchError(f"unknown op {kind!r}")


def _json_equal(a: Any, b: Any) -> bool:
    """JSON equality: true is not 1, and 1 equals 1.0."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b))
    numbers = (int, float)
    return isinstance(a, numbers) == isinstance(b, numbers) and a == b
