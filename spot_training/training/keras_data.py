"""Keras input pipelines resumed mid-epoch: the pieces :class:`spot_training.training.keras_adapter.ResumableFit`
uses to feed, from a restored step on, the batches an uninterrupted ``fit`` would have fed.

- :class:`ResumedPyDataset`: the rest of one epoch of a user's ``keras.utils.PyDataset``, with the
  user's own workers.
- :func:`warn_if_reshuffling`: a ``tf.data.Dataset`` that draws a new order on each iteration cannot
  be resumed exactly; say so once.
- :func:`class_weight_to_sample_weight`: ``fit(class_weight=...)`` as per-sample weights, since the
  resumed pieces of an epoch are fed as explicit batches.
"""

from __future__ import annotations

import logging

import keras
import numpy as np

from spot_training.training.core import warn_not_exact

__all__ = ["ResumedPyDataset", "class_weight_to_sample_weight", "warn_if_reshuffling"]

#: The front-end's logger: the warnings read as ResumableFit's.
log = logging.getLogger("spot_training.training.keras_adapter")


class ResumedPyDataset(keras.utils.PyDataset):
    """The rest of one epoch of a user's ``PyDataset``, from batch ``offset`` on: batch ``i`` is the
    user's batch ``offset + i``, fetched by Keras's own workers (``workers``, ``use_multiprocessing``
    and ``max_queue_size`` are the user's). ``on_epoch_end`` is forwarded.

    Args:
        base: the user's ``PyDataset``.
        offset: the first batch of the epoch to feed (0 <= offset < steps_per_epoch).
        steps_per_epoch: batches in one epoch of ``base``.
    """

    def __init__(self, base: keras.utils.PyDataset, offset: int, steps_per_epoch: int) -> None:
        super().__init__(workers=base.workers, use_multiprocessing=base.use_multiprocessing,
                         max_queue_size=base.max_queue_size)
        self.base, self.offset, self.length = base, offset, steps_per_epoch - offset

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index):
        return self.base[self.offset + index]

    def on_epoch_end(self) -> None:
        """Forwarded to the user's dataset (its own reshuffle or bookkeeping)."""
        self.base.on_epoch_end()


def warn_if_reshuffling(dataset, first_batch) -> None:
    """Read ``dataset``'s first batch a second time: when it differs from ``first_batch`` the
    pipeline yields another order on each iteration (``shuffle(...)`` with the default
    ``reshuffle_each_iteration=True``), and a resumed run cannot reproduce the interrupted order.

    Args:
        dataset: the user's ``tf.data.Dataset``.
        first_batch: the batch its first iteration yielded (a nest of tensors or arrays).
    """
    import tensorflow as tf

    again = next(iter(dataset.take(1)))
    same = all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(tf.nest.flatten(first_batch), tf.nest.flatten(again)))
    if not same:
        warn_not_exact("tf-data-reshuffle", (
            "the tf.data.Dataset yields another first batch each time it is iterated (shuffle(...) with the "
            "default reshuffle_each_iteration=True), so a resumed run reads another order than the interrupted "
            "one; fix: shuffle(..., seed=S, reshuffle_each_iteration=False), or pass a function epoch -> Dataset "
            "such as lambda e: ds.shuffle(1000, seed=e).batch(32) (docs/training.md, \"Your Keras script\")"),
            logger=log)


def class_weight_to_sample_weight(y: np.ndarray, class_weight: dict) -> np.ndarray:
    """Keras's rule (keras/src/trainers/data_adapters/data_adapter_utils.py): class indices from
    ``y`` (argmax of one-hot rows), weight 1 for a class not in ``class_weight``.

    Args:
        y: labels, shape (n,) or (n, 1), or one-hot rows (n, classes).
        class_weight: ``{class index: weight}``.

    Returns:
        float32 weights, shape (n,).

    Raises:
        ValueError: ``y`` has another shape.
    """
    y = np.asarray(y)
    if y.ndim == 2 and y.shape[1] > 1:
        classes = np.argmax(y, axis=1)
    elif y.ndim == 2 and y.shape[1] == 1:
        classes = y[:, 0]
    elif y.ndim == 1:
        classes = y
    else:
        raise ValueError(f"class_weight needs class labels or one-hot rows. Received: y with shape {y.shape}")
    weights = np.ones(len(classes), dtype=np.float32)
    for cls, weight in class_weight.items():
        weights[classes == int(cls)] = weight
    return weights
