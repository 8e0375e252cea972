"""Trained speculators: a small drafter distilled from one target, for a workload the target serves.

The drafter is a few-layer decoder of the target's own architecture. It shares the target's token
embeddings and LM head (taken from the target checkpoint at load time, never copied into the
speculator), its layers start as copies of some of the target's layers, and its head only scores a
reduced draft vocabulary (the target's most frequent output tokens), because at batch 1 on a CPU the
full LM head would cost more than the layers. Verification stays exact: the target checks every draft.

`distill.py` generates the training data with the kvyard engine (the target's greedy outputs and its
top-20 logprobs per token), `model.py` is the trainable drafter, `train.py` the training loop and its
acceptance estimate, `format.py` the checkpoint directory (and the check that refuses a speculator
trained for another target), `load.py` turns a directory into the engine's `DraftModelProposer`, and
`cli.py` is `kvyard speculator train`.
"""
