"""relay.integrations.verl against verl's own classes (runs in .venv-verl: verl pins transformers<5.11, so it
cannot share .venv; `make test` runs this file there). What verl itself does is reproduced with its own code:
the config is verl's rollout.yaml section turned into its CheckpointEngineConfig, the backend module is
imported by verl's import_external_libs and built by CheckpointEngineRegistry.new with the arguments verl's
actor workers (is_master) and rollout workers (none) pass, and the calls come in CheckpointEngineManager's
order. What cannot run here: verl's Ray worker groups and its rollout adapters (vLLM/SGLang on CUDA)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch

from relay.fanout import Destination, Fanout

from conftest import same_bits

pytest.importorskip("verl", reason="runs in .venv-verl (make test), where verl is installed")

BACKEND = "deltarelay"
MODULE = "relay.integrations.verl"


def verl_config(engine_kwargs: dict):
    """verl's own checkpoint_engine config section (rollout.yaml) with deltarelay chosen, as a user sets it."""
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    import verl

    section = OmegaConf.load(Path(verl.__file__).parent / "trainer/config/rollout/rollout.yaml").checkpoint_engine
    section.backend = BACKEND
    section.custom_backend_module = MODULE
    section.engine_kwargs = {BACKEND: engine_kwargs}
    return omega_conf_to_dataclass(section)


def build(cfg, actor_world: int, rollout_world: int):
    """The engines as verl's workers build them (engine_workers.py and CheckpointEngineWorker)."""
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    import_external_libs(cfg.custom_backend_module or None)
    bucket = cfg.update_weights_bucket_megabytes << 20
    kwargs = cfg.engine_kwargs.get(cfg.backend, {})
    actors = [CheckpointEngineRegistry.new(cfg.backend, is_master=(rank == 0), bucket_size=bucket, **kwargs)
              for rank in range(actor_world)]
    rollouts = [CheckpointEngineRegistry.new(cfg.backend, bucket_size=bucket, **kwargs) for _ in range(rollout_world)]
    return actors, rollouts


def manager_setup(cls, actors, rollouts) -> None:
    """CheckpointEngineManager.build_process_group without Ray: prepare, build_topology, init_process_group."""
    metadata = [e.prepare() for e in actors + rollouts]
    actor_kw, rollout_kw = cls.build_topology(len(actors), len(rollouts), metadata)
    assert all(len(v) == len(actors) for v in actor_kw.values())
    assert all(len(v) == len(rollouts) for v in rollout_kw.values())
    for i, e in enumerate(actors):
        e.init_process_group(**{k: v[i] for k, v in actor_kw.items()})
    for i, e in enumerate(rollouts):
        e.init_process_group(**{k: v[i] for k, v in rollout_kw.items()})


async def update_weights(actors, rollouts, state: dict[str, torch.Tensor], step: int) -> tuple[list, list[dict]]:
    """One CheckpointEngineManager.update_weights: every actor sends (each rank's generator, as verl's
    get_per_tensor_param hands it) while every rollout worker receives; returns the actors' metrics, what each
    rollout received, and how many tensors each actor's generator gave."""
    drained = [0] * len(actors)

    def per_tensor(rank: int):
        for name, t in state.items():
            drained[rank] += 1
            yield name, t

    async def receive(engine) -> dict[str, torch.Tensor]:
        return {name: t.clone() async for name, t in engine.receive_weights(global_steps=step)}

    results = await asyncio.gather(*[a.send_weights(per_tensor(r), global_steps=step) for r, a in enumerate(actors)],
                                   *[receive(r) for r in rollouts])
    assert drained == [len(state)] * len(actors)  # non-master ranks join the gathers too
    for e in actors + rollouts:
        e.finalize()
    return list(results[:len(actors)]), list(results[len(actors):])


def test_verl_picks_deltarelay_by_configuration_and_rollouts_get_every_step_bit_exact(moto_regions, trainer,
                                                                                      tmp_path):
    from verl.checkpoint_engine import CheckpointEngineRegistry

    from relay.integrations.verl import DeltaRelayCheckpointEngine

    east, west = moto_regions("us-east-1"), moto_regions("eu-west-1")
    origin = f"s3://{east.new_bucket('verl')}/run"
    regional = f"s3://{west.new_bucket('verl-west')}/run"
    cfg = verl_config({"url": origin, "storage_options": east.options, "source_url": regional,
                       "source_storage_options": west.options, "timeout": 60,
                       "publisher": {"snapshot_every": 3}})
    actors, rollouts = build(cfg, actor_world=2, rollout_world=2)
    assert CheckpointEngineRegistry.get(BACKEND) is DeltaRelayCheckpointEngine
    assert [a.role for a in actors] == ["actor", "actor"] and [r.role for r in rollouts] == ["rollout", "rollout"]
    manager_setup(DeltaRelayCheckpointEngine, actors, rollouts)
    fan = Fanout(origin, [Destination("eu-west-1", regional, west.options)], source_options=east.options,
                 poll_interval=0.05)
    relaying = threading.Thread(target=fan.run, daemon=True)
    relaying.start()
    try:
        t = trainer(seed=5)
        for step in range(1, 5):  # verl's global_steps start at 1
            state = t.step()
            metrics, received = asyncio.run(update_weights(actors, rollouts, state, step))
            assert metrics[0]["deltarelay/step"] == step and metrics[0]["deltarelay/bytes_uploaded"] > 0
            assert metrics[1] == {}  # the non-master rank publishes nothing
            for got in received:
                assert same_bits(got, state)
    finally:
        fan.stop()
        relaying.join(30)
    assert actors[0]._publisher is not None and actors[0]._publisher.step == 4
    assert actors[1]._publisher is None


def test_refusals_name_the_backend_and_the_reason(file_run, trainer):
    from relay.integrations.verl import DeltaRelayCheckpointEngine

    with pytest.raises(TypeError):
        DeltaRelayCheckpointEngine(bucket_size=1)  # no url
    with pytest.raises(ValueError, match="url"):
        DeltaRelayCheckpointEngine(bucket_size=1, url="")
    actors, rollouts = build(verl_config({"url": file_run.url, "timeout": 1.0}), 1, 1)
    state = trainer(seed=1).state()

    async def send(step: int) -> None:
        await actors[0].send_weights(iter(state.items()), global_steps=step)

    asyncio.run(send(3))
    with pytest.raises(ValueError, match="does not follow the last published step 3"):
        asyncio.run(send(3))

    async def receive(step: int) -> None:
        async for _ in rollouts[0].receive_weights(global_steps=step):
            pass

    asyncio.run(receive(3))
    with pytest.raises(Exception, match="did not reach step 9 within 1s"):
        asyncio.run(receive(9))
    with pytest.raises(RuntimeError, match="receive_weights on an actor"):
        asyncio.run(actors[0].receive_weights(1).__anext__())
    with pytest.raises(TypeError, match="takes no topology"):
        actors[0].init_process_group(rank=0)
