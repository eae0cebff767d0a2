"""Structure of infra/ (Terraform), checked without a terraform binary.

Every .tf file is parsed with python-hcl2. A small expander walks the module tree the way Terraform
would for a given var.rollout_regions / var.enable_crr (only the count forms infra/ uses are
understood; any other form fails the test so it gets taught here), so the tests can ask: does every
region get every piece, under the right name, and does each IAM policy grant only what its role
needs? Names and key prefixes are compared with the relay code itself (relay.manifest, relay.store).
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import math
import re
from functools import lru_cache
from pathlib import Path

import hcl2
import pytest

from relay import manifest as relay_manifest
from relay.publisher import Publisher
from relay.store import MANIFEST_KEY

INFRA = Path(__file__).resolve().parents[1] / "infra"
ROOT_DIR = INFRA
BUCKET_DIR = INFRA / "modules" / "bucket"
REGION_DIR = INFRA / "modules" / "region"

# What every store bucket (origin and regions) must have, all inside modules/bucket.
BUCKET_PIECES = (
    "aws_s3_bucket.store",
    "aws_s3_bucket_versioning.store",
    "aws_s3_bucket_server_side_encryption_configuration.store",
    "aws_s3_bucket_public_access_block.store",
    "aws_s3_bucket_policy.store",
    "aws_s3_bucket_lifecycle_configuration.store",
    "aws_s3_bucket_ownership_controls.store",
    "aws_kms_key.store",
    "aws_kms_alias.store",
)
ROLLOUT_PIECES = ("aws_iam_role.rollout", "aws_iam_role_policy.rollout")

# The relay store layout, taken from the relay code: <run>/manifest.json and three immutable kinds.
LAYOUT_KINDS = {
    relay_manifest.delta_key(7, 0).split("/")[0],
    relay_manifest.record_key(7).split("/")[0],
    relay_manifest.snapshot_prefix(7).split("/")[0],
}


# ----------------------------------------------------------------------------------------------
# Parsing and a minimal module expander


def _unquote(s: str) -> str:
    return s[1:-1] if len(s) >= 2 and s[0] == '"' and s[-1] == '"' else s


def _clean(x):
    """python-hcl2 8.x keeps quotes on labels and literals and adds markers; drop both."""
    if isinstance(x, dict):
        return {_unquote(k): _clean(v) for k, v in x.items() if k not in ("__is_block__", "__comments__")}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    if isinstance(x, str):
        return _unquote(x)
    return x


@lru_cache(maxsize=None)
def parse_file(path: Path) -> dict:
    with open(path) as fh:
        return _clean(hcl2.load(fh))


@lru_cache(maxsize=None)
def load_module(directory: Path) -> dict:
    """Blocks of one module directory, merged over its .tf files and keyed by address."""
    mod = {"resource": {}, "data": {}, "module": {}, "variable": {}, "output": {}, "locals": {},
           "provider": [], "files": {}}
    for path in sorted(directory.glob("*.tf")):
        doc = parse_file(path)
        mod["files"][path.name] = doc
        for block in doc.get("resource", []):
            for rtype, named in block.items():
                for name, body in named.items():
                    mod["resource"][f"{rtype}.{name}"] = body
        for block in doc.get("data", []):
            for dtype, named in block.items():
                for name, body in named.items():
                    mod["data"][f"data.{dtype}.{name}"] = body
        for kind in ("module", "variable", "output"):
            for block in doc.get(kind, []):
                for name, body in block.items():
                    assert name not in mod[kind], f"{path}: {kind} {name} declared twice"
                    mod[kind][name] = body
        for block in doc.get("locals", []):
            for name, value in block.items():
                assert name not in mod["locals"], f"{path}: local.{name} declared twice"
                mod["locals"][name] = value
        for block in doc.get("provider", []):
            for name, body in block.items():
                mod["provider"].append((name, body))
    return mod


def defaults() -> dict:
    """Root variable defaults, plus the principals a caller must supply."""
    env = {name: body.get("default") for name, body in load_module(ROOT_DIR)["variable"].items()}
    env["trainer_principal_arns"] = ["arn:aws:iam::123456789012:role/trainer-hosts"]
    env["relay_principal_arns"] = ["arn:aws:iam::123456789012:role/relay-hosts"]
    return env


_VAR = re.compile(r"\$\{var\.([A-Za-z0-9_]+)\}")


def render(value, env: dict):
    """Value of an attribute built only from literals and ${var.X}; None if it needs anything else."""
    if not isinstance(value, str):
        return value
    whole = re.fullmatch(r"\$\{var\.([A-Za-z0-9_]+)\}", value)
    if whole:
        return env.get(whole.group(1))
    out = _VAR.sub(lambda m: str(env[m.group(1)]) if m.group(1) in env else m.group(0), value)
    return None if "${" in out else out


def count_of(body: dict, env: dict) -> int:
    """Instances of a resource or module for the count forms infra/ uses."""
    expr = body.get("count")
    if expr is None:
        return 1
    m = re.fullmatch(r'\$\{contains\(var\.rollout_regions, "([a-z0-9-]+)"\) \? 1 : 0\}', expr)
    if m:
        return 1 if m.group(1) in env["rollout_regions"] else 0
    if expr == "${var.enable_crr ? 1 : 0}":
        return 1 if env["enable_crr"] else 0
    if expr == "${var.enable_crr ? 0 : 1}":
        return 0 if env["enable_crr"] else 1
    raise AssertionError(f"count form not understood by tests/test_infra.py: {expr}")


def expand(directory: Path = ROOT_DIR, env: dict | None = None, prefix: str = "") -> dict:
    """address -> (kind, body, env of its module instance), over the whole module tree."""
    env = defaults() if env is None else env
    mod = load_module(directory)
    out = {}
    for kind in ("resource", "data"):
        for addr, body in mod[kind].items():
            n = count_of(body, env)
            for _i in range(n):
                out[prefix + addr + ("[0]" if "count" in body else "")] = (kind, body, env)
    for name, body in mod["module"].items():
        child_dir = (directory / body["source"]).resolve()
        child_vars = load_module(child_dir)["variable"]
        for _i in range(count_of(body, env)):
            child_env = {k: v.get("default") for k, v in child_vars.items()}
            for arg in child_vars:
                if arg in body:
                    child_env[arg] = render(body[arg], env)
            child_prefix = f"{prefix}module.{name}" + ("[0]" if "count" in body else "") + "."
            out.update(expand(child_dir, child_env, child_prefix))
    return out


def alias(region: str) -> str:
    return region.replace("-", "_")


def supported_regions() -> list[str]:
    return sorted(load_module(ROOT_DIR)["locals"]["region_modules"])


_TOKEN = re.compile(r"\b(module\.[A-Za-z0-9_]+|local\.[A-Za-z0-9_]+|var\.[A-Za-z0-9_]+"
                    r"|data\.[A-Za-z0-9_]+\.[A-Za-z0-9_]+|aws_[A-Za-z0-9_]+\.[A-Za-z0-9_]+)")


def refs(value, local_values: dict, seen: frozenset = frozenset()) -> set[str]:
    """Root references (module.X, var.X, resources) an expression depends on, through locals."""
    text = value if isinstance(value, str) else json.dumps(value)
    found = set()
    for tok in _TOKEN.findall(text):
        if tok.startswith("local."):
            name = tok[len("local."):]
            assert name in local_values, f"unknown {tok}"
            if name not in seen:
                found |= refs(local_values[name], local_values, seen | {name})
        else:
            found.add(tok)
    return found


def statements(doc: dict) -> list[dict]:
    """Statements of an aws_iam_policy_document body, normalised."""
    out = []
    for st in doc.get("statement", []):
        out.append({
            "sid": st.get("sid"),
            "effect": st.get("effect", "Allow"),
            "actions": set(st.get("actions", [])),
            "resources": st.get("resources", []),
            "conditions": [(c["test"], c["variable"], tuple(c["values"])) for c in st.get("condition", [])],
            "principals": st.get("principals", []),
        })
    return out


def root_locals() -> dict:
    return load_module(ROOT_DIR)["locals"]


def stmt_refs(st: dict) -> set[str]:
    return refs(st["resources"], root_locals())


def attrs(block_list):
    """First (only) nested block of a parsed attribute list."""
    assert isinstance(block_list, list) and len(block_list) == 1, block_list
    return block_list[0]


# ----------------------------------------------------------------------------------------------
# Parsing, generation, region wiring


def test_every_tf_file_parses_and_modules_exist():
    files = sorted(INFRA.rglob("*.tf"))
    assert {p.parent for p in files} == {ROOT_DIR, BUCKET_DIR, REGION_DIR}
    for path in files:
        assert parse_file(path), f"{path} parsed to nothing"
    for directory in (ROOT_DIR, BUCKET_DIR, REGION_DIR):
        for name, body in load_module(directory)["module"].items():
            assert (directory / body["source"]).resolve().is_dir(), f"{directory}: module {name} source missing"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_regions", INFRA / "gen_regions.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_regions_tf_is_what_the_generator_writes():
    gen = _generator()
    assert (INFRA / "regions.tf").read_text() == gen.render(gen.current_regions()), \
        "regions.tf is stale: python infra/gen_regions.py --write"
    assert gen.current_regions() == supported_regions()


def test_generator_adds_a_region_with_provider_and_module(tmp_path):
    gen = _generator()
    regions = gen.current_regions() + ["sa-east-1"]
    path = tmp_path / "regions.tf"
    path.write_text(gen.render(regions))
    doc = _clean(hcl2.load(open(path)))
    providers = {body["alias"]: body["region"] for block in doc["provider"] for body in block.values()}
    assert providers["sa_east_1"] == "sa-east-1"
    modules = {name: body for block in doc["module"] for name, body in block.items()}
    assert modules["region_sa_east_1"]["providers"] == {"aws": "${aws.sa_east_1}"}
    with pytest.raises(ValueError, match="not AWS region names"):
        gen.render(["us-west-2", "US_WEST"])


def test_each_region_module_is_wired_to_its_own_provider_and_all_inputs():
    mod = load_module(ROOT_DIR)
    providers = {body["alias"]: body["region"] for name, body in mod["provider"] if "alias" in body}
    region_inputs = set(load_module(REGION_DIR)["variable"])
    region_modules = mod["locals"]["region_modules"]
    assert set(region_modules) == set(providers.values())
    for region in supported_regions():
        name = f"region_{alias(region)}"
        body = mod["module"][name]
        assert region_modules[region] == f"${{module.{name}}}"
        assert body["source"] == "./modules/region"
        assert body["count"] == f'${{contains(var.rollout_regions, "{region}") ? 1 : 0}}'
        assert providers[alias(region)] == region
        assert body["providers"] == {"aws": f"${{aws.{alias(region)}}}"}
        assert body["region"] == region
        assert region_inputs <= set(body), f"{name} leaves inputs unset: {region_inputs - set(body)}"
        assert body["rollout_principal_arns"] == f'${{lookup(var.rollout_principal_arns, "{region}", [])}}'
    # the instantiated regions are exactly the module list filtered by count
    assert mod["locals"]["regional"] == "${{for r, m in local.region_modules : r => m[0] if length(m) > 0}}"
    # the origin's provider is the unaliased one, in var.origin_region
    default = [body for name, body in mod["provider"] if "alias" not in body]
    assert len(default) == 1 and default[0]["region"] == "${var.origin_region}"


def test_rollout_regions_default_is_supported_and_guarded():
    env = defaults()
    assert env["rollout_regions"] and set(env["rollout_regions"]) <= set(supported_regions())
    guard = load_module(ROOT_DIR)["resource"]["terraform_data.config_guard"]
    conditions = [p["condition"] for p in attrs(guard["lifecycle"])["precondition"]]
    assert any("var.rollout_regions" in c and "local.supported_regions" in c for c in conditions)
    assert any("var.rollout_regions" in c and "var.rollout_principal_arns" in c for c in conditions)
    assert root_locals()["supported_regions"] == "${keys(local.region_modules)}"


@pytest.mark.parametrize("regions", [None, ["eu-central-1"], "all"])
@pytest.mark.parametrize("crr", [False, True])
def test_every_region_gets_every_piece_under_its_own_name(regions, crr):
    env = defaults()
    if regions == "all":
        regions = supported_regions()
    env["rollout_regions"] = regions or env["rollout_regions"]
    env["enable_crr"] = crr
    env["rollout_principal_arns"] = {r: [f"arn:aws:iam::123456789012:role/rollout-{r}"] for r in env["rollout_regions"]}
    inst = expand(env=env)

    origin = {f"module.origin.{p}" for p in BUCKET_PIECES}
    assert origin <= set(inst)
    names = {"bucket": set(), "role": set(), "alias": set()}
    for region in supported_regions():
        base = f"module.region_{alias(region)}[0]."
        wanted = {base + "module.store." + p for p in BUCKET_PIECES} | {base + p for p in ROLLOUT_PIECES}
        if region not in env["rollout_regions"]:
            assert not any(a.startswith(base) for a in inst), f"{region} is not a rollout region"
            continue
        assert wanted <= set(inst), f"{region} misses {sorted(wanted - set(inst))}"
        _, bucket, benv = inst[base + "module.store.aws_s3_bucket.store"]
        _, role, renv = inst[base + "aws_iam_role.rollout"]
        _, key_alias, _ = inst[base + "module.store.aws_kms_alias.store"]
        bucket_name = render(bucket["bucket"], benv)
        assert bucket_name == f"{env['name_prefix']}-{region}"
        assert render(role["name"], renv) == f"{env['name_prefix']}-rollout-{region}"
        assert render(key_alias["name"], benv) == f"alias/{bucket_name}"
        names["bucket"].add(bucket_name)
        names["role"].add(render(role["name"], renv))
        names["alias"].add(render(key_alias["name"], benv))
        assert benv["run_prefix"] == env["run_prefix"] and benv["runs"] == env["runs"]
    for kind, values in names.items():
        assert len(values) == len(env["rollout_regions"]), f"{kind} names collide: {values}"
    _, origin_bucket, oenv = inst["module.origin.aws_s3_bucket.store"]
    assert render(origin_bucket["bucket"], oenv) == f"{env['name_prefix']}-origin-{env['origin_region']}"

    assert ("aws_s3_bucket_replication_configuration.origin[0]" in inst) == crr
    assert ("aws_iam_role.replication[0]" in inst) == crr
    assert ("aws_iam_role.relay[0]" in inst) == (not crr)
    assert "aws_iam_role.trainer" in inst


# ----------------------------------------------------------------------------------------------
# One bucket's hardening (modules/bucket serves the origin and every region)


def test_bucket_is_versioned_kms_encrypted_private_owner_enforced_and_tls_only():
    res = load_module(BUCKET_DIR)["resource"]
    data = load_module(BUCKET_DIR)["data"]
    bucket_id = "${aws_s3_bucket.store.id}"
    for piece in BUCKET_PIECES:
        if piece.startswith("aws_s3_bucket_"):
            assert res[piece]["bucket"] == bucket_id, f"{piece} is not attached to this module's bucket"

    assert attrs(res["aws_s3_bucket_versioning.store"]["versioning_configuration"])["status"] == "Enabled"

    key = res["aws_kms_key.store"]
    assert key["enable_key_rotation"] is True
    sse = attrs(res["aws_s3_bucket_server_side_encryption_configuration.store"]["rule"])
    default = attrs(sse["apply_server_side_encryption_by_default"])
    assert default["sse_algorithm"] == "aws:kms"
    assert default["kms_master_key_id"] == "${aws_kms_key.store.arn}"  # this module's own key
    assert res["aws_kms_alias.store"]["target_key_id"] == "${aws_kms_key.store.key_id}"

    pab = res["aws_s3_bucket_public_access_block.store"]
    for flag in ("block_public_acls", "block_public_policy", "ignore_public_acls", "restrict_public_buckets"):
        assert pab[flag] is True, flag
    assert attrs(res["aws_s3_bucket_ownership_controls.store"]["rule"])["object_ownership"] == "BucketOwnerEnforced"

    policy = res["aws_s3_bucket_policy.store"]
    assert policy["policy"] == "${data.aws_iam_policy_document.tls_only.json}"
    sts = statements(data["data.aws_iam_policy_document.tls_only"])
    assert all(st["effect"] == "Deny" for st in sts), "the bucket policy only denies; grants live in IAM roles"
    tls = [st for st in sts if ("Bool", "aws:SecureTransport", ("false",)) in st["conditions"]]
    assert len(tls) == 1
    assert tls[0]["actions"] == {"s3:*"}
    assert set(tls[0]["resources"]) == {"${aws_s3_bucket.store.arn}", "${aws_s3_bucket.store.arn}/*"}
    assert attrs(tls[0]["principals"])["identifiers"] == ["*"]


def _lifecycle_rules() -> dict:
    lc = load_module(BUCKET_DIR)["resource"]["aws_s3_bucket_lifecycle_configuration.store"]
    return {rule["id"]: rule for rule in lc["rule"]}, attrs(lc["dynamic"])["rule"]


def test_lifecycle_rules_follow_the_relay_layout():
    rules, per_run = _lifecycle_rules()
    assert all(r["status"] == "Enabled" for r in rules.values())
    stale = rules["expire-stale-run-objects"]
    assert attrs(stale["filter"])["prefix"] == "${var.run_prefix}"
    assert attrs(stale["expiration"])["days"] == "${var.run_expiration_days}"
    noncurrent = rules["clean-noncurrent-versions"]
    assert (attrs(noncurrent["noncurrent_version_expiration"])["noncurrent_days"]
            == "${var.noncurrent_version_expiration_days}")
    assert attrs(noncurrent["expiration"])["expired_object_delete_marker"] is True
    uploads = rules["abort-incomplete-uploads"]
    assert (attrs(uploads["abort_incomplete_multipart_upload"])["days_after_initiation"]
            == "${var.abort_incomplete_multipart_days}")

    # Per listed run, one rule per immutable kind, with the relay's own directory names.
    loc = load_module(BUCKET_DIR)["locals"]
    kinds = loc["run_object_kinds"]
    assert set(kinds) == LAYOUT_KINDS
    assert kinds == {"deltas": "${var.delta_expiration_days}", "records": "${var.record_expiration_days}",
                     "snapshots": "${var.snapshot_expiration_days}"}
    template = '${var.run_prefix}${run}/${kind}/'
    assert template in loc["per_run_rules"] and "for kind, days in local.run_object_kinds" in loc["per_run_rules"]
    assert per_run["for_each"] == "${local.per_run_rules}"
    content = attrs(per_run["content"])
    assert attrs(content["filter"])["prefix"] == "${rule.value.prefix}"
    assert attrs(content["expiration"])["days"] == "${rule.value.days}"

    # The prefixes those rules produce select exactly the relay's immutable keys, never the manifest.
    run_prefix, run = defaults()["run_prefix"], "exp-1"
    prefixes = {kind: template.replace("${var.run_prefix}", run_prefix).replace("${run}", run).replace("${kind}", kind)
                for kind in kinds}
    key = lambda k: f"{run_prefix}{run}/{k}"  # noqa: E731
    assert key(relay_manifest.delta_key(12, 3)).startswith(prefixes["deltas"])
    assert key(relay_manifest.record_key(12)).startswith(prefixes["records"])
    shard = relay_manifest.snapshot_prefix(12) + "model-00001-of-00002.safetensors"
    assert key(shard).startswith(prefixes["snapshots"])
    assert not any(key(MANIFEST_KEY).startswith(p) for p in prefixes.values())


def test_lifecycle_days_stay_outside_the_gc_retention_window():
    env = defaults()
    floor_expr = root_locals()["retention_floor_days"]
    for name in ("gc_keep_snapshots", "snapshot_every", "max_step_interval_seconds"):
        assert f"var.{name}" in floor_expr
    # The trainer's own default decides how old the oldest kept snapshot is.
    assert env["snapshot_every"] == inspect.signature(Publisher).parameters["snapshot_every"].default
    floor = math.ceil(env["gc_keep_snapshots"] * env["snapshot_every"] * env["max_step_interval_seconds"] / 86400) + 1
    per_kind = [env["delta_expiration_days"], env["record_expiration_days"], env["snapshot_expiration_days"]]
    assert all(d >= floor for d in per_kind + [env["run_expiration_days"]])
    assert all(d <= env["run_expiration_days"] for d in per_kind)
    assert 1 <= env["noncurrent_version_expiration_days"] <= 7
    guard = load_module(ROOT_DIR)["resource"]["terraform_data.config_guard"]
    conditions = [p["condition"] for p in attrs(guard["lifecycle"])["precondition"]]
    assert any("local.retention_floor_days" in c for c in conditions)


# ----------------------------------------------------------------------------------------------
# Replication (CRR mode)


def test_replication_covers_every_region_with_rtc_and_no_delete_markers():
    mod = load_module(ROOT_DIR)
    rep = mod["resource"]["aws_s3_bucket_replication_configuration.origin"]
    assert rep["count"] == "${var.enable_crr ? 1 : 0}"
    assert rep["bucket"] == "${module.origin.bucket}"
    assert rep["role"] == "${aws_iam_role.replication[0].arn}"
    assert "${module.origin}" in rep["depends_on"]  # versioning on the source first
    dyn = attrs(rep["dynamic"])["rule"]
    assert dyn["for_each"] == "${local.crr_rules}"  # per instantiated rollout region (and run and kind)
    rules = root_locals()["crr_rules"]
    assert "for r, m in local.regional" in rules and "setproduct(var.runs, local.crr_replicated_kinds)" in rules
    assert "${var.run_prefix}${pair[0]}/${pair[1]}" in rules and "prefix = var.run_prefix" in rules
    rule = attrs(dyn["content"])
    assert rule["status"] == "Enabled"
    assert rule["id"] == "to-${rule.key}"
    assert attrs(rule["filter"])["prefix"] == "${rule.value.prefix}"
    assert attrs(rule["delete_marker_replication"])["status"] == "Disabled"
    assert attrs(attrs(rule["source_selection_criteria"])["sse_kms_encrypted_objects"])["status"] == "Enabled"
    dest = attrs(rule["destination"])
    assert dest["bucket"] == "${rule.value.region.versioned_bucket_arn}"
    assert attrs(dest["encryption_configuration"])["replica_kms_key_id"] == "${rule.value.region.kms_key_arn}"
    rtc = attrs(dest["replication_time"])
    assert rtc["status"] == "Enabled" and attrs(rtc["time"])["minutes"] == 15
    metrics = attrs(dest["metrics"])
    assert metrics["status"] == "Enabled" and attrs(metrics["event_threshold"])["minutes"] == 15
    # the region module exports what each rule needs, the destination ARN only after versioning
    outputs = load_module(REGION_DIR)["output"]
    assert {"versioned_bucket_arn", "kms_key_arn", "bucket_arn", "bucket", "rollout_role_arn"} <= set(outputs)
    bucket_out = load_module(BUCKET_DIR)["output"]["versioned_bucket_arn"]
    assert bucket_out["depends_on"] == ["${aws_s3_bucket_versioning.store}"]


def test_crr_without_snapshots_replicates_exactly_the_layout_but_snapshots():
    """The per-run rules name manifest.json, records/ and deltas/: every key a run has at the origin but
    snapshots/ (regional/ exists only in regions); the CRR test's replicator uses the same list."""
    from test_crossregion import CRR_REPLICATED

    kinds = root_locals()["crr_replicated_kinds"]
    assert tuple(kinds) == CRR_REPLICATED
    assert set(kinds) == {MANIFEST_KEY, *(k + "/" for k in LAYOUT_KINDS - {"snapshots"})}
    snapshot = relay_manifest.snapshot_prefix(10) + "model-00001-of-00001.safetensors"
    replicated = [relay_manifest.delta_key(11, 0), relay_manifest.record_key(11), MANIFEST_KEY]
    assert all(any(k.startswith(p) for p in kinds) for k in replicated)
    assert not any(k.startswith(p) for p in kinds for k in (snapshot, "regional/snapshots.json",
                                                             "regional/snapshots/10/x.safetensors"))
    guard = load_module(ROOT_DIR)["resource"]["terraform_data.config_guard"]
    conditions = [p["condition"] for p in attrs(guard["lifecycle"])["precondition"]]
    assert any("var.crr_regional_snapshots" in c and "length(var.runs) > 0" in c for c in conditions)


def test_materialiser_role_writes_only_regional_and_reads_origin_snapshots():
    mod = load_module(REGION_DIR)
    role = mod["resource"]["aws_iam_role.materialiser"]
    assert role["count"] == "${var.enable_crr ? 1 : 0}"
    sts = statements(mod["data"]["data.aws_iam_policy_document.materialiser"])
    conditional = set()
    for st in sts:
        raw = json.dumps(st["resources"])
        if {"s3:PutObject", "s3:DeleteObject"} & st["actions"]:
            assert raw.count("/regional/snapshots") == len(st["resources"]), st  # only regional/ is written
            assert "var.origin_bucket_arn" not in raw
            if raw.endswith('snapshots.json"]'):
                assert st["actions"] == {"s3:PutObject"}
                conditional.add(next(c[1] for c in st["conditions"] if c[0] == "Null"))
        if "var.origin_bucket_arn" in raw:
            assert st["actions"] == {"s3:GetObject"} and raw.endswith('/snapshots/*"]'), st  # the bootstrap only
    assert conditional == {"s3:if-match", "s3:if-none-match"}
    actions = set().union(*(st["actions"] for st in sts))
    assert actions == {"s3:ListBucket", "s3:GetObject", "s3:PutObject", "s3:AbortMultipartUpload",
                       "s3:ListMultipartUploadParts", "s3:DeleteObject", "kms:GenerateDataKey", "kms:Decrypt"}


def test_replication_role_reads_origin_and_only_replicates_into_regions():
    mod = load_module(ROOT_DIR)
    sts = statements(mod["data"]["data.aws_iam_policy_document.replication"])
    for st in sts:
        targets = stmt_refs(st)
        if any(t.startswith("module.origin") for t in targets):
            assert not any(t.startswith("module.region_") for t in targets)
            assert st["actions"] <= {"s3:GetReplicationConfiguration", "s3:ListBucket",
                                     "s3:GetObjectVersionForReplication",
                                     "s3:GetObjectVersionAcl", "s3:GetObjectVersionTagging", "kms:Decrypt"}
        else:
            assert ({t for t in targets if t.startswith("module.")}
                    == {f"module.region_{alias(r)}" for r in supported_regions()})
            assert st["actions"] <= {"s3:ReplicateObject", "s3:ReplicateTags", "kms:Encrypt", "kms:GenerateDataKey"}
    assert not any("s3:ReplicateDelete" in st["actions"] for st in sts)
    assume = statements(mod["data"]["data.aws_iam_policy_document.replication_assume"])[0]
    assert attrs(assume["principals"]) == {"type": "Service", "identifiers": ["s3.amazonaws.com"]}
    assert assume["actions"] == {"sts:AssumeRole"}


# ----------------------------------------------------------------------------------------------
# IAM: least privilege


def _all_policy_documents():
    for directory in (ROOT_DIR, BUCKET_DIR, REGION_DIR):
        for addr, body in load_module(directory)["data"].items():
            if addr.startswith("data.aws_iam_policy_document."):
                yield directory, addr, body


def test_no_wildcard_grants_and_no_managed_policies():
    for directory, addr, body in _all_policy_documents():
        for st in statements(body):
            if st["effect"] != "Allow":
                continue
            assert not any("*" in a for a in st["actions"]), f"{directory.name}/{addr}: wildcard action {st['actions']}"
            assert "*" not in st["resources"], f"{directory.name}/{addr}: resource *"
            for p in st["principals"]:
                assert "*" not in p["identifiers"], f"{directory.name}/{addr}: principal *"
    for directory in (ROOT_DIR, BUCKET_DIR, REGION_DIR):
        for addr in load_module(directory)["resource"]:
            assert not addr.startswith(("aws_iam_role_policy_attachment.", "aws_iam_policy_attachment.",
                                        "aws_iam_policy.", "aws_iam_user", "aws_iam_group")), addr


def test_roles_assume_only_from_the_principal_variables():
    mod = load_module(ROOT_DIR)
    for role, var in (("trainer", "trainer_principal_arns"), ("relay", "relay_principal_arns")):
        st = statements(mod["data"][f"data.aws_iam_policy_document.{role}_assume"])
        assert len(st) == 1 and st[0]["actions"] == {"sts:AssumeRole"}
        assert attrs(st[0]["principals"]) == {"type": "AWS", "identifiers": f"${{var.{var}}}"}
    rollout = statements(load_module(REGION_DIR)["data"]["data.aws_iam_policy_document.rollout_assume"])
    assert attrs(rollout[0]["principals"]) == {"type": "AWS", "identifiers": "${var.rollout_principal_arns}"}
    # each role carries exactly its own inline policy
    for role in ("trainer", "relay", "replication"):
        pol = mod["resource"][f"aws_iam_role_policy.{role}"]
        idx = "" if role == "trainer" else "[0]"
        assert pol["policy"] == f"${{data.aws_iam_policy_document.{role}{idx}.json}}"
        assert pol["role"] == f"${{aws_iam_role.{role}{idx}.id}}"
    reg = load_module(REGION_DIR)["resource"]["aws_iam_role_policy.rollout"]
    assert reg["policy"] == "${data.aws_iam_policy_document.rollout.json}"


def _manifest_and_immutable_locals(side: str) -> tuple[str, str]:
    loc = root_locals()
    manifest = loc[f"{side}_manifest_keys"]
    immutable = loc[f"{side}_immutable_keys"]
    assert manifest.endswith(f"/${{var.run_prefix}}*/{MANIFEST_KEY}") or \
        f'/${{var.run_prefix}}*/{MANIFEST_KEY}"]' in manifest, manifest
    assert "${var.run_prefix}*/${k}/*" in immutable and "local.immutable_kinds" in immutable
    assert set(loc["immutable_kinds"]) == LAYOUT_KINDS
    return f"local.{side}_manifest_keys", f"local.{side}_immutable_keys"


def _check_writer(sts: list[dict], side: str) -> None:
    """PutObject only on immutable keys, or on manifest.json with If-Match / If-None-Match; Delete never on it."""
    manifest, immutable = _manifest_and_immutable_locals(side)
    conditional: set[str] = set()
    announce: set[str] = set()
    for st in sts:
        raw = json.dumps(st["resources"])
        if "s3:PutObject" in st["actions"]:
            if side == "regional" and "local.regional_snapshot_keys" in raw:  # §8.1, create-only
                assert st["resources"] == "${local.regional_snapshot_keys}", st
            elif side == "regional" and "local.regional_announce_keys" in raw:  # §8.1, compare-and-swap
                assert st["resources"] == "${local.regional_announce_keys}", st
                cond = [c for c in st["conditions"] if c[0] == "Null"]
                assert len(cond) == 1 and cond[0][2] == ("false",), st
                announce.add(cond[0][1])
            elif manifest in raw:
                assert st["resources"] in ([f"${{{manifest}}}"], f"${{{manifest}}}")
                cond = [c for c in st["conditions"] if c[0] == "Null"]
                assert len(cond) == 1 and cond[0][2] == ("false",), st
                conditional.add(cond[0][1])
            else:
                assert st["resources"] == f"${{{immutable}}}", st
        if "s3:DeleteObject" in st["actions"]:
            assert st["resources"] in (f"${{{immutable}}}", "${local.regional_snapshot_keys}"), st
            assert side == "regional" or st["resources"] == f"${{{immutable}}}", st
    assert conditional == {"s3:if-match", "s3:if-none-match"}
    assert announce == (set() if side == "origin" else {"s3:if-match", "s3:if-none-match"})


def test_trainer_writes_only_the_origin_with_conditional_manifest_commits():
    sts = statements(load_module(ROOT_DIR)["data"]["data.aws_iam_policy_document.trainer"])
    allowed = {"s3:ListBucket", "s3:GetObject", "s3:PutObject", "s3:AbortMultipartUpload",
               "s3:ListMultipartUploadParts", "s3:DeleteObject", "kms:GenerateDataKey", "kms:Decrypt"}
    for st in sts:
        assert st["effect"] == "Allow" and st["actions"] <= allowed, st
        targets = {t for t in stmt_refs(st) if not t.startswith("var.")}
        assert targets == {"module.origin"}, f"trainer statement {st['sid']} reaches {targets}"
    kms = [st for st in sts if any(a.startswith("kms:") for a in st["actions"])]
    assert kms and all(st["resources"] == ["${module.origin.kms_key_arn}"] for st in kms)
    via_s3 = ("StringEquals", "kms:ViaService", ("s3.${var.origin_region}.amazonaws.com",))
    assert all(via_s3 in st["conditions"] for st in kms)
    _check_writer(sts, "origin")


def test_relay_reads_origin_and_writes_every_region():
    sts = statements(load_module(ROOT_DIR)["data"]["data.aws_iam_policy_document.relay"])
    every_region = {f"module.region_{alias(r)}" for r in supported_regions()}
    regional = []
    for st in sts:
        targets = {t for t in stmt_refs(st) if not t.startswith("var.")}
        if targets == {"module.origin"} and st["sid"].endswith("OriginFleetRegions"):
            # the one origin write: the fleet ledger's gathered regions (advisory, PROTOCOL §9)
            if "s3:PutObject" in st["actions"]:
                assert st["actions"] == {"s3:PutObject"} and st["resources"] == [
                    "${module.origin.bucket_arn}/${var.run_prefix}*/fleet/regions/*"], st
            else:
                assert st["actions"] == {"kms:GenerateDataKey"}, st
                via = ("StringEquals", "kms:ViaService", ("s3.${var.origin_region}.amazonaws.com",))
                assert via in st["conditions"], st
        elif targets == {"module.origin"}:
            assert st["actions"] <= {"s3:ListBucket", "s3:GetObject", "kms:Decrypt"}, f"relay writes the origin: {st}"
        else:
            assert targets == every_region, f"relay statement {st['sid']} reaches {targets}"
            regional.append(st)
    actions = set().union(*(st["actions"] for st in regional))
    assert actions == {"s3:ListBucket", "s3:GetObject", "s3:PutObject", "s3:AbortMultipartUpload",
                       "s3:ListMultipartUploadParts", "s3:DeleteObject", "kms:GenerateDataKey", "kms:Decrypt"}
    _check_writer(regional, "regional")


def test_rollout_role_reads_only_its_own_region():
    mod = load_module(REGION_DIR)
    all_sts = statements(mod["data"]["data.aws_iam_policy_document.rollout"])
    # its one write: the host's fleet ledger entry (advisory, PROTOCOL §9), encrypted with the region's key
    ledger = [st for st in all_sts if st["sid"] in ("WriteFleetLedger", "EncryptFleetLedger")]
    assert {st["sid"]: st["actions"] for st in ledger} == {"WriteFleetLedger": {"s3:PutObject"},
                                                           "EncryptFleetLedger": {"kms:GenerateDataKey"}}
    put = next(st for st in ledger if st["sid"] == "WriteFleetLedger")
    assert put["resources"] == ["${module.store.bucket_arn}/${var.run_prefix}*/fleet/hosts/*"]
    enc = next(st for st in ledger if st["sid"] == "EncryptFleetLedger")
    assert enc["resources"] == ["${module.store.kms_key_arn}"]
    assert ("StringEquals", "kms:ViaService", ("s3.${var.region}.amazonaws.com",)) in enc["conditions"]
    sts = [st for st in all_sts if st not in ledger]
    actions = set().union(*(st["actions"] for st in sts))
    assert actions == {"s3:ListBucket", "s3:GetObject", "kms:Decrypt"}
    writes = ("s3:Put", "s3:Delete", "s3:Abort", "kms:Encrypt", "kms:GenerateDataKey")
    assert not any(a.startswith(writes) for a in actions)
    for st in all_sts:
        targets = refs(st["resources"], mod["locals"])
        assert {t for t in targets if not t.startswith("var.")} == {"module.store"}, st
    get = next(st for st in sts if "s3:GetObject" in st["actions"])
    assert get["resources"] == ["${module.store.bucket_arn}/${var.run_prefix}*"]
    kms = next(st for st in sts if "kms:Decrypt" in st["actions"])
    assert kms["resources"] == ["${module.store.kms_key_arn}"]
    assert ("StringEquals", "kms:ViaService", ("s3.${var.region}.amazonaws.com",)) in kms["conditions"]
    # the module refuses to run with a provider from another region
    role = mod["resource"]["aws_iam_role.rollout"]
    pre = attrs(attrs(role["lifecycle"])["precondition"])
    assert pre["condition"] == "${data.aws_region.current.name == var.region}"


def test_store_url_outputs_match_the_relay_url_form():
    out = load_module(ROOT_DIR)["output"]
    env = defaults()
    origin = out["origin"]["value"]
    assert render(origin["runs_url"].replace("${local.url_scheme}", "s3://").replace("${module.origin.bucket}",
                  f"{env['name_prefix']}-origin-{env['origin_region']}"), env) == \
        f"s3://{env['name_prefix']}-origin-{env['origin_region']}/{env['run_prefix']}"
    assert root_locals()["url_scheme"] == "s3://"
    regions = out["regions"]["value"]
    assert "local.regional" in regions and "${m.bucket}/${var.run_prefix}" in regions and "rollout_role_arn" in regions
    assert {"trainer_role_arn", "relay_role_arn", "replication_role_arn", "mode"} <= set(out)


# ----------------------------------------------------------------------------------------------
# checkov skips and documentation


def test_every_checkov_skip_is_justified():
    skips = []
    for path in INFRA.rglob("*.tf"):
        for line in path.read_text().splitlines():
            if "checkov:skip" in line:
                m = re.search(r"#checkov:skip=(CKV2?_AWS_\d+):(.+)$", line)
                assert m and len(m.group(2).strip()) >= 30, f"{path.name}: skip without a reason: {line.strip()}"
                skips.append(m.group(1))
    assert len(skips) == len(set(skips)), "one skip per check"


def test_readme_documents_every_variable_output_and_mode():
    readme = (INFRA / "README.md").read_text()
    mod = load_module(ROOT_DIR)
    for name in list(mod["variable"]) + list(mod["output"]):
        assert f"`{name}`" in readme, f"infra/README.md does not mention `{name}`"
    for text in ("deltarelay relay", "deltarelay watch", "deltarelay publish", "deltarelay gc", "--keep-snapshots",
                 "gen_regions.py", "enable_crr"):
        assert text in readme, text
