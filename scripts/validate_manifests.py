#!/usr/bin/env python3
"""Strict schema validation of Kubernetes manifests, custom resources included.

Built-in kinds are validated with `kubernetes-validate --strict` (its library API) against
the Kubernetes schemas of --kubernetes-version. Custom resources are validated against the
openAPIV3Schema of their CustomResourceDefinition (from --crd files, and from any CRD found
among the inputs), made strict the way the API server's strict field validation is: an
object with `properties` accepts no other field unless it says
x-kubernetes-preserve-unknown-fields; null fields are pruned first (as the server does);
x-kubernetes-int-or-string and the int32/int64 formats are honoured; `metadata` is
checked as an ObjectMeta. A kind with no
schema anywhere is an error, unless named with --skip-kind (then one line says it was not
validated).

--images REGISTRY VERSION also checks that every container image under REGISTRY/ is one of
the images the Makefile builds: REGISTRY/operator:VERSION, REGISTRY/dataplane:VERSION or
REGISTRY/dataplane:VERSION-cuda (image names and tags come from one place).

--self-test feeds documents that must be refused (and some that must pass) and fails when
the validator does not tell them apart.

Exit status: 0 when every document is valid, 1 otherwise.
"""

import argparse
import copy
import json
import re
import sys

import jsonschema
import kubernetes_validate
import yaml
from kubernetes_validate.utils import SchemaNotFoundError

INT_BOUNDS = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}


def without_nulls(node):
    """The document as the API server validates a custom resource: null fields pruned."""
    if isinstance(node, dict):
        return {k: without_nulls(v) for k, v in node.items() if v is not None}
    if isinstance(node, list):
        return [without_nulls(v) for v in node]
    return node


def strict_schema(node):
    """The JSON Schema equivalent of a CRD structural schema node, strict."""
    if isinstance(node, list):
        return [strict_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k in ("properties", "patternProperties", "definitions"):
            out[k] = {name: strict_schema(s) for name, s in v.items()}
        elif k in ("items", "additionalProperties", "not") and isinstance(v, dict):
            out[k] = strict_schema(v)
        elif k in ("allOf", "anyOf", "oneOf"):
            out[k] = [strict_schema(s) for s in v]
        elif k.startswith("x-kubernetes-") or k in ("nullable", "format", "default", "example"):
            continue
        else:
            out[k] = v
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    fmt = node.get("format")
    if fmt in INT_BOUNDS:
        lo, hi = INT_BOUNDS[fmt]
        out["minimum"] = max(out.get("minimum", lo), lo)
        out["maximum"] = min(out.get("maximum", hi), hi)
    preserve = node.get("x-kubernetes-preserve-unknown-fields")
    if node.get("type") == "object" and "properties" in node and not preserve:
        out.setdefault("additionalProperties", False)
    return out


class Validator:
    def __init__(self, k8s_version, skip_kinds=(), images=None):
        self.k8s_version = k8s_version
        self.skip_kinds = set(skip_kinds)
        self.images = images
        self.crds = {}  # (group/version, kind) -> JSON schema

    def add_crd(self, crd):
        spec = crd["spec"]
        kind = spec["names"]["kind"]
        for v in spec["versions"]:
            schema = v.get("schema", {}).get("openAPIV3Schema")
            if schema is None:
                continue
            schema = strict_schema(copy.deepcopy(schema))
            # apiVersion, kind and metadata are checked separately.
            props = schema.setdefault("properties", {})
            props["apiVersion"] = {"type": "string"}
            props["kind"] = {"type": "string"}
            props["metadata"] = {"type": "object"}
            self.crds[(f"{spec['group']}/{v['name']}", kind)] = schema

    def errors(self, doc):
        """Every problem with one document (an empty list when it is valid)."""
        if not isinstance(doc, dict) or "kind" not in doc or "apiVersion" not in doc:
            return ["not a Kubernetes object (no apiVersion/kind)"]
        key = (doc["apiVersion"], doc["kind"])
        errs = []
        if key in self.crds:
            v = jsonschema.Draft202012Validator(self.crds[key])
            pruned = without_nulls(doc)
            for e in sorted(v.iter_errors(pruned), key=lambda e: [str(p) for p in e.path]):
                path = ".".join(str(p) for p in e.path) or "(root)"
                errs.append(f"{path}: {e.message}")
            # metadata as the API server sees it: an ObjectMeta, checked through a built-in
            # kind that has nothing else.
            meta = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc.get("metadata", {})}
            errs += self._builtin(meta)
            if not doc.get("metadata", {}).get("name"):
                errs.append("metadata.name: missing")
        elif doc["kind"] in self.skip_kinds:
            return None
        else:
            errs += self._builtin(doc)
        if self.images:
            errs += self._image_errors(doc)
        return errs

    def _builtin(self, doc):
        try:
            kubernetes_validate.validate(doc, self.k8s_version, strict=True)
            return []
        except SchemaNotFoundError as e:
            return [f"no schema: {e.message}"]
        except jsonschema.ValidationError as e:
            path = ".".join(str(p) for p in e.path) or "(root)"
            return [f"{path}: {e.message}"]

    def _image_errors(self, doc):
        registry, version = self.images
        allowed = {
            f"{registry}/operator:{version}",
            f"{registry}/dataplane:{version}",
            f"{registry}/dataplane:{version}-cuda",
        }
        errs = []

        def walk(node, path):
            if isinstance(node, dict):
                for k, v in node.items():
                    p = f"{path}.{k}" if path else k
                    if k == "image" and isinstance(v, str):
                        if v.startswith(registry + "/") and v not in allowed:
                            errs.append(f"{p}: image {v} is not one the Makefile builds "
                                        f"({', '.join(sorted(allowed))})")
                    else:
                        walk(v, p)
            elif isinstance(node, list):
                for i, v in enumerate(node):
                    walk(v, f"{path}[{i}]")

        walk(doc, "")
        return errs


def load(path):
    text = sys.stdin.read() if path == "-" else open(path).read()
    return [d for d in yaml.safe_load_all(text) if d]


def name_of(doc):
    if not isinstance(doc, dict):
        return "?"
    return f"{doc.get('kind', '?')}/{(doc.get('metadata') or {}).get('name', '?')}"


def self_test(k8s_version, crd_files):
    """Documents that must be refused, each with the text its error must contain."""
    v = Validator(k8s_version, images=("ghcr.io/tandem", "0.1.0"))
    for f in crd_files:
        for d in load(f):
            if d.get("kind") == "CustomResourceDefinition":
                v.add_crd(d)
    good = {
        "apiVersion": "tandem.dev/v1alpha1",
        "kind": "PDDeployment",
        "metadata": {"name": "t", "namespace": "default"},
        "spec": {
            "model": {"name": "m", "path": "/models/m.gguf"},
            "prefill": {"template": {
                "image": "ghcr.io/tandem/dataplane:0.1.0",
                "resources": {"requests": {"cpu": 1, "memory": "1Gi"}},
                "tolerations": [{"key": "k", "operator": "Exists", "tolerationSeconds": None}],
            }},
            "decode": {"template": {"image": "example.com/other:latest"}},
        },
    }

    def variant(path, value, delete=False):
        d = copy.deepcopy(good)
        node = d
        for p in path[:-1]:
            node = node[p]
        if delete:
            del node[path[-1]]
        else:
            node[path[-1]] = value
        return d

    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"},
        "spec": {"selector": {"matchLabels": {"a": "b"}},
                 "template": {"metadata": {"labels": {"a": "b"}},
                              "spec": {"containers": [{"name": "c", "image": "x"}]}}},
    }
    bad_deployment = copy.deepcopy(deployment)
    bad_deployment["spec"]["replica"] = 2
    cases = [
        ("valid PDDeployment", good, None),
        ("valid Deployment", deployment, None),
        ("unknown spec field", variant(["spec", "grups"], 2), "grups"),
        ("unknown nested field", variant(["spec", "health"], {"probePeriod": 2}), "probePeriod"),
        ("negative groups", variant(["spec", "groups"], -1), "minimum"),
        ("int32 overflow", variant(["spec", "groups"], 2**31), "maximum"),
        ("bad enum", variant(["spec", "restart"], {"policy": "Sometimes"}), "Sometimes"),
        ("string for an integer", variant(["spec", "transfer"], {"kvPort": "5600"}), "5600"),
        ("missing required", variant(["spec", "model"], None, delete=True), "model"),
        ("bad metadata", variant(["metadata", "labels"], {"a": 1}), "labels"),
        ("unknown field in a built-in", bad_deployment, "replica"),
        ("unknown kind", {"apiVersion": "x.io/v1", "kind": "Nope", "metadata": {"name": "n"}},
         "no schema"),
        ("image not built here", variant(["spec", "prefill", "template", "image"],
                                         "ghcr.io/tandem/dataplane:9.9"), "not one the Makefile"),
    ]
    failed = 0
    for what, doc, expect in cases:
        errs = v.errors(doc)
        ok = (not errs) if expect is None else any(expect in e for e in errs)
        if not ok:
            failed += 1
            print(f"SELF-TEST FAILED: {what}: expected "
                  f"{'no error' if expect is None else repr(expect)}, got {errs}")
    print(f"validate_manifests self-test: {len(cases) - failed}/{len(cases)} cases behave")
    return 1 if failed else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help="YAML files ('-' for stdin)")
    ap.add_argument("--kubernetes-version", default="1.33.0")
    ap.add_argument("--crd", action="append", default=[], help="file with CRDs to validate against")
    ap.add_argument("--skip-kind", action="append", default=[],
                    help="a kind with no schema available (reported, not validated)")
    ap.add_argument("--images", nargs=2, metavar=("REGISTRY", "VERSION"))
    ap.add_argument("--self-test", action="store_true")
    args = ap.parse_args()
    if args.self_test:
        return self_test(args.kubernetes_version, args.crd)

    v = Validator(args.kubernetes_version, args.skip_kind, args.images)
    docs = [(f, d) for f in args.files for d in load(f)]
    for f in args.crd:
        for d in load(f):
            if d.get("kind") == "CustomResourceDefinition":
                v.add_crd(d)
    for _, d in docs:
        if isinstance(d, dict) and d.get("kind") == "CustomResourceDefinition":
            v.add_crd(d)
    bad = skipped = 0
    for f, d in docs:
        errs = v.errors(d)
        if errs is None:
            skipped += 1
            print(f"SKIP {f}: {name_of(d)}: no schema for kind {d['kind']} (not validated)")
            continue
        for e in errs:
            print(f"ERROR {f}: {name_of(d)}: {e}")
        bad += bool(errs)
    print(f"validated {len(docs) - skipped} documents in {len(args.files)} files "
          f"against Kubernetes {args.kubernetes_version} and {len(v.crds)} CRD version(s): "
          f"{bad} invalid" + (f", {skipped} skipped" if skipped else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
