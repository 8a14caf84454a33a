"""Where a trial's recovery generations persist behind its local store
(:mod:`~areal_ckpt.persistence.generations`, ``PersistentGenerations``: one class over the trial's
recovery location, an object prefix or a folder on a shared file system), and how a load reads
them from there (:mod:`~areal_ckpt.persistence.reading`)."""
