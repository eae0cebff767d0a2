"""relay.integrations.trl: a real TRL GRPOTrainer (CPU, generation by model.generate, a reward function) on a
tiny random-init Llama, the DeltaRelayCallback publishing to a moto S3 origin, the regional relay copying into
another region's store, and a watcher there holding the trainer's weights bit for bit after every step: in
one process, and in two (torch.distributed gloo) with FSDP2 sharding the model (DTensor parameters)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import relay
from relay.fanout import Destination, Fanout

from conftest import free_port, same_bits

import trl_tiny
from relay.store import open_store

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return trl_tiny.save_model(tmp_path_factory.mktemp("tiny") / "model")


def test_grpo_publishes_every_step_and_the_relayed_watcher_is_bit_exact(moto_regions, tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    from relay.integrations.trl import DeltaRelayCallback

    east, west = moto_regions("us-east-1"), moto_regions("eu-west-1")
    origin = f"s3://{east.new_bucket('trl')}/run"
    dest = f"s3://{west.new_bucket('trl-west')}/run"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16)
    cb = DeltaRelayCallback(origin, storage_options=east.options, snapshot_every=3)
    fan = Fanout(origin, [Destination("eu-west-1", dest, west.options)], source_options=east.options,
                 poll_interval=0.05)
    watcher = relay.Watcher(dest, tmp_path / "dest", storage_options=west.options)
    seen: list[tuple[int, int, bool]] = []
    history: list[dict[str, torch.Tensor]] = []

    def check(step: int, weights: dict[str, torch.Tensor]) -> None:
        assert fan.sync_once(timeout=60)
        seen.append((step, watcher.sync(timeout=60), same_bits(watcher.tensors, weights)))
        history.append(weights)

    trainer = trl_tiny.grpo(model, tmp_path / "out", 4, [cb])
    trainer.add_callback(trl_tiny.checker(cb, check, lambda m: {k: v.detach().clone()
                                                                for k, v in m.state_dict().items()}))
    trainer.train()

    assert seen == [(s, s, True) for s in range(5)]  # the initial weights (step 0), then each global step
    assert all(not same_bits(a, b) for a, b in zip(history, history[1:]))  # training moved the weights
    assert cb.publisher is None and cb.published == 4  # on_train_end closed it after the last commit
    head = open_store(origin, east.options).read_manifest()
    assert head is not None and relay.Manifest.parse(head.data).head == 4


def test_sharded_fsdp2_ranks_publish_their_rows_and_the_relayed_watcher_is_bit_exact(moto_regions, tiny_model,
                                                                                      tmp_path):
    east, west = moto_regions("us-east-1"), moto_regions("eu-west-1")
    results, origins = {}, {}
    for layout in ("sharded", "gather"):
        origin = f"s3://{east.new_bucket('trl2')}/run"
        dest = f"s3://{west.new_bucket('trl2-west')}/run"
        out = tmp_path / f"{layout}.json"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
             str(free_port()), str(ROOT / "tests" / "trl_tiny.py"), "--model", str(tiny_model), "--origin", origin,
             "--origin-options", json.dumps(east.options), "--dest", dest, "--dest-options", json.dumps(west.options),
             "--layout", layout, "--steps", "3", "--out", str(out)],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
        assert proc.returncode == 0, proc.stderr[-4000:]
        results[layout], origins[layout] = json.loads(out.read_text()), origin
    for layout, found in results.items():
        assert found["dtensor"], layout  # really sharded by FSDP2, not DDP
        assert 0.45 < found["local_fraction"] < 0.55, layout  # each rank holds about half the parameters
        assert [(s["step"], s["head"], s["relayed"], s["bit_exact"]) for s in found["steps"]] == \
            [(s, s, True, True) for s in range(4)], layout
        assert all(s["changed"] for s in found["steps"][1:]), layout
    keys = {layout: sorted(open_store(url, east.options).list("snapshots/")) for layout, url in origins.items()}
    for rank in range(2):  # "sharded": each rank wrote its own rows' files; "gather": rank 0 wrote whole files
        assert any(f"rank-{rank:05d}-of-00002" in k for k in keys["sharded"]), keys["sharded"]
    assert not any("rank-" in k for k in keys["gather"]), keys["gather"]


def test_refuses_what_it_cannot_publish_correctly(tiny_model):
    from transformers import AutoModelForCausalLM

    from relay.integrations.trl import DeltaRelayCallback

    with pytest.raises(ValueError, match="layout must be one of"):
        DeltaRelayCallback("file:///nowhere", layout="zero3")
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16)
    cb = DeltaRelayCallback("file:///nowhere", layout="sharded")
    with pytest.raises(RuntimeError, match="needs torch.distributed initialized"):
        cb.on_train_begin(None, None, None, model=model)
    next(model.parameters()).ds_id = 7  # what DeepSpeed ZeRO-3 marks its partitioned parameters with
    with pytest.raises(NotImplementedError, match="ZeRO-3"):
        DeltaRelayCallback("file:///nowhere").on_train_begin(None, None, None, model=model)


def test_a_failed_background_publish_stops_training_at_the_next_step(tiny_model, tmp_path):
    """A publisher fenced by another (a second trainer resumed the run) fails its background commit: the next hook
    raises that ConflictError instead of training on while rollouts stay behind; nothing is committed after it."""
    from transformers import AutoModelForCausalLM, TrainerState

    from relay.integrations.trl import DeltaRelayCallback
    from relay.store import ConflictError

    url = f"file://{tmp_path}/run"
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16)
    cb = DeltaRelayCallback(url, snapshot_every=100)
    state = TrainerState()
    cb.on_train_begin(None, state, None, model=model)
    cb.wait()
    relay.Publisher(url, resume=True).close()  # takes the run over: cb's publisher is fenced
    with torch.no_grad():
        next(model.parameters()).add_(1)
    state.global_step = 1
    cb.on_step_end(None, state, None, model=model)  # hands step 1 to the thread, which is refused
    state.global_step = 2
    with pytest.raises(ConflictError):
        cb.on_step_end(None, state, None, model=model)
    head = open_store(url).read_manifest()
    assert head is not None and relay.Manifest.parse(head.data).head == 0
    assert cb.published == 0
