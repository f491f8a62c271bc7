"""Helpers that training, evaluation and the study code share, below all of them: the device
and precision, the run folder's files, checkpoints, the loss, opening the token data, and
the trainer's hook points (:class:`modbench.runtime.callback.Callback`)."""
