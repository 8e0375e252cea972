"""Images as a request carries them: OpenAI `image_url` parts holding data URLs, checked before anything decodes.

Nothing is fetched: a remote URL is refused. An image must be a PNG or a JPEG (its bytes say so, whatever the
URL's media type claims), at most `MAX_IMAGE_BYTES` encoded and `MAX_SIDE` pixels a side (checked from the header,
before the pixels are decoded), and decode whole. Every refusal is an `InvalidRequestError`: a 400 that says why.
"""

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image, UnidentifiedImageError

from kvyard.errors import InvalidRequestError

MAX_IMAGE_BYTES = 4 * 1024 * 1024
MAX_SIDE = 4096
MAX_IMAGES = 8  # per request
FORMATS = {"PNG": b"\x89PNG\r\n\x1a\n", "JPEG": b"\xff\xd8\xff"}


@dataclass(frozen=True)
class RequestImage:
    data: bytes  # the encoded file
    digest: bytes  # sha256 of `data`: the image's identity in the encoder cache and the KV cache

    @classmethod
    def from_bytes(cls, data: bytes) -> "RequestImage":
        return cls(data, hashlib.sha256(data).digest())


def image_from_url(url: str, param: str = "messages") -> RequestImage:
    """The image of a `data:image/...;base64,` URL, its size and format checked (not yet decoded)."""
    if not url.startswith("data:"):
        raise InvalidRequestError("remote image URLs are refused (kvyard fetches nothing): send the image as a "
                                  "data URL, data:image/png;base64,...", param=param)
    head, sep, payload = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise InvalidRequestError("an image data URL must be base64: data:image/png;base64,...", param=param)
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise InvalidRequestError(f"the image is larger than {MAX_IMAGE_BYTES} bytes", param=param)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError("the image data URL is not valid base64", param=param) from None
    if not any(data.startswith(magic) for magic in FORMATS.values()):
        raise InvalidRequestError("the image is neither a PNG nor a JPEG", param=param)
    return RequestImage.from_bytes(data)


def decode(image: RequestImage, param: str = "messages") -> Image.Image:
    """The image's pixels as RGB, or a 400 when it is too large or does not decode whole."""
    try:
        with Image.open(io.BytesIO(image.data)) as opened:
            if opened.format not in FORMATS:
                raise InvalidRequestError("the image is neither a PNG nor a JPEG", param=param)
            if max(opened.size) > MAX_SIDE:
                raise InvalidRequestError(f"the image is {opened.size[0]}x{opened.size[1]} pixels; at most "
                                          f"{MAX_SIDE} a side", param=param)
            return opened.convert("RGB")  # decodes every pixel: truncated or corrupt data fails here
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        if isinstance(e, InvalidRequestError):
            raise
        raise InvalidRequestError(f"the image does not decode: {e}", param=param) from None


def pixels(image: Image.Image, size: int) -> torch.Tensor:
    """[3, size, size] floats in [0, 1]; an image of another size is resized (bilinear) first."""
    rgb = image.convert("RGB")
    if rgb.size != (size, size):
        rgb = rgb.resize((size, size), Image.Resampling.BILINEAR)
    flat = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8)
    return flat.view(size, size, 3).permute(2, 0, 1).float() / 255.0


def file_pixels(path: Path, size: int) -> torch.Tensor:
    with Image.open(path) as image:
        return pixels(image, size)
