"""Training jobs a user would write: ``felactl launch --job examples.cnn:job --nproc-per-node 2``."""
