"""Where checkpoint bytes are kept, and how they move between places.

:mod:`areal_ckpt.storage.objects` declares what the commit protocol needs of an object store (the
:class:`ObjectStore` Protocol) and how a URL names one; :mod:`~areal_ckpt.storage.s3`,
:mod:`~areal_ckpt.storage.gcs` and :mod:`~areal_ckpt.storage.azure` implement it, chosen once by
:mod:`~areal_ckpt.storage.backends`; :mod:`~areal_ckpt.storage.commits` commits a folder of
objects without rename, :mod:`~areal_ckpt.storage.parts` writes one part by part from memory.
:mod:`~areal_ckpt.storage.location` (a folder or an object prefix: :mod:`~areal_ckpt.storage.folder_location`,
:mod:`~areal_ckpt.storage.object_location`) and :mod:`~areal_ckpt.storage.trials` are the contracts the
layers above call, whatever the location (a folder or a prefix); :mod:`~areal_ckpt.storage.in_place`
is the commit of a folder whose checkpoints are written in place (a trial's recovery generations),
:mod:`~areal_ckpt.storage.foreign` what in a trial folder is AReaL's own and stands in its way;
:mod:`~areal_ckpt.storage.retention` decides what a series drops; :mod:`~areal_ckpt.storage.folders`
moves whole checkpoint folders up and down and checks one where it is kept;
:mod:`~areal_ckpt.storage.peers` moves whole files between ranks (a tiered trial's nodes).
"""
