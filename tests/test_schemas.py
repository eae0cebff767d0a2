"""docs/schema/: the JSON Schemas of the manifest, the record, DEST's relay-state.json (#14) and a region's
snapshot announcement (#16), checked against what the code writes and what its parsers refuse, so the
schemas and relay/manifest.py / relay/announce.py cannot drift."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from referencing import Registry, Resource

from relay import fleet
from relay.announce import ANNOUNCE_KEY, Announcement
from relay.manifest import DestState, Manifest, ManifestError, Record
from relay.regional import Materialiser
from relay.signing import generate_keypair
from relay.store import open_store
from relay.watcher import Watcher
from fake_engine import FakeEngine

from conftest import publish_steps

SCHEMAS = Path(__file__).resolve().parent.parent / "docs" / "schema"


def _schema(name: str) -> dict:
    return json.loads((SCHEMAS / f"{name}.schema.json").read_text())


SCHEMA_NAMES = ("manifest", "record", "relay-state", "regional-snapshots", "fleet-host", "fleet-region")
_REGISTRY = Registry().with_resources(
    (s["$id"], Resource.from_contents(s)) for s in (_schema(n) for n in SCHEMA_NAMES))


def validator(name: str) -> jsonschema.Validator:
    schema = _schema(name)
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema, registry=_REGISTRY)


@pytest.fixture
def run_docs(file_run, trainer, tmp_path) -> dict:
    """Every kind of document a real signed run has: its manifest, its records, a watcher's state file."""
    key, pub, _ = generate_keypair(tmp_path / "k")
    publish_steps(file_run.url, trainer, 5, signing_key=key)
    store = open_store(file_run.url)
    m = Manifest.parse(store.read_manifest().data)
    with Watcher(file_run.url, tmp_path / "dest", trusted_keys=[pub]) as w:
        w.sync(timeout=10)
    with Materialiser(file_run.url, tmp_path / "mat", trusted_keys=[pub]) as mat:  # the run as its own region
        mat.sync_once(timeout=30)
    journal = f"file://{tmp_path}/journal-run"  # a journal-mode DEST: a snapshot, then two journaled steps
    publish_steps(journal, trainer, 3)  # one snapshot (step 0): steps 1 and 2 are journaled
    with Watcher(journal, tmp_path / "jdest", persist="journal") as w:
        w.sync(timeout=10)
    return {"manifest": json.loads(store.read_manifest().data),
            "records": [json.loads(store.get(s.record.key)) for s in m.steps],
            "state": json.loads((tmp_path / "dest" / "relay-state.json").read_bytes()),
            "announcement": json.loads(store.get(ANNOUNCE_KEY)),
            "journal_state": json.loads((tmp_path / "jdest" / "relay-state.json").read_bytes())}


def test_what_the_code_writes_follows_the_schemas(run_docs, file_run, trainer, tmp_path):
    validator("manifest").validate(run_docs["manifest"])
    assert run_docs["manifest"]["writer"] and run_docs["manifest"]["signatures"]
    for rec in run_docs["records"]:
        validator("record").validate(rec)
    assert all("blake3" in t for rec in run_docs["records"] for t in rec["tensors"].values())  # a signed run
    validator("relay-state").validate(run_docs["state"])
    DestState.parse(json.dumps(run_docs["state"]).encode())
    validator("regional-snapshots").validate(run_docs["announcement"])
    assert run_docs["announcement"]["snapshots"] and run_docs["announcement"]["origin_snapshots"] is True
    assert run_docs["journal_state"]["persist"] == "journal" and len(run_docs["journal_state"]["journal"]) == 2
    validator("relay-state").validate(run_docs["journal_state"])
    DestState.parse(json.dumps(run_docs["journal_state"]).encode())
    unsigned = f"file://{tmp_path}/unsigned"
    publish_steps(unsigned, trainer, 2)
    validator("manifest").validate(json.loads(open_store(unsigned).read_manifest().data))


MANIFEST_MUTATIONS = [
    lambda d: d.update(version=2), lambda d: d.update(format="x"), lambda d: d.update(extra=1),
    lambda d: d.update(run="run1"), lambda d: d.update(writer="me"), lambda d: d.update(head=-1),
    lambda d: d.update(head=1 << 63), lambda d: d.update(snapshots=[]), lambda d: d.update(steps=[]),
    lambda d: d["steps"][1].update(parent=None), lambda d: d["steps"][1].update(parts=[]),
    lambda d: d["steps"][1]["parts"][0].update(xxh3="xyz"), lambda d: d["steps"][1]["parts"][0].update(size="1"),
    lambda d: d["steps"][1]["parts"][0].update(key="../etc/passwd"), lambda d: d["steps"][1]["parts"][0].pop("tensors"),
    lambda d: d["steps"][1]["parts"][0].update(tensors=["caf\u00e9"]),
    lambda d: d["steps"][1]["record"].update(sha256="0"),
    lambda d: d["steps"][1]["record"].update(key="deltas/1-0.drd"), lambda d: d["snapshots"][0]["files"][0].pop("xxh3"),
    lambda d: d["signatures"][0].update(key_id="xyz"), lambda d: d.update(signatures=[]),
    lambda d: d["signatures"][0].update(sig="!" * 88),
]


RECORD_MUTATIONS = [
    lambda r: r.update(run="r"), lambda r: r.update(step=-1), lambda r: r.update(extra=1),
    lambda r: next(iter(r["tensors"].values())).update(dtype="bfloat16"),
    lambda r: next(iter(r["tensors"].values())).update(digest="xyz"),
    lambda r: next(iter(r["tensors"].values())).update(shape=[-1]),
    lambda r: r["weight_map"].update({next(iter(r["weight_map"])): "../x.safetensors"}),
    lambda r: r["weight_map"].update({next(iter(r["weight_map"])): ".hidden.safetensors"}),
    lambda r: r["weight_map"].update({next(iter(r["weight_map"])): "model.bin"}),
    lambda r: next(iter(r["tensors"].values())).update(blake3="ab" * 16),
    lambda r: next(iter(r["tensors"].values())).update(blake3="AB" * 32),
]

ANNOUNCE_MUTATIONS = [
    lambda a: a.update(version=2), lambda a: a.update(format="x"), lambda a: a.update(extra=1),
    lambda a: a.update(run="r"), lambda a: a.update(origin_snapshots="no"),
    lambda a: a["snapshots"][0].update(step=-1), lambda a: a["snapshots"][0].update(files=[]),
    lambda a: a["snapshots"][0]["index"].update(key="snapshots/3/model.safetensors.index.json"),
    lambda a: a["snapshots"][0]["files"][0].update(key="regional/snapshots/1/../../manifest.json"),
    lambda a: a["snapshots"][0]["files"][0].update(xxh3="0"), lambda a: a["snapshots"][0]["files"][0].pop("size"),
    lambda a: a["snapshots"][0].update(extra=1),
]

STATE_MUTATIONS = [
    lambda s: s.pop("url"), lambda s: s.update(step="3"), lambda s: s.update(run=1),
    lambda s: next(iter(s["tensors"].values())).update(digest="0"),
]

JOURNAL_STATE_MUTATIONS = [
    lambda s: s.update(persist="mirror"), lambda s: s.pop("base"), lambda s: s["base"].update(step=-1),
    lambda s: s["base"].update(extra=1), lambda s: s["journal"][0].update(file="../../x.drd"),
    lambda s: s["journal"][0].update(file="journal/1-0.bin"), lambda s: s["journal"][0].update(xxh3="0"),
    lambda s: s["journal"][0].pop("tensors"), lambda s: s["journal"][0].update(tensors=["a", "a"]),
    lambda s: s["journal"][0].update(size=-1), lambda s: s.update(journal={}),
]

# (schema, document of the run, parser, mutations)
CASES = [("manifest", lambda d: d["manifest"], Manifest.parse, MANIFEST_MUTATIONS),
         ("record", lambda d: d["records"][-1], Record.parse, RECORD_MUTATIONS),
         ("relay-state", lambda d: d["state"], DestState.parse, STATE_MUTATIONS),
         ("relay-state", lambda d: d["journal_state"], DestState.parse, JOURNAL_STATE_MUTATIONS),
         ("regional-snapshots", lambda d: d["announcement"], Announcement.parse, ANNOUNCE_MUTATIONS)]


@pytest.mark.parametrize("schema, pick, parse, mutate",
                         [(name, pick, parse, m) for name, pick, parse, ms in CASES for m in ms],
                         ids=[f"{name}-{j}-{i}" for j, (name, _, _, ms) in enumerate(CASES) for i in range(len(ms))])
def test_schemas_refuse_what_the_parsers_refuse(run_docs, schema, pick, parse, mutate):
    doc = json.loads(json.dumps(pick(run_docs)))
    doc.pop("check", None)  # a state file's checksum would refuse any edit: the rule itself is under test
    mutate(doc)
    with pytest.raises(ManifestError):
        parse(json.dumps(doc).encode())
    assert not validator(schema).is_valid(doc)


def test_cross_field_rules_are_the_parsers(run_docs):
    """What JSON Schema cannot say (the schema's description lists it) is still refused by the parser."""
    doc = json.loads(json.dumps(run_docs["manifest"]))
    doc["head"] = doc["head"] + 1
    assert validator("manifest").is_valid(doc)
    with pytest.raises(ManifestError, match="is not the last step"):
        Manifest.parse(json.dumps(doc).encode())


@pytest.fixture
def fleet_docs(file_run, trainer, tmp_path) -> dict:
    """A watcher's ledger entry (with an engine's state) and the region document a relay gathers from it."""
    publish_steps(file_run.url, trainer, 2)
    with Watcher(file_run.url, tmp_path / "dest", host="h-1", region="eu",
                 engine=FakeEngine(kind="vllm", pause=0.02)) as w:
        w.sync(timeout=10)
    region = open_store(file_run.url)
    origin = open_store(f"file://{tmp_path}/origin")
    fleet.RegionGatherer(origin, {"eu": region}).gather("eu")
    return {"host": json.loads(region.get("fleet/hosts/h-1.json")),
            "region": json.loads(origin.get(fleet.region_key("eu")))}


def test_fleet_documents_follow_their_schemas(fleet_docs):
    validator("fleet-host").validate(fleet_docs["host"])
    assert fleet_docs["host"]["engine"]["kind"] == "vllm" and fleet_docs["host"]["step"] == 1
    validator("fleet-region").validate(fleet_docs["region"])
    assert [h["host"] for h in fleet_docs["region"]["hosts"]] == ["h-1"]
    f = fleet.Fleet()
    fleet._read_region(json.dumps(fleet_docs["region"]).encode(), fleet.region_key("eu"), "eu", f)
    assert [e.report.host for e in f.entries] == ["h-1"]


HOST_MUTATIONS = [
    lambda d: d.update(version=2), lambda d: d.update(format="x"), lambda d: d.update(extra=1),
    lambda d: d.update(host="../x"), lambda d: d.update(host=""), lambda d: d.update(step=-1),
    lambda d: d.update(step="3"), lambda d: d.update(step=True), lambda d: d.update(updated=0),
    lambda d: d.update(interval=7200), lambda d: d.update(interval=0), lambda d: d.pop("instance"),
    lambda d: d.update(partial=None), lambda d: d.update(bytes_downloaded=-1),
    lambda d: d.update(failures={"Bad Reason": 1}), lambda d: d.update(failures={"sync": -1}),
    lambda d: d.update(engine={"a": {"b": 1}}), lambda d: d.update(engine={"k": "x" * 300}),
    lambda d: d.update(engine=[1]), lambda d: d.update(hostname="h" * 300), lambda d: d.update(region=""),
]

REGION_MUTATIONS = [
    lambda d: d.update(version=2), lambda d: d.update(format="x"), lambda d: d.update(extra=1),
    lambda d: d.update(interval=1e9), lambda d: d.update(hosts={}), lambda d: d.pop("truncated"),
    lambda d: d.update(updated=-5), lambda d: d.pop("url"),
]


@pytest.mark.parametrize("i", range(len(HOST_MUTATIONS)))
def test_fleet_host_schema_refuses_what_the_parser_refuses(fleet_docs, i):
    doc = json.loads(json.dumps(fleet_docs["host"]))
    HOST_MUTATIONS[i](doc)
    with pytest.raises(fleet.FleetError):
        fleet.HostReport.parse(json.dumps(doc).encode(), "entry")
    assert not validator("fleet-host").is_valid(doc)


@pytest.mark.parametrize("i", range(len(REGION_MUTATIONS)))
def test_fleet_region_schema_refuses_what_the_parser_refuses(fleet_docs, i):
    doc = json.loads(json.dumps(fleet_docs["region"]))
    REGION_MUTATIONS[i](doc)
    with pytest.raises(fleet.FleetError):
        fleet._read_region(json.dumps(doc).encode(), fleet.region_key("eu"), "eu", fleet.Fleet())
    assert not validator("fleet-region").is_valid(doc)
