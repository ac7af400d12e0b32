"""Framework integrations over the manager (layer 8, beside ``dcp``): they import the manager and
lower layers, and their framework only inside their own module, so ``import resilient_ckpt``
never needs one.

- ``integrations.lightning``: ``LocalCheckpointCallback`` and ``HierarchicalCheckpointIO``, the
  classes of nvidia-resiliency-ext's ``ptl_resiliency.local_checkpoint_callback`` over our
  ``CheckpointManager`` (extra ``resilient-ckpt[lightning]``; see docs/lightning.md);
- ``integrations.huggingface``: ``LocalCheckpointCallback``, a ``transformers.TrainerCallback``
  saving and resuming the ``Trainer`` through the manager (extra ``resilient-ckpt[huggingface]``;
  see docs/huggingface.md).
"""
