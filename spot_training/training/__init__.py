"""Resumable training on interruptible capacity: used inside the user's training process.

``spot_training.training.store`` (atomic, verified keep-N checkpoints) and ``spot_training.training.notice`` (SIGTERM /
SIGUSR1 / request file, save cadence) are framework-neutral and stdlib only; they are re-exported
here. ``spot_training.training.core`` is the framework-neutral checkpoint driver every front-end runs on;
``import spot_training.training.early_notice`` as a script's first line catches a SIGTERM during slow imports.
The framework adapters import their framework, so import them explicitly:
``from spot_training.training.keras_adapter import ...`` (TensorFlow/Keras), ``from spot_training.training.mxnet_adapter
import ...`` (MXNet Gluon) or ``from spot_training.training.torch_adapter import ...`` (PyTorch, in ``.venv-torch``).
Never import two frameworks in one process: MXNet 1.9.1 segfaults after TensorFlow.
No boto3 or AWS import anywhere in this package (docs/architecture.md, "Layers").
"""

from spot_training.training import store
from spot_training.training.notice import REQUEST_FILE_ENV, NoticeHandler, SaveSchedule
from spot_training.training.store import *  # noqa: F403 - the store's public names, listed once in store.__all__

__all__ = [*store.__all__, "NoticeHandler", "REQUEST_FILE_ENV", "SaveSchedule"]
