"""The SFT trainer's parts: global batches and their split over ranks, the loss, checkpoints.

``python -m verl.trainer.sft_trainer`` is the entry point (:mod:`verl.trainer.sft_trainer`)."""
