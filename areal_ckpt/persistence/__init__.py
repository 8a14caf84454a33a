"""Where a trial's recovery generations persist behind its local store: the contract
(:mod:`~areal_ckpt.persistence.contract`, ``PersistentGenerations``) and its two
implementations, a prefix of an object store (:mod:`~areal_ckpt.persistence.remote`) and a trial
folder on a shared file system (:mod:`~areal_ckpt.persistence.shared_folder`)."""
