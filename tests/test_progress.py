"""CLI progress (relay.progress): bars only on a terminal and never with --json, fed by counters the
library keeps (Reader.progress while a sync downloads, Publisher.bytes_uploaded), which must be right."""

from __future__ import annotations

import io
import time

from relay import cli, progress
from relay.publisher import Publisher
from relay.store import open_store
from relay.watcher import Watcher


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bars_only_on_a_terminal_and_never_with_json():
    assert not progress.wanted(stream=io.StringIO())
    assert progress.wanted(stream=Tty())
    assert not progress.wanted(json_output=True, stream=Tty())


def test_poller_draws_one_bar_per_transfer(capsys):
    states = iter([None, (0, 100), (40, 100), (100, 100), None, (5, None), None])
    last: list = []

    def read():
        last.append(next(states, None))
        return last[-1]

    with progress.Poller(read, "moving", enabled=True, interval=0.01, min_bytes=0):
        deadline = time.monotonic() + 30
        while len(last) < 8 and time.monotonic() < deadline:
            time.sleep(0.01)
    err = capsys.readouterr().err
    assert "moving" in err and "100/100" in err.replace("B", "").replace(" ", "")
    with progress.Poller(lambda: (1 << 40, 1 << 41), "off", enabled=False):
        pass
    assert capsys.readouterr().err == ""
    small = iter([(10, 20), None])
    with progress.Poller(lambda: next(small, None), "small", enabled=True, interval=0.01, min_bytes=1000):
        time.sleep(0.1)
    assert "small" not in capsys.readouterr().err  # over before a bar would help


def test_reader_progress_counts_a_sync_as_it_downloads(file_run, trainer, tmp_path):
    t = trainer(seed=3)
    with Publisher(file_run.url, snapshot_every=3, background=False) as pub:
        pub.publish(t.state(), 0)
        pub.publish(t.step(), 1)
        store = open_store(file_run.url)
        assert pub.bytes_uploaded == sum(store.list_run().values())  # every object once, nothing else
    with Watcher(file_run.url, tmp_path / "d") as w:
        seen = []
        real = w.store.download

        def download(key, fd, size=None):
            got = real(key, fd, size)
            seen.append(w.reader.progress())  # the file has landed, not yet counted as read
            return got

        w.store.download = download
        assert w.reader.progress() is None
        w.sync(timeout=30)
        assert seen, "the snapshot's files are downloaded"
        for done, total in seen:
            assert 0 < done <= total
        assert seen[-1][1] >= w.bytes_downloaded - 4096  # the plan's cost: what the sync reads
        assert w.reader.progress() is None  # between syncs


def test_cli_commands_run_without_a_terminal(file_run, trainer, tmp_path, capsys):
    from relay.checkpoint import save

    t = trainer(seed=1)
    save(t.state(), tmp_path / "ck.safetensors")
    assert cli.main(["publish", file_run.url, str(tmp_path / "ck.safetensors"), "--step", "0"]) == 0
    assert cli.main(["watch", file_run.url, "--dest", str(tmp_path / "d"), "--once", "--no-report"]) == 0
    assert cli.main(["dest", "materialize", str(tmp_path / "d"), str(tmp_path / "out"), "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "step 0" in captured.out and "\r" not in captured.err  # no bar drawn on a pipe
    assert not open_store(file_run.url).list("fleet/")  # --no-report: no ledger entry
