"""Where checkpoint bytes are kept when that is not the local filesystem: object storage.

:mod:`areal_ckpt.storage.objects` declares what the commit protocol needs of a store (the
:class:`ObjectStore` Protocol) and how a URL names one; :mod:`areal_ckpt.storage.s3` is the
S3-compatible implementation (AWS, MinIO, SeaweedFS, Ceph...).
"""
