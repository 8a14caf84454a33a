"""Local copies of remote truth know what they mirror and never stand in for it: a cache (an
object trial's staging copy) is named by and records the full identity of its location (scheme,
endpoint, bucket, prefix) and is set aside when it does not match; a location whose committed
history is empty is a fresh start whatever the node's cache holds; a tier (local_dir) of
another location is refused naming both. Real servers on 127.0.0.1 (SeaweedFS, fake-gcs-server,
Azurite)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from object_helpers import _store, keys_under
from recover_fixtures import SPEC, Setup, make_setup, step_info, train_step
from test_object_recover import TRIAL, s3_config
from test_tiered import assert_same_weights, local_step, tiered_config

import areal_ckpt as ac
from areal_ckpt.errors import CheckpointError
from areal_ckpt.storage.mirrors import MIRROR_RECORD, SET_ASIDE_PREFIX


def dump_steps(config: ac.RecoverConfig, steps: range) -> Setup:
    """A job on ``config`` that dumps after each of ``steps``; closed; returns its model's setup."""
    setup = make_setup()
    handler = ac.RecoverHandler(config, SPEC)
    for step in steps:
        train_step(setup, step)
        handler.dump(setup.engine, step_info(step), force=True)
    handler.close()
    return setup


def resumed_step(config: ac.RecoverConfig) -> int | None:
    """The global step a new job on ``config`` resumes after (None: a fresh start)."""
    handler = ac.RecoverHandler(config, SPEC)
    info = handler.load(make_setup(seed=1).engine)
    handler.close()
    return None if info is None else info.last_step_info.global_step


def use(server, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Point this process's clients at ``server``."""
    for variable, value in server.environment().items():
        monkeypatch.setenv(variable, value)


def set_aside(staging: Path) -> list[Path]:
    return sorted(path for path in staging.rglob(f"{SET_ASIDE_PREFIX}*") if path.is_dir())


@pytest.mark.parametrize(("first", "second"), [("gs", "az"), ("s3", "gs"), ("az", "s3")])
def test_a_cache_never_stands_in_for_another_store_holding_the_same_bucket_name(
    first, second, request, tmp_path, monkeypatch
):
    # the case found three times: a job on an empty az:// container resumed a gs:// trial's step
    servers = {"s3": "s3_server", "gs": "gcs_server", "az": "azure_server"}
    name = f"same-name-{first}-{second}-{os.getpid() % 10000}"
    for scheme in (first, second):
        server = request.getfixturevalue(servers[scheme])
        server.make_bucket(name)
        use(server, monkeypatch)  # the variables of the three stores do not overlap
    staging = tmp_path / "node-staging"  # one node, one staging_dir, both jobs
    ran = dump_steps(s3_config(f"{first}://{name}", staging), range(7))
    empty = s3_config(f"{second}://{name}", staging)
    assert not ac.check_if_recover(empty)
    assert resumed_step(empty) is None  # a fresh start, not step 6 of the other store's trial
    dump_steps(empty, range(2))  # its first dump is not refused over the other trial's commit
    assert resumed_step(empty) == 1
    fresh = make_setup(seed=1)
    handler = ac.RecoverHandler(s3_config(f"{first}://{name}", staging), SPEC)
    assert handler.load(fresh.engine).last_step_info.global_step == 6  # the first trial is untouched
    handler.close()
    assert_same_weights(ran.model, fresh.model)
    folders = sorted(path.relative_to(staging).parts[:2] for path in staging.glob("*/*"))
    assert [scheme for scheme, _ in folders] == sorted([first, second])  # one cache per store


def test_two_endpoints_of_one_scheme_never_share_a_cache_or_a_tier(s3_server, own_s3_server, tmp_path, monkeypatch):
    for server in (s3_server, own_s3_server):
        server.make_bucket("one-name")
    staging, local = tmp_path / "staging", tmp_path / "local"
    use(s3_server, monkeypatch)
    dump_steps(s3_config("s3://one-name", staging), range(4))
    dump_steps(tiered_config("s3://one-name/tiered", local), range(3))
    use(own_s3_server, monkeypatch)  # the same bucket name on another server
    assert resumed_step(s3_config("s3://one-name", staging)) is None
    with pytest.raises(
        CheckpointError,
        match=rf"belongs to s3://one-name/tiered/\S+ at {s3_server.endpoint}, not to s3://one-name/tiered/\S+ at "
        rf"{own_s3_server.endpoint} .* give this job another local_dir, or move that trial folder away",
    ):
        ac.RecoverHandler(tiered_config("s3://one-name/tiered", local), SPEC)
    assert local_step(local) == 2  # nothing read or deleted
    assert resumed_step(tiered_config("s3://one-name/tiered", tmp_path / "another-local")) is None  # the hint followed
    use(s3_server, monkeypatch)
    assert resumed_step(s3_config("s3://one-name", staging)) == 3
    assert resumed_step(tiered_config("s3://one-name/tiered", local)) == 2


def test_a_trial_emptied_at_its_location_starts_fresh_whatever_the_cache_holds(object_bucket, tmp_path, caplog):
    staging = tmp_path / "staging"
    config = s3_config(object_bucket, staging)
    dump_steps(config, range(3))
    assert resumed_step(config) == 2  # the cache now holds the data files too
    store, _ = _store(object_bucket)
    store.delete(keys_under(object_bucket, TRIAL))  # the trial emptied to start over
    assert not ac.check_if_recover(config)
    caplog.clear()
    assert resumed_step(config) is None  # not the step the bucket no longer holds
    (aside,) = set_aside(staging)
    assert f"{aside}" in caplog.text and "holds no committed recovery checkpoint" in caplog.text
    assert list(aside.glob("gen-00000002-*/default/__0_0.distcp"))  # set aside whole, nothing deleted
    dump_steps(config, range(1))  # a fresh trial's first dump
    assert resumed_step(config) == 0


def test_a_dump_without_a_load_on_an_emptied_trial_is_not_refused_over_the_cache(object_bucket, tmp_path):
    config = s3_config(object_bucket, tmp_path / "staging")
    dump_steps(config, range(2))
    store, _ = _store(object_bucket)
    store.delete(keys_under(object_bucket, TRIAL))
    dump_steps(config, range(5, 6))  # no load first: the cache's old commit is not this trial's
    assert resumed_step(config) == 5


@pytest.mark.parametrize("damage", ["missing", "garbled", "a link", "another location"])
def test_a_cache_whose_record_does_not_match_is_set_aside_and_rebuilt(object_bucket, tmp_path, damage, caplog):
    staging = tmp_path / "staging"
    config = s3_config(object_bucket, staging)
    setup = dump_steps(config, range(2))
    assert resumed_step(config) == 1
    (record,) = staging.rglob(MIRROR_RECORD)
    held = json.loads(record.read_text())
    record.unlink()
    if damage == "garbled":
        record.write_text('{"scheme": ')
    elif damage == "a link":
        (tmp_path / "planted.json").write_text(json.dumps(held))
        record.symlink_to(tmp_path / "planted.json")
    elif damage == "another location":
        record.write_text(json.dumps({**held, "prefix": "elsewhere/trial"}))
    caplog.clear()
    fresh = make_setup(seed=1)
    handler = ac.RecoverHandler(config, SPEC)
    assert handler.load(fresh.engine).last_step_info.global_step == 1  # from the bucket, every file again
    handler.close()
    assert_same_weights(setup.model, fresh.model)
    (aside,) = set_aside(staging)
    assert f"set aside as {aside}" in caplog.text
    assert list(aside.glob(".recover/gen-*/default/__0_0.distcp"))  # kept, not read, not deleted
    assert json.loads(record.read_text()) == held and not record.is_symlink()  # rebuilt with its own record
    if damage == "a link":
        assert json.loads((tmp_path / "planted.json").read_text()) == held  # never written through


def test_a_local_tier_whose_record_is_garbled_is_refused_and_one_an_older_version_recorded_is_kept(
    persistent_root, tmp_path
):
    local = tmp_path / "local"
    config = tiered_config(persistent_root.root, local)
    dump_steps(config, range(2))
    trial = local / "checkpoints/tester/exp/trial"
    record = trial / MIRROR_RECORD
    held = record.read_bytes()
    record.write_text("not json")
    with pytest.raises(CheckpointError, match=rf"{MIRROR_RECORD} is unreadable.* move that trial folder away"):
        ac.RecoverHandler(config, SPEC)
    assert local_step(local) == 1  # nothing read or deleted
    record.unlink()  # as an older version left it: the location's text in .recover/.persists-at
    (trial / ".recover/.persists-at").write_text(f"{persistent_root.root}/{TRIAL}/.recover\n")
    assert resumed_step(config) == 1
    assert record.read_bytes() == held  # recorded in full from now on


def _different_persistent_tiers(rank: int, world_size: int, root: str) -> None:
    config = ac.RecoverConfig(
        experiment_name="exp",
        trial_name="trial",
        fileroot=f"{root}/shared-{rank}",  # a misconfigured node: another persistent tier
        user="tester",
        local_dir=f"{root}/node{rank}",
        local_replicas=1,
        mode="on",
    )
    with pytest.raises(
        ac.RankMismatchError, match=r"the ranks name different persistent tiers: \[.*shared-0.*shared-1"
    ):
        ac.RecoverHandler(config, SPEC)
    assert not list(Path(root).glob(f"node{rank}/**/{MIRROR_RECORD}"))  # no tier claimed, no copy moved


@pytest.mark.dist
def test_ranks_that_name_different_persistent_tiers_are_refused_before_a_tier_is_claimed_or_a_copy_moves(tmp_path):
    from distributed import run_distributed

    run_distributed(_different_persistent_tiers, 2, str(tmp_path))
