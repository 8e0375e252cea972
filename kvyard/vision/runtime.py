"""A graft served: the frozen encoder and the trained projector turn a request's images into soft tokens.

`kvyard serve --model GRAFTDIR` serves the graft's language model, and a chat request's `image_url` parts reach
it as soft tokens (kvyard/engine/soft_tokens.py) at placeholder positions: the templated conversation carries the
graft's placeholder text where each image goes (as in training), is cut there, and each image's place becomes
`tokens` placeholder ids. Encoder outputs are cached by the image's content hash (least recently used first out),
so a repeated image runs the encoder once; the same hash keys the KV blocks. A request without an image never
comes here.
"""

import threading
from collections import OrderedDict
from pathlib import Path

import torch
from safetensors.torch import load_file

from kvyard.engine.soft_tokens import SoftTokens
from kvyard.errors import CheckpointError, InvalidRequestError
from kvyard.vision.config import PROJECTOR_FILE, GraftConfig
from kvyard.vision.encoder import load_encoder, normalise
from kvyard.vision.images import RequestImage, decode, pixels
from kvyard.vision.projector import Projector


class VisionGraft:
    def __init__(self, directory: str | Path, hidden: int, cache_images: int = 256):
        from kvyard.loader.registry import resolve_model

        self.directory = Path(directory).expanduser()
        self.config = GraftConfig.read(self.directory)
        if self.config.hidden != hidden:
            raise CheckpointError(f"{self.directory / 'graft.json'}: the projector writes {self.config.hidden}-wide "
                                  f"soft tokens, the served model's embeddings are {hidden} wide")
        self.encoder = load_encoder(resolve_model(self.config.encoder))
        self.projector = self._projector()
        self.cache_images = cache_images
        self._cache: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()  # requests encode on worker threads; the cache and the counters are shared
        self.encoder_runs = 0
        self.cache_hits = 0

    def _projector(self) -> Projector:
        c, path = self.config, self.directory / PROJECTOR_FILE
        projector = Projector(c.feature_dim, c.hidden, c.tokens, c.width)
        try:
            projector.load_state_dict(load_file(path))
        except Exception as e:  # noqa: BLE001 - a missing, corrupt or mis-shaped file gets one clear error
            raise CheckpointError(f"{path}: not this graft's projector ({type(e).__name__}: {e})") from e
        return projector.eval().requires_grad_(False)

    @property
    def placeholder(self) -> str:
        return self.config.placeholder

    def embeds(self, image: RequestImage) -> torch.Tensor:
        """[tokens, hidden]: the image's soft tokens, from the cache or the encoder. Raises InvalidRequestError
        for an image that does not decode."""
        with self._lock:
            if image.digest in self._cache:
                self.cache_hits += 1
                self._cache.move_to_end(image.digest)
                return self._cache[image.digest]
        rgb = decode(image)
        with torch.inference_mode():
            features = self.encoder.features(normalise(pixels(rgb, self.config.image_size)[None]))
            soft = self.projector(features)[0]
        with self._lock:
            self.encoder_runs += 1
            self._cache[image.digest] = soft
            while len(self._cache) > self.cache_images:
                self._cache.popitem(last=False)
        return soft

    def prompt(self, pieces: list[list[int]], images: list[RequestImage]) -> tuple[list[int], list[SoftTokens]]:
        """The templated conversation cut at its placeholders (`pieces`, one more than `images`) as one prompt,
        each image's place holding `tokens` placeholder ids, and the soft tokens that fill them."""
        if len(pieces) != len(images) + 1:
            raise InvalidRequestError(f"the templated messages mark {len(pieces) - 1} places with "
                                      f"{self.placeholder!r} for {len(images)} images: that text is reserved for "
                                      f"images", param="messages")
        ids, spans = list(pieces[0]), []
        for image, piece in zip(images, pieces[1:], strict=True):
            spans.append(SoftTokens(len(ids), self.embeds(image), image.digest))
            ids += [self.config.placeholder_id] * self.config.tokens + piece
        return ids, spans
