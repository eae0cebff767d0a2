"""What an S3 implementation honours of the conditional writes the relay builds on (docs/STORES.md).

AWS S3 (and moto) refuse a create-only PutObject or CompleteMultipartUpload on an existing key and
accept If-Match with the ETag as they returned it. Other implementations differ: Ceph RGW 16 refuses
If-Match with the quoted ETag (it takes it unquoted) and completes a multipart upload over an existing
object although the request says If-None-Match: *. So before its first conditional write, an S3Store
probes its store on scratch keys under its prefix (`.deltarelay-probe/<random>/`, outside the run's
layout, removed afterwards) and uses what the store honours; what the relay cannot do without is
refused with StoreCapabilityError, naming the store, the capability and the remedy. One probe per
endpoint and bucket per process (`capabilities`), repeated after a probe that failed; answers other than
AWS's are confirmed by a second round on fresh keys, so a one-off fault on the way decides nothing.
"""

from __future__ import annotations

import errno
import threading
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from relay.store import S3Store

PROBE_PREFIX = ".deltarelay-probe/"


class StoreCapabilityError(RuntimeError):
    """The store does not honour a conditional write the relay needs: no retry or other writer is the cause."""


@dataclass(frozen=True)
class Answer:
    """A probe request's outcome: the HTTP status and, for a refused or accepted write on an existing key,
    whether the object kept its bytes."""

    status: int
    unchanged: bool | None = None

    def __str__(self) -> str:
        if self.unchanged is None:
            return str(self.status)
        return f"{self.status}, {'object unchanged' if self.unchanged else 'object replaced'}"


@dataclass(frozen=True)
class Capabilities:
    """The probe's answers, and what the relay does with them."""

    store: str  # endpoint and bucket, for messages
    create_exists: Answer  # PutObject If-None-Match: * on an existing key (AWS: 412, unchanged)
    match_quoted: Answer  # PutObject If-Match: the current ETag as returned, quoted (AWS: 200)
    match_unquoted: Answer  # ... the same ETag without quotes (AWS: 200)
    match_stale: Answer  # PutObject If-Match: an ETag the object no longer has (AWS: 412, unchanged)
    match_missing: Answer  # PutObject If-Match on a missing key (AWS: 404; 412 is as good: refused)
    complete_exists: Answer  # CompleteMultipartUpload If-None-Match: * on an existing key (AWS: 412, unchanged)

    @property
    def create_only_put(self) -> bool:
        return self.create_exists.status in (409, 412) and self.create_exists.unchanged is True

    @property
    def if_match_form(self) -> str | None:
        """How If-Match must carry an ETag here: "quoted" (as returned), "unquoted", or None (neither works,
        or a stale ETag is not refused: no compare-and-swap)."""
        if not (self.match_stale.status in (409, 412) and self.match_stale.unchanged is True
                and self.match_missing.status in (404, 409, 412)):
            return None
        if self.match_quoted.status == 200:
            return "quoted"
        if self.match_unquoted.status == 200:
            return "unquoted"
        return None

    @property
    def create_only_completion(self) -> bool:
        return self.complete_exists.status in (409, 412) and self.complete_exists.unchanged is True

    def as_aws_documents(self) -> bool:
        """Whether every answer is AWS S3's."""
        return (self.create_only_put and self.if_match_form == "quoted" and self.match_unquoted.status == 200
                and self.match_missing.status == 404 and self.create_only_completion)

    def if_match(self, etag: str) -> str:
        """`etag` in the form this store's If-Match takes."""
        return etag.strip('"') if self.if_match_form == "unquoted" else etag

    def rows(self) -> list[tuple[str, str, str, str]]:
        """(request, AWS S3's answer, this store's, what the relay does) for each probed request."""
        form = self.if_match_form
        cas = f"manifest compare-and-swap: If-Match {form}" if form else "REFUSES to write: no compare-and-swap"
        return [
            ("PutObject If-None-Match: * , existing key", "412, object unchanged", str(self.create_exists),
             "create-only PutObject" if self.create_only_put else "REFUSES to write: no create-only PUT"),
            ("PutObject If-Match: current ETag, quoted", "200", str(self.match_quoted),
             "uses it" if form == "quoted" else "not used"),
            ("PutObject If-Match: current ETag, unquoted", "200", str(self.match_unquoted),
             "uses it" if form == "unquoted" else "not used"),
            ("PutObject If-Match: stale ETag", "412, object unchanged", str(self.match_stale), cas),
            ("PutObject If-Match: missing key", "404", str(self.match_missing), cas),
            ("CompleteMultipartUpload If-None-Match: * , existing key", "412, object unchanged",
             str(self.complete_exists),
             "multipart create of large objects" if self.create_only_completion else
             "large objects: spooled to disk, one create-only PutObject (at most 5 GiB each)"),
        ]

    def table(self) -> str:
        """The rows as a Markdown table."""
        head = ("request", "AWS S3", self.store, "deltarelay")
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in self.rows()]
        return "\n".join(lines)

    def require(self, url: str) -> None:
        """Raise StoreCapabilityError unless the store honours both conditional writes every writer needs:
        checked before a writer's first write, so a run never starts where it could not commit again."""
        if not self.create_only_put:
            raise StoreCapabilityError(
                f"{url}: the store at {self.store} does not honour PutObject If-None-Match: * (answered "
                f"{self.create_exists} on an existing key): it cannot create an object without replacing another "
                f"writer's, so deltarelay does not write there. Use an S3 implementation that does (AWS S3, "
                f"Ceph RGW 16+; docs/STORES.md), or a file:// store")
        if self.if_match_form is None:
            raise StoreCapabilityError(
                f"{url}: the store at {self.store} does not honour PutObject If-Match (current ETag: quoted "
                f"{self.match_quoted}, unquoted {self.match_unquoted}; stale ETag {self.match_stale}; missing key "
                f"{self.match_missing}): without compare-and-swap two writers could fork the run, so deltarelay "
                f"does not write there. Use an S3 implementation that does (AWS S3, Ceph RGW 16+; docs/STORES.md), "
                f"or a file:// store")


_CACHE: dict[tuple[str, str], Capabilities] = {}
_LOCK = threading.Lock()


def capabilities(store: S3Store) -> Capabilities:
    """The store's Capabilities, probed once per endpoint and bucket in this process."""
    ident = (str(getattr(store.fs, "endpoint_url", None) or
                 (getattr(store.fs, "client_kwargs", None) or {}).get("endpoint_url") or "AWS S3"), store.bucket)
    name = f"{ident[0]} bucket {ident[1]}"
    with _LOCK:
        if ident not in _CACHE:
            found = probe(store, name)
            if not found.as_aws_documents():  # confirmed on fresh keys: a one-off fault must not decide
                again = probe(store, name)
                if again != found:
                    raise OSError(errno.EIO, f"{store.url}: the store's answers to the conditional-write probe changed "
                                             f"between two rounds ({found.rows()} then {again.rows()}); retried")
            _CACHE[ident] = found
        return _CACHE[ident]


def _status(exc: BaseException) -> int:
    from relay.store import _client_error, transient

    if transient(exc):
        raise exc  # not an answer about the store: the probe is repeated by the next write
    code, status = _client_error(exc)
    if status in (401, 403) or isinstance(exc, PermissionError):
        raise exc  # denied: the caller's own write would be, too; its error says so best
    if status:
        return status
    if isinstance(exc, FileNotFoundError):
        return 404
    if isinstance(exc, FileExistsError) or code == "PreconditionFailed":
        return 412
    raise exc


def probe(store: S3Store, name: str) -> Capabilities:
    """Ask the store each conditional write once, on scratch keys; every scratch object and upload is removed."""
    base = store._key(f"{PROBE_PREFIX}{uuid.uuid4().hex}/")
    a, b = base + "a", base + "b"
    call = store.fs.call_s3
    bucket = store.bucket

    def put(key: str, body: bytes, **cond: Any) -> tuple[int, str | None]:
        try:
            return 200, call("put_object", Bucket=bucket, Key=key, Body=body, **cond)["ETag"]
        except OSError as exc:
            return _status(exc), None

    def body(key: str) -> bytes | None:
        try:
            resp = call("get_object", Bucket=bucket, Key=key)
        except FileNotFoundError:
            return None
        return store._read_body(resp)

    try:
        status, etag = put(a, b"1", IfNoneMatch="*")
        if status != 200 or etag is None:  # a fresh random key: a retry of a PUT that landed unanswered, at most
            raise OSError(errno.EIO, f"{store.url}: the store at {name} answered {status} to a create-only PutObject "
                                     f"of a new scratch key; probing again with the next write")
        status, _ = put(a, b"2", IfNoneMatch="*")
        create_exists = Answer(status, body(a) == b"1")
        if not create_exists.unchanged:
            put(a, b"1")
        etag = call("head_object", Bucket=bucket, Key=a)["ETag"]
        quoted = etag if etag.startswith('"') else f'"{etag}"'
        status, new = put(a, b"3", IfMatch=quoted)
        match_quoted = Answer(status)
        if new is not None:
            etag = new
        status, new = put(a, b"4", IfMatch=etag.strip('"'))
        match_unquoted = Answer(status)
        if match_quoted.status == 200 or match_unquoted.status == 200:
            stale, before = quoted, body(a)  # the ETag of b"1", long replaced
            stale_form = stale if match_quoted.status == 200 else stale.strip('"')
            status, _ = put(a, b"5", IfMatch=stale_form)
            match_stale = Answer(status, body(a) == before)
        else:
            match_stale = Answer(0)
        status, _ = put(b, b"6", IfMatch=quoted)
        match_missing = Answer(status if body(b) is None else 200)
        before = body(a)
        uid = call("create_multipart_upload", Bucket=bucket, Key=a)["UploadId"]
        try:
            part = call("upload_part", Bucket=bucket, Key=a, UploadId=uid, PartNumber=1, Body=b"7")["ETag"]
            try:
                call("complete_multipart_upload", Bucket=bucket, Key=a, UploadId=uid, IfNoneMatch="*",
                     MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": part}]})
                status = 200
            except OSError as exc:
                status = _status(exc)
        finally:
            if status != 200:
                try:
                    call("abort_multipart_upload", Bucket=bucket, Key=a, UploadId=uid)
                except OSError:
                    pass
        complete_exists = Answer(status, body(a) == before)
    finally:
        try:
            call("delete_objects", Bucket=bucket, Delete={"Objects": [{"Key": a}, {"Key": b}], "Quiet": True})
        except OSError:
            pass
    return Capabilities(name, create_exists, match_quoted, match_unquoted, match_stale, match_missing, complete_exists)


__all__ = ["Capabilities", "Answer", "StoreCapabilityError", "capabilities", "probe", "PROBE_PREFIX"]
