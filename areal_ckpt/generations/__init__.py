"""The local generation store: a trial's recovery generations in a folder, committed by the
``current`` switch (:mod:`~areal_ckpt.generations.store`), what a commit supersedes deleted off
the hot path (:mod:`~areal_ckpt.generations.tidy`), AReaL's own folders told apart
(:mod:`~areal_ckpt.generations.foreign`) and a lost ``current`` re-pointed
(:mod:`~areal_ckpt.generations.repoint`)."""
