"""Ed25519 signatures on manifests, so a bucket writer cannot put weights into a fleet.

Object tags (xxh3) catch accidents; anyone who can write the bucket can recompute them. A signed
manifest also carries a SHA-256 of every object it names, and its signature covers those, so a
reader that checks the signature and then each object's SHA-256 holds the publisher's bytes.

Keys are PEM files: PKCS#8 private keys (`PREFIX.key`, mode 0600) and SubjectPublicKeyInfo public
keys (`PREFIX.pub`). A key id is the first 16 hex digits of the SHA-256 of the raw 32-byte public
key; readers trust a set of keys (rotation: trust old and new, switch the signer, drop the old).
docs/SECURITY.md has the threat model and the rotation procedure.
"""

from __future__ import annotations

import base64
import dataclasses
import binascii
import hashlib
import logging
import os
import stat
from collections.abc import Set
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence, Union

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from relay.files import create_exclusive
from relay.manifest import Manifest, ManifestError, ObjRef, Signature

log = logging.getLogger(__name__)

KeySource = Union[str, os.PathLike, Ed25519PrivateKey]
PublicSource = Union[str, os.PathLike, Ed25519PublicKey]


class SignatureError(ManifestError):
    """A manifest that is unsigned, tampered with, or signed by no trusted key: never acted on."""


class KeyFileError(ValueError):
    """A key file that cannot be used (missing, not PEM, not Ed25519, would be overwritten)."""


def key_id(public: Ed25519PublicKey) -> str:
    """16 hex digits naming a public key: short enough for logs, long enough never to collide in a key set."""
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


# -- key files -------------------------------------------------------------------------------------
def _write_new(path: Path, data: bytes, mode: int) -> None:
    """Create `path` with exactly `mode` (not narrowed by the umask): a key is never overwritten."""
    try:
        create_exclusive(path, data, mode)
    except FileExistsError:
        raise KeyFileError(f"{path}: already exists; refusing to overwrite a key") from None


def generate_keypair(prefix: str | os.PathLike) -> tuple[Path, Path, str]:
    """Write PREFIX.key (private, PEM, 0600) and PREFIX.pub (public, PEM, 0644); returns (key, pub, key id)."""
    key = Ed25519PrivateKey.generate()
    prefix = Path(prefix)
    key_path, pub_path = Path(f"{prefix}.key"), Path(f"{prefix}.pub")
    if pub_path.exists():
        raise KeyFileError(f"{pub_path}: already exists; refusing to overwrite a key")
    key_path.parent.mkdir(parents=True, exist_ok=True)
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.PEM,
                                           serialization.PublicFormat.SubjectPublicKeyInfo)
    _write_new(key_path, private, 0o600)
    try:
        _write_new(pub_path, public, 0o644)
    except BaseException:
        key_path.unlink(missing_ok=True)
        raise
    return key_path, pub_path, key_id(key.public_key())


def _read(path: Path, what: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot read the {what} ({exc.strerror or exc})") from None
    if len(data) > 64 << 10:
        raise KeyFileError(f"{path}: {len(data)} bytes is not a PEM {what}")
    return data


def load_private_key(path: str | os.PathLike) -> Ed25519PrivateKey:
    """An Ed25519 private key from a PEM file; warns when others can read it."""
    path = Path(path)
    data = _read(path, "private key")
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("%s: private key is readable by group or others (mode %o); chmod 600 it", path, mode & 0o777)
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise KeyFileError(f"{path}: not an unencrypted PEM private key ({exc})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFileError(f"{path}: a {type(key).__name__}, expected an Ed25519 key (deltarelay keygen)")
    return key


def load_public_key(path: str | os.PathLike) -> Ed25519PublicKey:
    """An Ed25519 public key from a PEM file (a private key file is refused: readers never need one)."""
    path = Path(path)
    data = _read(path, "public key")
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as exc:
        raise KeyFileError(f"{path}: not a PEM public key ({exc})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise KeyFileError(f"{path}: a {type(key).__name__}, expected an Ed25519 key (deltarelay keygen)")
    return key


# -- signing and verifying ------------------------------------------------------------------------
class Signer:
    """Signs manifests with one or more private keys (several during a rotation, so every reader accepts)."""

    def __init__(self, keys: KeySource | Sequence[KeySource]) -> None:
        if isinstance(keys, (str, os.PathLike, Ed25519PrivateKey)):
            keys = [keys]
        self.keys = [k if isinstance(k, Ed25519PrivateKey) else load_private_key(k) for k in keys]
        if not self.keys:
            raise KeyFileError("no signing key given")
        self.key_ids = [key_id(k.public_key()) for k in self.keys]

    def sign(self, payload: bytes) -> tuple[Signature, ...]:
        return tuple(Signature(kid, base64.b64encode(k.sign(payload)).decode("ascii"))
                     for kid, k in zip(self.key_ids, self.keys))

    def trusted(self) -> "TrustedKeys":
        """The matching public keys (a resumed publisher checks the run it continues)."""
        return TrustedKeys([k.public_key() for k in self.keys])


@dataclass(frozen=True)
class Verified:
    key_id: str


class TrustedKeys:
    """The public keys a reader accepts. A manifest passes when a trusted key's signature verifies and
    every trusted-key signature on it verifies (an invalid one means someone altered the manifest)."""

    def __init__(self, keys: PublicSource | Iterable[PublicSource]) -> None:
        if isinstance(keys, (str, os.PathLike, Ed25519PublicKey)):
            keys = [keys]
        loaded = [k if isinstance(k, Ed25519PublicKey) else load_public_key(k) for k in keys]
        if not loaded:
            raise KeyFileError("no trusted key given")
        self.keys = {key_id(k): k for k in loaded}

    @classmethod
    def from_option(cls, keys: PublicSource | Iterable[PublicSource] | "TrustedKeys" | None) -> "TrustedKeys | None":
        """None, a TrustedKeys, or paths/keys -> TrustedKeys (the form Watcher/Fanout accept)."""
        if keys is None or isinstance(keys, TrustedKeys):
            return keys
        return cls(keys)

    def verify(self, m: Manifest, where: str = "manifest") -> Verified:
        """Raise SignatureError unless `m` is signed by a trusted key over everything it says."""
        if not m.signatures:
            raise SignatureError(f"{where}: unsigned, and this reader trusts only keys {sorted(self.keys)}")
        payload = m.signed_payload()
        good = None
        for sig in m.signatures:
            public = self.keys.get(sig.key_id)
            if public is None:
                continue
            try:
                public.verify(base64.b64decode(sig.sig, validate=True), payload)
            except (InvalidSignature, binascii.Error, ValueError):
                raise SignatureError(f"{where}: signature by key {sig.key_id} does not match the content "
                                     f"(tampered with after signing)") from None
            good = sig.key_id
        if good is None:
            raise SignatureError(f"{where}: signed by {[s.key_id for s in m.signatures]}, none of them trusted "
                                 f"(trusted: {sorted(self.keys)})")
        weak = [r.key for r in m.refs() if r.sha256 is None]
        if weak:
            raise SignatureError(f"{where}: signed, but {len(weak)} object(s) carry no sha256 (e.g. {weak[0]}); "
                                 f"xxh3 alone does not authenticate them")
        return Verified(good)


def strengthen(store, m: Manifest, unverified: Set[str] = frozenset()) -> Manifest:
    """`m` with a SHA-256 in every object reference, reading (and tag-checking) the objects that lack one, and
    those whose key is in `unverified` (their sha256 came from an unsigned manifest: nobody vouched for it):
    the first signed commit of a run that was published unsigned vouches only for bytes it has seen. Objects
    are streamed through the hashes, never held whole (snapshot files are gigabytes)."""
    from relay.manifest import Snapshot, Step

    cache: dict[str, ObjRef] = {}

    def strong(ref: ObjRef) -> ObjRef:
        if ref.sha256 is not None and ref.key not in unverified:
            return ref
        if ref.key not in cache:
            problem, got = ref.check_chunks(store.iter_chunks(ref.key), strong=True)
            if problem or got is None:
                raise SignatureError(f"{store.url}/{ref.key}: {problem}; refusing to sign a manifest naming it")
            cache[ref.key] = got
        return cache[ref.key]

    if all(r.sha256 is not None and r.key not in unverified for r in m.refs()):
        return m
    log.info("%s: adding SHA-256s of the run's earlier objects (read and checked) before its first signed commit",
             store.url)
    steps = [Step(s.step, strong(s.record), s.parent,
                  None if s.parts is None else tuple(dataclasses.replace(p, ref=strong(p.ref)) for p in s.parts))
             for s in m.steps]
    snaps = [Snapshot(s.step, strong(s.index), tuple(strong(f) for f in s.files)) for s in m.snapshots]
    return dataclasses.replace(m, steps=steps, snapshots=snaps)


__all__ = ["Signer", "TrustedKeys", "SignatureError", "KeyFileError", "generate_keypair", "load_private_key",
           "load_public_key", "key_id", "strengthen"]
