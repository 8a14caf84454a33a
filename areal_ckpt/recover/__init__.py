"""Recovery checkpoints, the handler's side: the RecoverHandler (dump / load), a dump's two halves
(prepare, write) and the reading of a generation, preemption, and the policy by which local
commits reach where the trial persists (:mod:`~areal_ckpt.recover.location`,
:mod:`~areal_ckpt.recover.publication`). The local generation store is
:mod:`areal_ckpt.generations`, where a trial persists :mod:`areal_ckpt.persistence`, a node-local
tier and its transport :mod:`areal_ckpt.tier`."""
