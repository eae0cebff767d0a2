"""The manifest and record schema: round trips, and strict refusals that name the field."""

from __future__ import annotations

import json

import pytest
import torch

from relay.manifest import (Manifest, ManifestError, ObjRef, Part, Record, Snapshot, Step, TensorInfo, mismatches,
                            step_of_key, tensor_infos)

H = "0" * 32


def ref(key: str, size: int = 10) -> ObjRef:
    return ObjRef(key, size, H)


def sample() -> Manifest:
    snap0 = Snapshot(0, ref("snapshots/0/model.safetensors.index.json"),
                     (ref("snapshots/0/model-00001-of-00001.safetensors", 1000),))
    snap2 = Snapshot(2, ref("snapshots/2/model.safetensors.index.json"),
                     (ref("snapshots/2/model-00001-of-00001.safetensors", 1000),))
    steps = [Step(0, ref("records/0.json")),
             Step(1, ref("records/1.json"), 0, (Part(ref("deltas/1-0.drd", 50)),)),
             Step(2, ref("records/2.json"), 1,
                  (Part(ref("deltas/2-0.drd", 60)), Part(ref("deltas/2-1.drd", 5), ("b",)))),
             Step(3, ref("records/3.json"), 2, (Part(ref("deltas/3-0.drd", 70)),))]
    return Manifest("1" * 32, 3, steps, [snap0, snap2])


def doc() -> dict:
    return json.loads(sample().to_bytes())


def test_round_trip_and_chain():
    m = Manifest.parse(sample().to_bytes())
    assert m == sample()
    assert m.base == 2
    assert [s.step for s in m.chain(0)] == [1, 2, 3]
    assert [s.step for s in m.chain(2)] == [3]
    assert m.chain(3) == [] and m.chain(7) is None
    assert m.step(2).delta_bytes == 65
    assert "deltas/2-1.drd" in m.referenced() and len(m.referenced()) == 4 + 4 + 4


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(version=2), "version 2 is not supported"),
    (lambda d: d.update(format="other"), "format"),
    (lambda d: d.update(extra=1), "unknown field"),
    (lambda d: d.update(head=9), "head 9 is not the last step"),
    (lambda d: d.update(base=0), "base: 0 but the newest snapshot is 2"),
    (lambda d: d["steps"].reverse(), "strictly increase"),
    (lambda d: d["steps"][1].update(parent=None), "both null or both set"),
    (lambda d: d["steps"][2].update(parent=5), "not an earlier step"),
    (lambda d: d["steps"][1]["parts"][0].update(xxh3="xyz"), "32 hex digits"),
    (lambda d: d["steps"][1]["parts"][0].update(key="../etc/passwd"), "not a deltas/"),
    (lambda d: d["steps"][1]["parts"][0].update(size="10"), "expected int"),
    (lambda d: d["steps"][1].update(parts=[]), "empty"),
    (lambda d: d["snapshots"][0]["files"][0].update(key="snapshots/1/x.safetensors"), "not under snapshots/0/"),
    (lambda d: d.update(snapshots=[]), "snapshots: empty"),
    (lambda d: d["steps"].pop(0), "snapshot 0 has no step entry"),
    (lambda d: d.update(head=True), "head: expected int, got bool"),
    (lambda d: d.update(head=-1), "integer from 0 to 2\\*\\*63-1"),
])
def test_strict_parsing_names_the_problem(mutate, message):
    d = doc()
    mutate(d)
    with pytest.raises(ManifestError, match=message):
        Manifest.parse(json.dumps(d).encode())


def test_not_json():
    with pytest.raises(ManifestError, match="not UTF-8"):
        Manifest.parse(b"\xff{")
    with pytest.raises(ManifestError, match="not JSON"):
        Manifest.parse(b"{")


def test_keys_and_steps():
    assert step_of_key("deltas/12-0.drd") == 12
    assert step_of_key("records/7.json") == 7
    assert step_of_key("snapshots/25/model-00001-of-00002.safetensors") == 25
    assert step_of_key("manifest.json") is None and step_of_key("deltas/x.drd") is None


def test_record_round_trip_and_hashes():
    tensors = {"a": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "b": torch.ones(2)}
    infos = tensor_infos(tensors)
    assert infos["a"].dtype == "BF16" and infos["a"].shape == (2, 3) and len(infos["a"].digest) == 32
    rec = Record("2" * 32, 4, infos, {"a": "m.safetensors", "b": "m.safetensors"})
    assert Record.parse(rec.to_bytes()) == rec
    assert mismatches(tensors, infos) == []
    changed = dict(tensors, a=tensors["a"].clone())
    changed["a"][0, 0] = -0.0  # +0.0 -> -0.0: equal as floats, different bits
    assert mismatches(changed, infos) == ["a"]
    assert mismatches(dict(tensors, a=tensors["a"].reshape(3, 2)), infos) == ["a"]  # same bytes, other shape
    assert mismatches({"a": tensors["a"]}, infos) == ["b"]


def test_record_refuses_incomplete_layout():
    rec = json.loads(Record("2" * 32, 1, {"a": TensorInfo("BF16", (2,), H)}, {"a": "m.safetensors"}).to_bytes())
    rec["weight_map"] = {}
    with pytest.raises(ManifestError, match="weight_map"):
        Record.parse(json.dumps(rec).encode())


# -- protocol precision (#13): what PROTOCOL types is what the parser accepts -----------------------
@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(run="run1"), "run: a run id is 32 lower-case hex digits"),
    (lambda d: d.update(run="A" * 32), "run: a run id is 32 lower-case hex digits"),
    (lambda d: d.update(writer="me"), "writer: a writer id is 32 lower-case hex digits"),
    (lambda d: d.update(head=1 << 63), "integer from 0 to 2\\*\\*63-1"),
    (lambda d: d["steps"][1]["record"].update(size=1 << 63), "size: .* is not from 0 to 2\\*\\*63-1"),
    (lambda d: d["steps"][1]["record"].update(key="records/3.json"), "expected 'records/1.json'"),
    (lambda d: d["steps"][2]["parts"][0].update(key="deltas/1-0.drd"), "is not a delta of step 2"),
    (lambda d: d["steps"][2]["parts"][0].update(key="records/2.json"), "is not a delta of step 2"),
    (lambda d: d["steps"][2]["parts"][1].update(tensors=["caf\u00e9"]), "outside printable ASCII"),
    (lambda d: d["steps"][2]["parts"][1].update(tensors=["a\nb"]), "outside printable ASCII"),
])
def test_manifest_fields_are_validated_as_documented(mutate, message):
    d = doc()
    mutate(d)
    with pytest.raises(ManifestError, match=message):
        Manifest.parse(json.dumps(d).encode())


def test_writer_round_trips_and_is_optional():
    m = sample()
    m.writer = "f" * 32
    assert Manifest.parse(m.to_bytes()).writer == "f" * 32
    assert Manifest.parse(sample().to_bytes()).writer is None  # manifests written before the field existed


@pytest.mark.parametrize("mutate, message", [
    (lambda r: r.update(run="r"), "run: a run id"),
    (lambda r: r["tensors"]["a"].update(digest="xyz"), "digest: a digest is 32 lower-case hex digits"),
    (lambda r: r["tensors"]["a"].update(dtype="bfloat16"), "not a dtype of docs/FORMAT.md"),
    (lambda r: r.update(step=-1), "integer from 0"),
])
def test_record_fields_are_validated_as_documented(mutate, message):
    rec = json.loads(Record("2" * 32, 1, {"a": TensorInfo("BF16", (2,), H)}, {"a": "m.safetensors"}).to_bytes())
    mutate(rec)
    with pytest.raises(ManifestError, match=message):
        Record.parse(json.dumps(rec).encode())


def test_signed_payload_test_vector():
    """docs/vectors/signed-manifest.json: the canonical JSON a second implementation must rebuild."""
    from pathlib import Path

    from cryptography.hazmat.primitives.serialization import load_pem_public_key

    from relay.signing import TrustedKeys, key_id

    vec = json.loads((Path(__file__).parent.parent / "docs" / "vectors" / "signed-manifest.json").read_text())
    m = Manifest.parse(json.dumps(vec["manifest"]).encode())
    assert m.signed_payload() == vec["signed_payload"].encode("ascii")
    public = load_pem_public_key(vec["public_key"].encode())
    assert key_id(public) == vec["key_id"] == m.signatures[0].key_id
    assert TrustedKeys(public).verify(m).key_id == vec["key_id"]
    # the payload is exactly: the prefix, then sorted-key compact JSON with only \" and \\ escaped
    body = vec["signed_payload"].split("\n", 1)[1]
    assert body == json.dumps({k: v for k, v in vec["manifest"].items() if k != "signatures"}, sort_keys=True,
                              separators=(",", ":"))
    assert '\\"name\\" \\\\ here' in body
