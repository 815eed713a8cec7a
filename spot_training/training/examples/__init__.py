"""Runnable examples: the article's training job for Keras and its MXNet Gluon twin, and ``prepare_data``."""
