"""The one place a ``recover:`` block's ``fileroot`` and ``local_dir`` become stores.

=====================================  ===========================  ==========================================
``fileroot`` / ``local_dir``           local store (dumps commit)   behind it (published to), the policy
=====================================  ===========================  ==========================================
a folder / unset                       the trial itself             nothing (KeptLocally)
a URL / unset                          the cache (staging copy)     the prefix (PublishedInDump)
a URL / a folder                       the local tier               the prefix (PublishedInBackground)
a shared folder / a node-local folder  the local tier               the shared trial (PublishedInBackground)
=====================================  ===========================  ==========================================

Nothing else in the package decides which row it is in: the handler, the dump and the load call
the :class:`~areal_ckpt.recover.publication.Publication` this returns.
"""

from __future__ import annotations

from pathlib import Path

from areal_ckpt.config import RecoverConfig
from areal_ckpt.generations.store import RecoverStore
from areal_ckpt.paths import default_user, trial_root
from areal_ckpt.persistence.generations import PersistentGenerations
from areal_ckpt.recover.publication import KeptLocally, Publication, PublishedInBackground, PublishedInDump
from areal_ckpt.storage.folders import staging_root
from areal_ckpt.urls import locate


def persistent_generations(fileroot: str, user: str, experiment: str, trial: str) -> PersistentGenerations:
    """Where the trial ``user/experiment/trial`` under ``fileroot`` persists: a prefix on the
    object store the URL names, or a trial folder. Pure (nothing is contacted)."""
    where = locate(fileroot, "fileroot")
    if isinstance(where, Path):
        return PersistentGenerations(trial_root(fileroot, user, experiment, trial))
    return PersistentGenerations(where.child("checkpoints", user, experiment, trial))


def trial_location(config: RecoverConfig) -> tuple[RecoverStore, Publication]:
    """The store a ``recover:`` block's dumps commit to, and the policy by which they reach where
    the trial persists (the table above; ``user`` defaults to the login name). Creates nothing
    but, for an object trial without ``local_dir``, the node's cache folder of it with its
    identity record (one that mirrors anything else set aside first; the default base private:
    :func:`~areal_ckpt.storage.folders.staging_root`). Contacts no store."""
    user = config.user or default_user()
    names = (user, config.experiment_name, config.trial_name)
    if config.local_dir is not None:
        behind = persistent_generations(config.fileroot, *names)
        publication = PublishedInBackground(behind, config.local_replicas, config.upload_every)
        return RecoverStore(trial_root(config.local_dir, *names), links_previous_data=False), publication
    where = locate(config.fileroot, "fileroot")
    if isinstance(where, Path):
        return RecoverStore(trial_root(config.fileroot, *names)), KeptLocally()
    remote = where.child("checkpoints", *names)
    staging = RecoverStore(staging_root(config.staging_dir, remote), links_previous_data=False)
    return staging, PublishedInDump(PersistentGenerations(remote))


def trial_store(config: RecoverConfig) -> RecoverStore:
    """The store of :func:`trial_location` alone (what a launcher watches for new commits)."""
    return trial_location(config)[0]
