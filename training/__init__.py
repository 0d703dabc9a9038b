"""The parts of `train.py`: flags, data, the training step, state on disk, metrics, setup, loop.

`train.py` is the command line over them; `training.loop.train` is the whole run.
"""
