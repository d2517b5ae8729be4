"""Images: a store of read-only layers shared by every sandbox, and the builders that fill it."""

from shoal.images.store import Image, ImageConfig, ImageStore

__all__ = ["Image", "ImageConfig", "ImageStore"]
