"""Elastic trainers (``layout.elastic_trainers``): the trainers' membership epochs over
TRAIN_DATA_PARALLEL (group.py), gradients averaged over whichever trainers are live
(gradients.py), and a joining trainer healed from a live one (healing.py). docs/failures.md
walks a loss and a heal."""
