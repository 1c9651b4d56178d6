"""The object tier: asynchronous fetches and uploads (RemoteIO), the stored chunk's
frame (checksum, signature, compression, encryption), the tier's health, and the
backends in ``tiers/``. Imports nothing from ``kvtier.host``."""
