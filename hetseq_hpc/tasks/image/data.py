"""Images for classification: where they come from, the on-disk cache, deterministic augmentation.

Sources, in the order the default tries them (nothing is downloaded):

1. ``task.data.path``: a folder with one sub-folder per class (read with Pillow), or an ``.npz``
   with ``images`` ``(N, H, W)``/``(N, H, W, C)``/``(N, C, H, W)`` and integer ``labels (N,)``.
2. Fashion-MNIST (Xiao et al., 2017) from the Debian package ``dataset-fashion-mnist``
   (``/usr/share/datasets/fashion-mnist/*-ubyte.gz``, IDX format): 60 k train + 10 k test.
3. scikit-learn's ``load_digits()`` (1 797 8x8 digits, shipped inside the wheel).

Every source is decoded once into ``uint8`` arrays ``(N, C, H, W)`` in a cache directory
(``prepare``); every rank memory-maps them (``load``). Training images get a random crop with
zero padding and a random horizontal flip (the CIFAR recipe of He et al., 2016), drawn from
``numpy.random.default_rng([seed, epoch, split, index])``: a pure function of the sample, never
of the rank or the world size.
"""

from __future__ import annotations

import gzip
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from hetseq_hpc.errors import ConfigError, DataError
from hetseq_hpc.tasks.cache import TaskCache, files_fingerprint
from hetseq_hpc.tasks.cache import cache_key as key_of
from hetseq_hpc.tasks.samples import fixed_split, sample_rng

log = logging.getLogger(__name__)

FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_CLASSES = [
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
]
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm"}
#: bump when the cache layout changes
CACHE_FORMAT = 1


@dataclass(frozen=True)
class ImageSource:
    """Where images come from. ``kind``: ``folder``, ``npz``, ``fashion_mnist`` or ``digits``."""

    kind: str
    location: str
    fingerprint: str

    @property
    def description(self) -> str:
        """A one-line human description for the log and summary."""
        return {
            "fashion_mnist": "Fashion-MNIST (Debian dataset-fashion-mnist)",
            "digits": "scikit-learn load_digits()",
        }.get(self.kind, f"{self.kind} {self.location}")


def _stat_digest(paths: Sequence[Path], root: Optional[Path] = None) -> str:
    """:func:`files_fingerprint` of ``paths``, named relative to ``root`` (else resolved)."""
    return files_fingerprint(
        (str(p.relative_to(root)) if root else str(p.resolve()), p) for p in paths
    )


def _folder_files(root: Path) -> List[Tuple[Path, int]]:
    classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    files = []
    for label, name in enumerate(classes):
        files += [
            (p, label)
            for p in sorted((root / name).rglob("*"))
            if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES
        ]
    return files


def resolve_source(path: Optional[str]) -> ImageSource:
    """Pick the image source for ``task.data.path`` (see the module docstring for the order).

    Raises:
        ConfigError: ``path`` does not exist, or is neither a folder nor an ``.npz``.
        DataError: no path and no built-in source is installed.
    """
    if path:
        p = Path(os.path.expanduser(path))
        if p.is_dir():
            files = _folder_files(p)
            if not files:
                raise ConfigError(
                    f"task.data.path={path!r} holds no images in class sub-folders: "
                    "use <path>/<class>/<image>.png, or an .npz"
                )
            return ImageSource("folder", str(p), _stat_digest([f for f, _ in files], p))
        if p.is_file() and p.suffix == ".npz":
            return ImageSource("npz", str(p), _stat_digest([p]))
        raise ConfigError(
            f"task.data.path={path!r} is neither a folder nor an .npz file: point "
            "it at a folder of class sub-folders or at an .npz with images/labels"
        )
    fashion = sorted(FASHION_DIR.glob("*-ubyte.gz"))
    if len(fashion) == 4:
        return ImageSource("fashion_mnist", str(FASHION_DIR), _stat_digest(fashion))
    try:
        import sklearn
    except ImportError:
        raise DataError(
            f"no built-in image set: {FASHION_DIR} is missing and scikit-learn is not installed; "
            "apt-get install dataset-fashion-mnist, or pip install scikit-learn, or set "
            "task.data.path to your own images"
        ) from None
    return ImageSource("digits", "sklearn.datasets.load_digits", f"sklearn-{sklearn.__version__}")


def _read_idx(path: Path, offset: int) -> np.ndarray:
    with gzip.open(path, "rb") as fh:
        return np.frombuffer(fh.read(), np.uint8, offset=offset)


def _resize(images: np.ndarray, size: int) -> np.ndarray:
    """``(N, C, H, W)`` uint8 -> ``(N, C, size, size)`` with Pillow's bilinear filter."""
    from PIL import Image

    out = np.empty((*images.shape[:2], size, size), dtype=np.uint8)
    for i, img in enumerate(images):
        for c, plane in enumerate(img):
            out[i, c] = np.asarray(Image.fromarray(plane).resize((size, size), Image.BILINEAR))
    return out


def _read_folder(root: Path, image_size: Optional[int]) -> Tuple[np.ndarray, np.ndarray, list]:
    from PIL import Image

    files = _folder_files(root)
    arrays, sizes = [], set()
    for path, _ in files:
        try:
            with Image.open(path) as img:
                rgb = img.convert("RGB")
        except OSError as exc:
            raise DataError(
                f"image {str(path)!r} cannot be read by Pillow ({exc}): fix or remove it"
            ) from None
        if image_size:
            rgb = rgb.resize((image_size, image_size), Image.BILINEAR)
        sizes.add(rgb.size)
        arrays.append(np.asarray(rgb, dtype=np.uint8).transpose(2, 0, 1))
    if len(sizes) > 1:
        raise ConfigError(
            f"task.data.path={str(root)!r} holds images of {len(sizes)} sizes (e.g. "
            f"{sorted(sizes)[:2]}): set task.data.image_size=32 to resize them"
        )
    images = np.stack(arrays)
    if (images == images[:, :1]).all():  # grey images stored as RGB: keep one channel
        images = np.ascontiguousarray(images[:, :1])
    classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    return images, np.asarray([label for _, label in files], dtype=np.int64), classes


def _read_npz(path: Path) -> Tuple[np.ndarray, np.ndarray, list]:
    try:
        with np.load(path) as data:
            images, labels = np.asarray(data["images"]), np.asarray(data["labels"])
    except (KeyError, ValueError, OSError) as exc:
        raise DataError(
            f"{str(path)!r} is not an .npz with arrays 'images' and 'labels' ({exc}): "
            "save it with np.savez(path, images=..., labels=...)"
        ) from None
    if images.ndim == 3:
        images = images[:, None]
    elif images.ndim == 4 and images.shape[-1] in (1, 3) and images.shape[1] not in (1, 3):
        images = images.transpose(0, 3, 1, 2)
    if images.ndim != 4 or labels.shape != (images.shape[0],) or images.shape[0] < 2:
        raise DataError(
            f"{str(path)!r}: images {images.shape} / labels {labels.shape} do not "
            "match: need images (N, H, W[, C]) and labels (N,) with N >= 2"
        )
    if images.dtype != np.uint8:
        scale = 255.0 if float(images.max(initial=0)) <= 1.0 else 1.0
        images = np.clip(images.astype(np.float64) * scale, 0, 255).round().astype(np.uint8)
    _, labels = np.unique(labels, return_inverse=True)
    return np.ascontiguousarray(images), labels.astype(np.int64).reshape(-1), []


def read_source(source: ImageSource, image_size: Optional[int]) -> Dict[str, object]:
    """Decode a source into ``uint8 (N, C, H, W)`` arrays.

    Returns:
        ``{"images", "labels", "classes"}`` plus ``"test_images"``/``"test_labels"`` when the
        source has its own test split (Fashion-MNIST).
    """
    out: Dict[str, object] = {}
    if source.kind == "fashion_mnist":
        d = Path(source.location)
        for split, prefix in (("", "train"), ("test_", "t10k")):
            out[split + "images"] = _read_idx(d / f"{prefix}-images-idx3-ubyte.gz", 16).reshape(
                -1, 1, 28, 28
            )
            out[split + "labels"] = _read_idx(d / f"{prefix}-labels-idx1-ubyte.gz", 8).astype(
                np.int64
            )
        out["classes"] = FASHION_CLASSES
    elif source.kind == "digits":
        from sklearn.datasets import load_digits

        digits = load_digits()
        out["images"] = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)[:, None]
        out["labels"] = digits.target.astype(np.int64)
        out["classes"] = [str(c) for c in digits.target_names]
    elif source.kind == "folder":
        out["images"], out["labels"], out["classes"] = _read_folder(
            Path(source.location), image_size
        )
    else:
        out["images"], out["labels"], out["classes"] = _read_npz(Path(source.location))
    if image_size:
        for key in ("images", "test_images"):
            if key in out and out[key].shape[-1] != image_size:
                out[key] = _resize(out[key], image_size)
    return out


def cache_key(source: ImageSource, image_size: Optional[int], val_fraction: float) -> str:
    """Directory name for one (source, size, split) combination."""
    return key_of("image", CACHE_FORMAT, source.kind, source.fingerprint, image_size, val_fraction)


def image_cache(directory: Path) -> TaskCache:
    """The image cache in ``directory``."""
    return TaskCache(directory, "image cache")


def build_image_cache(
    source: ImageSource, image_size: Optional[int], val_fraction: float, directory: Path
) -> Path:
    """Decode ``source`` and write ``{train,val}_{x,y}.npy`` and ``meta.json`` into ``directory``
    once (:meth:`~hetseq_hpc.tasks.cache.TaskCache.build_once`: skipped when ``meta.json``
    exists, which is written last; a concurrent builder waits for the first). Returns
    ``directory``.

    Sources without a test split are split by a fixed permutation (seed 0, not ``trainer.seed``)
    with at least one image on each side.

    Raises:
        DataError: fewer than 2 images, or a file cannot be decoded.
    """
    cache = image_cache(directory)
    return cache.build_once(lambda: _build(source, image_size, val_fraction, cache))


def _build(
    source: ImageSource, image_size: Optional[int], val_fraction: float, cache: TaskCache
) -> None:
    data = read_source(source, image_size)
    images, labels = data["images"], data["labels"]
    if "test_images" in data:
        train_x, train_y, val_x, val_y = images, labels, data["test_images"], data["test_labels"]
    else:
        n = int(images.shape[0])
        if n < 2:
            raise DataError(f"{source.description} holds {n} image(s): need at least 2")
        train, val = fixed_split(n, val_fraction)
        train_x, train_y, val_x, val_y = images[train], labels[train], images[val], labels[val]
    pixels = train_x.astype(np.float64) / 255.0
    mean = pixels.mean(axis=(0, 2, 3))
    std = np.maximum(pixels.std(axis=(0, 2, 3)), 1e-3)
    for name, array in (
        ("train_x", train_x),
        ("train_y", train_y),
        ("val_x", val_x),
        ("val_y", val_y),
    ):
        cache.save(name, array)
    num_classes = int(max(train_y.max(), val_y.max())) + 1
    meta = {
        "source": source.description,
        "kind": source.kind,
        "train": int(train_x.shape[0]),
        "val": int(val_x.shape[0]),
        "shape": list(train_x.shape[1:]),
        "num_classes": num_classes,
        "classes": list(data["classes"]) or [str(i) for i in range(num_classes)],
        "mean": mean.tolist(),
        "std": std.tolist(),
        "format": CACHE_FORMAT,
    }
    cache.write_meta(meta, indent=2)
    log.info(
        "image cache: %s, %d train + %d val images of %s, %d classes -> %s",
        meta["source"],
        meta["train"],
        meta["val"],
        meta["shape"],
        num_classes,
        cache.directory,
    )


@dataclass(frozen=True)
class ImageArrays:
    """Memory-mapped cached images. ``x``: ``(N, C, H, W)`` uint8, ``y``: ``(N,)`` int64."""

    train_x: np.ndarray
    train_y: np.ndarray
    val_x: np.ndarray
    val_y: np.ndarray
    meta: dict

    @property
    def mean(self) -> np.ndarray:
        """Per-channel mean of the training pixels in [0, 1], ``(C,)``."""
        return np.asarray(self.meta["mean"], dtype=np.float32)

    @property
    def std(self) -> np.ndarray:
        """Per-channel standard deviation of the training pixels, ``(C,)``."""
        return np.asarray(self.meta["std"], dtype=np.float32)


def load_image_cache(directory: Path, max_val_samples: int) -> ImageArrays:
    """Memory-map a cache written by :func:`build_image_cache`; keep the first
    ``max_val_samples`` validation images (0 = all).

    Raises:
        DataError: the cache is missing or damaged.
    """
    cache = image_cache(directory)
    meta, arrays = cache.open(("train_x", "train_y", "val_x", "val_y"))
    if arrays["train_x"].shape[0] != meta.get("train") or arrays["val_x"].shape[0] != meta.get(
        "val"
    ):
        raise cache.mismatch()
    if max_val_samples:
        arrays["val_x"], arrays["val_y"] = (
            arrays["val_x"][:max_val_samples],
            arrays["val_y"][:max_val_samples],
        )
    return ImageArrays(meta=meta, **arrays)


def augment(
    image: np.ndarray, pad: int, flip: bool, seed: int, epoch: int, index: int
) -> np.ndarray:
    """Random crop (zero padding ``pad``) and random horizontal flip of one training image.

    A pure function of its arguments: ``index`` is the image's row in the training array.

    Args:
        image: ``(C, H, W)`` uint8.

    Returns:
        ``(C, H, W)`` uint8.
    """
    rng = sample_rng(seed, epoch, "train", index)
    dy, dx = rng.integers(0, 2 * pad + 1, size=2) if pad else (0, 0)
    mirror = bool(rng.random() < 0.5) and flip
    if pad:
        _, h, w = image.shape
        image = np.pad(image, ((0, 0), (pad, pad), (pad, pad)))[:, dy : dy + h, dx : dx + w]
    if mirror:
        image = image[:, :, ::-1]
    return image


def make_image_batch(
    data: ImageArrays,
    positions: Sequence[int],
    split: str,
    seed: int,
    epoch: int,
    pad: int,
    flip: bool,
) -> Dict[str, torch.Tensor]:
    """A normalised batch: ``{"images": (B, C, H, W) float32, "labels": (B,) int64}``;
    training images are augmented, validation images are not."""
    x, y = (data.train_x, data.train_y) if split == "train" else (data.val_x, data.val_y)
    rows = np.asarray(positions, dtype=np.int64).reshape(-1)
    images = []
    for index in rows:
        image = np.asarray(x[index])
        if split == "train":
            image = augment(image, pad, flip, seed, epoch, int(index))
        images.append(image)
    stacked = (
        np.stack(images).astype(np.float32) / 255.0
        if images
        else np.zeros((0, *x.shape[1:]), np.float32)
    )
    stacked = (stacked - data.mean[:, None, None]) / data.std[:, None, None]
    return {
        "images": torch.from_numpy(np.ascontiguousarray(stacked, dtype=np.float32)),
        "labels": torch.from_numpy(np.asarray(y[rows], dtype=np.int64)),
    }
