"""DeepSpeed-shaped checkpoints: ``save_checkpoint`` / ``load_checkpoint`` with tags, ``latest``
and ``client_state`` (:mod:`areal_ckpt.tags.api`), committed to a folder or an object
store prefix through one location (:mod:`areal_ckpt.tags.save_dir`)."""
