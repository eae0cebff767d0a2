"""A throw-away one-node Ceph cluster with radosgw (Ceph's S3 gateway) on loopback, for the tests that must hold
on a real S3 implementation as well as on moto (docs/STORES.md).

Debian 12's Ceph (Pacific, 16.2) has no standalone radosgw backend, so the gateway runs in front of one
monitor and one memstore OSD, no mgr, no authentication, every daemon in a temporary directory and in the
foreground of a process this module started (stopped by its PID). `python tests/ceph.py` starts one and
prints its endpoint and start time, for a look by hand.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from conftest import free_port

BINARIES = ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "monmaptool", "ceph")
INSTALL = "apt-get install -y radosgw ceph-mon ceph-osd"
ACCESS_KEY, SECRET_KEY = "relaytest", "relaytestsecret"


def missing_binaries() -> list[str]:
    """The Ceph programs this helper needs that are not on PATH."""
    return [b for b in BINARIES if shutil.which(b) is None]


@dataclass
class Ceph:
    """A running cluster: `endpoint` is radosgw's S3 endpoint; `stop()` ends every daemon by PID."""

    root: Path
    endpoint: str = ""
    started_s: float = 0.0
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def conf(self) -> str:
        return str(self.root / "ceph.conf")

    def options(self) -> dict:
        """s3fs storage_options for the gateway."""
        return {"endpoint_url": self.endpoint, "key": ACCESS_KEY, "secret": SECRET_KEY,
                "client_kwargs": {"region_name": "us-east-1"}}

    def client(self):  # a boto3 client
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name="us-east-1")

    def _run(self, *args: str, timeout: float = 60) -> str:
        done = subprocess.run([*args, "-c", self.conf], capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}\n"
                               f"logs: {self.root / 'log'}")
        return done.stdout

    def _ceph(self, *args: str, deadline: float) -> str:
        """A `ceph` command, repeated while the new monitor refuses it: for a moment after it starts it takes
        commands before it knows the cluster's fsid and answers EPERM. The commands used are idempotent."""
        while True:
            try:
                return self._run("ceph", *args, timeout=30)
            except (RuntimeError, subprocess.TimeoutExpired):
                self._check_alive()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def _daemon(self, *args: str) -> None:
        log = open(self.root / "log" / f"{Path(args[0]).name}-{len(self.procs)}.out", "wb")
        self.procs.append(subprocess.Popen([*args, "-c", self.conf, "-f"], stdout=log, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL, start_new_session=True))
        log.close()

    def _check_alive(self) -> None:
        for p in self.procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args[0]} exited ({p.returncode}); logs: {self.root / 'log'}")

    def start(self, timeout: float = 120) -> None:
        t0 = time.monotonic()
        fsid, mon_port, rgw_port = str(uuid.uuid4()), free_port(), free_port()
        for d in ("run", "log", "mon", "osd"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        (self.root / "ceph.conf").write_text(f"""[global]
fsid = {fsid}
mon host = v1:127.0.0.1:{mon_port}
public addr = 127.0.0.1
ms bind ipv6 = false
auth cluster required = none
auth service required = none
auth client required = none
auth supported = none
mon allow pool size one = true
mon warn on pool no redundancy = false
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd crush chooseleaf type = 0
osd crush update on start = false
osd class update on start = false
run dir = {self.root}/run
admin socket = {self.root}/run/$name.asok
log file = {self.root}/log/$name.log
keyring = /dev/null
mon data = {self.root}/mon/$name
osd data = {self.root}/osd/$name
osd objectstore = memstore
memstore device bytes = 2147483648
[client.rgw]
rgw frontends = beast endpoint=127.0.0.1:{rgw_port}
rgw dns name = 127.0.0.1
""")
        try:
            self._run("monmaptool", "--create", "--addv", "a", f"[v1:127.0.0.1:{mon_port}]", "--fsid", fsid,
                      str(self.root / "monmap"))
            self._run("ceph-mon", "--mkfs", "-i", "a", "--monmap", str(self.root / "monmap"))
            self._daemon("ceph-mon", "-i", "a")
            osd_uuid = str(uuid.uuid4())  # the OSD's id in the map and on its store must be one
            osd = self._ceph("osd", "create", osd_uuid, deadline=t0 + timeout).strip()
            # placed here, not by the OSD at boot: its own commands can meet the monitor's moment of EPERM
            # ('wrong fsid'), which ends the OSD
            self._ceph("osd", "crush", "add", f"osd.{osd}", "1.0", "root=default", deadline=t0 + timeout)
            (self.root / "osd" / f"osd.{osd}").mkdir(exist_ok=True)
            self._run("ceph-osd", "-i", osd, "--mkfs", "--osd-uuid", osd_uuid)
            self._daemon("ceph-osd", "-i", osd)
            self._daemon("radosgw", "-n", "client.rgw")
            self._wait(f"http://127.0.0.1:{rgw_port}", t0 + timeout)
            self._run("radosgw-admin", "user", "create", "--uid", "relaytest", "--display-name", "relay tests",
                      "--access-key", ACCESS_KEY, "--secret", SECRET_KEY)
        except BaseException:
            self.stop()
            raise
        self.endpoint = f"http://127.0.0.1:{rgw_port}"
        self.started_s = time.monotonic() - t0

    def _wait(self, url: str, deadline: float) -> None:
        import urllib.error
        import urllib.request

        while True:
            self._check_alive()
            try:
                urllib.request.urlopen(url, timeout=2).close()
                return
            except urllib.error.HTTPError:
                return  # the gateway answers (an anonymous request is refused): it is up
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"radosgw did not answer on {url}; logs: {self.root / 'log'}") from None
                time.sleep(0.25)

    def stop(self) -> None:
        """End every daemon this cluster started (by PID: TERM, then KILL after 10 s); keep the logs."""
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        self.procs.clear()


def start(root: str | None = None) -> Ceph:
    """Start a cluster in `root` (a new temporary directory if None)."""
    c = Ceph(Path(root or tempfile.mkdtemp(prefix="relay-ceph-")))
    c.start()
    return c


if __name__ == "__main__":
    if missing_binaries():
        sys.exit(f"missing {missing_binaries()}: {INSTALL}")
    cluster = start()
    print(f"radosgw at {cluster.endpoint} (key {ACCESS_KEY}, secret {SECRET_KEY}), up in {cluster.started_s:.1f} s; "
          f"{cluster.root}")
    try:
        if len(sys.argv) > 1 and sys.argv[1] == "--wait":
            signal.pause()
    finally:
        cluster.stop()
        print(f"stopped; logs in {cluster.root / 'log'}", file=sys.stderr)
    os._exit(0)
