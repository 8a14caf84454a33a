"""A node-local tier (``recover.local_dir``) in front of where a trial persists, with its
transport: the uploads behind each local commit (:mod:`~areal_ckpt.tier.upload`), which ranks
share a tier and the files a node receives from the others before a load
(:mod:`~areal_ckpt.tier.nodes`), peer copies (:mod:`~areal_ckpt.tier.peer_copies`) and where a
tiered trial resumes (:mod:`~areal_ckpt.tier.resume`)."""
