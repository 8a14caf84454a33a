"""DeepSpeed-shaped checkpoints: ``save_checkpoint`` / ``load_checkpoint`` with tags, ``latest``
and ``client_state`` (:mod:`areal_ckpt.tags.api`), committed in a folder
(:mod:`areal_ckpt.tags.folder`) or on object storage (:mod:`areal_ckpt.tags.objects`)."""
