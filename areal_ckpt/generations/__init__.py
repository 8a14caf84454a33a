"""The local generation store: a trial's recovery generations in a folder, committed in place by
the ``current`` switch (:mod:`~areal_ckpt.generations.store` over
:mod:`~areal_ckpt.storage.in_place`), what a commit supersedes deleted off the hot path
(:mod:`~areal_ckpt.generations.tidy`) and a lost ``current`` re-pointed
(:mod:`~areal_ckpt.generations.repoint`)."""
